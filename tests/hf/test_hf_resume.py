"""Folders the callback wrote resume with stock transformers; memory is preferred when newer."""

import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback

from flashckpt import CheckpointError
from flashckpt.hf import FlashCheckpointCallback

from ._hf import make_trainer, shm_left


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def test_stock_trainer_resumes_from_a_folder_the_callback_wrote(tmp_path, reference_10):
    out = str(tmp_path / "run")
    make_trainer(out, [FlashCheckpointCallback(), StopAt(6)], max_steps=10).train()
    assert sorted(os.listdir(out)) == ["checkpoint-3", "checkpoint-6"]  # the stock folders, nothing else
    assert not shm_left(out)
    again = FlashCheckpointCallback()
    make_trainer(out, [again], max_steps=10)
    assert again.resumed_from is None  # train() ended cleanly: memory freed, the folders are newest

    loaded = AutoModelForCausalLM.from_pretrained(os.path.join(out, "checkpoint-6"))
    resumed = make_trainer(out, max_steps=10)  # stock Trainer, no flashckpt
    for a, b in zip(loaded.parameters(), resumed.model.parameters()):
        assert not torch.equal(a, b)  # a fresh model: the weights must come from the folder
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 10
    for a, b in zip(reference_10, resumed.model.parameters()):
        assert torch.equal(a, b)


class Crash(TrainerCallback):
    """Simulates a crash: the process stops right after step N without any clean-up (run the
    Trainer class's ``train``, not the callback's wrapper, which cleans up after an exception)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt


@pytest.mark.parametrize("saver_flushes", [True, False], ids=["saver-wrote-it", "constructor-writes-it"])
def test_memory_newer_than_the_newest_folder_is_resumed(tmp_path, saver_flushes, reference_10):
    out = str(tmp_path / "run")
    first = FlashCheckpointCallback(memory_every=2)
    trainer = make_trainer(out, [first, Crash(5)], max_steps=10, save_steps=3)
    with pytest.raises(KeyboardInterrupt):
        Trainer.train(trainer)
    engine = first._ckpt.engine
    assert sorted(engine.memory_steps()) == [3, 4]
    engine.wait()
    assert sorted(os.listdir(out)) == [".flashckpt", "checkpoint-3"]
    if saver_flushes:
        engine._client.sock.close()  # a crash: the saver writes the newest memory step out by itself
    else:
        engine._client.close()  # the saver is told all is well, so memory is all there is of step 4
    first._ckpt = None

    second = FlashCheckpointCallback(memory_every=2)
    resumed = make_trainer(out, [second], max_steps=10, save_steps=3)
    assert second.resumed_from == {"step": 4, "source": "memory"}
    assert len(os.listdir(os.path.join(out, "checkpoint-4"))) == 8  # the full stock layout
    assert sorted(os.listdir(out)) == ["checkpoint-3", "checkpoint-4"]  # the crash's scratch is gone
    resumed.train(resume_from_checkpoint=True)
    for a, b in zip(reference_10, resumed.model.parameters()):
        assert torch.equal(a, b)
    assert not shm_left(out)


def test_failing_to_write_memory_out_is_a_clear_error_at_construction(tmp_path):
    out = str(tmp_path / "run")
    first = FlashCheckpointCallback(memory_every=2)
    with pytest.raises(KeyboardInterrupt):
        Trainer.train(make_trainer(out, [first, Crash(5)], max_steps=10, save_steps=3))
    first._ckpt.wait()
    shutil.rmtree(first._static)  # the exporter will miss training_args.bin
    first._ckpt.engine._client.close()  # no flush by the saver: only the constructor writes step 4
    first._ckpt = None
    with pytest.raises(CheckpointError, match=r"writing step 4 from memory to .*checkpoint-4 failed: rank 0: .*No such file or directory: .*static-"):
        make_trainer(out, [FlashCheckpointCallback()], max_steps=10, save_steps=3)
    assert sorted(n for n in os.listdir(out) if "checkpoint" in n) == ["checkpoint-3"]  # nothing half-written
    kept = shm_left(out)
    assert any(".slot" in p for p in kept)  # the only copy of step 4 stays for a later attempt
    for path in kept:
        os.unlink(path)


def _crash_at_5(out: str) -> "FlashCheckpointCallback":
    """A run that dies after step 5 (memory: steps 3 and 4; checkpoint-3 written), its
    saver told all is well, so nothing flushes step 4."""
    first = FlashCheckpointCallback(memory_every=2)
    with pytest.raises(KeyboardInterrupt):
        Trainer.train(make_trainer(out, [first, Crash(5)], max_steps=10, save_steps=3))
    first._ckpt.wait()
    first._ckpt.engine._client.close()
    return first


def test_a_folder_newer_than_memory_wins(tmp_path):
    """E.g. the user copied or resumed from a folder of a longer run: the Trainer picks
    folders by number, and memory older than the newest folder is not written out."""
    out = str(tmp_path / "run")
    _crash_at_5(out)._ckpt = None
    shutil.copytree(os.path.join(out, "checkpoint-3"), os.path.join(out, "checkpoint-6"))
    again = FlashCheckpointCallback()
    make_trainer(out, [again], max_steps=10, save_steps=3)
    assert again.resumed_from is None
    assert sorted(os.listdir(out)) == ["checkpoint-3", "checkpoint-6"]
    assert not shm_left(out)


def test_a_committed_step_whose_folder_was_never_written_is_written_at_construction(tmp_path, reference_10):
    """The node whose saver was writing checkpoint-3 was lost with its memory (no replica):
    the step is committed in flashckpt's scratch, its folder is not; the agreement picks it
    from storage and the constructor writes the folder, so the Trainer resumes there."""
    out = str(tmp_path / "run")
    first = _crash_at_5(out)
    first._ckpt.engine.discard_newer_than(-1)  # the memory is lost with the node
    first._ckpt = None
    shutil.rmtree(os.path.join(out, "checkpoint-3"))  # its exporter died with the node
    second = FlashCheckpointCallback(memory_every=2)
    resumed = make_trainer(out, [second], max_steps=10, save_steps=3)
    assert second.resumed_from == {"step": 3, "source": "storage"}
    assert sorted(os.listdir(out)) == ["checkpoint-3"]
    assert len(os.listdir(os.path.join(out, "checkpoint-3"))) == 8  # the full stock layout
    resumed.train(resume_from_checkpoint=True)
    for a, b in zip(reference_10, resumed.model.parameters()):
        assert torch.equal(a, b)
    assert not shm_left(out)
