"""Overlapped saves (issue 42 item 4): ``save(step, state, overlap=True)`` returns before the
optimizer-owned tensors are copied; the optimizer's step pre-hook waits for the copy.

The copy is made slow deterministically: the background part of the copy (``copy_in`` on a
thread other than the caller's) waits on a gate. The gate opens when someone waits for the
copy (the optimizer's pre-hook, ``wait_copy``, the next save, close) or when an update has
finished (the step's post-hook, registered by the test): without the pre-hook's wait the
update runs first and the saved bytes are the updated ones, which the tests catch.
"""

from __future__ import annotations

import threading

import pytest
import torch

from flashckpt import CheckpointError, Options
from flashckpt._engine import Engine, SingleProcess, place
from flashckpt.memory import _overlap
from flashckpt.memory._rank_slots import RankSlots
from flashckpt.torch import Checkpointer, DdpCheckpointer


@pytest.fixture
def gate(monkeypatch):
    """Holds the background part of every copy until someone waits for it (or an update ended)."""
    gate = threading.Event()
    copy_in, wait = RankSlots.copy_in, _overlap.OverlappedCopy.wait
    caller = threading.current_thread()

    def held_copy_in(self, *args, **kwargs):
        if threading.current_thread() is not caller:
            assert gate.wait(60), "the copy was never waited for"
        return copy_in(self, *args, **kwargs)

    def opening_wait(self, *args, **kwargs):
        gate.set()
        return wait(self, *args, **kwargs)

    monkeypatch.setattr(RankSlots, "copy_in", held_copy_in)
    monkeypatch.setattr(_overlap.OverlappedCopy, "wait", opening_wait)
    return gate


def _model(bn: bool = False):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 32)] + ([torch.nn.BatchNorm1d(32)] if bn else []) + [torch.nn.Linear(32, 4)]
    model = torch.nn.Sequential(*layers)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _forward_backward(model) -> None:
    model(torch.randn(8, 16)).square().sum().backward()


def _train(model, opt, steps: int = 1) -> None:
    for _ in range(steps):
        opt.zero_grad()
        _forward_backward(model)
        opt.step()


def _state(model, opt) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _clone(tree):
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    return tree.clone() if isinstance(tree, torch.Tensor) else tree


def _assert_equal(got, want, path: str = "") -> None:
    if isinstance(want, dict):
        assert set(got) == set(want), path
        for k in want:
            _assert_equal(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, list):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_equal(g, w, f"{path}/{i}")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), path
    else:
        assert got == want, path


def _loaded(directory, job_id, bn: bool = False) -> dict:
    model, opt = _model(bn)
    _train(model, opt)  # the optimizer's state exists, to be filled in place
    state = _state(model, opt)
    with Checkpointer(directory, job_id=job_id) as ckpt:
        ckpt.load(state)
    return state


def test_the_saved_bytes_are_the_state_at_save_though_the_next_update_comes_before_the_copy(tmp_path, job_id, gate):
    model, opt = _model()
    _train(model, opt, 2)
    opt.register_step_post_hook(lambda *_: gate.set())  # an update that ran before the copy releases it
    with Checkpointer(tmp_path, job_id=job_id, persist_every=1000) as ckpt:
        at_save = _clone(_state(model, opt))
        handle = ckpt.save(2, _state(model, opt), overlap=True, optimizer=opt)
        assert not handle.copied()  # the gate holds the copy: save returned before it
        _train(model, opt)  # forward and backward overlap the copy; the update waits for it
        copied_before_the_update_ended = handle.copied()
        handle.wait_copy()
        assert not torch.equal(model[0].weight, at_save["model"]["0.weight"])
        assert sorted(ckpt.engine.memory_steps()) == [2]
    _assert_equal(_loaded(tmp_path, job_id), at_save)
    assert copied_before_the_update_ended


def test_forward_changing_batchnorm_statistics_does_not_reach_the_saved_step(tmp_path, job_id, gate):
    model, opt = _model(bn=True)
    _train(model, opt)
    with Checkpointer(tmp_path, job_id=job_id, persist_every=1000, overlap=True) as ckpt:
        at_save = _clone(_state(model, opt))
        handle = ckpt.save(1, _state(model, opt), optimizer=opt)  # overlap from the options
        assert not handle.copied()
        opt.zero_grad()
        _forward_backward(model)  # train mode: the running statistics change now, the copy still held
        assert not torch.equal(model[1].running_mean, at_save["model"]["1.running_mean"])
        opt.step()
        handle.wait()
    _assert_equal(_loaded(tmp_path, job_id, bn=True), at_save)


