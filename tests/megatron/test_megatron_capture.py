"""Failure capture of a megatron-core GPTModel with its optimizer (issue 42), TP=2 on 2 gloo
ranks (each rank holds its own shards: every rank's capture is needed): the FP32Optimizer,
and the fp16/bf16 one (``Float16OptimizerWithFloat16Params``: its step copies the fp32 main
parameters into the model after the torch step; built on CPU as ``_gpt.optimizer`` says).

Both ranks: load (a fresh start), arm ``save_on_failure`` with the megatron optimizer, save
step 2 (persisted), three updates; in step 6's backward the main thread blocks in a C++
wait and the process gets SIGTERM: the watcher thread builds the sharded state dict and
captures step 5. A new pair loads step 5 from memory, bit-exact (parameters and Adam
moments), in fp32 and, in another pair, in bf16 (also the fp32 main parameters). A capture
between the bf16 optimizer's torch step and its copy into the model writes nothing and says
why. Where only rank 1 captures (rank 0 was ``kill -9``ed after step 5), the restart
loads step 2 (fp16 with a constant loss scale: its save loads bit-exact) and rank 0 logs
why. Bad input, in the restarting pair: a
``state_fn`` that raises or gives another tree fails the first save; the distributed
optimizer (alone or chained) is refused; an object with no step is a TypeError.
"""

from __future__ import annotations

import glob
import logging
import os
import uuid

import numpy as np
import pytest
import torch

from flashckpt._names import job_prefix
from tests._fork import run_ranks
from tests.capture._blocked import SigtermWhileBlocked, logged

from . import _gpt

pytest.importorskip("megatron.core")


def _numpy(state: dict) -> dict:
    """numpy has no bfloat16: those tensors as their bits."""
    return {k: (v.view(torch.int16) if v.dtype == torch.bfloat16 else v).numpy() for k, v in state.items()}


def _step(model, opt, step: int, in_backward=None) -> None:
    opt.zero_grad()
    loss = opt.scale_loss(_gpt.loss(model, step))  # as megatron's schedules scale it (fp16: by 1024)
    if in_backward is not None:
        loss.register_hook(in_backward)
    loss.backward()
    opt.step()


def _train_to_5(directory: str, job: str, dtype: torch.dtype):
    """Fresh start, armed capture, step 2 saved and persisted, steps 3-5 trained. Returns
    (checkpointer, model, optimizer, capture, the local state of step 2)."""
    from flashckpt.megatron import MegatronCheckpointer

    model = _gpt.build(2, dtype=dtype)
    opt = _gpt.optimizer(model)
    ckpt = MegatronCheckpointer(directory, job_id=job, persist_every=100)
    assert ckpt.load(_gpt.state_of(model, opt)) == (None, None)  # loading=True would make Adam state without "step"
    capture = ckpt.save_on_failure(lambda: _gpt.state_of(model, opt), optimizer=opt)
    for step in range(1, 6):
        _step(model, opt, step)
        if step == 2:
            ckpt.save(2, _gpt.state_of(model, opt), persist=True)
            ckpt.wait()
            at2 = _gpt.local_state(model, opt)
    return ckpt, model, opt, capture, at2


def _sigterm_in_backward(rank: int, world: int, directory: str, job: str, dtype: torch.dtype) -> dict:
    """Step 6's backward: SIGTERM while the main thread waits in C++ until the watcher
    thread has captured (a launcher's SIGTERM while a rank waits in a collective)."""
    term = SigtermWhileBlocked()
    ckpt, model, opt, capture, _ = _train_to_5(directory, job, dtype)
    at5 = _gpt.local_state(model, opt)

    def in_backward(grad):
        term.block()
        return grad

    _step(model, opt, 6, in_backward)
    term.assert_captured(5, capture)
    return _numpy(at5)  # the process ends unclosed, as one that a launcher stops does


def _rank_0_killed(rank: int, world: int, directory: str, job: str, dtype: torch.dtype) -> None:
    """After step 5 rank 0 is ``kill -9``ed (it captures nothing); rank 1 captures step 5.
    Each rank's state of step 2 goes to ``at2-<rank>.npz`` beside ``directory``."""
    import signal

    import numpy as np

    _, _, _, capture, at2 = _train_to_5(directory, job, dtype)
    np.savez(f"{directory}-at2-{rank}.npz", **_numpy(at2))
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    assert capture.capture("test") == 5


