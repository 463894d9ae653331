"""Pure geometry and ranged reads of the resharding layer, no process group."""

import json
import os

import numpy as np
import pytest
import torch

from flashckpt import CorruptCheckpointError
from flashckpt._engine import new_token
from flashckpt.memory._format import plan_image
from flashckpt.restore._reshard import (LAYOUT_KEY, Piece, RangeReader, _contiguous_range, byte_shape, chunk_pieces,
                                path_key, read_sources)
from flashckpt.storage._local import LocalStorage
from flashckpt.memory._tree import flatten
from flashckpt.torch import _tensors  # noqa: F401
from flashckpt.torch._tensors import host_byte_array as _host_bytes


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 7, 8, 13, 64, 1001])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 16])
def test_chunk_pieces_follow_torch_chunk(n, world):
    t = torch.arange(n * 3).reshape(n, 3)
    chunks = list(torch.chunk(t, world, dim=0)) if n else []
    chunks += [t[n:]] * (world - len(chunks))  # torch.chunk returns fewer chunks; FSDP pads with empty ones
    pieces = chunk_pieces((n, 3), world)
    assert len(pieces) == world
    for piece, chunk in zip(pieces, chunks):
        assert piece.lengths == tuple(chunk.shape)
        if chunk.numel():
            assert torch.equal(t[piece.offsets[0]:piece.offsets[0] + piece.lengths[0]], chunk)
    assert sum(p.lengths[0] for p in pieces) == n


def test_piece_intersection_and_contiguous_runs():
    a = Piece((0, 0), (4, 6))
    assert a.intersect(Piece((2, 3), (5, 5))) == Piece((2, 3), (2, 3))
    assert a.intersect(Piece((4, 0), (1, 6))) is None
    assert Piece((), ()).intersect(Piece((), ())) == Piece((), ())
    assert _contiguous_range((4, 6), (1, 0), (2, 6)) == (6, 12)     # whole rows
    assert _contiguous_range((4, 6), (1, 2), (1, 3)) == (8, 3)      # part of one row
    assert _contiguous_range((4, 6), (1, 2), (2, 3)) is None        # parts of two rows
    assert byte_shape((3, 5), 2) == (3, 10) and byte_shape((), 4) == (4,)


def _write_step(root, tensors_by_rank, step=1):
    """A committed step whose ranks hold the given pieces: {rank: {key: (tensor, Piece, global shape)}}."""
    storage = LocalStorage(str(root))
    storage.check_writable()
    token = new_token()
    for rank, pieces in tensors_by_rank.items():
        tree = {"t": {k: t for k, (t, _, _) in pieces.items()}}
        layout = {"tensors": {path_key(("t", k)): {"shape": list(g), **p.to_json()} for k, (_, p, g) in pieces.items()}}
        tree[LAYOUT_KEY] = json.dumps(layout)
        flat = flatten(tree)
        image = plan_image([(l.name, l.dtype, l.shape) for l in flat.leaves],
                           {"tree": flat.skeleton, "kinds": {l.name: "torch" for l in flat.leaves}})
        buf = bytearray(image.size)
        buf[:len(image.header)] = image.header
        for e in image.entries:
            obj = next(l.obj for l in flat.leaves if l.name == e.name)
            if obj.numel():
                at = len(image.header) + e.offset
                buf[at:at + e.nbytes] = _host_bytes(obj.contiguous()).tobytes()
        storage.write_shard(step, rank, token, memoryview(buf))
    assert storage.try_commit(step, len(tensors_by_rank), token, keep_last=0)
    return storage


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_range_reader_fills_any_box_from_row_and_column_shards(tmp_path, dtype):
    full = (torch.arange(7 * 10) * 3 - 50).reshape(7, 10).to(dtype)
    rows = chunk_pieces((7, 10), 3)                       # dim-0 shards: contiguous, preadv
    cols = [Piece((0, 0), (7, 4)), Piece((0, 4), (7, 6))]  # dim-1 shards: strided, mmap
    scalar = torch.tensor(5.0)
    by_rank = {r: {"rows": (full[p.offsets[0]:p.offsets[0] + p.lengths[0]].clone(), p, (7, 10)),
                   "cols": (full[:, c.offsets[1]:c.offsets[1] + c.lengths[1]].clone(), c, (7, 10)),
                   "s": (scalar, Piece((), ()), ())} for r, (p, c) in enumerate(zip(rows, cols + [cols[1]]))}
    storage = _write_step(tmp_path, by_rank)
    sources = read_sources(storage, 1)
    wants = [Piece((0, 0), (7, 10)), Piece((2, 3), (4, 5)), Piece((6, 0), (1, 10)), Piece((3, 9), (4, 1))]
    with RangeReader(sources) as reader:
        for key in ("rows", "cols"):
            for want in wants:
                out = torch.zeros(want.lengths, dtype=dtype)
                reader.fill(path_key(("t", key)), _host_bytes(out), want, _tensors.DTYPE_NAMES[dtype], (7, 10))
                o, l = want.offsets, want.lengths
                assert torch.equal(out, full[o[0]:o[0] + l[0], o[1]:o[1] + l[1]]), (key, want)
        before = reader.bytes_read
        out = torch.zeros(())
        reader.fill(path_key(("t", "s")), _host_bytes(out), Piece((), ()), "F32", ())
        assert out.item() == 5.0 and reader.bytes_read - before == 4  # replicated: read once


