"""The saver persists several local ranks at once, and exports off the persist threads.

Two local ranks of one job live in this process: engines with hand-made placements, each
writing its own directory (storage world 1), so each commits on its own. A rank's persist
is held up for real: the test holds that rank's lock file (``flock``), which the saver
takes before it reads the slot, and checks in ``/proc/locks`` that the saver waits on it.
An export is held up by a FIFO where the DeepSpeed exporter reads its manifest. The
queue's rules are also checked alone, with no saver (``Jobs`` and a thread that takes).

Nothing here sleeps and then checks that something did not happen: a call that must wait
reports whether what it waits for had happened when it returned (``_returns_after``),
once the saver has read the request (``_asked``); a check that the queue hands out
nothing runs once the taking thread is parked in ``Jobs.take`` (``_Taker``).
"""

import fcntl
import json
import os
import queue
import struct
import sys
import termios
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable

import pytest
import torch

from flashckpt import _names
from flashckpt._engine import Engine, Options, Placement, new_token
from flashckpt._errors import CheckpointError
from flashckpt.saver._jobs import Job, Jobs
from flashckpt.memory._slot import RankLock
from flashckpt.storage._local import LocalStorage
from flashckpt.torch import _tensors  # noqa: F401  (registers torch tensors as leaves)

@pytest.fixture(autouse=True)
def _four_persist_threads(monkeypatch):
    """The saver these tests start (it inherits this environment) persists 4 ranks at once
    whatever this machine's default."""
    monkeypatch.setenv("FLASHCKPT_PERSIST_THREADS", "4")


_BOUND = 30.0  # seconds any single condition below may take on a loaded machine


def _engine(directory, job_id: str, rank: int, **options) -> Engine:
    placement = Placement(local_rank=rank, memory_rank=rank, writes_memory=True, storage_rank=0,
                          storage_world=1, persists=True, token=new_token())
    return Engine(str(directory), Options(**{"persist_every": 1, "keep_last": 0, "job_id": job_id, **options}),
                  placement)


def _state(step: int, numel: int = 4096) -> dict:
    return {"w": torch.full((numel,), float(step))}


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + _BOUND
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {_BOUND:.0f}s: {what}")
        time.sleep(0.02)


def _waiters(path: str) -> bool:
    """Whether some process waits for an flock on ``path`` (a ``->`` line of /proc/locks)."""
    ino = os.stat(path).st_ino
    with open("/proc/locks") as f:
        return any("->" in line and line.split()[6].endswith(f":{ino}") for line in f if "FLOCK" in line)


@contextmanager
def _rank_held(job_id: str, rank: int):
    """Hold local rank ``rank``'s lock file, as a trainer mid-header-update would."""
    lock = RankLock(_names.lock_path(_names.slot_path(job_id, rank, 0)))
    try:
        with lock.held():
            yield lock.path
    finally:
        lock.close()


class _Background:
    """``fn`` on a thread; ``join`` returns what it returned, or re-raises what it raised."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.value = fn()
        except BaseException as exc:  # noqa: BLE001 -- handed to join
            self.error = exc

    def join(self) -> Any:
        self.thread.join(_BOUND)
        assert not self.thread.is_alive(), "still waiting"
        if self.error is not None:
            raise self.error
        return self.value


def _returns_after(fn: Callable[[], None], event: threading.Event) -> Callable[[], bool]:
    """``fn`` that then tells whether ``event`` was set when it returned."""
    def run() -> bool:
        fn()
        return event.is_set()
    return run


def _unread(sock) -> int:
    """Bytes sent on this end of a unix socket that the peer has not read yet (SIOCOUTQ)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]


def _asked(engine: Engine, op: str, monkeypatch) -> Callable[[], bool]:
    """A condition: ``engine`` sent an ``op`` request and the saver has read it (every
    byte sent on the socket consumed), so the saver has it in hand before the test goes on."""
    client = engine._client
    sent: list[str] = []
    send = client._send
    monkeypatch.setattr(client, "_send", lambda msg: (send(msg), sent.append(msg["op"]))[0])
    return lambda: op in sent and _unread(client.sock) == 0


