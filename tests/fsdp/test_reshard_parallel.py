"""RangeReader.fill_many: all of a rank's ranges at once, on several threads, bit for bit
what one-by-one fills give; every block a range touches verified, no other; a flipped
byte in a range names the file and the bytes."""

import json
import os

import pytest
import torch

import flashckpt.restore._shard_read as shard_read
from flashckpt import CorruptCheckpointError
from flashckpt.restore._reshard import Fill, Piece, RangeReader, chunk_pieces, path_key, read_sources
from flashckpt.torch import _tensors
from flashckpt.torch._tensors import host_byte_array as _host_bytes

from .test_fsdp_layout import _write_step

pytestmark = pytest.mark.timeout(60)

BLOCK = 4096
SHAPE = (301, 40)  # 47 KiB of float32: a dozen blocks a tensor


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr("flashckpt.storage._local.BLOCK_SIZE", BLOCK)
    monkeypatch.setattr(shard_read, "CHUNK_BYTES", 3 * BLOCK)


def _full(seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(SHAPE, generator=g) * 100).to(dtype)


def _step(tmp_path, source_world: int = 4):
    """A step saved by ``source_world`` ranks: rows (dim-0, contiguous) and cols (dim-1,
    strided) of two dtypes, a replicated scalar."""
    fulls = {"a": _full(0, torch.float32), "b": _full(1, torch.bfloat16), "c": _full(2, torch.float32)}
    by_rank = {}
    for r in range(source_world):
        rows = chunk_pieces(SHAPE, source_world)[r]
        cols = chunk_pieces(SHAPE, source_world, dim=1)[r]
        pieces = {}
        for k, full in fulls.items():
            p = cols if k == "c" else rows
            o, n = p.offsets, p.lengths
            pieces[k] = (full[o[0]:o[0] + n[0], o[1]:o[1] + n[1]].clone(), p, SHAPE)
        pieces["s"] = (torch.tensor(7.5), Piece((), ()), ())
        by_rank[r] = pieces
    return _write_step(tmp_path, by_rank), fulls


def _wants(world: int, rank: int) -> dict[str, Piece]:
    return {"a": chunk_pieces(SHAPE, world)[rank], "b": chunk_pieces(SHAPE, world, dim=1)[rank],
            "c": chunk_pieces(SHAPE, world)[rank], "s": Piece((), ())}


def _targets(fulls, wants):
    out = {k: torch.zeros(w.lengths, dtype=fulls[k].dtype) for k, w in wants.items() if k != "s"}
    out["s"] = torch.zeros(())
    return out


def _fills(out, wants, prefer):
    return [Fill(_host_bytes(out[k]), key=path_key(("t", k)), want=w, dtype=_tensors.DTYPE_NAMES[out[k].dtype],
                 global_shape=SHAPE if k != "s" else (), prefer=prefer) for k, w in wants.items()]


@pytest.mark.parametrize("world,rank", [(2, 0), (2, 1), (3, 2), (1, 0)])
@pytest.mark.parametrize("threads", [1, 4])
def test_fill_many_equals_one_by_one_fills_bit_for_bit(tmp_path, world, rank, threads):
    storage, fulls = _step(tmp_path)
    wants = _wants(world, rank)
    serial, parallel = _targets(fulls, wants), _targets(fulls, wants)
    with RangeReader(read_sources(storage, 1)) as reader:
        for f in _fills(serial, wants, rank):
            reader.fill(f.key, f.dst, f.want, f.dtype, f.global_shape, prefer=f.prefer)
        one_by_one = reader.bytes_read
    with RangeReader(read_sources(storage, 1)) as reader:
        reader.fill_many(_fills(parallel, wants, rank), threads=threads)
        assert reader.bytes_read == one_by_one
    for k, want in wants.items():
        assert torch.equal(serial[k].view(-1).view(torch.uint8) if serial[k].dim() else serial[k].view(1).view(torch.uint8),
                           parallel[k].view(-1).view(torch.uint8) if parallel[k].dim() else parallel[k].view(1).view(torch.uint8)), k
        if k != "s":
            o, n = want.offsets, want.lengths
            assert torch.equal(parallel[k], fulls[k][o[0]:o[0] + n[0], o[1]:o[1] + n[1]]), k
    assert parallel["s"].item() == 7.5


