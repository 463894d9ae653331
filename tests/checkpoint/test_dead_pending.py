"""Pending directories (``step-N.tmp-<token>``) of persists killed mid-write are removed by
the next commit and by ``flashckpt gc DIR``; one a live writer is writing is never removed.

A writer is a real process (a saver, or a process calling ``write_shard``) stopped at a
chosen point (its shard's part file open and half written), then killed with SIGKILL or
left alive."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from flashckpt._engine import Engine, Options, Placement, new_token
from flashckpt.storage._local import LocalStorage
from flashckpt.torch import _tensors  # noqa: F401  (registers torch tensors as leaves)

from .test_ckpt_crash import saver_pids
from .test_storage_lineage import A, B, REPO, commit

pytestmark = pytest.mark.timeout(60)

WRITER = """
import sys
from flashckpt.storage import _local
from tests.checkpoint.test_storage_lineage import image

def stall(path, data):  # stop mid-shard: the part file open and half written
    with open(path, "wb") as f:
        f.write(bytes(data[:len(data) // 2]))
        f.flush()
        print("writing", flush=True)
        sys.stdin.read()  # until the test kills this process (or closes stdin)

_local.write_durable = stall
root, step, rank, tok = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
_local.LocalStorage(root).write_shard(step, rank, tok, image(step, tok, 1 << 16))
"""


def start_writer(root, step: int, tok: str, rank: int = 0) -> subprocess.Popen:
    """A process writing rank ``rank`` of ``step`` (run ``tok``) into ``root``, stopped mid-shard."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(step), str(rank), tok], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"))
    assert proc.stdout.readline() == "writing\n", "the writer did not reach its shard"
    return proc


def kill(proc: subprocess.Popen) -> None:
    proc.kill()  # SIGKILL
    assert proc.wait() == -signal.SIGKILL


def pending(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if ".tmp-" in n)


@pytest.fixture
def writers():
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            kill(proc)


def test_the_next_commit_removes_killed_persists_and_keeps_a_live_one(tmp_path, writers):
    storage = LocalStorage(tmp_path)
    commit(storage, 1, A, branch=-1)
    for step in (2, 3, 4):  # three persists killed mid-shard
        kill(start_writer(tmp_path, step, A))
    live = start_writer(tmp_path, 5, A, rank=1)  # this run's slower rank, still writing step 5
    writers.append(live)
    assert pending(tmp_path) == [f"step-{s}.tmp-{A}" for s in (2, 3, 4, 5)]
    assert commit(storage, 6, A, branch=-1)
    assert pending(tmp_path) == [f"step-5.tmp-{A}"], "a live writer's directory was removed"
    kill(live)
    assert commit(storage, 7, A, branch=-1)
    assert pending(tmp_path) == []


def test_a_newer_lines_commit_keeps_a_live_writer_of_an_older_line(tmp_path, writers):
    storage = LocalStorage(tmp_path)
    commit(storage, 1, A, branch=-1)
    kill(start_writer(tmp_path, 2, A))
    writers.append(start_writer(tmp_path, 3, A))  # a saver still persisting a dead trainer's step
    assert commit(storage, 2, B, branch=1)
    assert pending(tmp_path) == [f"step-3.tmp-{A}"]


def flashckpt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashckpt.cli", *args], capture_output=True, text=True,
                          timeout=30, cwd=REPO)