@contextmanager
def _held_persist(job_id: str, engine: Engine, step: int):
    """Rank 0 (``engine``) has ``step`` in memory and its flush waiting in the saver,
    stuck on its lock file; yields an event set just before the lock is let go, and
    fails if that flush returned before it was set."""
    engine.save(step, _state(step), persist=False)
    released = threading.Event()
    with _rank_held(job_id, 0) as lock_path:
        flush = _Background(_returns_after(engine.flush, released))
        _until(lambda: _waiters(lock_path), "the saver waits for rank 0's lock")
        try:
            yield released
        finally:
            released.set()
    assert flush.join(), "rank 0's flush returned while its persist was held"


def test_one_ranks_persist_does_not_wait_for_another_ranks(tmp_path, job_id):
    a, b = _engine(tmp_path / "a", job_id, 0), _engine(tmp_path / "b", job_id, 1)
    with _held_persist(job_id, a, 1):
        handle = b.save(1, _state(1))
        _until(handle.durable, "rank 1's step committed while rank 0's persist is held")
        assert a.storage.committed_steps() == []
    assert a.storage.committed_steps() == [1] and b.storage.committed_steps() == [1]
    for engine in (a, b):
        engine.close()


def test_a_flush_waits_for_every_persist_queued_before_it(tmp_path, job_id, monkeypatch):
    """Rank 1's flush, read by the saver while rank 0's persist is held, returns only after
    that persist is let go (rank 0's own flush too). Were the saver to read the flush but
    handle it only after rank 0's persist finished, a reply sent too early would go unseen."""
    a, b = _engine(tmp_path / "a", job_id, 0), _engine(tmp_path / "b", job_id, 1)
    with _held_persist(job_id, a, 1) as released:
        handle = b.save(1, _state(1))
        asked = _asked(b, "flush", monkeypatch)
        flush_b = _Background(_returns_after(b.flush, released))  # asked after rank 0's persist: waits for it too
        _until(handle.durable, "rank 1's step committed while rank 0's persist is held")
        _until(asked, "the saver read rank 1's flush")
    assert flush_b.join(), "rank 1's flush returned while rank 0's persist, queued before it, was held"
    assert a.storage.committed_steps() == [1] and b.storage.committed_steps() == [1]
    for engine in (a, b):
        engine.close()


def test_one_ranks_persists_stay_in_save_order(tmp_path, job_id, monkeypatch):
    """Rank 1's saves (into its two slots in turn) persist one after another, in step
    order, while rank 0's persist is held."""
    monkeypatch.setenv("FLASHCKPT_SAVER_TIMEOUT", str(_BOUND))  # a save waiting for a slot fails, not hangs
    a, b = _engine(tmp_path / "a", job_id, 0), _engine(tmp_path / "b", job_id, 1)
    steps = [1, 2, 3, 4, 5]
    with _held_persist(job_id, a, 1):
        handles = [b.save(step, _state(step, 4 << 20)) for step in steps]  # 16 MiB each
        _until(handles[-1].durable, "rank 1's last step committed while rank 0's persist is held")
    storage = LocalStorage(b.storage.root)
    assert storage.committed_steps() == steps
    committed_at = [storage.metadata(step)["committed_at"] for step in steps]
    assert committed_at == sorted(committed_at)
    for step in steps:
        assert storage.verify(step) == []
    got = _state(0, 4 << 20)
    for engine in (a, b):
        engine.close()
    reader = _engine(tmp_path / "b", job_id, 1)
    assert reader.load(got) == 5 and torch.equal(got["w"], _state(5, 4 << 20)["w"])
    reader.close()


def _deepspeed_state(step: int, tag: str) -> dict:
    return {"deepspeed": {"files": {f"{tag}/mp_rank_00_model_states.pt": {"w": torch.full((1024,), float(step))}}}}


def _export(save_dir, tag: str) -> dict:
    return {"name": "deepspeed", "params": {"save_dir": str(save_dir), "tag": tag, "keep_last": 0}}


