"""A full read of a shard that is not in the page cache (a restart's load: the saver wrote
it with O_DIRECT) leaves it out of the page cache; a cached shard is read from the cache
and stays there. Both give exactly the saved bytes and verify every block."""

import ctypes
import mmap
import os

import pytest
import torch

from flashckpt import CorruptCheckpointError
from flashckpt.storage._local import LocalStorage
from flashckpt.torch import Checkpointer

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def cached_fraction(path) -> float:
    """The share of the file's pages in the page cache (mincore over a mapping of it)."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value)
        pages = -(-size // mmap.PAGESIZE)
        vec = ctypes.create_string_buffer(pages)
        try:
            assert _libc.mincore(addr, size, vec) == 0
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec.raw) / pages


def evict(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def make_state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    # sizes that leave the file's end off any 512-byte boundary, tensors off alignment
    return {"w": torch.randn(3_000_001, generator=gen), "step": torch.tensor(float(seed)),
            "b": torch.randn(777, 1001, generator=gen).to(torch.bfloat16), "n": seed}


def saved_shard(directory, job_id) -> str:
    with Checkpointer(str(directory), job_id=job_id) as ck:
        ck.save(1, make_state(1))
        ck.wait()
    path, _ = LocalStorage(str(directory)).shard_path(1, 0)
    assert os.path.getsize(path) % 512
    return path


def load_from_storage(directory, job_id) -> dict:
    state = make_state(2)
    with Checkpointer(str(directory), job_id=job_id + "-new") as ck:  # another job: nothing in memory
        assert ck.load(state) == 1
    return state


def assert_saved(state: dict) -> None:
    want = make_state(1)
    assert state["n"] == 1
    for key in ("w", "step", "b"):
        assert torch.equal(state[key], want[key]), key


@pytest.fixture
def shard(tmp_path, job_id):
    return tmp_path, job_id, saved_shard(tmp_path, job_id)


def test_a_cold_shard_is_not_left_in_the_page_cache(shard):
    directory, job_id, path = shard
    evict(path)
    assert cached_fraction(path) < 0.05
    assert_saved(load_from_storage(directory, job_id))
    assert cached_fraction(path) < 0.5  # each chunk read is dropped from the cache


def test_a_cached_shard_is_read_from_the_cache(shard):
    directory, job_id, path = shard
    with open(path, "rb") as f:
        while f.read(1 << 20):
            pass
    assert cached_fraction(path) > 0.95
    assert_saved(load_from_storage(directory, job_id))
    assert cached_fraction(path) > 0.95


def test_a_flipped_byte_in_a_cold_shard_names_the_file(shard):
    directory, job_id, path = shard
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size - 100)
        byte = f.read(1)
        f.seek(size - 100)
        f.write(bytes([byte[0] ^ 0x10]))
        f.flush()
        os.fsync(f.fileno())
    evict(path)
    with pytest.raises(CorruptCheckpointError, match="rank-0.safetensors"):
        with Checkpointer(str(directory), job_id=job_id + "-new") as ck:
            ck.load(make_state(2), step=1)
