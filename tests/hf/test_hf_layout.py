"""A run with FlashCheckpointCallback writes the same checkpoint folders as the stock save."""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import TrainerCallback

from flashckpt.hf import FlashCheckpointCallback

from ._hf import make_trainer, shm_left

TIMINGS = ("_runtime", "_per_second")


def _folders(out) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(out, "checkpoint-*")))


def _same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}/{i}")
    elif hasattr(a, "dtype") and hasattr(a, "tobytes"):  # numpy arrays in the RNG state
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), where
    elif type(a).__eq__ is object.__eq__ and hasattr(a, "__dict__"):  # e.g. DeepSpeed's LossScaler
        assert type(a) is type(b), where
        _same(vars(a), vars(b), where)
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _without_timings(obj):
    if isinstance(obj, dict):
        return {k: _without_timings(v) for k, v in obj.items() if not k.endswith(TIMINGS)}
    if isinstance(obj, list):
        return [_without_timings(v) for v in obj]
    return obj


def _compare_folder(stock: str, flash: str) -> None:
    names = sorted(os.listdir(stock))
    assert sorted(os.listdir(flash)) == names, f"{flash}: files differ from the stock save"
    for name in names:
        a, b = os.path.join(stock, name), os.path.join(flash, name)
        if os.path.isdir(a):  # DeepSpeed's tag global_step<N>
            _compare_folder(a, b)
        elif name.endswith((".safetensors", ".py")) or name in ("config.json", "generation_config.json", "latest"):
            assert open(a, "rb").read() == open(b, "rb").read(), f"{name} differs"
        elif name == "trainer_state.json":
            sa, sb = json.load(open(a)), json.load(open(b))
            for key in ("best_model_checkpoint",):  # a path inside each run's own output_dir
                sa[key] = sa[key] and os.path.basename(sa[key])
                sb[key] = sb[key] and os.path.basename(sb[key])
            assert _without_timings(sa) == _without_timings(sb)
        elif name == "training_args.bin":
            ta = torch.load(a, weights_only=False).to_dict()
            tb = torch.load(b, weights_only=False).to_dict()
            for key in ("output_dir", "logging_dir"):
                ta.pop(key, None), tb.pop(key, None)
            assert ta == tb
        elif name.endswith((".pt", ".pth")):
            _same(torch.load(a, weights_only=False), torch.load(b, weights_only=False), name)
        else:
            raise AssertionError(f"unexpected file {name} in {stock}")


CASES = {
    "steps": {"save_total_limit": 2, "logging_steps": 1},
    "save_only_model": {"save_only_model": True},
    "eval_best": {"eval_strategy": "steps", "eval_steps": 3, "load_best_model_at_end": True,
                  "metric_for_best_model": "loss", "save_total_limit": 1},
    "llama": {"llama": True},
    "epoch": {"save_strategy": "epoch", "max_steps": -1, "num_train_epochs": 2, "per_device_train_batch_size": 16},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_folders_as_the_stock_save(tmp_path, case):
    stock, flash = str(tmp_path / "stock"), str(tmp_path / "flash")
    ref = make_trainer(stock, **CASES[case])
    ref.train()
    cb = FlashCheckpointCallback()
    run = make_trainer(flash, [cb], **CASES[case])
    run.train()
    assert _folders(flash) == _folders(stock) and _folders(stock)
    for name in _folders(stock):
        _compare_folder(os.path.join(stock, name), os.path.join(flash, name))
    for a, b in zip(ref.model.parameters(), run.model.parameters()):
        assert torch.equal(a, b)
    assert not glob.glob(os.path.join(flash, ".checkpoint-*")), "temporary folders left behind"
    assert cb._ckpt is None and not shm_left(flash)  # train() ended: shared memory freed
    if case == "save_only_model":  # as the stock save: no optimizer, scheduler or RNG files
        assert sorted(os.listdir(os.path.join(flash, "checkpoint-6"))) == [
            "config.json", "generation_config.json", "model.safetensors", "trainer_state.json", "training_args.bin"]


def test_memory_snapshots_between_saves_write_no_folder(tmp_path):
    saves = []
    from flashckpt import _events
    listener = lambda event, **info: saves.append(info["step"]) if event == "save" else None  # noqa: E731
    _events.subscribe(listener)
    try:
        make_trainer(str(tmp_path), [FlashCheckpointCallback(memory_every=1)], max_steps=5).train()
    finally:
        _events.unsubscribe(listener)
    assert saves == [1, 2, 3, 4, 5]
    assert _folders(tmp_path) == ["checkpoint-3", "checkpoint-5"]


@pytest.mark.parametrize("memory_slots", [2, 1])
def test_persist_every_and_keep_last(tmp_path, memory_slots):
    slots = []

    class CountSlots(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            slots.append(len([p for p in shm_left(tmp_path) if ".slot" in p]))

    make_trainer(str(tmp_path), [FlashCheckpointCallback(persist_every=2, keep_last=2, memory_slots=memory_slots),
                                 CountSlots()], max_steps=7, save_steps=1).train()
    assert _folders(tmp_path) == ["checkpoint-6", "checkpoint-7"]
    assert max(slots) == memory_slots, slots


def test_added_after_construction_still_saves(tmp_path):
    trainer = make_trainer(str(tmp_path), max_steps=4)
    cb = FlashCheckpointCallback()
    trainer.add_callback(cb)
    trainer.train()
    assert _folders(tmp_path) == ["checkpoint-3", "checkpoint-4"]
    assert cb._stock_save is not None and cb._ckpt is None and not shm_left(tmp_path)


@pytest.mark.timeout(600)
def test_deepspeed_same_folders_as_the_stock_save(tmp_path):
    """The Trainer's DeepSpeed integration (1 process, torchrun; one launch per mode trains
    ZeRO-2, ZeRO-3 and ZeRO-2 with save_only_model in turn): DeepSpeed's tag, ``latest`` and
    recovery scripts in each folder, every tensor equal to the stock save's."""
    script = os.path.join(os.path.dirname(__file__), "_deepspeed_hf.py")
    variants = ["2", "3", "2-only-model"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    runs = {mode: subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                    "--nproc_per_node=1", script, str(tmp_path / mode), mode, *variants],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            for mode in ("stock", "flash")}
    for proc in runs.values():
        log, _ = proc.communicate(timeout=500)
        assert proc.returncode == 0, log[-4000:]
    for variant in variants:
        stock, flash = str(tmp_path / "stock" / variant), str(tmp_path / "flash" / variant)
        assert _folders(flash) == _folders(stock) == ["checkpoint-2", "checkpoint-4"], variant
        for name in _folders(stock):
            _compare_folder(os.path.join(stock, name), os.path.join(flash, name))
        # DeepSpeed's own resume reads ``latest``; save_only_model leaves DeepSpeed's tag out, as the stock save
        assert ("latest" in os.listdir(os.path.join(flash, "checkpoint-4"))) == (variant != "2-only-model"), variant
        assert not glob.glob(os.path.join(flash, ".checkpoint-*")) and not shm_left(flash), variant
