"""The one shard reader: ranged reads verify exactly the blocks they touch, a full read
on several threads equals a one-thread read bit for bit, damage and truncation name the
file and the bytes."""

import os

import pytest
import torch

import flashckpt.restore._shard_read as shard_read
import flashckpt.storage._local as storage_mod
from flashckpt import CorruptCheckpointError
from flashckpt.memory._format import plan_image
from flashckpt.restore._shard_read import open_shard, read_shard_into
from flashckpt.storage._local import LocalStorage
from flashckpt.memory._tree import flatten, merge_into
from flashckpt.torch import _tensors  # noqa: F401  (registers the torch kind)

from .test_storage_lineage import token

pytestmark = pytest.mark.timeout(60)

BLOCK = 4096


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """4 KiB checksum blocks and 3-block read chunks: many blocks and chunks in small files."""
    monkeypatch.setattr(storage_mod, "BLOCK_SIZE", BLOCK)
    monkeypatch.setattr(shard_read, "CHUNK_BYTES", 3 * BLOCK)


def odd_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "f32": torch.randn(7, 13, generator=g),
        "bf16": torch.randn(1001, generator=g).to(torch.bfloat16),
        "f16": torch.randn(3, 5, 9, generator=g).to(torch.float16),
        "f64": torch.randn(2049, generator=g, dtype=torch.float64),
        "i64": torch.randint(-2**40, 2**40, (777,), generator=g),
        "i8": torch.randint(-128, 127, (4099,), generator=g, dtype=torch.int8),
        "bool": torch.rand(333, generator=g) > 0.5,
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "big": torch.randn(10_000, generator=g),
        "nested": {"step": 17, "name": "odd", "t": torch.arange(11, dtype=torch.int32)},
    }


