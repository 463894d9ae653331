"""Pending directories (``step-N.tmp-<token>``) of persists killed mid-write are removed by
the next commit and by ``flashckpt gc DIR``; one a live writer is writing is never removed.

A writer is a real process stopped at a chosen point (its shard's part file open and half
written), then killed with SIGKILL or left alive."""

import os
import signal
import subprocess
import sys

import pytest

from flashckpt.storage._local import LocalStorage

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
