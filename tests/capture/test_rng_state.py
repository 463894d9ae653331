"""``flashckpt.rng_state()`` gives numpy's global generator exactly as ``numpy.random.get_state()``
does after every kind of change, also where it reads numpy's state only when it moved."""

import numpy as np
import pytest
import torch

import flashckpt


def as_numpy_state(state: dict) -> tuple:
    saved = state["numpy"]
    return saved["kind"], saved["keys"].numpy().astype(np.uint32), saved["pos"], saved["has_gauss"], \
        saved["cached_gaussian"]


def assert_same(given: tuple, expected: tuple) -> None:
    assert given[0] == expected[0] and np.array_equal(given[1], expected[1])
    assert given[2:] == (int(expected[2]), int(expected[3]), float(expected[4]))


CHANGES = {
    "nothing": lambda: None,
    "uniform": lambda: np.random.rand(3),
    "one gaussian (one cached)": lambda: np.random.standard_normal(),
    "the cached gaussian only": lambda: np.random.standard_normal(),
    "three gaussians": lambda: np.random.standard_normal(3),
    "seed": lambda: np.random.seed(7),
    "the same seed again": lambda: np.random.seed(7),
    "set_state with a gaussian cached": lambda: np.random.set_state(("MT19937", np.arange(624, dtype=np.uint32), 5,
                                                                    1, 0.25)),
}


def test_every_change_of_numpys_generator_is_in_rng_state():
    np.random.seed(1)
    flashckpt.rng_state()
    for name, change in CHANGES.items():
        change()
        for _ in range(2):  # the second read is the one that may not read numpy in full
            assert_same(as_numpy_state(flashckpt.rng_state()), np.random.get_state()), name


def test_set_rng_state_gives_back_a_cached_gaussian_over_the_same_words():
    np.random.seed(3)
    np.random.standard_normal()  # one cached
    cached = flashckpt.rng_state()
    np.random.standard_normal()  # takes it: the same words, no gaussian cached
    flashckpt.rng_state()
    flashckpt.set_rng_state(cached)
    assert as_numpy_state(flashckpt.rng_state())[3] == 1
    assert np.random.standard_normal() == cached["numpy"]["cached_gaussian"]


def test_each_call_gives_keys_of_its_own():
    first = flashckpt.rng_state()["numpy"]["keys"]
    first.zero_()
    second = flashckpt.rng_state()["numpy"]["keys"]
    assert np.array_equal(second.numpy().astype(np.uint32), np.random.get_state()[1])


@pytest.mark.parametrize("draws", [0, 1])
def test_a_restored_state_replays_the_same_draws(draws):
    np.random.seed(11)
    np.random.standard_normal(draws)
    state = flashckpt.rng_state()
    expected = (np.random.standard_normal(5), torch.rand(3))
    flashckpt.set_rng_state(state)
    assert np.array_equal(np.random.standard_normal(5), expected[0]) and torch.equal(torch.rand(3), expected[1])