def zeros_like(state):
    if isinstance(state, dict):
        return {k: zeros_like(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return None


def commit_state(storage: LocalStorage, step: int, state: dict) -> None:
    """Commit ``state`` as rank 0 of ``step``, the way the engine lays out a shard."""
    flat = flatten(state)
    tok = token()
    meta = {"format": "flashckpt/1", "step": step, "tree": flat.skeleton, "token": tok,
            "kinds": {leaf.name: leaf.kind.name for leaf in flat.leaves}}
    image = plan_image([(leaf.name, leaf.dtype, leaf.shape) for leaf in flat.leaves], meta)
    buf = bytearray(image.size)
    buf[:len(image.header)] = image.header
    objs = {leaf.name: leaf.obj for leaf in flat.leaves}
    for e in image.entries:
        at = len(image.header) + e.offset
        buf[at:at + e.nbytes] = objs[e.name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    storage.write_shard(step, 0, tok, memoryview(bytes(buf)))
    assert storage.try_commit(step, 1, tok, keep_last=0, branch=-1)


def load(storage: LocalStorage, state: dict, threads: int) -> None:
    def merge(image):
        return merge_into(state, image.meta["tree"], {e.name: (e.dtype, e.shape) for e in image.entries},
                          allow_pickle=False)
    read_shard_into(storage, 1, 0, merge, threads=threads)


def same_bits(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                        b.reshape(-1).view(torch.uint8))
    return a == b


def shard_file(storage: LocalStorage) -> str:
    return os.path.join(storage.step_dir(1), "rank-0.safetensors")


def flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.fixture
def committed(tmp_path):
    storage = LocalStorage(tmp_path / "ck")
    storage.check_writable()
    commit_state(storage, 1, odd_state())
    return storage


# -- ranged reads ---------------------------------------------------------------------

RANGES = [(0, 10), (100, BLOCK), (BLOCK, BLOCK), (BLOCK - 1, 2), (3 * BLOCK + 5, 5 * BLOCK + 17), (7 * BLOCK, 1)]


@pytest.mark.parametrize("start,length", RANGES)
def test_a_ranged_read_returns_the_bytes_and_verifies_exactly_the_blocks_it_touches(committed, start, length):
    path = shard_file(committed)
    with open(path, "rb") as f:
        whole = f.read()
    with open_shard(committed, 1, 0) as reader:
        assert reader.size == len(whole) and reader.path == path
        buf = bytearray(length)
        reader.readinto(memoryview(buf), start)
        assert bytes(buf) == whole[start:start + length]
    touched = set(range(start // BLOCK, (start + length - 1) // BLOCK + 1))
    header_end = len(reader.image.header)
    for block in range(-(-len(whole) // BLOCK)):
        at = max(block * BLOCK, header_end)  # a byte of this block after the header
        if at >= min((block + 1) * BLOCK, len(whole)):
            continue
        flip(path, at)
        try:
            with open_shard(committed, 1, 0) as reader:
                if block in touched:
                    with pytest.raises(CorruptCheckpointError, match=f"{path}.*bytes {block * BLOCK}-"):
                        reader.readinto(memoryview(bytearray(length)), start)
                else:
                    reader.readinto(memoryview(bytearray(length)), start)
        finally:
            flip(path, at)


def test_a_range_past_the_end_is_an_error_naming_the_file(committed):
    with open_shard(committed, 1, 0) as reader:
        with pytest.raises(CorruptCheckpointError, match=shard_file(committed)):
            reader.readinto(memoryview(bytearray(100)), reader.size - 50)


def test_a_shard_truncated_after_commit_is_refused(committed):
    path = shard_file(committed)
    os.truncate(path, os.path.getsize(path) - 1000)
    with pytest.raises(CorruptCheckpointError, match=f"{path}.*truncated"):
        open_shard(committed, 1, 0)
    with pytest.raises(CorruptCheckpointError, match=path):
        load(committed, zeros_like(odd_state()), threads=4)
    assert any(path in p for p in committed.verify(1))


def test_a_shard_truncated_while_open_is_an_error_naming_the_file(committed):
    path = shard_file(committed)
    with open_shard(committed, 1, 0) as reader:
        os.truncate(path, reader.size - 3 * BLOCK)
        with pytest.raises(CorruptCheckpointError, match=f"{path}.*truncated"):
            reader.readinto(memoryview(bytearray(2 * BLOCK)), reader.size - 2 * BLOCK - 7)


# -- full reads -----------------------------------------------------------------------

@pytest.mark.parametrize("threads", [2, 4, 8])
def test_a_full_read_on_several_threads_equals_the_one_thread_read_bit_for_bit(committed, threads):
    one, many = zeros_like(odd_state()), zeros_like(odd_state())
    load(committed, one, threads=1)
    load(committed, many, threads=threads)
    assert same_bits(one, many)
    expected = odd_state()
    assert same_bits(many, expected)


def test_a_full_read_into_non_contiguous_and_new_targets(committed):
    state = zeros_like(odd_state())
    state["f32"] = torch.zeros(13, 7).t()  # not contiguous: read through a scratch buffer
    state["nested"] = {}  # an empty container: filled with new tensors and the plain values
    load(committed, state, threads=4)
    assert same_bits(state, odd_state())


def test_a_damaged_block_names_the_file_and_bytes_and_applies_no_plain_value(committed):
    path = shard_file(committed)
    with open_shard(committed, 1, 0) as reader:
        size, header = reader.size, len(reader.image.header)
    for at in (header + 1, size // 2, size - 1):
        flip(path, at)
        block = at // BLOCK
        state = zeros_like(odd_state())
        state["nested"]["step"] = -1
        with pytest.raises(CorruptCheckpointError,
                           match=f"{path}: checksum .* of bytes {block * BLOCK}-{min(size, (block + 1) * BLOCK)} "):
            load(committed, state, threads=4)
        assert state["nested"]["step"] == -1
        problems = committed.verify(1)
        assert len(problems) == 1 and path in problems[0] and f"bytes {block * BLOCK}-" in problems[0]
        flip(path, at)
    assert committed.verify(1) == []


class BytesShard:
    """A shard that is not a local file: ``name``, ``size``, positional ``preadv``, as an
    object store's shard (``flashckpt.storage._object.ObjectShard``) reads."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            self.data = f.read()
        self.name, self.size, self.closed = f"mem://{path}", len(self.data), False

    def preadv(self, pieces, offset):
        for piece in pieces:
            piece = memoryview(piece).cast("B")
            if offset + len(piece) > self.size:
                raise CorruptCheckpointError(f"{self.name}: truncated")
            piece[:] = self.data[offset:offset + len(piece)]
            offset += len(piece)

    def close(self):
        self.closed = True


def test_a_shard_that_is_not_a_local_file_reads_and_verifies_the_same(committed):
    f, record = committed.open_shard(1, 0)
    f.close()
    shard = BytesShard(shard_file(committed))
    with shard_read.ShardReader(shard, record) as reader:
        parts = [(reader.body_start + e.offset, memoryview(bytearray(e.nbytes))) for e in reader.image.entries]
        reader.read_all([p for p in parts if len(p[1])], threads=4)
        with pytest.raises(OSError):
            reader.fileno()
        reader.advise(0, 10)  # nothing to advise: no error
    assert shard.closed
    assert b"".join(bytes(v) for _, v in parts) == shard.data[reader.body_start:]
    damaged = BytesShard(shard_file(committed))
    damaged.data = damaged.data[:-1] + bytes([damaged.data[-1] ^ 1])
    with pytest.raises(CorruptCheckpointError, match="mem://.*checksum"):
        shard_read.ShardReader(damaged, record).verify()
