"""Nothing waits without a bound, and a returned save survives a stuck or dead saver (issue 20).

Each scenario runs the trainer as a subprocess that reports on stdout, so a hang is a
bounded wait that fails with the trainer's stacks (faulthandler), never a stuck suite.
The saver is found as ``python -m flashckpt.saver._saver --job-id JOB`` (``saver_pids``).
"""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from flashckpt import _names
from flashckpt.memory._slot import Slot, SlotHeader, SlotState
from flashckpt.storage._local import LocalStorage
from flashckpt.torch import Checkpointer

from .test_ckpt_crash import saver_pids

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PRELUDE = textwrap.dedent("""
    import faulthandler, json, os, signal, sys, time
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    import torch
    from flashckpt import CheckpointError, CheckpointTimeoutError
    from flashckpt.torch import Checkpointer
    from tests.checkpoint._trainer import check, fill, make_state
    directory, job = sys.argv[1], sys.argv[2]

    def say(*parts):
        print(*parts, flush=True)

    def attempt(fn):
        '''"ok", "CheckpointError ..." (a flashckpt error: allowed) or "RAW ..." (anything else).'''
        start = time.monotonic()
        try:
            fn()
            outcome = "ok"
        except CheckpointError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        except BaseException as exc:
            outcome = f"RAW {type(exc).__name__}: {exc}"
        return {"outcome": outcome, "seconds": round(time.monotonic() - start, 2)}

    def st(step, mb=1.0):
        s = make_state(mb)
        fill(s, step)
        return s
""")


class Script:
    """``python -c PRELUDE+body DIR JOB`` with stdin/stdout lines and bounded waits."""

    def __init__(self, body: str, directory, job: str, env: dict[str, str] | None = None) -> None:
        full_env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
                        OMP_NUM_THREADS="1", **(env or {}))
        self.proc = subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(body), str(directory), job],
                                     cwd=REPO, env=full_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.err: list[str] = []
        self._cond = threading.Condition()
        for stream, into in ((self.proc.stdout, self.lines), (self.proc.stderr, self.err)):
            threading.Thread(target=self._pump, args=(stream, into), daemon=True).start()

    def _pump(self, stream, into: list[str]) -> None:
        for line in stream:
            with self._cond:
                into.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def expect(self, prefix: str, timeout: float, what: str) -> str:
        """The first output line starting with ``prefix``; fails (with the script's stacks) after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    if line.startswith(prefix):
                        return line
                if self.proc.poll() is not None:
                    self._cond.wait(0.2)
                    if not any(line.startswith(prefix) for line in self.lines):
                        pytest.fail(f"{what}: the trainer exited {self.proc.returncode} first:\n{self.stderr()}")
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    pytest.fail(f"{what}: nothing within {timeout:.0f}s (a hang). Stacks:\n{self.stacks()}")
                self._cond.wait(min(left, 0.5))

    def result(self, prefix: str, timeout: float, what: str) -> dict:
        return json.loads(self.expect(prefix, timeout, what)[len(prefix):])

    def send(self, line: str = "go") -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stacks(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(0.5)
        return self.stderr()

    def stderr(self) -> str:
        return "\n".join(self.err[-60:])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def wait_gone_or_zombie(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} still running {timeout}s after SIGKILL")


def one_saver(job: str, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while not (pids := saver_pids(job)):
        assert time.monotonic() < deadline, f"no saver for job {job}"
        time.sleep(0.05)
    assert len(pids) == 1, f"several savers for job {job}: {pids}"
    return pids[0]


def cleanup(job: str, *scripts: Script) -> None:
    for script in scripts:
        if script is not None:
            script.kill()
    for pid in saver_pids(job):
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for path in glob.glob(_names.job_prefix(job) + ".*"):
        try:
            os.unlink(path)
        except OSError:
            pass


# -- (a) the saver SIGKILLed while the trainer lives ------------------------------------

SAVER_KILLED = """
    op = sys.argv[3]
    ck = Checkpointer(directory, job_id=job, persist_every=1, keep_last=0)
    ck.save(1, st(1))
    ck.wait()
    say("ready")
    input()                 # the saver is stopped now
    ck.save(2, st(2))       # its persist request waits, unread, in the stopped saver's socket
    say("saved 2")
    input()                 # the saver was SIGKILLed (with that request unread: the socket resets)
    if op == "save":
        first = attempt(lambda: ck.save(3, st(3)))
        newest = 3 if first["outcome"] == "ok" else 2
        then = attempt(lambda: ck.flush(timeout=60))
        if then["outcome"] != "ok":  # one named error is allowed; the next flush must work
            then = attempt(lambda: ck.flush(timeout=60))
    elif op == "flush":
        newest, first = 2, attempt(lambda: ck.flush(timeout=60))
        then = first if first["outcome"] == "ok" else attempt(lambda: ck.flush(timeout=60))
    else:
        newest, first = 2, attempt(ck.close)
        then = first
    say("result " + json.dumps({"first": first, "then": then, "newest": newest}))
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("op", ["save", "flush", "close"])
def test_saver_killed_next_call_recovers_or_raises_a_named_error(tmp_path, job_id, op):
    """The first save/flush/close after the saver died neither hangs nor raises a raw
    ConnectionResetError/BrokenPipeError; the newest step ends up committed."""
    script = Script(SAVER_KILLED.replace("sys.argv[3]", repr(op)), tmp_path, job_id)
    try:
        script.expect("ready", 60, "first save")
        saver = one_saver(job_id)
        os.kill(saver, signal.SIGSTOP)
        script.send()
        script.expect("saved 2", 30, "save(2) with the saver stopped (one free slot)")
        time.sleep(0.2)
        os.kill(saver, signal.SIGKILL)
        wait_gone_or_zombie(saver)
        script.send()
        res = script.result("result ", 90, f"{op}() after the saver was killed")
        assert not res["first"]["outcome"].startswith("RAW"), \
            f"{op}() after the saver died raised a non-flashckpt error: {res['first']['outcome']}"
        assert not res["then"]["outcome"].startswith("RAW"), f"then: {res['then']['outcome']}"
        if op == "close" and res["first"]["outcome"] != "ok":
            return  # close said it could not flush: allowed (nothing silently freed)
        assert res["then"]["outcome"] == "ok", f"a flush after the saver died kept failing: {res}"
        latest = LocalStorage(str(tmp_path)).committed_steps()
        assert latest and latest[-1] == res["newest"], \
            f"after {op}() and a flush the newest committed step is {latest[-1:]}, expected {res['newest']}"
    finally:
        cleanup(job_id, script)