def _restart(directory: str, job: str, dtype: torch.dtype) -> tuple:
    """Load into a model and optimizer of other weights and learning rate."""
    from flashckpt.megatron import MegatronCheckpointer

    lines: list[str] = []
    logged(lines)
    model = _gpt.build(2, seed=3, dtype=dtype)
    opt = _gpt.optimizer(model, lr=0.5)
    with MegatronCheckpointer(directory, job_id=job) as ckpt:
        state, step = ckpt.load(_gpt.state_of(model, opt, loading=True))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        loaded = ckpt.last_load
        captured = bool(ckpt.engine.memory_info(step).get("captured")) if loaded.source == "memory" else False
    return step, loaded.source, captured, _numpy(_gpt.local_state(model, opt)), opt.param_groups[0]["lr"], lines


def _bad_input(directory: str, job: str) -> list[str]:
    """What each bad input raised (one rank's view: every rank raises the same)."""
    from megatron.core.optimizer import ChainedOptimizer, DistributedOptimizer

    from flashckpt import CheckpointError, StateMismatchError
    from flashckpt.megatron import MegatronCheckpointer

    model = _gpt.build(2)
    opt = _gpt.optimizer(model)
    _step(model, opt, 1)
    said = []

    def boom():
        raise ValueError("no state here")

    cases = [(boom, CheckpointError, ["state_fn() raised ValueError: no state here"]),
             (lambda: {"model": model.sharded_state_dict()}, StateMismatchError,
              ["another tree than save() got (missing: /", "/optimizer"])]  # rank 0: its common part first
    for i, (state_fn, error, words) in enumerate(cases):
        with MegatronCheckpointer(directory, job_id=f"{job}{i}") as ckpt:
            ckpt.save_on_failure(state_fn, optimizer=opt)
            with pytest.raises(error) as raised:
                ckpt.save(1, _gpt.state_of(model, opt))
            assert all(w in str(raised.value) for w in words), raised.value
            said.append(str(raised.value))
    assert not {"step", "step_with_ready_grads"} & set(vars(opt)), "close() left the step boundary on the optimizer"
    # the distributed optimizer (alone or chained): its state dict is gathered over the data-parallel group
    distributed = DistributedOptimizer.__new__(DistributedOptimizer)
    chained = ChainedOptimizer.__new__(ChainedOptimizer)
    chained.chained_optimizers = [opt, distributed]
    for optimizer in (distributed, chained):
        with MegatronCheckpointer(directory, job_id=f"{job}d") as ckpt:
            with pytest.raises(CheckpointError) as raised:
                ckpt.save_on_failure(lambda: _gpt.state_of(model, opt), optimizer=optimizer)
            assert "DistributedOptimizer" in str(raised.value) and "collective" in str(raised.value), raised.value
            said.append(str(raised.value))
    with MegatronCheckpointer(directory, job_id=f"{job}t") as ckpt, pytest.raises(TypeError, match="step"):
        ckpt.save_on_failure(lambda: _gpt.state_of(model, opt), optimizer=object())
    return said


def _inside_the_update(directory: str, job: str) -> tuple:
    """bf16: step 1, then a capture in step 2 between the torch step (the fp32 main parameters
    updated) and their copy into the bf16 model. (What it returned, the steps in memory
    after it, the log lines, the step count after step 2.)"""
    from flashckpt.megatron import MegatronCheckpointer

    lines: list[str] = []
    logged(lines)
    model = _gpt.build(2, dtype=torch.bfloat16)
    opt = _gpt.optimizer(model)
    with MegatronCheckpointer(directory, job_id=job) as ckpt:
        assert ckpt.load(_gpt.state_of(model, opt)) == (None, None)
        capture = ckpt.save_on_failure(lambda: _gpt.state_of(model, opt), optimizer=opt)
        _step(model, opt, 1)
        got: list = []
        copy_back = opt._copy_main_params_to_model_params

        def between() -> None:
            got.append(capture.capture("inside the update"))
            copy_back()

        opt._copy_main_params_to_model_params = between
        _step(model, opt, 2)
        return got, sorted(ckpt.engine.memory_steps()), lines, capture.current_step


