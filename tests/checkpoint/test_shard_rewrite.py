"""A second write of a shard that is already durable never damages it.

A rank's shard can be written twice into its step's pending directory: a successor
saver re-persists an orphaned slot whose shard the dead saver had already written and
marked. The first write is durable (its ``rank-N.done`` marker is there) and commits
with any later rank. A rewrite that fails (a full disk) or dies (``kill -9``) half-way
must leave that shard as it was, and the step commits intact with no stray file.
"""

import errno
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from flashckpt.storage import _files
from flashckpt._errors import CheckpointError
from flashckpt.storage._local import LocalStorage

from .test_storage_lineage import REPO, image, token


def _commit_and_check(storage: LocalStorage, tok: str) -> None:
    storage.write_shard(4, 1, tok, image(4, tok))
    assert storage.try_commit(4, 2, tok, 0, branch=-1)
    assert storage.verify(4) == []
    assert sorted(os.listdir(storage.step_dir(4))) == [
        "metadata.json", "rank-0.done", "rank-0.safetensors", "rank-1.done", "rank-1.safetensors"]


def test_a_rewrite_that_fails_half_way_leaves_the_durable_shard(tmp_path, monkeypatch):
    storage, tok = LocalStorage(tmp_path), token()
    storage.write_shard(4, 0, tok, image(4, tok))

    def full_disk(path: str, data: memoryview) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, data[:100])
        os.close(fd)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("flashckpt.storage._local.write_durable", full_disk)
    with pytest.raises(CheckpointError, match="No space left"):
        storage.write_shard(4, 0, tok, image(4, tok))
    monkeypatch.setattr("flashckpt.storage._local.write_durable", _files.write_durable)
    _commit_and_check(storage, tok)


def test_a_rewrite_killed_half_way_leaves_the_durable_shard(tmp_path):
    storage, tok = LocalStorage(tmp_path), token()
    storage.write_shard(4, 0, tok, image(4, tok))
    rewrite = textwrap.dedent(f"""
        import os, signal
        from flashckpt.storage import _files
        from flashckpt.storage._local import LocalStorage
        from tests.checkpoint.test_storage_lineage import image

        real_write = os.write
        def dies_in_the_write(fd, data):  # the shard's file is open: die before its bytes land
            if len(data) > 200:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_write(fd, data)
        _files.os.write = dies_in_the_write
        LocalStorage({str(tmp_path)!r}).write_shard(4, 0, {tok!r}, image(4, {tok!r}))
    """)
    proc = subprocess.run([sys.executable, "-c", rewrite], cwd=REPO, capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    _commit_and_check(storage, tok)


def test_a_first_write_whose_marker_fails_leaves_no_shard_behind(tmp_path, monkeypatch):
    storage, tok = LocalStorage(tmp_path), token()

    def full_disk(path: str, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("flashckpt.storage._directory.write_atomic", full_disk)  # markers go through the backend
    with pytest.raises(CheckpointError, match="No space left"):
        storage.write_shard(4, 0, tok, image(4, tok, 1 << 20))
    assert os.listdir(tmp_path) == []  # no shard without its marker holding the disk


def test_a_rewrite_whose_marker_fails_leaves_no_marker_of_other_bytes(tmp_path, monkeypatch):
    """A second save of the step (other bytes, same size) replaced the shard, then its marker
    failed: the first save's marker must not stay to vouch for the second save's bytes."""
    storage, tok = LocalStorage(tmp_path), token()
    other = bytearray(image(4, tok))
    other[-1] ^= 0xFF
    storage.write_shard(4, 0, tok, memoryview(bytes(other)))

    def full_disk(path: str, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("flashckpt.storage._directory.write_atomic", full_disk)  # markers go through the backend
    with pytest.raises(CheckpointError, match="No space left"):
        storage.write_shard(4, 0, tok, image(4, tok))
    pending = tmp_path / f"step-4.tmp-{tok}"
    assert not (pending / "rank-0.done").exists() and not (pending / "rank-0.safetensors").exists()