def test_gc_removes_pending_directories_of_killed_persists(tmp_path, writers):
    storage = LocalStorage(tmp_path)
    commit(storage, 1, A, branch=-1)
    for step in (2, 3):
        kill(start_writer(tmp_path, step, A))  # an older line's killed persists
    assert commit(storage, 4, B, branch=1)
    kill(start_writer(tmp_path, 3, A))  # a late one, after the newer line's commit
    kill(start_writer(tmp_path, 3, B))  # the newer line's own, superseded by its step 4
    writers.append(start_writer(tmp_path, 2, A, rank=1))  # alive
    writers.append(start_writer(tmp_path, 5, B))  # alive, newer than every commit
    before = pending(tmp_path)
    assert before == [f"step-2.tmp-{A}", f"step-3.tmp-{A}", f"step-3.tmp-{B}", f"step-5.tmp-{B}"]

    out = flashckpt("gc", str(tmp_path), "--dry-run")
    assert out.returncode == 0, out.stderr
    assert pending(tmp_path) == before
    assert f"would remove {tmp_path / f'step-3.tmp-{A}'}" in out.stdout, out.stdout
    assert f"would remove {tmp_path / f'step-3.tmp-{B}'}" in out.stdout, out.stdout

    out = flashckpt("gc", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert pending(tmp_path) == [f"step-2.tmp-{A}", f"step-5.tmp-{B}"], out.stdout
    assert f"keeping {tmp_path / f'step-2.tmp-{A}'}" in out.stdout and "being written" in out.stdout, out.stdout
    assert storage.committed_steps() == [1, 4] and storage.verify(4) == []


STALL = '''
import os, threading
from flashckpt.storage import _local

_where, _real = os.environ["FLASHCKPT_TEST_STALL"], _local.write_durable


def _stall(path, data):  # once per arming: stop with the shard's part file half written
    try:
        os.rename(os.path.join(_where, "armed"), os.path.join(_where, "fired"))
    except FileNotFoundError:
        return _real(path, data)
    with open(path, "wb") as f:
        f.write(bytes(data[:len(data) // 2]))
        f.flush()
    open(os.path.join(_where, "stalled"), "w").close()
    threading.Event().wait()  # until the test kills this saver


_local.write_durable = _stall
'''


def until_exited(pid: int) -> None:
    """Wait (bounded) until every thread of ``pid`` has exited, so its files are closed: a
    zombie with no other thread left (the leader turns zombie before the others end), or gone."""
    deadline = time.monotonic() + 30
    while True:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                zombie = f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
            if zombie and os.listdir(f"/proc/{pid}/task") == [str(pid)]:
                return
        except FileNotFoundError:
            return
        assert time.monotonic() < deadline, f"pid {pid} still runs 30s after SIGKILL"
        time.sleep(0.01)


def test_a_saver_killed_mid_persist_again_and_again_leaves_nothing_after_the_next_commit(tmp_path, job_id,
                                                                                         monkeypatch):
    """A real saver stopped mid-shard (``sitecustomize`` in its path) and SIGKILLed, three
    times: each new saver is told the saves again; the next commit leaves no pending
    directory and no part file. (This held before the writers' flock: a regression test.)"""
    site, stall = tmp_path / "site", tmp_path / "stall"
    site.mkdir()
    stall.mkdir()
    (site / "sitecustomize.py").write_text(STALL)  # runs first in the savers this test starts
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("FLASHCKPT_TEST_STALL", str(stall))
    monkeypatch.setenv("FLASHCKPT_SAVER_TIMEOUT", "30")
    placement = Placement(local_rank=0, memory_rank=0, writes_memory=True, storage_rank=0, storage_world=1,
                          persists=True, token=new_token())
    engine = Engine(str(tmp_path / "ck"), Options(persist_every=1, keep_last=1, job_id=job_id), placement)
    state = lambda step: {"w": torch.full((1 << 18,), float(step))}  # noqa: E731
    try:
        engine.save(1, state(1)).wait(timeout=30)
        for step in (2, 3, 4):
            (stall / "armed").touch()
            engine.save(step, state(step))
            deadline = time.monotonic() + 30
            while not (stall / "stalled").exists():
                assert time.monotonic() < deadline, "the saver never reached the shard"
                time.sleep(0.02)
            (stall / "stalled").unlink()
            assert pending(engine.storage.root)  # the stalled persist's (this step, or one told again)
            for pid in saver_pids(job_id):
                os.kill(pid, signal.SIGKILL)
                until_exited(pid)  # its socket is closed: the next save finds it gone, not a buffer
        engine.save(5, state(5)).wait(timeout=30)
        storage = LocalStorage(engine.storage.root)
        assert storage.latest_step() == 5 and storage.verify(5) == []
        assert pending(engine.storage.root) == []
    finally:
        engine.close()