def _restarts(rank: int, world: int, root: str, job: str) -> dict:
    """One new process pair for the restarts, the capture inside an update and the bad input
    (each process start imports megatron-core: seconds of CPU); each part's result, or its
    traceback."""
    import functools
    import traceback

    from megatron.core import parallel_state as ps

    out: dict = {}
    parts = (("sigterm", functools.partial(_restart, dtype=torch.float32), "a"),
             ("one", functools.partial(_restart, dtype=torch.float16), "b"),
             ("bf16", functools.partial(_restart, dtype=torch.bfloat16), "e"),
             ("inside", _inside_the_update, "f"), ("bad", _bad_input, "c"))
    for name, part, where in parts:
        try:
            out[name] = part(f"{root}/{name}", job + where)
        except Exception:
            out[name] = traceback.format_exc()
        finally:
            logging.getLogger("flashckpt").handlers.clear()
            ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """The three failing runs (SIGTERM in fp32 and in bf16, rank 0 killed in fp16), then one
    pair that restarts from each, captures inside an update and tries bad input."""
    root = str(tmp_path_factory.mktemp("mcap"))
    job = "t" + uuid.uuid4().hex[:12]
    try:
        at5 = run_ranks(_sigterm_in_backward, 2, f"{root}/sigterm", job + "a", torch.float32, timeout=240)
        at5_bf16 = run_ranks(_sigterm_in_backward, 2, f"{root}/bf16", job + "e", torch.bfloat16, timeout=240)
        with pytest.raises(AssertionError) as died:
            run_ranks(_rank_0_killed, 2, f"{root}/one", job + "b", torch.float16, timeout=240)
        assert "rank 0: exited with code -9 and no result" in str(died.value) and "rank 1" not in str(died.value), \
            died.value
        at2 = [dict(np.load(f"{root}/one-at2-{rank}.npz")) for rank in range(2)]
        yield {torch.float32: at5, torch.bfloat16: at5_bf16}, at2, run_ranks(_restarts, 2, root, job, timeout=240)
    finally:
        for path in glob.glob(job_prefix(job) + "*"):
            if not path.endswith((".sock", ".saver.lock")):
                os.unlink(path)


def _part(out: dict, name: str, rank: int):
    assert not isinstance(out[name], str), f"rank {rank}, {name}:\n{out[name]}"
    return out[name]


def _assert_equal(got: dict, want: dict, rank: int) -> None:
    assert sorted(got) == sorted(want), (rank, sorted(set(got) ^ set(want)))
    bad = [k for k in want if not (got[k] == want[k]).all()]
    assert not bad, f"rank {rank}: {bad}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype, part", [(torch.float32, "sigterm"), (torch.bfloat16, "bf16")])
def test_sigterm_in_backward_captures_the_last_step_and_the_restart_loads_it(ran, dtype, part):
    at5, _, restarts = ran
    for rank, out in enumerate(restarts):
        step, source, captured, state, lr, lines = _part(out, part, rank)
        assert (step, source, captured) == (5, "memory", True), (rank, lines)
        assert lr == 0.01
        _assert_equal(state, at5[dtype][rank], rank)
        if dtype == torch.bfloat16:  # the fp32 main parameters and their Adam moments are in it
            assert any(k.startswith("main.") for k in state) and any(k.startswith("exp_avg.") for k in state)


def test_a_capture_between_the_bf16_torch_step_and_the_copy_into_the_model_writes_nothing(ran):
    for rank, out in enumerate(ran[2]):
        got, steps, lines, step = _part(out, "inside", rank)
        assert got == [None] and steps == [], (rank, got, steps)
        said = [line for line in lines if "inside the update" in line]
        assert len(said) == 1 and "inside an optimizer update (step 1)" in said[0] and "nothing captured" in said[0], \
            (rank, lines)
        assert step == 2, rank


def test_a_capture_one_rank_lacks_falls_back_to_the_newest_save(ran):
    _, at2, restarts = ran
    for rank, out in enumerate(restarts):
        step, _, captured, state, _, _ = _part(out, "one", rank)
        assert (step, captured) == (2, False), rank
        _assert_equal(state, at2[rank], rank)
    lines = [_part(out, "one", rank)[5] for rank, out in enumerate(restarts)]
    said = [line for line in lines[0] if "captured" in line]
    assert len(said) == 1, lines[0]
    assert "step 5" in said[0] and "rank(s) 1" in said[0] and "loading step 2 from memory" in said[0] \
        and "rank(s) 0 hold no copy" in said[0], said
    assert not any("captured" in line for line in lines[1]), lines[1]


def test_bad_input_is_a_clear_error(ran):
    for rank, out in enumerate(ran[2]):
        assert len(_part(out, "bad", rank)) == 4, out["bad"]