def test_fill_many_reads_whole_entries_and_verifies_exactly_the_blocks_it_touches(tmp_path):
    storage, fulls = _step(tmp_path, source_world=2)
    sources = read_sources(storage, 1)
    want = Piece((0, 0), (10, 40))  # the first 10 rows of "a": rank 0's file only
    out, whole = torch.zeros(10, 40), torch.zeros(150, 40, dtype=torch.bfloat16)
    home = sources[1]
    with RangeReader(sources) as reader:
        reader.fill_many([Fill(_host_bytes(out), key="t/a", want=want, dtype="F32", global_shape=SHAPE),
                          Fill(_host_bytes(whole), source=home, entry=home.entry("t/b"))], threads=4)
        assert torch.equal(out, fulls["a"][:10]) and torch.equal(whole, fulls["b"][151:])

        def touched(src, key, lo, n):
            at = src.file_offset(src.entry(key)) + lo
            return set(range(at // BLOCK, (at + n - 1) // BLOCK + 1))

        header = lambda src: set(range(0, (src.reader.body_start - 1) // BLOCK + 1))
        assert sources[0].reader._sums.verified == header(sources[0]) | touched(sources[0], "t/a", 0, 10 * 160)
        assert sources[1].reader._sums.verified == header(sources[1]) | touched(sources[1], "t/b", 0, 150 * 80)


@pytest.mark.parametrize("key", ["a", "c"])  # a contiguous range, a strided span
def test_a_flipped_byte_in_a_range_names_the_file_and_bytes(tmp_path, key):
    storage, fulls = _step(tmp_path, source_world=2)
    sources = read_sources(storage, 1)
    src = sources[1]
    # global row 201 of "a" (rank 1's rows start at 151), of "c" (rank 1 holds every row, 80 bytes each)
    at = src.file_offset(src.entry(f"t/{key}")) + (50 * 160 if key == "a" else 201 * 80) + 3
    path = src.path
    for s in sources:
        s.reader.close()
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))
    wants = _wants(2, 1)
    out = _targets(fulls, wants)
    with RangeReader(read_sources(storage, 1)) as reader:
        block = at // BLOCK
        with pytest.raises(CorruptCheckpointError, match=rf"rank-1\.safetensors: checksum .* bytes {block * BLOCK}-"):
            reader.fill_many(_fills(out, wants, 1), threads=4)
    # rank 0's rows of the same tensor never touch the damaged block: read and verified
    wants0 = {"a": chunk_pieces(SHAPE, 2)[0]}
    out0 = _targets(fulls, wants0)
    with RangeReader(read_sources(storage, 1)) as reader:
        reader.fill_many(_fills(out0, wants0, 0), threads=4)
    assert torch.equal(out0["a"], fulls["a"][:151])


def test_sources_open_together_and_a_damaged_header_closes_them_all(tmp_path):
    storage, _ = _step(tmp_path, source_world=4)
    sources = read_sources(storage, 1)
    assert [s.rank for s in sources] == [0, 1, 2, 3]
    for s in sources:
        s.reader.close()
    path = sources[2].path
    with open(path, "r+b") as f:
        f.seek(9)  # inside the header's JSON
        byte = f.read(1)[0]
        f.seek(9)
        f.write(bytes([byte ^ 0x01]))
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(CorruptCheckpointError, match=r"rank-2\.safetensors"):
        read_sources(storage, 1)
    assert len(os.listdir("/proc/self/fd")) == before


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))


def test_headers_left_to_the_reads_are_verified_for_the_shards_read_from_only(tmp_path):
    """``read_sources(verify_headers=False)`` (a resharding load) reads no header block
    up front: the reads verify those of the shards they read from, a damaged one fails
    the fill, and a shard that is not read from costs nothing."""
    storage, fulls = _step(tmp_path, source_world=2)
    sources = read_sources(storage, 1, verify_headers=False)
    assert all(not s.reader._sums.verified for s in sources)
    paths = [s.path for s in sources]
    body_start = sources[0].reader.body_start
    for s in sources:
        s.reader.close()
    assert body_start < BLOCK - 1
    for path in paths:
        _flip(path, BLOCK - 1)  # the first block, past the header: the header block no longer verifies
    want = Piece((0, 0), (10, 40))  # the first 10 rows of "a": rank 0's file only
    out = torch.zeros(10, 40)
    with RangeReader(read_sources(storage, 1, verify_headers=False)) as reader:
        with pytest.raises(CorruptCheckpointError, match=r"rank-0\.safetensors: checksum .* bytes 0-"):
            reader.fill_many([Fill(_host_bytes(out), key="t/a", want=want, dtype="F32", global_shape=SHAPE)])
    _flip(paths[0], BLOCK - 1)  # rank 0's file intact again; rank 1's header block stays damaged
    with RangeReader(read_sources(storage, 1, verify_headers=False)) as reader:
        reader.fill_many([Fill(_host_bytes(out), key="t/a", want=want, dtype="F32", global_shape=SHAPE)])
        assert not reader.sources[1].reader._sums.verified
    assert torch.equal(out, fulls["a"][:10])
    with pytest.raises(CorruptCheckpointError, match=r"rank-1\.safetensors"):
        read_sources(storage, 1)  # verified up front, the default


def test_a_replicated_scalar_is_read_from_the_header_block(tmp_path):
    """Small entries lie first in the body, smallest first, in the header's checksum
    block: a rank that takes only a replicated scalar from a shard reads that block and
    no other (not one block per scalar, spread among the large tensors)."""
    storage, _ = _step(tmp_path, source_world=2)
    sources = read_sources(storage, 1, verify_headers=False)
    home = sources[1]
    out = torch.zeros(())
    with RangeReader(sources) as reader:
        reader.fill_many([Fill(_host_bytes(out), source=home, entry=home.entry("t/s"))])
        assert home.reader._sums.verified == set(range(-(-home.reader.body_start // BLOCK)))
    assert out.item() == 7.5


def test_a_damaged_header_that_still_parses_is_reported_as_damage_not_a_mismatch(tmp_path):
    storage, fulls = _step(tmp_path, source_world=2)
    sources = read_sources(storage, 1, verify_headers=False)
    path, body_start = sources[1].path, sources[1].reader.body_start
    name = json.dumps(sources[1].entry("t/a").name).encode()
    for s in sources:
        s.reader.close()
    with open(path, "r+b") as f:
        head = f.read(body_start)
        at = head.index(name + b':{"dtype":"F32"') + len(name + b':{"dtype":"')
        f.seek(at)
        f.write(b"I")  # F32 -> I32: the header still parses; its checksum block no longer verifies
    wants = _wants(2, 1)
    out = _targets(fulls, wants)
    with RangeReader(read_sources(storage, 1, verify_headers=False)) as reader:
        with pytest.raises(CorruptCheckpointError, match=r"rank-1\.safetensors: checksum .* bytes 0-"):
            reader.fill_many(_fills(out, wants, 0))