def test_everything_after_an_overlapped_save_comes_after_its_copy(tmp_path, job_id, gate):
    """A failure capture, the next save and close each wait for the copy in flight; later
    saves need no optimizer again (here: the one given to save_on_failure)."""
    model, opt = _model()
    with Checkpointer(tmp_path, job_id=job_id, persist_every=1000) as ckpt:
        capture = ckpt.save_on_failure(lambda: _state(model, opt), optimizer=opt)
        _train(model, opt)
        first = ckpt.save(1, _state(model, opt), overlap=True)
        assert not first.copied()
        assert capture.capture("test") is None  # no update since step 1, whose copy it waited for
        assert first.copied() and sorted(ckpt.engine.memory_steps()) == [1]
        _train(model, opt)
        at_save = _clone(_state(model, opt))
        gate.clear()
        second = ckpt.save(2, _state(model, opt), overlap=True)
        assert not second.copied()
        ckpt.save(3, _state(model, opt), overlap=True)  # the same state again
        assert second.copied()
    assert ckpt.latest_step() == 3  # close waited for the copy, then persisted it
    _assert_equal(_loaded(tmp_path, job_id), at_save)


def test_overlap_without_an_optimizer_is_refused_at_the_call(tmp_path, job_id):
    model, opt = _model()
    with Checkpointer(tmp_path, job_id=job_id) as ckpt:
        with pytest.raises(ValueError, match=r"save\(overlap=True\) needs the optimizer"):
            ckpt.save(1, _state(model, opt), overlap=True)
        with pytest.raises(TypeError, match="register_step_pre_hook"):
            ckpt.save(1, _state(model, opt), overlap=True, optimizer=object())
        assert ckpt.engine.memory_steps() == {}
        ckpt.save(1, _state(model, opt))  # a blocking save needs none
    with pytest.raises(ValueError, match="overlap must be a bool"):
        Checkpointer(tmp_path, job_id=job_id, overlap="yes")
    with pytest.raises(ValueError, match="overlap option is for the torch Checkpointer"):  # FSDP, DeepSpeed, TF...
        Engine(str(tmp_path), Options(overlap=True, job_id=job_id), place(SingleProcess(), replicated=False))


@pytest.mark.parametrize("next_call", ["optimizer step", "save", "wait"])
def test_an_error_in_the_copy_is_raised_at_the_next_call(tmp_path, job_id, monkeypatch, next_call):
    model, opt = _model()
    _train(model, opt)
    copy_in, caller = RankSlots.copy_in, threading.current_thread()

    def failing(self, *args, **kwargs):
        if threading.current_thread() is not caller:
            raise OSError("injected copy failure")
        return copy_in(self, *args, **kwargs)

    monkeypatch.setattr(RankSlots, "copy_in", failing)
    with Checkpointer(tmp_path, job_id=job_id, persist_every=1000) as ckpt:
        ckpt.save(1, _state(model, opt), overlap=True, optimizer=opt)
        with pytest.raises(CheckpointError, match="overlapped copy of step 1 failed.*injected copy failure"):
            if next_call == "optimizer step":
                _train(model, opt)
            elif next_call == "save":
                ckpt.save(2, _state(model, opt))
            else:
                ckpt.wait()
        assert 1 not in ckpt.engine.memory_steps()  # the torn slot never counts
        monkeypatch.setattr(RankSlots, "copy_in", copy_in)
        _train(model, opt)  # raised once: training goes on
        ckpt.save(3, _state(model, opt), overlap=True)
        at_save = _clone(_state(model, opt))
    assert ckpt.latest_step() == 3
    _assert_equal(_loaded(tmp_path, job_id), at_save)


def _ddp_overlapped(rank: int, world: int, directory: str, job: str) -> list[float]:
    """Each rank: DDP with BatchNorm, an overlapped save every step, then a load into a fresh model."""
    from torch.nn.parallel import DistributedDataParallel

    model, opt = _model(bn=True)
    ddp = DistributedDataParallel(model)
    with DdpCheckpointer(directory, job_id=job, persist_every=2) as ckpt:
        for step in range(1, 4):
            opt.zero_grad()
            ddp(torch.randn(8, 16)).square().sum().backward()
            opt.step()
            at_save = _clone(_state(model, opt))
            ckpt.save(step, _state(model, opt), overlap=True, optimizer=opt)
        ddp(torch.randn(8, 16))  # forward changes the statistics before the copy is waited for
        fresh, fresh_opt = _model(bn=True)
        _train(fresh, fresh_opt)
        state = _state(fresh, fresh_opt)
        assert ckpt.load(state) == 3
    _assert_equal(state, at_save)
    return fresh[0].weight.flatten()[:4].tolist()


def test_ddp_overlapped_saves_on_two_ranks(tmp_path, job_id):
    from .._fork import run_ranks
    weights = run_ranks(_ddp_overlapped, 2, str(tmp_path), job_id, timeout=120)
    assert weights[0] == weights[1]
