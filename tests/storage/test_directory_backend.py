"""A local directory implements the Backend primitives (``flashckpt.storage._directory``),
and LocalStorage's policy reads go through them: objects below the directory, never
through a link below it, while the directory itself may be a link."""

from __future__ import annotations

import os

import pytest

from flashckpt import CheckpointNotFoundError, CorruptCheckpointError, UnsafeFileError
from flashckpt.storage import Backend, CommittedStore
from flashckpt.storage._local import LocalStorage
from tests.objectstore.conftest import image, token


def test_the_primitives_on_a_directory(tmp_path):
    backend = LocalStorage(tmp_path / "ckpt").backend
    assert isinstance(backend, Backend)
    backend.write("step-1/a.json", memoryview(b"hello"))
    (tmp_path / "ckpt" / "step-1" / "b.json.tmp-1-x").write_bytes(b"half")  # a write in progress
    assert backend.read_small("step-1/a.json", 5) == b"hello" and backend.size("step-1/a.json") == 5
    assert list(backend.list()) == ["step-1/a.json"] and list(backend.list("step-1")) == ["step-1/a.json"]
    with pytest.raises(CorruptCheckpointError, match="larger than 4 bytes"):
        backend.read_small("step-1/a.json", 4)
    with backend.open_range("step-1/a.json", 5) as f:
        out = bytearray(3)
        f.readinto(out)
    assert out == b"hel" and f.name == str(tmp_path / "ckpt" / "step-1" / "a.json")
    backend.delete(["step-1/a.json", "step-1/gone.json"])
    with pytest.raises(CheckpointNotFoundError):
        backend.read_small("step-1/a.json", 5)
    assert backend.read_many(["nope"])["nope"].__class__ is CheckpointNotFoundError


def test_a_linked_step_directory_is_refused_a_linked_checkpoint_directory_is_not(tmp_path):
    real = tmp_path / "real"
    storage = LocalStorage(real)
    storage.check_writable()
    run = token()
    storage.write_shard(1, 0, run, memoryview(image(run, 3000)))
    assert storage.try_commit(1, 1, run, 0)
    os.symlink(real, tmp_path / "link")
    through = LocalStorage(tmp_path / "link")
    assert through.latest_step() == 1 and through.verify(1) == []
    (tmp_path / "other").mkdir()
    os.rename(real / "step-1", tmp_path / "other" / "step-1")
    os.symlink(tmp_path / "other" / "step-1", real / "step-1")
    with pytest.raises(UnsafeFileError, match="symbolic link"):
        storage.backend.read_small("step-1/metadata.json", 1 << 20)
    assert storage.committed_steps() == []


def test_the_one_policy_runs_on_a_directory_backend(tmp_path):
    """The object-store policy (commit by metadata last) over the directory's primitives."""
    store = CommittedStore(LocalStorage(tmp_path / "ckpt").backend)
    run = token()
    for rank in range(2):
        store.write_shard(1, rank, run, memoryview(image(run, 3000 + rank)))
    assert store.try_commit(1, 2, run, 0) and store.latest_step() == 1 and store.verify(1) == []