def test_a_slow_export_does_not_hold_up_the_next_persists(tmp_path, job_id, monkeypatch):
    """Rank 0's export of step 1 hangs (its manifest is a FIFO nobody writes yet): rank 1
    persists and commits meanwhile, rank 0's next step reaches storage (its commit waits
    for the export, which must read step 1 before retention could retire it), and rank
    0's flush returns only once the export is done."""
    save_dir = tmp_path / "ds"
    save_dir.mkdir()
    manifest = save_dir / ".flashckpt-tags.json"
    os.mkfifo(manifest)
    a, b = _engine(tmp_path / "a", job_id, 0, keep_last=1), _engine(tmp_path / "b", job_id, 1)
    released = threading.Event()
    released_at = 0.0
    try:
        a.save(1, _deepspeed_state(1, "t1"), export=_export(save_dir, "t1"))
        _until(lambda: (save_dir / "t1").is_dir(), "the export of step 1 reached its manifest")
        handle = b.save(1, _state(1))
        _until(handle.durable, "rank 1's step committed while rank 0's export hangs")
        a.save(2, _state(2))
        _until(lambda: any((tmp_path / "a" / name / "rank-0.done").exists() for name in os.listdir(tmp_path / "a")
                           if name.startswith("step-2.tmp-")), "rank 0's next step written while its export hangs")
        asked = _asked(a, "flush", monkeypatch)
        flush = _Background(_returns_after(a.flush, released))
        _until(asked, "the saver read rank 0's flush")
        assert a.storage.committed_steps() == [1]  # step 2's commit would retire step 1 mid-export
    finally:
        released.set()
        released_at = time.time()
        _release(manifest)
    assert flush.join(), "rank 0's flush returned while its export hung"
    assert a.storage.committed_steps() == [2]
    assert a.storage.metadata(2)["committed_at"] >= released_at, "step 2 committed while step 1's export hung"
    assert (save_dir / "t1" / "mp_rank_00_model_states.pt").is_file()
    assert json.loads(manifest.read_text())[0][:2] == ["t1", 1]
    for engine in (a, b):
        engine.close()


