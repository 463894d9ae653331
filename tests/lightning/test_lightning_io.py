"""FlashCheckpointIO on its own, one process: bad input is a clear error that writes
nothing; save/load round trip from memory; remove_checkpoint keeps flashckpt's steps."""

from __future__ import annotations

import os

import pytest
import torch

from flashckpt import CheckpointError
from flashckpt.lightning import FlashCheckpointIO


@pytest.fixture
def io(tmp_path):
    io = FlashCheckpointIO(tmp_path / "ckpt", keep_last=2)
    yield io
    io.teardown()


def checkpoint(step: int) -> dict:
    return {"global_step": step, "epoch": 0, "state_dict": {"w": torch.full((3,), float(step))},
            "loops": {"fit_loop": {"n": step}}, "hyper_parameters": {"width": 8}}


def test_bad_input_is_refused(io, tmp_path):
    with pytest.raises(TypeError, match="is a dict"):
        io.save_checkpoint([1, 2], tmp_path / "ckpt" / "a.ckpt")
    with pytest.raises(CheckpointError, match="not in this FlashCheckpointIO's directory"):
        io.save_checkpoint(checkpoint(1), tmp_path / "elsewhere" / "a.ckpt")
    with pytest.raises(CheckpointError, match="global_step"):
        io.save_checkpoint({"state_dict": {}}, tmp_path / "ckpt" / "a.ckpt")
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint(checkpoint(1), tmp_path / "ckpt" / "a.ckpt", storage_options={"x": 1})
    with pytest.raises(CheckpointError, match="allow_pickle"):
        io.save_checkpoint({"global_step": 1, "obj": object()}, tmp_path / "ckpt" / "b.ckpt")
    assert not os.path.exists(tmp_path / "elsewhere")
    assert not [n for n in os.listdir(tmp_path / "ckpt") if n.endswith(".ckpt")]  # no placeholder left
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(tmp_path / "ckpt" / "missing.ckpt")


def test_round_trip_from_memory_and_removal(io, tmp_path):
    d = tmp_path / "ckpt"
    for step in (2, 4):
        io.save_checkpoint(checkpoint(step), d / f"step={step}.ckpt")
    io.last_save.wait()
    got = io.load_checkpoint(d / "step=2.ckpt")
    assert io.checkpointer.last_load.source == "memory" and got["global_step"] == 2
    assert torch.equal(got["state_dict"]["w"], torch.full((3,), 2.0)) and got["hyper_parameters"] == {"width": 8}
    assert io.load_checkpoint(d / "last.ckpt")["global_step"] == 4  # "last" names the newest
    stock = torch.load(d / "step=4.ckpt", weights_only=True)  # the exporter's stock file
    assert stock["global_step"] == 4 and torch.equal(stock["state_dict"]["w"], torch.full((3,), 4.0))
    io.remove_checkpoint(d / "step=4.ckpt")
    assert not os.path.exists(d / "step=4.ckpt")
    assert io.checkpointer.latest_step() == 4  # flashckpt's own retention is untouched
    # a stock file outside the directory is read by the stock IO
    torch.save(checkpoint(9), tmp_path / "other.ckpt")
    assert io.load_checkpoint(tmp_path / "other.ckpt")["global_step"] == 9
