"""transformers' own Trainer checkpoint and resume scenarios (``tests/trainer/test_trainer_checkpointing.py``,
the ones that run on CPU), each run once with the stock Trainer and once with
``FlashCheckpointCallback()`` added: the same weights, trainer state, checkpoint folders and
``os.listdir(output_dir)``, and upstream's own assertions on both."""

import math
import os
import shutil
import time
from unittest.mock import patch

import pytest
import safetensors.torch
import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from flashckpt.hf import FlashCheckpointCallback, last_checkpoint

from ._hf import shm_left
from ._regression import (AlmostAccuracy, RegressionDataset, RegressionModelConfig, RegressionPreTrainedModel,
                          listing, regression_trainer, state_of, to_sharded)


def both(tmp_path, scenario, *args, **kwargs):
    """Run ``scenario(output_dir, flash, ...)`` stock and with the callback; the results must agree."""
    results = {}
    for flash in (False, True):
        out = str(tmp_path / ("flash" if flash else "stock"))
        results[flash] = scenario(out, flash, *args, **kwargs)
        if flash:
            assert not shm_left(out), "shared memory left after train()"
    assert results[True] == results[False]
    return results[True]


def ab(trainer) -> tuple[float, float]:
    return trainer.model.a.item(), trainer.model.b.item()


def evaluations(values):
    """upstream's ``evaluate_side_effect_factory``."""
    yield from values
    while True:
        yield values[-1]


# -- resume ---------------------------------------------------------------------


def resume_older_after_longer_run(out, flash, pretrained):
    """``test_can_resume_training``: 48 steps, then resume from checkpoint-5 and checkpoint-15 in the same
    output_dir (a rollback: the new saves of steps 10..48 replace the longer run's)."""
    kwargs = dict(train_len=128, save_steps=5, learning_rate=0.1, logging_steps=5, pretrained=pretrained)
    trainer = regression_trainer(out, flash=flash, **kwargs)
    trainer.train()
    full, state = ab(trainer), state_of(trainer)
    seen = [listing(out)]
    for step in (5, 15):
        trainer = regression_trainer(out, flash=flash, **kwargs)
        trainer.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{step}"))
        assert ab(trainer) == full
        assert state_of(trainer) == state
        seen.append(listing(out))
    assert seen[0] == seen[1] == seen[2]
    return {"ab": full, "listings": seen}


@pytest.mark.parametrize("pretrained", [True, False], ids=["pretrained", "bare-module"])
def test_resume_from_an_older_checkpoint_after_a_longer_run(tmp_path, pretrained):
    both(tmp_path, resume_older_after_longer_run, pretrained)


def bogus_and_missing_checkpoints(out, flash):
    """The end of ``test_can_resume_training``: the stock errors stay the stock errors."""
    trainer = regression_trainer(out, flash=flash)
    with pytest.raises(Exception, match="Can't find a valid checkpoint at"):
        trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-15-bogus"))
    trainer = regression_trainer(out, flash=flash)
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory"):
        trainer.train(resume_from_checkpoint=True)
    return {"listing": listing(out)}


def test_bogus_or_missing_checkpoint_errors_are_the_stock_ones(tmp_path):
    assert both(tmp_path, bogus_and_missing_checkpoints) == {"listing": []}


def resume_with(out, flash, freeze=False, to_shards=False, **kwargs):
    """``test_resume_training_with_frozen_params`` / ``_gradient_accumulation`` / ``_shard_checkpoint``."""
    kwargs = dict(train_len=128, save_steps=5, learning_rate=0.1, **kwargs)
    trainer = regression_trainer(out, flash=flash, **kwargs)
    if freeze:
        trainer.model.a.requires_grad_(False)
    trainer.train()
    full, state = ab(trainer), state_of(trainer)
    first = listing(out)
    checkpoint = os.path.join(out, "checkpoint-5")
    if to_shards:
        to_sharded(checkpoint)
    trainer = regression_trainer(out, flash=flash, **kwargs)
    if freeze:
        trainer.model.a.requires_grad_(False)
    trainer.train(resume_from_checkpoint=checkpoint)
    if freeze:
        assert not trainer.model.a.requires_grad
    assert ab(trainer) == full
    assert state_of(trainer) == state
    return {"ab": full, "listings": [first, listing(out)],
            "checkpoint-5": sorted(os.listdir(checkpoint))}