def test_range_reader_reports_a_missing_piece(tmp_path):
    full = torch.arange(12.0).reshape(6, 2)
    p0, _ = chunk_pieces((6, 2), 2)
    storage = _write_step(tmp_path, {0: {"w": (full[:3].clone(), p0, (6, 2))},
                                     1: {"w": (full[:3].clone(), p0, (6, 2))}})  # rank 1 repeats rank 0's rows
    with RangeReader(read_sources(storage, 1)) as reader:
        with pytest.raises(CorruptCheckpointError, match="cover 6 of the 12 elements"):
            reader.fill("t/w", _host_bytes(torch.zeros(6, 2)), Piece((0, 0), (6, 2)), "F32", (6, 2))


def test_truncated_shard_is_named(tmp_path):
    full = torch.arange(12.0).reshape(6, 2)
    storage = _write_step(tmp_path, {0: {"w": (full, Piece((0, 0), (6, 2)), (6, 2))}})
    path, _ = storage.shard_path(1, 0)
    os.truncate(path, os.path.getsize(path) - 8)
    with pytest.raises(CorruptCheckpointError, match="rank-0.safetensors"):
        read_sources(storage, 1)


def test_numpy_views_are_bytes():
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    assert _host_bytes(t).shape == (2, 6) and _host_bytes(torch.tensor(1.0)).shape == (4,)
    assert isinstance(_host_bytes(t), np.ndarray)


def test_ranged_reads_verify_only_the_blocks_they_touch(tmp_path, monkeypatch):
    """A flipped byte in a block a resharded load reads is a checksum error naming the
    file; one in a block it does not read costs nothing (no whole-file read)."""
    monkeypatch.setattr("flashckpt.storage._local.BLOCK_SIZE", 4096)
    full = torch.arange(16384.0).reshape(4096, 4)  # 64 KiB: 16 blocks of 4 KiB
    storage = _write_step(tmp_path, {0: {"w": (full, Piece((0, 0), (4096, 4)), (4096, 4))}})
    path, record = storage.shard_path(1, 0)
    assert record["block_size"] == 4096 and len(record["block_crc32"]) == -(-record["size"] // 4096)
    (source,) = read_sources(storage, 1)
    data_start = source.file_offset(source.entry("t/w"))
    last_row = Piece((4095, 0), (1, 4))

    def flip(at):
        with open(path, "r+b") as f:
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ 0xFF]))

    flip(data_start + 512 * 16)  # row 512: neither in the header's block nor in the last row's
    with RangeReader(read_sources(storage, 1)) as reader:
        out = torch.zeros(1, 4)
        reader.fill("t/w", _host_bytes(out), last_row, "F32", (4096, 4))
        assert torch.equal(out, full[4095:])
        with pytest.raises(CorruptCheckpointError, match=r"rank-0\.safetensors: checksum"):
            reader.fill("t/w", _host_bytes(torch.zeros(2, 4)), Piece((511, 0), (2, 4)), "F32", (4096, 4))
    assert storage.verify(1) and "checksum" in storage.verify(1)[0]
