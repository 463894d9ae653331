"""A state that differs from the checkpoint in several ways gets one error listing every
difference: keys only in the checkpoint, keys only in the state, shapes and dtypes —
capped with a count — and the state is left untouched."""

import pytest
import torch
from torch import nn

from flashckpt import StateMismatchError
from flashckpt.torch import Checkpointer


class Saved(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2)
        self.old = nn.Linear(2, 2)


class Changed(nn.Module):
    """``enc`` widened, ``head`` in another dtype, ``old`` removed, ``new`` added."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(4, 16)
        self.head = nn.Linear(8, 2).double()
        self.new = nn.Linear(2, 3)


def _saved(tmp_path, job_id):
    torch.manual_seed(0)
    model = Saved()
    with Checkpointer(tmp_path, job_id=job_id) as ck:
        ck.save(1, {"model": model.state_dict()})


def _message(tmp_path, job_id, state):
    before = {k: v.clone() for k, v in state["model"].items()}
    with Checkpointer(tmp_path, job_id=job_id) as ck:
        with pytest.raises(StateMismatchError) as err:
            ck.load(state)
    assert all(torch.equal(v, before[k]) for k, v in state["model"].items())
    return str(err.value)


def test_every_kind_of_difference_is_listed(tmp_path, job_id):
    _saved(tmp_path, job_id)
    message = _message(tmp_path, job_id, {"model": Changed().state_dict()})
    assert "only in checkpoint: ['old.weight', 'old.bias']" in message
    assert "only in state: ['new.weight', 'new.bias']" in message
    assert "model/enc.weight: checkpoint has F32[8, 4], state has F32[16, 4]" in message
    assert "model/enc.bias: checkpoint has F32[8], state has F32[16]" in message
    assert "model/head.weight: checkpoint has F32[2, 8], state has F64[2, 8]" in message
    assert "model/head.bias: checkpoint has F32[2], state has F64[2]" in message
    head = message.splitlines()[0]
    for kind in ("2 keys only in the checkpoint", "2 keys only in the state", "2 shape changes", "2 dtype changes"):
        assert kind in head, head


def test_long_lists_are_capped_with_a_count(tmp_path, job_id):
    state = {"model": {**Changed().state_dict(), **{f"extra{i}": torch.zeros(1) for i in range(30)}},
             "more": {f"w{i}": torch.zeros(1) for i in range(25)}}
    with Checkpointer(tmp_path, job_id=job_id) as ck:
        ck.save(2, {"model": Saved().state_dict(), "more": {f"w{i}": torch.zeros(2) for i in range(25)}})
    message = _message(tmp_path, job_id, state)
    assert "... and 12 more" in message  # 32 keys only in the state, 20 named
    assert "'extra17'" in message and "'extra18'" not in message
    assert "... and 10 more" in message  # 1 key line + 4 shared layers + 25 others, 20 shown
    head = message.splitlines()[0]
    for kind in ("2 keys only in the checkpoint", "32 keys only in the state", "27 shape changes", "2 dtype changes"):
        assert kind in head, head
    assert len(message.splitlines()) < 30
