"""Failure capture of a megatron-core GPTModel writes the state as of the step boundary
(issue 42), one gloo rank (TP=1), megatron-core's FP32Optimizer; the module buffer also with
a bf16 and an fp16 model under ``Float16OptimizerWithFloat16Params`` and a bf16 one under a
``ChainedOptimizer`` of two of them.

A capture after the main thread went past step 3's boundary (step 4's batch drawn: the data
position in the common part moved; the RNG used: the ``ShardedObject`` of the RNG states
changed) writes step 3's values that ``boundary_state`` gave, and step 3's value of a module
buffer that step 4's forward moved (found in the sharded state dict, outside what the
wrapper's update owns), the live one left as it is. A ``boundary_state`` naming what the
sharded state dict lacks fails the first save. Under the fp16/bf16 optimizer and the chained
one, the buffer is the one tensor found outside the update (the fp16/bf16 model parameters, the
fp32 main ones and their Adam moments, of every member, are the update's).
"""

from __future__ import annotations

import pytest
import torch

from tests._fork import run_ranks

from . import _gpt

pytest.importorskip("megatron.core")


def _capture_past_the_boundary(rank: int, world: int, directory: str, job: str) -> dict:
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    import flashckpt
    from flashckpt import StateMismatchError
    from flashckpt.megatron import MegatronCheckpointer

    position, out = {"consumed": 0}, {}

    def boundary() -> dict:
        return {"data": dict(position), "rng": ShardedObject("rng_state", flashckpt.rng_state(), (1,), (0,))}

    def state(model, opt, loading: bool = False) -> dict:
        return {**_gpt.state_of(model, opt, loading=loading), **boundary()}

    def step(model, opt, n: int) -> None:
        opt.zero_grad()
        model.seen.add_(1)  # its forward
        _gpt.loss(model, n).backward()
        opt.step()

    model = _gpt.build(1)
    model.register_buffer("seen", torch.zeros(4))  # a buffer forward changes (attention's needs CUDA: step adds 1)
    opt = _gpt.optimizer(model)
    with MegatronCheckpointer(directory, job_id=job, persist_every=100) as ckpt:
        assert ckpt.load(state(model, opt)) == (None, None)
        capture = ckpt.save_on_failure(lambda: state(model, opt), optimizer=opt, boundary_state=boundary)
        for n in range(1, 4):
            position["consumed"] += 8  # the batch is drawn
            step(model, opt, n)
        at3 = {"data": dict(position), "torch": torch.get_rng_state(), "seen": model.seen.clone()}
        position["consumed"] += 8  # step 4: its batch drawn, the RNG used, its forward run
        torch.rand(3)
        model.seen.add_(1)
        out["captured"] = capture.capture("test")
        out["live_seen"] = model.seen.clone()
    with MegatronCheckpointer(directory, job_id=job) as ckpt:
        loaded, out["loaded"] = ckpt.load(state(model, opt, loading=True))
        seen = loaded["model"]["seen"].clone()  # the model's own buffer, which the next step moves
    out["data"] = (loaded["data"], at3["data"])
    out["rng"] = torch.equal(loaded["rng"]["torch"], at3["torch"])
    out["seen"] = (seen, at3["seen"])
    with MegatronCheckpointer(f"{directory}-bad", job_id=f"{job}b") as ckpt:
        ckpt.save_on_failure(lambda: state(model, opt), optimizer=opt, boundary_state=lambda: {"epoch": 1})
        step(model, opt, 1)
        try:
            ckpt.save(1, state(model, opt))
        except StateMismatchError as exc:
            out["mismatch"] = str(exc)
    ps.destroy_model_parallel()
    return out