def _release(fifo) -> None:
    """Let a reader blocked on ``fifo`` go on: it reads an empty manifest."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # nobody is reading it
        return
    os.write(fd, b"[]")
    os.close(fd)


def test_an_export_that_fails_is_reported_and_later_persists_go_on(tmp_path, job_id):
    save_dir = tmp_path / "ds"
    save_dir.mkdir()
    a, b = _engine(tmp_path / "a", job_id, 0), _engine(tmp_path / "b", job_id, 1)
    handle = a.save(1, _state(1), export=_export(save_dir, "t1"))  # no "deepspeed" entry: the exporter raises
    with pytest.raises(CheckpointError, match="KeyError"):
        a.wait()
    assert handle.done() and handle.durable()  # committed; only the export failed
    for step in (2, 3):
        a.save(step, _state(step))
        b.save(step, _state(step))
    for engine in (a, b):
        engine.wait()
    assert a.storage.committed_steps() == [1, 2, 3] and b.storage.committed_steps() == [2, 3]
    for engine in (a, b):
        engine.close()


def test_the_saver_loads_an_exporter_when_asked_before_the_first_export(tmp_path, job_id):
    """A trainer that will export names its exporter at start: the saver imports it then
    (seconds: torch, DeepSpeed), not when the first step commits."""
    a = _engine(tmp_path / "a", job_id, 0)
    a._client.warm_exporter("deepspeed")
    log_path = _names.saver_log_path(job_id)
    _until(lambda: os.path.exists(log_path)  # the saver starts in the background
           and "loaded the exporter flashckpt.deepspeed._export" in open(log_path).read(),
           "the saver loaded the DeepSpeed exporter before any save")
    save_dir = tmp_path / "ds"
    save_dir.mkdir()
    a.save(1, _deepspeed_state(1, "t1"), export=_export(save_dir, "t1"))
    a.wait()
    assert (save_dir / "t1" / "mp_rank_00_model_states.pt").is_file()
    assert open(log_path).read().count("loaded the exporter") == 1
    a.close()


class _Inbox:
    def __init__(self) -> None:
        self.sent: list[dict] = []

    def send(self, msg: dict) -> None:
        self.sent.append(msg)


class _Taker:
    """Takes jobs as a persist thread does (without running them), on a thread of its own
    that counts the times it parks: blocks in ``Jobs.take`` having found nothing to take.

    Every change to the jobs is made through :meth:`after`, which returns once the thread
    has looked at the queue as that change left it and parked again; so each check that
    follows sees all the thread would do, and "nothing more was taken" is a fact, not a
    guess after a sleep."""

    _WAIT, _TAKE = threading.Condition.wait.__code__, Jobs.take.__code__

    def __init__(self, jobs: Jobs) -> None:
        self.jobs = jobs
        self._taken: "queue.Queue[Job]" = queue.Queue()
        self._parked = threading.Condition()
        self._parks = 0
        threading.Thread(target=self._run, daemon=True).start()
        self._wait_parks(1)  # took what it could of the jobs queued before it started

    def _run(self) -> None:
        sys.setprofile(self._profile)  # this thread only
        for job in iter(self.jobs.take, None):
            self._taken.put(job)

    def _profile(self, frame, event: str, arg) -> None:
        if event == "call" and frame.f_code is self._WAIT and frame.f_back.f_code is self._TAKE:
            with self._parked:  # entered under the jobs' lock: it saw every change made before
                self._parks += 1
                self._parked.notify_all()

    def _wait_parks(self, count: int) -> None:
        with self._parked:
            if not self._parked.wait_for(lambda: self._parks >= count, _BOUND):
                pytest.fail(f"the taking thread did not park within {_BOUND:.0f}s")

    def after(self, change: Callable[[], Any]) -> None:
        """``change()`` (a call that wakes the parked thread), then wait until it parks again."""
        count = self._parks + 1
        change()
        self._wait_parks(count)

    def taken(self) -> list[Job]:
        """The jobs handed out since the last call."""
        out = []
        while not self._taken.empty():
            out.append(self._taken.get_nowait())
        return out


def test_jobs_of_one_rank_run_one_at_a_time_and_a_reply_waits_for_every_job_taken_before_it():
    jobs, inbox = Jobs(), _Inbox()
    a1, a2 = Job(_names.slot_path("tq", 0, 0), 1, inbox), Job(_names.slot_path("tq", 0, 1), 2, inbox)
    b1 = Job(_names.slot_path("tq", 1, 0), 1, inbox)
    for job in (a1, a2, b1):
        jobs.put(job)
    jobs.put(Job("", 0, inbox, reply={"op": "flushed", "id": 7}), later=True)
    taker = _Taker(jobs)
    assert taker.taken() == [a1, b1]  # not a2: its rank's slot is being read
    taker.after(lambda: jobs.release(a1))  # a1 read its slot; its export may still run
    assert taker.taken() == [a2]
    taker.after(lambda: jobs.finish(b1))
    taker.after(lambda: jobs.finish(a2))
    assert inbox.sent == [] and not jobs.idle()  # a1 (its export) is not finished
    taker.after(lambda: jobs.finish(a1))
    assert inbox.sent == [{"op": "flushed", "id": 7}], "the reply once every job before it finished"
    assert jobs.idle()
    jobs.stop()


def test_jobs_a_fallback_waits_while_newest_step_work_runs():
    jobs, inbox = Jobs(), _Inbox()
    newest = Job(_names.slot_path("tq", 0, 0), 5, inbox)
    fallback = Job(_names.slot_path("tq", 1, 1), 4, inbox, unless_committed=("/d", "tok", 5))
    jobs.put(fallback, later=True)
    jobs.put(newest)  # newest-step work goes first even when queued after
    taker = _Taker(jobs)
    assert taker.taken() == [newest]  # not the fallback: another rank's, yet it waits
    taker.after(lambda: jobs.release(newest))
    assert taker.taken() == [fallback]
    for job in (newest, fallback):
        jobs.finish(job)
    jobs.stop()


@pytest.mark.parametrize("value", ["0", "four"])
def test_a_bad_thread_count_is_a_clear_error_at_construction(tmp_path, job_id, monkeypatch, value):
    monkeypatch.setenv("FLASHCKPT_PERSIST_THREADS", value)
    with pytest.raises(ValueError, match="FLASHCKPT_PERSIST_THREADS"):
        _engine(tmp_path / "a", job_id, 0)
