"""Two writers of the same shard of the same save (a rank's own slot and a replica of it, or a
repeated persist request): the second one's write is not an error when the first one's step
commits under it, and a shard that is committed already is not written again.

The second writer is a real process stopped mid-shard (its part file open and half written)
while the step commits, then let go."""

import os
import subprocess
import sys

import pytest

from flashckpt.storage._local import LocalStorage

from .test_dead_pending import pending
from .test_storage_lineage import A, REPO, image

pytestmark = pytest.mark.timeout(60)

WRITER = """
import sys
from flashckpt.storage import _local
from tests.checkpoint.test_storage_lineage import image

durable = _local.write_durable

def stall(path, data):  # stop mid-shard until stdin closes, then finish the shard
    with open(path, "wb") as f:
        f.write(bytes(data[:len(data) // 2]))
        f.flush()
        print("writing", flush=True)
        sys.stdin.read()
    durable(path, data)

_local.write_durable = stall
root, step, rank, tok = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
_local.LocalStorage(root).write_shard(step, rank, tok, image(step, tok))
print("written", flush=True)
"""


def stray(storage: LocalStorage, step: int) -> list[str]:
    """Pending directories, and part files inside the committed step."""
    return pending(storage.root) + [n for n in os.listdir(storage.step_dir(step)) if ".tmp-" in n]


def test_a_second_writer_of_a_shard_whose_step_commits_meanwhile_succeeds(tmp_path):
    storage = LocalStorage(tmp_path)
    for rank in (0, 1):
        storage.write_shard(3, rank, A, image(3, A))
    second = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), "3", "1", A], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"))
    try:
        assert second.stdout.readline() == "writing\n", second.stderr.read()
        assert storage.try_commit(3, 2, A, 0, branch=-1)  # rank 1's first shard was durable
        out, err = second.communicate(timeout=30)
    finally:
        second.kill()
    assert second.returncode == 0 and out == "written\n", err[-2000:]
    assert storage.verify(3) == [] and storage.latest_step() == 3
    assert stray(storage, 3) == []


def test_a_shard_committed_already_is_not_written_again(tmp_path):
    storage = LocalStorage(tmp_path)
    records = [storage.write_shard(3, rank, A, image(3, A)) for rank in (0, 1)]
    assert storage.try_commit(3, 2, A, 0, branch=-1)
    assert storage.write_shard(3, 1, A, image(3, A)) == records[1]
    assert stray(storage, 3) == [] and storage.verify(3) == []
