"""DeepSpeed's own objects through flashckpt's plain tree, and the unpickling allow-list."""

import base64
import pickle
from collections import OrderedDict

import pytest
import torch

from flashckpt import CorruptCheckpointError
from flashckpt.memory._tree import flatten
from flashckpt.deepspeed import _objects


def test_deepspeed_objects_round_trip_and_tensors_are_not_copied():
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    weight = torch.randn(3, 2)
    state = {"module": OrderedDict(w=weight), "param_shapes": [OrderedDict(w=torch.Size([3, 2]))],
             "loss_scaler": LossScaler(4.0), "zero_stage": ZeroStageEnum.gradients,
             "mappings": [OrderedDict(w=fragment_address(numel=6, start=0))], "names": {"b", "a"}, "n": 1}
    encoded = _objects.encode(state)
    flat = flatten(encoded)  # plain enough for the core, without allow_pickle
    assert [leaf.obj for leaf in flat.leaves] == [weight] and flat.leaves[0].obj is weight
    back = _objects.decode(encoded)
    assert type(back["module"]) is OrderedDict and back["module"]["w"] is weight
    assert back["param_shapes"][0]["w"] == torch.Size([3, 2]) and type(back["param_shapes"][0]["w"]) is torch.Size
    assert back["loss_scaler"].cur_scale == 4.0 and back["zero_stage"] is ZeroStageEnum.gradients
    assert back["mappings"][0]["w"] == fragment_address(numel=6, start=0)
    assert back["names"] == {"a", "b"} and back["n"] == 1


def test_foreign_pickles_are_refused():
    blob = base64.b64encode(pickle.dumps(OSError("x"))).decode()
    with pytest.raises(CorruptCheckpointError, match="refusing to unpickle builtins.OSError"):
        _objects.decode({_objects.TAG: "pickle", "b64": blob})


def test_user_objects_are_left_to_allow_pickle():
    class Mine:
        pass

    encoded = _objects.encode({"x": Mine()})
    with pytest.raises(Exception, match="allow_pickle"):
        flatten(encoded)
