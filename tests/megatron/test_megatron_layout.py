"""Megatron blocks of random layouts, saved and read back in other layouts through the one
resharding reader: several blocks of one key in a shard (a layer stack's prepended axis),
strided boxes, from shared memory and from storage (one process, no distributed)."""

import uuid

import numpy as np
import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from flashckpt import StateMismatchError, _events
from flashckpt.megatron import MegatronCheckpointer


def _cuts(rng, n):
    """Random split points of an axis of extent ``n``: [(start, length), ...]."""
    inner = sorted(set(int(x) for x in rng.integers(1, n, int(rng.integers(0, n)))) if n > 1 else set())
    bounds = [0, *inner, n]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:])]


def _blocks(key, full, rng, prepend, data=None):
    """ShardedTensors that tile ``full`` (its first ``prepend`` axes are a layer stack: one
    block per index, that axis not in the block's local shape); ``data(shape)`` makes each
    block's tensor (default: its part of ``full``)."""
    grids = [[(i, 1) for i in range(n)] if d < prepend else _cuts(rng, n) for d, n in enumerate(full.shape)]
    out = []
    for corner in np.ndindex(*(len(g) for g in grids)):
        box = [grids[d][i] for d, i in enumerate(corner)]
        local = tuple(n for _, n in box[prepend:])
        part = full[tuple(slice(a, a + n) for a, n in box)].reshape(local)
        tensor = part.clone() if data is None else data(local)
        out.append(ShardedTensor(key, tensor, full.dtype, local, tuple(full.shape), tuple(a for a, _ in box),
                                 None, replica_id=0, prepend_axis_num=prepend))
    return out


def _random_state(rng, count):
    fulls = {}
    for i in range(count):
        ndim = int(rng.integers(1, 4))
        prepend = int(rng.integers(0, 2)) if ndim > 1 else 0
        shape = tuple(int(x) for x in rng.integers(1, 7, ndim))
        dtype = (torch.float32, torch.bfloat16, torch.int64)[i % 3]
        fulls[f"t{i}"] = (torch.arange(int(np.prod(shape))).reshape(shape) + 1000 * i).to(dtype), prepend
    return fulls


def _load(ck, fulls, rng, strided):
    """Load into another random layout; ``strided``: every block's data a non-contiguous view."""
    def zeros(full):
        if not strided:
            return lambda shape: torch.zeros(shape, dtype=full.dtype)
        return lambda shape: torch.zeros(shape[::-1], dtype=full.dtype).permute(*reversed(range(len(shape))))

    want = {key: _blocks(key, full, rng, prepend, data=zeros(full)) for key, (full, prepend) in fulls.items()}
    state, step = ck.load({key: list(blocks) for key, blocks in want.items()})
    bad = []
    for key, (full, prepend) in fulls.items():
        for block, got in zip(want[key], state[key]):
            box = tuple(slice(o, o + n) for o, n in zip(block.global_offset, (1,) * prepend + block.local_shape))
            if not torch.equal(got.reshape(-1), full[box].reshape(-1)):
                bad.append((key, block.global_offset))
    return step, bad


@pytest.mark.parametrize("strided", [False, True])
def test_random_layouts_read_back_in_other_layouts_from_memory_and_storage(tmp_path, strided):
    rng = np.random.default_rng(7 + strided)
    fulls = _random_state(rng, 60)
    saved = {key: _blocks(key, full, rng, prepend) for key, (full, prepend) in fulls.items()}
    sources = []

    def listen(event, **info):
        if event == "load":
            sources.append(info["source"])

    _events.subscribe(listen)
    try:
        with MegatronCheckpointer(tmp_path, job_id=f"lay-{uuid.uuid4().hex[:8]}") as ck:
            ck.save(3, saved)
            ck.wait()
            assert _load(ck, fulls, rng, strided) == (3, [])
        with MegatronCheckpointer(tmp_path, job_id=f"lay-{uuid.uuid4().hex[:8]}") as ck:
            assert _load(ck, fulls, rng, strided) == (3, [])
    finally:
        _events.unsubscribe(listen)
    assert sources == ["memory", "storage"]


def test_blocks_of_another_rank_or_dtype_or_cover_are_named(tmp_path):
    full = torch.arange(24.0).reshape(4, 6)
    with MegatronCheckpointer(tmp_path, job_id=f"lay-{uuid.uuid4().hex[:8]}") as ck:
        ck.save(1, {"w": ShardedTensor("w", full[:2].clone(), torch.float32, (2, 6), (4, 6), (0, 0), None)})
        ck.wait()
        asks = {
            "rank": ShardedTensor("w", torch.zeros(4, 6, 1), torch.float32, (4, 6, 1), (4, 6, 1), (0, 0, 0), None,
                                  allow_shape_mismatch=True),
            "dtype": ShardedTensor("w", torch.zeros(2, 6, dtype=torch.float64), torch.float64, (2, 6), (4, 6),
                                   (0, 0), None),
            "cover": ShardedTensor("w", torch.zeros(3, 6), torch.float32, (3, 6), (4, 6), (1, 0), None),
        }
        for name, ask in asks.items():
            with pytest.raises(StateMismatchError) as raised:
                ck.load({"x": ask})
            assert {"rank": "have 2 dimensions, the model's 3", "dtype": "checkpoint has dtype F32, the model F64",
                    "cover": "holds 6 of the 18 elements"}[name] in str(raised.value), str(raised.value)