@pytest.mark.parametrize("case", ["frozen", "grad-accum", "sharded"])
def test_resume_variants(tmp_path, case):
    kwargs = {"frozen": {"freeze": True, "per_device_train_batch_size": 4},
              "grad-accum": {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 4},
              "sharded": {"to_shards": True}}[case]
    result = both(tmp_path, resume_with, **kwargs)
    if case == "sharded":  # the resume read the sharded folder (and wrote none over it)
        assert "model.safetensors.index.json" in result["checkpoint-5"]


def different_batch_size(out, flash):
    """``test_resume_training_with_different_batch_size``: 2 steps, then resume from checkpoint-1 to 4."""
    regression_trainer(out, flash=flash, max_steps=2, save_steps=1, per_device_train_batch_size=2).train()
    trainer = regression_trainer(out, flash=flash, max_steps=4, save_steps=1, per_device_train_batch_size=4)
    trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-1"))
    assert trainer._train_batch_size == 4
    return {"ab": ab(trainer), "state": state_of(trainer), "listing": listing(out)}


def test_resume_with_a_different_batch_size(tmp_path):
    both(tmp_path, different_batch_size)


def other_args_logged(out, flash):
    """``test_compare_trainer_and_checkpoint_args_logging``: resume checkpoint-5 with other arguments."""
    regression_trainer(out, flash=flash, train_len=128, eval_steps=5, gradient_accumulation_steps=2,
                       per_device_train_batch_size=4, save_steps=5, learning_rate=0.1).train()
    trainer = regression_trainer(out, flash=flash, train_len=256, eval_steps=10, gradient_accumulation_steps=4,
                                 per_device_train_batch_size=8, save_steps=10, learning_rate=0.1)
    from transformers import trainer_utils
    with patch.object(trainer_utils.logger, "warning_once") as warn:  # once per process: patched to see both
        trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-5"))
    text = " ".join(str(call.args[0]) for call in warn.call_args_list)
    assert "save_steps: 10 (from args) != 5 (from trainer_state.json)" in text
    assert "per_device_train_batch_size: 8 (from args) != 4 (from trainer_state.json)" in text
    return {"ab": ab(trainer), "listing": listing(out)}


def test_resume_with_other_arguments_logs_the_differences(tmp_path):
    both(tmp_path, other_args_logged)


