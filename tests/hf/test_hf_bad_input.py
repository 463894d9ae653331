"""Bad input and unusual settings: clear errors, or the stock behaviour with a clear message."""

import glob
import logging
import os
import shutil

import pytest
from transformers import TrainerCallback

from flashckpt import CheckpointError, _events
from flashckpt.hf import FlashCheckpointCallback

from ._hf import make_trainer, shm_left


@pytest.mark.parametrize("kwargs", [{"memory_every": 0}, {"persist_every": -1}, {"keep_last": -1},
                                    {"memory_every": 2.5}, {"persist_every": True}, {"memory_slots": 3}])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        FlashCheckpointCallback(**kwargs)


def test_output_dir_not_writable_fails_at_construction():
    # sysfs refuses new files even to root: a directory that exists and cannot be written
    with pytest.raises(CheckpointError, match=r"output_dir '/sys/fs' is not writable"):
        make_trainer("/sys/fs", [FlashCheckpointCallback()])


def test_save_strategy_no_leaves_the_callback_idle(tmp_path, caplog):
    cb = FlashCheckpointCallback()
    with caplog.at_level(logging.WARNING, logger="flashckpt.hf"):
        trainer = make_trainer(str(tmp_path), [cb], save_strategy="no")
    assert "save_strategy='no'" in caplog.text
    trainer.train()
    assert os.listdir(tmp_path) == [] and cb._ckpt is None


def test_save_strategy_no_with_memory_every_snapshots_memory_only(tmp_path):
    saves = []
    listener = lambda event, **info: saves.append(info["step"]) if event == "save" else None  # noqa: E731
    _events.subscribe(listener)
    try:
        make_trainer(str(tmp_path), [FlashCheckpointCallback(memory_every=2)], save_strategy="no").train()
    finally:
        _events.unsubscribe(listener)
    assert saves == [2, 4, 6]
    assert not glob.glob(str(tmp_path / "checkpoint-*"))  # a clean end writes no folder


class BreakExport(TrainerCallback):
    """After step 3 is on storage, take away a file the exporter needs for later steps."""

    def __init__(self, flash: FlashCheckpointCallback) -> None:
        self.flash = flash

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == 3:
            self.flash._ckpt.wait()
            shutil.rmtree(self.flash._static)


def test_a_failed_export_reaches_the_trainer_and_keeps_older_folders(tmp_path):
    flash = FlashCheckpointCallback()
    trainer = make_trainer(str(tmp_path), [flash, BreakExport(flash)], max_steps=7)
    with pytest.raises(CheckpointError, match=r"writing .*checkpoint-6 failed"):
        trainer.train()
    assert sorted(n for n in os.listdir(tmp_path) if "checkpoint" in n) == ["checkpoint-3"]
    assert len(os.listdir(tmp_path / "checkpoint-3")) == 8
    assert not glob.glob(str(tmp_path / ".checkpoint-*"))  # no half-written folder
    if flash._ckpt is not None:  # the error came from the save of step 7, not from on_train_end
        flash._ckpt.engine.discard_newer_than(-1)
        flash._ckpt.close()
    assert not shm_left(tmp_path)


def test_not_given_to_a_trainer():
    from transformers import TrainerControl, TrainerState, TrainingArguments
    with pytest.raises(CheckpointError, match="must be passed to a transformers Trainer"):
        FlashCheckpointCallback().on_init_end(TrainingArguments("unused", report_to=[]), TrainerState(),
                                              TrainerControl())
