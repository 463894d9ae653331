"""Pure functions of the megatron loader: box intersections and contiguous read runs."""

import numpy as np
import pytest

from flashckpt.megatron._layout import Box, intersect, read_runs


def test_read_runs_yield_the_block_in_c_order_for_random_layouts():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        n = int(rng.integers(1, 5))
        shape = tuple(int(x) for x in rng.integers(1, 5, n))
        offset = tuple(int(x) for x in rng.integers(0, 3, n))
        data = np.arange(np.prod(shape)).reshape(shape)
        p_off = tuple(int(o + rng.integers(0, s)) for o, s in zip(offset, shape))
        p_shape = tuple(int(rng.integers(1, o + s - p + 1)) for o, s, p in zip(offset, shape, p_off))
        run, starts = read_runs(Box(offset, shape), Box(p_off, p_shape))
        got = np.concatenate([data.reshape(-1)[s:s + run] for s in starts]).reshape(p_shape)
        want = data[tuple(slice(p - o, p - o + s) for p, o, s in zip(p_off, offset, p_shape))]
        assert (got == want).all()


def test_tensor_parallel_row_split_is_one_run_and_column_split_one_per_row():
    saved = Box((64, 0), (64, 32))
    assert read_runs(saved, saved) == (64 * 32, [0])
    assert read_runs(Box((0, 0), (8, 32)), Box((0, 16), (8, 16))) == (16, [16 + 32 * i for i in range(8)])


def test_intersections():
    assert intersect(Box((0, 0), (4, 4)), Box((2, 2), (4, 4))) == Box((2, 2), (2, 2))
    assert intersect(Box((0,), (4,)), Box((4,), (4,))) is None
    with pytest.raises(ValueError):
        intersect(Box((0,), (4,)), Box((0, 0), (4, 4)))
    with pytest.raises(ValueError):
        read_runs(Box((0,), (4,)), Box((2,), (4,)))