class MockCudaOOM(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.train_batch_size >= 16:
            raise RuntimeError("CUDA out of memory.")


def auto_batch_size(out, flash):
    """``test_auto_batch_size_with_resume_from_checkpoint``: the batch-size finder retries after an OOM
    inside train(); a resume picks the smaller batch size up from the checkpoint."""
    kwargs = dict(max_steps=2, save_steps=1, per_device_train_batch_size=16, auto_find_batch_size=True)
    trainer = regression_trainer(out, flash=flash, callbacks=[MockCudaOOM()], **kwargs)
    trainer.train()
    smaller = trainer._train_batch_size
    assert smaller < 16
    trainer = regression_trainer(out, flash=flash, **kwargs)
    assert trainer._train_batch_size == 16
    trainer.train(resume_from_checkpoint=True)
    assert trainer._train_batch_size == smaller
    return {"ab": ab(trainer), "listing": listing(out), "batch": smaller}


def test_auto_batch_size_with_resume(tmp_path):
    both(tmp_path, auto_batch_size)


class DictModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(10, 2)

    def forward(self, input_ids=None, attention_mask=None, labels=None):
        logits = self.linear(input_ids.float())
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


class DictData(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.rand(100, 10, generator=g)
        self.labels = torch.randint(0, 2, (100,), generator=g)

    def __len__(self):
        return 100

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "attention_mask": torch.ones(10), "labels": self.labels[i]}


def interrupted_into_another_dir(out, flash):
    """``test_resume_from_interrupted_training``: 2 steps into one dir, resumed into another."""
    cbs = lambda: [FlashCheckpointCallback()] if flash else []  # noqa: E731
    model = DictModel()
    common = dict(num_train_epochs=1, per_device_train_batch_size=2, gradient_accumulation_steps=3,
                  save_strategy="steps", save_steps=1, report_to=[], use_cpu=True, disable_tqdm=True)
    first = os.path.join(out, "first")
    Trainer(model=model, args=TrainingArguments(first, max_steps=2, **common), train_dataset=DictData(),
            callbacks=cbs()).train()
    assert os.path.isdir(os.path.join(first, "checkpoint-2"))
    second = os.path.join(out, "second")
    trainer = Trainer(model=model, args=TrainingArguments(second, **common), train_dataset=DictData(),
                      callbacks=cbs())
    trainer.train(resume_from_checkpoint=os.path.join(first, "checkpoint-2"))
    steps = math.ceil(100 / (2 * 3))
    assert trainer.state.global_step == steps
    assert os.path.isfile(os.path.join(second, f"checkpoint-{steps}", "model.safetensors"))
    return {"first": listing(first), "second": listing(second), "weights": trainer.model.linear.weight.tolist()}


def test_resume_from_interrupted_training_into_another_dir(tmp_path):
    both(tmp_path, interrupted_into_another_dir)


class OrderData(torch.utils.data.Dataset):
    def __init__(self, size=10):
        g = torch.Generator().manual_seed(42)
        self.data = torch.randn((size, 10), generator=g)
        self.data[:, 0] = torch.arange(0, size)
        self.labels = torch.randint(0, 10, (size,), generator=g)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.labels[i]}


