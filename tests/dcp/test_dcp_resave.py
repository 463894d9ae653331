"""A save of a checkpoint id made again and cut short before rank 0's ``finish`` (a fixed id
such as ``last``, a retried or rerun step) leaves some ranks' copies of the new save in
memory: a load reads one save whole, never one rank's items from each."""

from __future__ import annotations

import pytest

from . import _ranks
from ._common import killed_then_restarted


@pytest.mark.parametrize("name", ["step-5", "last"])
def test_a_load_never_mixes_two_saves_of_one_id(tmp_path, name):
    loaded = killed_then_restarted(str(tmp_path), _ranks.resave_dies_before_finish, _ranks.load_halves,
                                   args=(name,))
    assert all(len(set(values)) == 1 for values in loaded), loaded
    assert loaded[0] == loaded[1], loaded
