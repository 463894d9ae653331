"""``convert``: a sharded flashckpt step (4 FSDP2 ranks) as one consolidated model and
optimizer that stock tools load -- ``torch.load``, ``safetensors``,
``torch.distributed.checkpoint.load`` -- equal to the consolidated originals; damaged
shards and unknown formats are clear errors. (DCP import: ``test_fsdp_reshard``.)"""

import json
import os
import shutil

import pytest
import torch

from flashckpt import CheckpointError, CorruptCheckpointError
from flashckpt._convert import convert

from ._fsdp_common import assert_equal_states
from .conftest import assert_ok


@pytest.fixture(scope="module")
def w4(ran4, fsdp_root):
    assert_ok(ran4, "save w4")
    return os.path.join(fsdp_root, "w4"), torch.load(os.path.join(fsdp_root, "w4.pt"))


def test_to_torch(w4, tmp_path):
    directory, originals = w4
    out = convert(directory, None, "torch", tmp_path / "model.pt")
    got = torch.load(out, weights_only=True)
    assert got["step"] == 3 and got["extra"] == {"world": 4}
    assert_equal_states(got["model"], originals["model"], "model ")
    assert_equal_states(got["optim"]["state"], originals["optim"], "optim ")
    assert got["optim"]["param_groups"] == originals["param_groups"]


def test_to_safetensors(w4, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file
    directory, originals = w4
    out = convert(directory, 3, "safetensors", tmp_path / "model.safetensors")
    got = load_file(out)
    assert_equal_states({k: v for k, v in got.items() if not k.startswith("optim/")}, originals["model"])
    for fqn, state in originals["optim"].items():
        for k, v in state.items():
            assert torch.equal(got[f"optim/{fqn}/{k}"], v), (fqn, k)
    with safe_open(out, "pt") as f:
        meta = json.loads(f.metadata()["flashckpt"])
    assert meta["step"] == 3 and meta["param_groups"] == json.loads(json.dumps(originals["param_groups"]))


def test_to_dcp(w4, tmp_path):
    import torch.distributed.checkpoint as dcp
    directory, originals = w4
    out = convert(directory, None, "dcp", tmp_path / "dcp")
    template = {"model": {k: torch.zeros_like(v) for k, v in originals["model"].items()},
                "optim": {"state": {fqn: {k: torch.zeros_like(v) for k, v in st.items()}
                                    for fqn, st in originals["optim"].items()},
                          "param_groups": [dict(g, lr=-1.0) for g in originals["param_groups"]]}}
    dcp.load(template, checkpoint_id=out, no_dist=True)
    assert template["optim"]["param_groups"] == originals["param_groups"]
    assert_equal_states(template["model"], originals["model"], "model ")
    assert_equal_states(template["optim"]["state"], originals["optim"], "optim ")


def test_damaged_shard_is_named_and_nothing_is_written(w4, tmp_path):
    directory, _ = w4
    copy = tmp_path / "ckpt"
    shutil.copytree(directory, copy)
    shard = copy / "step-3" / "rank-2.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="rank-2.safetensors"):
        convert(copy, 3, "torch", tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def test_plain_checkpoint_converts_from_rank_0(tmp_path, job_id):
    """A checkpoint without a sharded layout (Checkpointer, one process) converts whole."""
    from flashckpt.torch import Checkpointer
    from safetensors.torch import load_file
    state = {"net": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)},
             "sampler": {"pos": 7}}
    with Checkpointer(tmp_path / "plain", job_id=job_id) as ck:
        ck.save(4, state)
    got = torch.load(convert(tmp_path / "plain", None, "torch", tmp_path / "plain.pt"), weights_only=True)
    assert_equal_states(got, {"step": 4, **state})
    got = load_file(convert(tmp_path / "plain", 4, "safetensors", tmp_path / "plain.safetensors"))
    assert_equal_states(got, {"net/w": state["net"]["w"], "net/b": state["net"]["b"]})


def test_a_plain_checkpoint_keeps_every_entry_in_safetensors_and_flashckpt_outputs(tmp_path, job_id):
    """Both outputs used to drop what was neither model, optim nor extra (a sampler's
    position, an RNG state, plain values) and exit 0."""
    from safetensors import safe_open

    from flashckpt.torch import Checkpointer, FsdpCheckpointer
    state = {"model": {"w": torch.arange(6.0)}, "sampler": {"epoch": 3, "pos": 1234},
             "rng": torch.arange(4, dtype=torch.uint8), "tags": ["a", None, 2.5], "step": 5,
             "__metadata__": torch.ones(2)}
    with Checkpointer(tmp_path / "plain", job_id=job_id) as ck:
        ck.save(5, state)
    with safe_open(convert(tmp_path / "plain", 5, "safetensors", tmp_path / "p.safetensors"), "pt") as f:
        assert sorted(f.keys()) == ["__metadata__#", "rng", "w"]  # model tensors by FQN
        meta = json.loads(f.metadata()["flashckpt"])
    assert meta["values"] == {"sampler/epoch": 3, "sampler/pos": 1234, "tags/0": "a", "tags/1": None,
                              "tags/2": 2.5, "step": 5}
    convert(tmp_path / "plain", 5, "flashckpt", tmp_path / "fc")
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(6))
    with FsdpCheckpointer(tmp_path / "fc", job_id=f"{job_id}fc") as ck:
        assert ck.load(model) == 5
    assert torch.equal(model.w.detach(), state["model"]["w"])
    assert_equal_states(ck.extra, {k: v for k, v in state.items() if k != "model"})


def test_bad_arguments(w4, tmp_path):
    directory, _ = w4
    with pytest.raises(CheckpointError, match="target format"):
        convert(directory, 3, "onnx", tmp_path / "x")
    with pytest.raises(CheckpointError, match="source format"):
        convert(directory, 3, "torch", tmp_path / "x", source="tf")
    with pytest.raises(CheckpointError, match="step 9 is not committed"):
        convert(directory, 9, "torch", tmp_path / "x")
    with pytest.raises(CheckpointError, match="no .metadata"):
        convert(directory, None, "torch", tmp_path / "x", source="dcp")