class OrderModel(nn.Module):
    """Records the order of the samples it saw in a buffer that grows every step."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(42)
        self.fc = nn.Linear(10, 10, bias=False)
        self.register_buffer("data_order", torch.empty(0, dtype=torch.long))

    def load_state_dict(self, state_dict, strict=True):
        if "data_order" in state_dict and self.data_order.shape != state_dict["data_order"].shape:
            self.data_order = state_dict["data_order"].clone()
        return super().load_state_dict(state_dict, strict=strict)

    def forward(self, input_ids, labels=None):
        logits = self.fc(input_ids)
        self.data_order = torch.cat([self.data_order, input_ids[:, 0].int().detach().clone()])
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def batch_order(out, flash):
    """``test_resume_batch_order``: resuming from checkpoint-6 (inside epoch 2) sees the same data order."""
    def run(where, resume=None):
        args = TrainingArguments(where, seed=42, learning_rate=0.1, per_device_train_batch_size=2,
                                 save_strategy="steps", save_steps=1, num_train_epochs=3, optim="sgd",
                                 disable_tqdm=True, dataloader_num_workers=0, report_to=[], use_cpu=True)
        Trainer(model=OrderModel(), args=args, train_dataset=OrderData(),
                callbacks=[FlashCheckpointCallback()] if flash else []).train(resume_from_checkpoint=resume)
        return safetensors.torch.load_file(os.path.join(where, "checkpoint-15", "model.safetensors"))["data_order"]

    baseline = run(os.path.join(out, "base"))
    resumed = run(os.path.join(out, "resumed"), os.path.join(out, "base", "checkpoint-6"))
    assert torch.equal(baseline, resumed)
    return {"order": baseline.tolist(), "base": listing(os.path.join(out, "base")),
            "resumed": listing(os.path.join(out, "resumed"))}


def test_resume_keeps_the_batch_order(tmp_path):
    both(tmp_path, batch_order)


# -- reruns into a used output_dir ----------------------------------------------


class RaiseAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise RuntimeError(f"boom at step {self.step}")


def rerun_from_scratch(out, flash, first):
    """A script rerun from scratch (no resume) into an output_dir a first run used: a clean run, or one
    that raised at step 22."""
    kwargs = dict(train_len=128, save_steps=5, learning_rate=0.1, logging_steps=5)
    if first == "clean":
        regression_trainer(out, flash=flash, **kwargs).train()
    else:
        with pytest.raises(RuntimeError, match="boom"):
            regression_trainer(out, flash=flash, callbacks=[RaiseAt(22)], **kwargs).train()
    after_first = listing(out)
    trainer = regression_trainer(out, flash=flash, **kwargs)
    trainer.train()
    return {"ab": ab(trainer), "state": state_of(trainer), "listings": [after_first, listing(out)]}


@pytest.mark.parametrize("first", ["clean", "raised"])
def test_rerun_from_scratch_into_a_used_output_dir(tmp_path, first):
    both(tmp_path, rerun_from_scratch, first)


def test_rerun_from_scratch_after_a_crash_that_left_newer_steps(tmp_path):
    """A first run dies at step 23 (no clean-up in the process; its saver writes the newest memory copy
    out by itself); the script is rerun from scratch into the same output_dir and saves steps 5, 10,
    ... again: they must commit and be written although older state of steps up to 20 is on storage."""
    kwargs = dict(train_len=128, save_steps=5, learning_rate=0.1, logging_steps=5)
    stock_dir, out = str(tmp_path / "stock"), str(tmp_path / "flash")
    stock = regression_trainer(stock_dir, flash=False, **kwargs)
    stock.train()

    first = FlashCheckpointCallback(memory_every=2)
    crashed = regression_trainer(out, flash=False, callbacks=[first, RaiseAt(23)], **kwargs)
    with pytest.raises(RuntimeError, match="boom"):
        Trainer.train(crashed)  # the class's train, not the callback's wrapper: no clean-up, as in a crash
    engine = first._ckpt.engine
    engine._client.sock.close()  # the process is gone: the saver flushes step 22 by itself
    first._ckpt = None

    trainer = regression_trainer(out, flash=True, **kwargs)
    assert "checkpoint-22" in listing(out)  # written from memory (by the saver or the constructor)
    trainer.train()
    assert ab(trainer) == ab(stock)
    assert state_of(trainer) == state_of(stock)
    assert listing(out) == sorted(listing(stock_dir) + ["checkpoint-22"])
    assert not shm_left(out)


# -- rotation and the best model --------------------------------------------------


def best_with_save(out, flash):
    """``test_load_best_model_with_save``."""
    first = os.path.join(out, "a")
    trainer = regression_trainer(first, flash=flash, save_steps=5, eval_strategy="steps", eval_steps=5,
                                 max_steps=9)
    trainer.train()
    assert os.path.exists(os.path.join(first, "checkpoint-9"))
    second = os.path.join(out, "b")
    trainer = regression_trainer(second, flash=flash, save_steps=5, eval_strategy="steps", eval_steps=5,
                                 load_best_model_at_end=True, save_total_limit=2, max_steps=11)
    trainer.train()
    assert listing(second) == ["checkpoint-10", "checkpoint-11"]
    best = safetensors.torch.load_file(os.path.join(trainer.state.best_model_checkpoint, "model.safetensors"))
    for k, v in trainer.model.state_dict().items():
        assert torch.allclose(v, best[k])
    return {"a": listing(first), "b": listing(second), "ab": ab(trainer), "state": state_of(trainer)}


def test_load_best_model_with_save_total_limit(tmp_path):
    both(tmp_path, best_with_save)


def best_with_save_best(out, flash, memory_every=None):
    """``test_load_best_model_with_save_best``: save_strategy='best'; with ``memory_every``,
    also a memory snapshot that often (the Trainer decides a best save after evaluating,
    later than the callback's per-step plan: it must still be a folder)."""
    cbs = [FlashCheckpointCallback(memory_every=memory_every)] if flash and memory_every else []
    trainer = regression_trainer(out, flash=flash and not memory_every, callbacks=cbs, save_strategy="best",
                                 eval_strategy="steps", eval_steps=5, load_best_model_at_end=True,
                                 save_total_limit=2, max_steps=11)
    trainer.train()
    assert trainer.state.best_model_checkpoint is not None
    best = safetensors.torch.load_file(os.path.join(trainer.state.best_model_checkpoint, "model.safetensors"))
    for k, v in trainer.model.state_dict().items():
        assert torch.allclose(v, best[k])
    return {"listing": listing(out), "ab": ab(trainer), "state": state_of(trainer)}


def test_load_best_model_with_save_strategy_best(tmp_path):
    both(tmp_path, best_with_save_best)


def test_save_strategy_best_with_memory_snapshots_writes_the_best_folders(tmp_path):
    both(tmp_path, best_with_save_best, 1)


def test_save_strategy_best_keeps_the_memory_snapshots_of_steps_that_are_no_new_best(tmp_path):
    from flashckpt import _events
    saved = []
    _events.subscribe(lambda event, **info: saved.append(info["step"]) if event == "save" else None)
    trainer = regression_trainer(str(tmp_path), flash=False, callbacks=[FlashCheckpointCallback(memory_every=1)],
                                 save_strategy="best", eval_strategy="steps", eval_steps=1, max_steps=6,
                                 metric_for_best_model="score", greater_is_better=True,
                                 compute_metrics=_Scores([0.1, 0.3, 0.2, 0.25, 0.4, 0.35]))
    trainer.train()
    assert sorted(set(saved)) == [1, 2, 3, 4, 5, 6]  # 3, 4 and 6 are no new best
    assert listing(str(tmp_path)) == ["checkpoint-1", "checkpoint-2", "checkpoint-5"]  # the new bests, as stock


class _Scores:
    """``compute_metrics`` returning the given scores in turn (the last one after them)."""

    def __init__(self, scores) -> None:
        self.scores = evaluations(list(scores))

    def __call__(self, _predictions) -> dict:
        return {"score": next(self.scores)}


def early_stop_between_saves(out, flash):
    """Early stopping at a step that saves nothing, the best step's folder just saved: the
    Trainer loads the best model right after the loop, while the saver may still write it."""
    from transformers import EarlyStoppingCallback
    trainer = regression_trainer(out, flash=flash, learning_rate=0.1, eval_strategy="steps", eval_steps=1,
                                 save_steps=2, max_steps=30, load_best_model_at_end=True,
                                 metric_for_best_model="score", greater_is_better=True,
                                 compute_metrics=_Scores([0.1, 0.2, 0.3, 0.9, 0.5]),
                                 callbacks=[EarlyStoppingCallback(early_stopping_patience=1)])
    trainer.train()
    assert trainer.state.global_step == 5 and os.path.basename(trainer.state.best_model_checkpoint) == "checkpoint-4"
    best = safetensors.torch.load_file(os.path.join(trainer.state.best_model_checkpoint, "model.safetensors"))
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, best[k]), k
    return {"listing": listing(out), "ab": ab(trainer), "state": state_of(trainer)}