def test_a_capture_past_the_boundary_writes_the_boundary_state(tmp_path, job_id):
    out, = run_ranks(_capture_past_the_boundary, 1, str(tmp_path / "ckpt"), job_id, timeout=180)
    assert out["captured"] == 3 and out["loaded"] == 3, out
    assert out["data"] == ({"consumed": 24}, {"consumed": 24}), out["data"]
    assert out["rng"]
    assert torch.equal(*out["seen"]) and out["seen"][1].tolist() == [3.0] * 4, out["seen"]  # the buffer of step 3
    assert out["live_seen"].tolist() == [4.0] * 4  # the live one left as it is
    assert "boundary_state" in out.get("mismatch", "") and "epoch" in out["mismatch"], out


def _buffer_under(kind: str, directory: str, job: str) -> dict:
    """A bf16 model (fp16 for "fp16") with a buffer of its dtype that each forward moves,
    ``kind``'s optimizer ("bf16", "fp16": megatron's fp16/bf16 one; "chained": two bf16 ones
    chained): steps 1-3, step 4's forward, a capture, then a load of it."""
    from megatron.core import parallel_state as ps

    from flashckpt.megatron import MegatronCheckpointer
    from tests.capture._blocked import logged

    lines: list[str] = []
    logged(lines)
    dtype = torch.float16 if kind == "fp16" else torch.bfloat16
    model = _gpt.build(1, dtype=dtype)
    model.register_buffer("seen", torch.zeros(4, dtype=dtype))
    opt = _gpt.chained(model) if kind == "chained" else _gpt.optimizer(model)
    out: dict = {"kind": type(opt).__name__, "dtype": dtype}
    first = {name: p.detach().clone() for name, p in model.named_parameters()}
    with MegatronCheckpointer(directory, job_id=job, persist_every=100) as ckpt:
        assert ckpt.load(_gpt.state_of(model, opt)) == (None, None)
        capture = ckpt.save_on_failure(lambda: _gpt.state_of(model, opt), optimizer=opt)
        for n in range(1, 4):
            opt.zero_grad()
            model.seen.add_(1)  # its forward
            opt.scale_loss(_gpt.loss(model, n)).backward()  # fp16: by 1024
            with _gpt.on_cpu():  # the chained optimizer's gradient norm
                opt.step()
        model.seen.add_(1)  # step 4's forward
        out["captured"] = capture.capture("test")
        out["live"] = model.seen.clone()
    out["stepped"] = sorted({name.split(".")[0] for name, p in model.named_parameters() if not p.equal(first[name])})
    with MegatronCheckpointer(directory, job_id=job) as ckpt:
        loaded, out["loaded"] = ckpt.load(_gpt.state_of(model, opt, loading=True))
        out["seen"] = loaded["model"]["seen"].clone()
    out["found"] = [line for line in lines if "outside the optimizer" in line]
    ps.destroy_model_parallel()
    return out


def _buffers_under_kinds(rank: int, world: int, directory: str, job: str) -> list[dict]:
    return [_buffer_under(kind, f"{directory}-{kind}", f"{job}{kind}") for kind in ("bf16", "fp16", "chained")]


def test_a_buffer_under_the_fp16_bf16_and_the_chained_optimizer_is_captured_as_of_the_boundary(tmp_path, job_id):
    """One process for all three (each process start imports megatron-core: seconds of CPU)."""
    outs = run_ranks(_buffers_under_kinds, 1, str(tmp_path / "ckpt"), job_id, timeout=180)[0]
    assert [(out["kind"], out["dtype"]) for out in outs] == [
        ("Float16OptimizerWithFloat16Params", torch.bfloat16), ("Float16OptimizerWithFloat16Params", torch.float16),
        ("ChainedOptimizer", torch.bfloat16)]
    for out in outs:
        assert out["captured"] == 3 and out["loaded"] == 3, out
        assert out["stepped"] == ["decoder", "embedding", "output_layer"], out  # every member updated
        assert out["seen"].dtype == out["dtype"] and out["seen"].tolist() == [3.0] * 4, out  # step 3's
        assert out["live"].tolist() == [4.0] * 4, out  # the live one left as it is
        assert len(out["found"]) == 1 and "failure capture: 1 tensor(s)" in out["found"][0], out["found"]