# -- (b) the saver, the trainer's own child, killed: a zombie ------------------------------

ZOMBIE = """
    ck = Checkpointer(directory, job_id=job, persist_every=1, keep_last=2, memory_slots=2)
    ck.save(0, st(0))
    ck.wait()
    say("ready")
    input()                  # the saver is stopped
    for step in (1, 2):      # both slots held for it, the requests unread
        ck.save(step, st(step))
    say("saved 2")
    input()                  # saver SIGKILLed: our unreaped child, a zombie, holding both slots
    for step in range(3, 23):
        ck.save(step, st(step))
        say(f"saved {step}")
    say("flush " + json.dumps(attempt(lambda: ck.flush(timeout=60))))
"""


@pytest.mark.timeout(150)
def test_many_saves_after_the_saver_died_as_a_zombie_do_not_hang(tmp_path, job_id):
    """The saver (the trainer's own child, so a zombie until reaped) is SIGKILLed while both
    slots are held for it; 20 more saves must neither wait on it forever nor fail."""
    script = Script(ZOMBIE, tmp_path, job_id)
    try:
        script.expect("ready", 60, "first save")
        saver = one_saver(job_id)
        os.kill(saver, signal.SIGSTOP)
        script.send()
        script.expect("saved 2", 30, "saves 1 and 2 with the saver stopped (two slots)")
        os.kill(saver, signal.SIGKILL)
        wait_gone_or_zombie(saver)
        script.send()
        for step in range(3, 23):
            script.expect(f"saved {step}", 30, f"save({step}) after the saver died (slot choice waiting on a zombie?)")
        res = script.result("flush ", 90, "flush after 20 saves")
        assert res["outcome"] == "ok", res
        assert LocalStorage(str(tmp_path)).committed_steps()[-1:] == [22]
    finally:
        cleanup(job_id, script)


# -- (c) a stopped saver (stuck storage I/O) ----------------------------------------------

STOPPED = """
    which = sys.argv[3]
    ck = Checkpointer(directory, job_id=job, persist_every=1, keep_last=2)
    ck.save(1, st(1))
    ck.wait()
    say("ready")
    input()                      # saver stopped
    ck.save(2, st(2))            # the other slot is free: this returns
    say("saved 2")
    if which == "flush":
        say("result " + json.dumps(attempt(lambda: ck.flush(timeout=3))))
    elif which == "close":
        say("result " + json.dumps(attempt(ck.close)))
    time.sleep(600)
"""