def test_early_stopping_loads_the_best_folder_written_in_the_background(tmp_path):
    both(tmp_path, early_stop_between_saves)


def save_best_checkpoint(out, flash, metric, values):
    """``test_save_best_checkpoint``: save_strategy='best' with evaluations patched in."""
    trainer = regression_trainer(out, flash=flash, a=1.5, b=2.5, learning_rate=0.1, eval_strategy="epoch",
                                 save_strategy="best", metric_for_best_model=metric,
                                 compute_metrics=AlmostAccuracy())
    with patch.object(trainer, "_evaluate", side_effect=values):
        trainer.train()
    assert len(os.listdir(out)) == 2
    return {"listing": listing(out), "state": state_of(trainer)}


@pytest.mark.parametrize("metric", ["accuracy", "loss"])
def test_save_strategy_best_keeps_the_best_folders(tmp_path, metric):
    values = {"accuracy": [{"eval_loss": 0.03, "eval_accuracy": 0.60, "epoch": 1.0},
                           {"eval_loss": 0.02, "eval_accuracy": 0.65, "epoch": 2.0},
                           {"eval_loss": 0.01, "eval_accuracy": 0.64, "epoch": 3.0}],
              "loss": [{"eval_loss": 0.03, "eval_accuracy": 0.60, "epoch": 1.0},
                       {"eval_loss": 0.02, "eval_accuracy": 0.65, "epoch": 2.0},
                       {"eval_loss": 0.03, "eval_accuracy": 0.66, "epoch": 3.0}]}[metric]
    both(tmp_path, save_best_checkpoint, metric, values)


