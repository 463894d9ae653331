"""A full DeepSpeed load from memory fills the engine's own tensors (parameters, ZeRO fp32
partitions, the optimizer's moments) instead of new ones, and restores exactly what was
saved; a checkpoint that does not fit the engine is refused before any of them is written,
and parameters registered in another order still land by name."""

import pytest
import torch

from tests._fork import run_ranks

from . import _ds_train


def _live(engine) -> dict:
    """The engine's training state by name: module parameters, fp32 partitions, Adam moments."""
    tensors = {f"param/{n}": p.data for n, p in engine.module.named_parameters()}
    zero = engine.optimizer
    for i, part in enumerate(zero.single_partition_of_fp32_groups):
        tensors[f"fp32/{i}"] = part.data
        for name, moment in zero.optimizer.state[part].items():
            if isinstance(moment, torch.Tensor) and moment.numel() > 1:
                tensors[f"adam/{i}/{name}"] = moment
    return tensors


def _places(rank, world, directory, job):
    from flashckpt import StateMismatchError
    from flashckpt.deepspeed import DeepSpeedCheckpointer
    sources = _ds_train.join_group(rank)

    engine = _ds_train.make_engine(1)
    ck = DeepSpeedCheckpointer(engine, directory, job_id=job, persist_every=1000)
    for step in (1, 2):
        _ds_train.train_step(engine, rank, step)
    ck.save(2)
    saved = {k: v.clone() for k, v in _live(engine).items()}

    restarted = _ds_train.make_engine(1)
    _ds_train.train_step(restarted, rank, 7)  # its own optimizer state, other values
    before = _live(restarted)
    pointers = {k: v.data_ptr() for k, v in before.items()}
    step = DeepSpeedCheckpointer(restarted, directory, job_id=job).load()
    after = _live(restarted)
    out = {"step": step, "source": sources[-1],
           "equal": sorted(k for k in saved if not torch.equal(after[k], saved[k])) or True,
           "moved": sorted(k for k in after if after[k].data_ptr() != pointers.get(k)) or None,
           "next_loss_equal": _ds_train.train_step(restarted, rank, 3) == _ds_train.train_step(engine, rank, 3)}

    other = _ds_train.make_engine(1, hidden=24)  # another model of the same stage
    _ds_train.train_step(other, rank, 7)
    untouched = {k: v.clone() for k, v in _live(other).items()}
    try:
        DeepSpeedCheckpointer(other, directory, job_id=job).load()
        out["other_model"] = "loaded"
    except StateMismatchError as exc:
        out["other_model"] = str(exc)
    out["other_untouched"] = all(torch.equal(v, untouched[k]) for k, v in _live(other).items())
    ck.close()
    return out


@pytest.mark.timeout(240)
def test_a_restart_from_memory_fills_the_engines_own_tensors(tmp_path, job_id):
    for out in run_ranks(_places, 2, str(tmp_path / "ckpt"), job_id, timeout=220):
        assert out["step"] == 2 and out["source"] == "memory"
        assert out["equal"] is True, out["equal"]
        assert out["moved"] is None, f"loaded into new tensors: {out['moved']}"
        assert out["next_loss_equal"]
        assert "another model" in out["other_model"] and out["other_untouched"]


class _TwoLayers(torch.nn.Module):
    """Two layers of one shape, registered in either order (state dict keys follow it)."""

    def __init__(self, b_first: bool) -> None:
        super().__init__()
        for name in ("b", "a") if b_first else ("a", "b"):
            setattr(self, name, torch.nn.Linear(8, 8))

    def forward(self, x):
        return self.b(self.a(x))


def _reordered(rank, world, directory, job):
    import deepspeed
    from flashckpt.deepspeed import DeepSpeedCheckpointer
    sources = _ds_train.join_group(rank)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
              "zero_optimization": {"stage": 0}, "steps_per_print": 10**9}

    def engine(b_first: bool):
        torch.manual_seed(1 if b_first else 0)
        model = _TwoLayers(b_first)
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]

    saving = engine(False)
    ck = DeepSpeedCheckpointer(saving, directory, job_id=job, persist_every=1000)
    ck.save(1)
    saved = {n: p.detach().clone() for n, p in saving.module.named_parameters()}
    loading = engine(True)
    DeepSpeedCheckpointer(loading, directory, job_id=job).load()
    wrong = sorted(n for n, p in loading.module.named_parameters() if not torch.equal(p, saved[n]))
    ck.close()
    return sources[-1], wrong or None


@pytest.mark.timeout(120)
def test_parameters_registered_in_another_order_load_by_name(tmp_path, job_id):
    [(source, wrong)] = run_ranks(_reordered, 1, str(tmp_path / "ckpt"), job_id, timeout=100)
    assert source == "memory" and wrong is None, wrong


def _bracketed(rank, world, directory, job):
    from flashckpt.deepspeed import DeepSpeedCheckpointer
    sources = _ds_train.join_group(rank)
    engine = _ds_train.make_engine(1)
    ck = DeepSpeedCheckpointer(engine, directory, job_id=job, persist_every=1)
    _ds_train.train_step(engine, rank, 1)
    ck.save(1)
    ck.wait()
    saved = {k: v.clone() for k, v in _live(engine).items()}
    loads = []
    for _ in ("memory", "storage"):
        restarted = _ds_train.make_engine(1)
        _ds_train.train_step(restarted, rank, 7)
        step = DeepSpeedCheckpointer(restarted, directory, job_id=job).load()
        loads.append((step, sources[-1], all(torch.equal(v, saved[k]) for k, v in _live(restarted).items())))
        ck.close()  # the second load reads storage
    return loads


@pytest.mark.timeout(120)
def test_a_directory_named_with_glob_brackets_loads(tmp_path, job_id):
    """DeepSpeed globs the directory it loads from: a sweep's ``run[lr=0.1]`` must still load."""
    [loads] = run_ranks(_bracketed, 1, str(tmp_path / "run[lr=0.1]"), job_id, timeout=100)
    assert loads == [(1, "memory", True), (1, "storage", True)]
