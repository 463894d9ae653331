"""torchtitan's checkpoint manager on flashckpt, in this process: torchtitan's command line
keeps its config, bad configuration is refused at construction, an object store's folder
is taken chained (``flashckpt::s3://...``), a disabled manager does
nothing, and the purge (``keep_latest_k``) deletes step folders only, never an export's
staging folder."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch.distributed as dist
import tyro
from torchtitan.components.checkpointer import BaseCheckpointManager, CheckpointManager
from torchtitan.config.manager import custom_registry

from flashckpt import CheckpointError
from flashckpt.dcp.torchtitan import FlashCheckpointManager

from . import _pieces

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


@pytest.mark.parametrize("fields, message", [
    ({"persist_every": 0}, "persist_every"),
    ({"keep_last": -1}, "keep_last"),
    ({"store": "relative/store"}, "absolute"),
    ({"keep_latest_k": 1}, "at least 2"),  # torchtitan's own checks still run
])
def test_bad_config_is_refused_at_construction(fields, message):
    with pytest.raises(ValueError, match=message):
        FlashCheckpointManager.Config(enable=True, **fields)


def test_an_object_store_folder_is_chained_and_another_remote_one_refused(tmp_path):
    """An object store's folder, chained or not, becomes ``flashckpt::s3://...`` (torchtitan's
    own look at it goes through flashckpt's file system, memory first); a remote folder
    flashckpt keeps no run in is refused at construction, naming its scheme."""
    training = _pieces.build(seed=0)
    for folder in ("s3://bucket-x/run", "flashckpt::s3://bucket-x/run/"):
        config = FlashCheckpointManager.Config(enable=True, folder=folder, keep_latest_k=0)
        assert _pieces.manager(config, training, str(tmp_path)).folder == "flashckpt::s3://bucket-x/run"
    for folder, scheme in (("ftp://host/run", "ftp"), ("flashckpt::nosuch://b/run", "nosuch")):
        config = FlashCheckpointManager.Config(enable=True, folder=folder, keep_latest_k=0)
        with pytest.raises(CheckpointError, match=f"unknown scheme '{scheme}'"):
            _pieces.manager(config, training, str(tmp_path))


def test_a_disabled_manager_does_nothing(tmp_path):
    checkpointer = _pieces.manager(FlashCheckpointManager.Config(enable=False), _pieces.build(seed=0), str(tmp_path))
    assert checkpointer.load() is False and checkpointer.save(1) is False
    checkpointer.close()
    assert os.listdir(tmp_path) == []


@pytest.fixture
def one_rank(tmp_path):
    """A process group of this process alone (torchtitan's purge asks for the rank)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_purge_deletes_step_folders_only(tmp_path, one_rank):
    """keep_latest_k=2 over step-1..3 and step-3.tmp-flashckpt: only step-1 goes
    (torchtitan's own ``step-(\\d+)`` search counts the staging folder and takes step-2 too)."""
    folder = tmp_path / "checkpoint"
    for name in ("step-1", "step-2", "step-3", "step-3.tmp-flashckpt"):
        os.makedirs(folder / name)
    config = FlashCheckpointManager.Config(enable=True, folder="checkpoint", keep_latest_k=2)
    checkpointer = _pieces.manager(config, _pieces.build(seed=0), str(tmp_path))
    checkpointer._purge_stale_checkpoints()  # what a save ends with
    checkpointer.close()  # joins the purge thread; no flash run was opened
    assert sorted(os.listdir(folder)) == ["step-2", "step-3", "step-3.tmp-flashckpt"]


@dataclasses.dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """``Trainer.Config``'s checkpoint field, as torchtitan declares it."""

    checkpoint: BaseCheckpointManager.Config = dataclasses.field(default_factory=CheckpointManager.Config)


def test_torchtitans_command_line_keeps_the_flash_config_and_sets_its_fields():
    """A trainer config whose ``checkpoint`` is this Config, parsed as torchtitan's
    ``ConfigManager`` parses (tyro, its registry): the subclass stays, its fields are flags."""
    default = TrainerConfig(checkpoint=FlashCheckpointManager.Config(enable=True, interval=10))
    parsed = tyro.cli(TrainerConfig, args=["--checkpoint.interval", "5", "--checkpoint.persist-every", "4"],
                      default=default, registry=custom_registry)
    assert isinstance(parsed.checkpoint, FlashCheckpointManager.Config)
    assert (parsed.checkpoint.interval, parsed.checkpoint.persist_every) == (5, 4)