BEST_CASES = {  # test_best_model_checkpoint_behavior, cases 1-6: (arguments, evaluations, expected entries)
    "no-eval": (dict(eval_strategy="no", save_strategy="steps", save_steps=1, metric_for_best_model="accuracy",
                     greater_is_better=True), None, "global_step"),
    "no-eval-limit-1": (dict(eval_strategy="no", save_strategy="steps", save_steps=1,
                             metric_for_best_model="accuracy", greater_is_better=True, save_total_limit=1),
                        None, 1),
    "eval-equals-save": (dict(eval_strategy="epoch", save_strategy="epoch", metric_for_best_model="accuracy",
                              compute_metrics=AlmostAccuracy(), greater_is_better=True,
                              load_best_model_at_end=False), [0.59, 0.57, 0.55], 3),
    "eval-differs-from-save": (dict(eval_strategy="epoch", save_strategy="steps", save_steps=1,
                                    metric_for_best_model="accuracy", compute_metrics=AlmostAccuracy(),
                                    greater_is_better=True, load_best_model_at_end=False),
                               [0.59, 0.57, 0.55], "global_step"),
    "limit-1-best-first": (dict(eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
                                metric_for_best_model="accuracy", compute_metrics=AlmostAccuracy(),
                                greater_is_better=True, save_total_limit=1), [0.90, 0.80, 0.70], 1),
    "save-more-often": (dict(eval_strategy="steps", eval_steps=3, save_strategy="steps", save_steps=2,
                             metric_for_best_model="accuracy", compute_metrics=AlmostAccuracy(),
                             greater_is_better=True), [0.90, 0.80, 0.70], "half"),
}


