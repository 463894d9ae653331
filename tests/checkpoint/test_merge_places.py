"""``merge_into(places=...)``: a leaf the state has no place for goes into the tensor offered
for its path only when that tensor fits it exactly and no other entry takes it."""

import torch

from flashckpt.memory._tree import flatten, merge_into
from flashckpt.torch import _tensors  # noqa: F401  (registers the torch kind)


def test_offered_tensors_take_only_the_entries_they_fit_exactly():
    saved = {"fits": torch.arange(6.0).reshape(2, 3), "dtype": torch.ones(4), "shape": torch.ones(5),
             "first": torch.zeros(3, dtype=torch.float64), "second": torch.ones(3, dtype=torch.float64),
             "nested": [{"x": torch.full((2,), 7.0)}], "plain": 3}
    flat = flatten(saved)
    entries = {leaf.name: (leaf.dtype, leaf.shape) for leaf in flat.leaves}
    names = {id(leaf.obj): leaf.name for leaf in flat.leaves}
    shared = torch.empty(3, dtype=torch.float64)
    offers = {"fits": torch.empty(2, 3), "dtype": torch.empty(4, dtype=torch.float64), "shape": torch.empty(4),
              "first": shared, "second": shared, "nested/0/x": torch.empty(2)}

    state: dict = {}
    merge = merge_into(state, flat.skeleton, entries, allow_pickle=False, places=offers.get)
    into = {name: obj for name, obj in merge.fills}
    entry = {key: names[id(value)] for key, value in saved.items() if isinstance(value, torch.Tensor)}

    assert into[entry["fits"]] is offers["fits"]
    assert into[entry["dtype"]] is not offers["dtype"] and into[entry["shape"]] is not offers["shape"]
    assert into[entry["first"]] is shared and into[entry["second"]] is not shared  # never one tensor for two
    assert into[names[id(saved["nested"][0]["x"])]] is offers["nested/0/x"]
    assert state == {}  # nothing written before the fills run