LOADER = """
    state = make_state(1.0)
    def run():
        ck = Checkpointer(directory, job_id=job, persist_every=1, keep_last=2)
        say("loaded " + json.dumps(ck.load(state)))
    say("result " + json.dumps(attempt(run)))
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("which", ["flush", "close", "load"])
def test_a_stopped_saver_gives_a_timeout_error_not_a_hang(tmp_path, job_id, which):
    """``kill -STOP`` on the saver: ``flush(timeout=3)`` raises CheckpointTimeoutError naming the
    saver's pid; with FLASHCKPT_SAVER_TIMEOUT=3, ``close()`` and a restarted trainer's ``load()``
    (which waits for the dead trainer's crash flush) raise it too, each within ~10 s."""
    env = {"FLASHCKPT_SAVER_TIMEOUT": "3"}
    script = Script(STOPPED.replace("sys.argv[3]", repr(which)), tmp_path, job_id, env)
    loader = None
    saver = 0
    try:
        script.expect("ready", 60, "first save")
        saver = one_saver(job_id)
        os.kill(saver, signal.SIGSTOP)
        script.send()
        script.expect("saved 2", 30, "save(2) with a stopped saver and a free slot")
        if which == "load":
            script.kill()  # the trainer crashes; its restart must wait for a crash flush that cannot come
            loader = Script(LOADER, tmp_path, job_id, env)
            res = loader.result("result ", 40, "a restart's construct + load() with the saver stopped")
            if res["outcome"] == "ok":  # a design that replaces a stuck saver: must have restored step 2
                assert loader.result("loaded ", 1, "load") == 2
                return
        else:
            res = script.result("result ", 25, f"{which}() with the saver stopped")
        assert res["outcome"].startswith("CheckpointTimeoutError"), \
            f"{which}() with a stopped saver: {res['outcome']!r}, expected CheckpointTimeoutError"
        assert res["seconds"] < 10, f"{which}() took {res['seconds']}s to time out (bound 3 s)"
        assert str(saver) in res["outcome"], f"the error does not name the saver pid {saver}: {res['outcome']}"
    finally:
        cleanup(job_id, script, loader)  # continues and kills the stopped saver


# -- (d) the saver's socket deleted ---------------------------------------------------------

NEXT_PROCESS = """
    def run():
        ck = Checkpointer(directory, job_id=job, persist_every=1, keep_last=2)
        ck.save(2, st(2))
        ck.flush(timeout=30)
        ck.close()
    say("result " + json.dumps(attempt(run)))
"""


@pytest.mark.timeout(150)
def test_a_deleted_saver_socket_does_not_block_the_next_process(tmp_path, job_id):
    """The socket file is removed (a tmp cleaner) while the old saver still serves another
    process of the job (here: a bare connection to it). The next process of the job must get
    a working saver within seconds: construct, save, flush and close in < 10 s."""
    first = Script("""
        ck = Checkpointer(directory, job_id=job, persist_every=1, keep_last=2)
        ck.save(1, st(1))
        ck.close()
        say("ready")
        time.sleep(600)
    """, tmp_path, job_id)
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    nxt = None
    try:
        first.expect("ready", 60, "first run")
        sock_path = _names.socket_path(job_id)
        other.connect(sock_path)  # another process of the job, still served by this saver
        other.sendall(json.dumps({"op": "hello", "v": 1, "pid": os.getpid(), "slots": []}).encode() + b"\n")
        first.kill()
        os.unlink(sock_path)
        nxt = Script(NEXT_PROCESS, tmp_path, job_id)
        res = nxt.result("result ", 40, "the next process of the job after its saver socket was deleted")
        assert res["outcome"] == "ok", res
        assert res["seconds"] < 10, f"construct+save+flush+close took {res['seconds']}s (waited for a socket?)"
        assert LocalStorage(str(tmp_path)).committed_steps()[-1:] == [2]
    finally:
        other.close()
        cleanup(job_id, first, nxt)


# -- (e) two slots, storage slower than the saves -------------------------------------------

SLOW_STORAGE = """
    import logging, traceback
    from flashckpt import _engine
    from flashckpt.memory._tree import kind_named

    kill_inside = False  # the save running now is killed at the first kill point it reaches

    def killed_here(where):
        '''A kill point: say where, and whether Engine.save is on the stack, then wait to be killed.'''
        in_save = any(f.name == "save" and f.filename == _engine.__file__ for f in traceback.extract_stack())
        say("inside " + json.dumps({"where": where, "in_save": in_save}))
        input()  # never answered

    torch_kind = kind_named("torch")
    whole_copy = torch_kind.copy

    def half_a_copy(dsts, srcs):  # kill point 1: the save copies into a slot (half its tensors written)
        if not kill_inside:
            return whole_copy(dsts, srcs)
        whole_copy(dsts[:len(dsts) // 2], srcs[:len(srcs) // 2])
        killed_here("copying")

    torch_kind.copy = half_a_copy

    class WaitingForASlot(logging.Handler):  # kill point 2: the save waits for the saver to free a slot
        def emit(self, record):
            if kill_inside and record.getMessage().startswith("save waits for storage"):
                killed_here("waiting for a slot")

    _engine.log.addHandler(WaitingForASlot())

    ck = Checkpointer(directory, job_id=job, persist_every=3, keep_last=0, memory_slots=2)
    state = make_state(64)
    for step in (1, 2):
        fill(state, step)
        ck.save(step, state)
    say("ready")
    input()                 # the saver is stopped: storage is far slower than the saves
    for step in (3, 4, 5):  # 3 is due to persist: its copy is held for the saver
        fill(state, step)
        kill_inside = step == 5
        ck.save(step, state)
        say(f"saved {step}")
    time.sleep(600)
"""


def _slots(job: str) -> dict[int, tuple[str, int]]:
    """Step -> (state, writer pid if WRITING else reader pid) of rank 0's two memory slots."""
    headers = [Slot.peek_header(_names.slot_path(job, 0, i)) or SlotHeader() for i in (0, 1)]
    return {h.step: (h.state.name, h.writer_pid if h.state == SlotState.WRITING else h.reader_pid)
            for h in headers if h.state != SlotState.EMPTY}


@pytest.mark.timeout(150)
def test_a_crash_during_a_save_while_storage_lags_keeps_the_last_returned_save(tmp_path, job_id):
    """memory_slots=2, persist_every=3, the saver stopped while it owes step 3: save(4)
    returns; the trainer is SIGKILLed inside save(5), at the first of two chosen points it
    reaches: halfway through its copy into a slot, or waiting for the saver to free one
    (this engine waits: one slot is held for the saver, the other holds the newest copy).
    The restart must restore >= 4, not the 3 the saver was reading."""
    script = Script(SLOW_STORAGE, tmp_path, job_id)
    saver = 0
    loader = None
    try:
        script.expect("ready", 90, "saves 1 and 2")
        saver = one_saver(job_id)
        os.kill(saver, signal.SIGSTOP)
        script.send()
        script.expect("saved 4", 60, "save(4) with storage stopped")
        inside = script.result("inside ", 60, "save(5) reaching a kill point")
        script.kill()
        assert script.proc.returncode == -signal.SIGKILL, f"the trainer exited {script.proc.returncode} first"
        assert inside["in_save"], f"the kill point {inside['where']!r} is not inside Engine.save"
        assert not any(line.startswith("saved 5") for line in script.lines), "save(5) returned before the kill"
        slots = _slots(job_id)  # what the kill left, as the restart finds it
        assert slots.get(3) == ("COMPLETE", saver), f"step 3 is no longer held for the saver: {slots}"
        if inside["where"] == "copying":  # step 5 half written into the one slot not holding 3
            assert slots.get(5) == ("WRITING", script.proc.pid), f"the kill landed outside save(5)'s copy: {slots}"
        else:  # nothing of step 5 written: 4, which save(4) returned, is whole
            assert slots.get(4) == ("COMPLETE", 0), f"save(5) was killed waiting for a slot, yet: {slots}"
        os.kill(saver, signal.SIGCONT)
        loader = Script("""
            state = make_state(64)
            ck = Checkpointer(directory, job_id=job, persist_every=3, keep_last=0, memory_slots=2)
            step = ck.load(state)
            say("result " + json.dumps({"step": step, "check": check(state) if step is not None else None,
                                        "source": ck.last_load.source}))
        """, tmp_path, job_id)
        res = loader.result("result ", 60, "restart after the crash")
        assert res["step"] is not None and res["step"] >= 4, \
            (f"save(4) had returned, the trainer died inside save(5) ({inside['where']}), "
             f"and the restart restored {res['step']} from {res['source']}")
        assert res["check"] == res["step"]
    finally:
        cleanup(job_id, script, loader)  # continues and kills the stopped saver


# -- (f) `latest` is a hint --------------------------------------------------------------

@pytest.mark.timeout(120)
def test_a_committed_step_newer_than_latest_wins_and_latest_is_repaired(tmp_path, job_id):
    """A saver killed after renaming step-3 into place but before replacing ``latest``
    (simulated: commit 1..3, then write 2 into ``latest``): the restart, with only storage,
    loads 3, and ``latest`` says 3 again."""
    with Checkpointer(tmp_path, job_id=job_id, persist_every=1, keep_last=0) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"w": torch.full((1000,), float(step))})
        ck.wait(timeout=60)
    assert LocalStorage(str(tmp_path)).committed_steps() == [1, 2, 3]
    (tmp_path / "latest").write_text("2\n")
    cleanup(job_id)  # a fresh machine: only storage is left
    target = {"w": torch.zeros(1000)}
    ck = Checkpointer(tmp_path, job_id=job_id, persist_every=1, keep_last=0)
    try:
        assert ck.latest_step() == 3, f"latest_step() follows the stale hint: {ck.latest_step()}"
        assert ck.load(target) == 3 and bool((target["w"] == 3).all())
    finally:
        ck.close()
    assert (tmp_path / "latest").read_text().strip() == "3", "latest was not repaired"