def best_checkpoint_behavior(out, flash, case):
    kwargs, values, expected = BEST_CASES[case]
    trainer = regression_trainer(out, flash=flash, **kwargs)
    if values is None:
        trainer.train()
    else:
        with patch.object(trainer, "_evaluate",
                          side_effect=evaluations([{"eval_accuracy": v} for v in values])):
            trainer.train()
    n = {"global_step": trainer.state.global_step, "half": trainer.state.global_step // 2}.get(expected, expected)
    assert len(os.listdir(out)) == n
    best = trainer.state.best_model_checkpoint
    return {"listing": listing(out), "best": best and os.path.basename(best), "metric": trainer.state.best_metric,
            "best_step": trainer.state.best_global_step}


@pytest.mark.parametrize("case", sorted(BEST_CASES))
def test_best_model_checkpoint_behavior(tmp_path, case):
    both(tmp_path, best_checkpoint_behavior, case)


def save_total_limit_rotation(out, flash):
    trainer = regression_trainer(out, flash=flash, save_steps=2, save_total_limit=2, logging_steps=2)
    trainer.train()
    return {"listing": listing(out), "ab": ab(trainer), "state": state_of(trainer)}


def test_save_total_limit_rotation(tmp_path):
    assert both(tmp_path, save_total_limit_rotation)["listing"] == ["checkpoint-22", "checkpoint-24"]


# -- what a clean train() leaves, the README's usage, and a raised train() -------


def test_output_dir_holds_what_the_stock_trainer_leaves(tmp_path):
    def run(out, flash):
        regression_trainer(out, flash=flash, save_steps=5).train()
        return {"listing": listing(out)}

    assert both(tmp_path, run)["listing"] == ["checkpoint-10", "checkpoint-15", "checkpoint-20",
                                              "checkpoint-24", "checkpoint-5"]


def test_readme_usage_runs_on_a_first_run_and_on_a_resume(tmp_path):
    """The README's lines, as written: the same script starts fresh, then resumes."""
    out = str(tmp_path / "never-created")
    for max_steps, expected in ((6, ["checkpoint-3", "checkpoint-6"]), (9, ["checkpoint-3", "checkpoint-6",
                                                                            "checkpoint-9"])):
        args = TrainingArguments(out, max_steps=max_steps, save_steps=3, report_to=[], use_cpu=True,
                                 disable_tqdm=True, learning_rate=0.1)
        model = RegressionPreTrainedModel(RegressionModelConfig())
        trainer = Trainer(model=model, args=args, train_dataset=RegressionDataset(),
                          callbacks=[FlashCheckpointCallback()])
        trainer.train(resume_from_checkpoint=last_checkpoint(args.output_dir))
        assert listing(out) == expected
    stock = str(tmp_path / "stock")  # the same two runs, stock, the second resumed from checkpoint-6
    regression_trainer(stock, flash=False, max_steps=6, save_steps=3, learning_rate=0.1).train()
    resumed = regression_trainer(stock, flash=False, max_steps=9, save_steps=3, learning_rate=0.1)
    resumed.train(resume_from_checkpoint=os.path.join(stock, "checkpoint-6"))
    assert ab(trainer) == ab(resumed)


def test_last_checkpoint(tmp_path):
    assert last_checkpoint(str(tmp_path / "missing")) is None
    assert last_checkpoint(str(tmp_path)) is None
    for name in ("checkpoint-5", "checkpoint-40", ".checkpoint-50.tmp-1", "checkpoint-x"):
        os.makedirs(tmp_path / name)
    (tmp_path / "checkpoint-60").write_text("a file, not a folder")
    newest = str(tmp_path / "checkpoint-40")
    assert last_checkpoint(str(tmp_path)) == get_last_checkpoint(str(tmp_path)) == newest


def _tree(root):
    found = {}
    for where, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(where, name)
            found[os.path.relpath(path, root)] = os.lstat(path).st_mtime_ns
    return found


def test_nothing_is_written_into_output_dir_after_train_raised(tmp_path):
    """Every step saves, the run raises at step 7 with persists still in flight: when train() raises,
    the folders are final (the stock ones of steps 1-6), the shared memory is freed, and output_dir can
    be removed at once."""
    stock, out = str(tmp_path / "stock"), str(tmp_path / "flash")
    with pytest.raises(RuntimeError, match="boom"):
        regression_trainer(stock, flash=False, save_steps=1, callbacks=[RaiseAt(7)]).train()
    cb = FlashCheckpointCallback()
    with pytest.raises(RuntimeError, match="boom"):
        regression_trainer(out, flash=False, save_steps=1, callbacks=[cb, RaiseAt(7)]).train()
    before = _tree(out)
    time.sleep(1.0)
    assert _tree(out) == before
    assert listing(out) == listing(stock)
    assert cb._ckpt is None and not shm_left(out)
    shutil.rmtree(out)


def test_a_raised_train_writes_the_newest_memory_snapshot_out_first(tmp_path):
    """Snapshots between saves (memory_every) exist to survive a failure: when train() raises at step 5,
    step 4 (memory only) is written as checkpoint-4 before the exception leaves train(), and a resume
    from it matches the run that did not fail."""
    out = str(tmp_path / "run")
    cb = FlashCheckpointCallback(memory_every=2)
    with pytest.raises(RuntimeError, match="boom"):
        regression_trainer(out, flash=False, save_steps=3, max_steps=8, callbacks=[cb, RaiseAt(5)]).train()
    assert listing(out) == ["checkpoint-3", "checkpoint-4"]
    assert cb._ckpt is None and not shm_left(out)
    trainer = regression_trainer(out, flash=True, save_steps=3, max_steps=8)
    trainer.train(resume_from_checkpoint=last_checkpoint(out))
    reference = regression_trainer(str(tmp_path / "stock"), flash=False, save_steps=3, max_steps=8)
    reference.train()
    assert ab(trainer) == ab(reference)
