"""FSDP2 failure capture writes the state as of the step boundary (issue 42), 2 gloo ranks.

A capture taken after the main thread went on into step 4 (its batch drawn: the data
position moved; the RNGs used; its forward run: BatchNorm's running statistics moved) writes
step 3's data position and RNG states (``boundary_state``, laid over ``extra``) and step 3's
BatchNorm statistics (module buffers outside the optimizer, copied at each boundary). A
``boundary_state`` naming what ``extra`` lacks fails the first save.
"""

from __future__ import annotations

from tests._fork import run_ranks


def _make():
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _step(model, opt) -> None:
    import torch

    opt.zero_grad()
    model(torch.randn(8, 4)).square().mean().backward()
    opt.step()


def _capture_past_the_boundary(rank: int, world: int, directory: str, job: str) -> dict:
    import torch

    import flashckpt
    from flashckpt import StateMismatchError
    from flashckpt.torch import FsdpCheckpointer

    position = {"consumed": 0}

    def state() -> dict:
        return {"sampler": dict(position), "rng": flashckpt.rng_state()}

    out: dict = {}
    model, opt = _make()
    with FsdpCheckpointer(directory, job_id=job, persist_every=100) as ckpt:
        assert ckpt.load(model, opt) is None
        capture = ckpt.save_on_failure(state, optimizer=opt, boundary_state=state)
        for _ in range(3):
            position["consumed"] += 8  # the batch is drawn
            _step(model, opt)
        at3 = {"sampler": dict(position), "torch": torch.get_rng_state(),
               "buffers": {name: b.clone() for name, b in model.named_buffers()}}
        position["consumed"] += 8  # step 4: its batch drawn, the RNG used, its forward run
        model(torch.randn(8, 4))
        out["moved"] = not torch.equal(model[1].running_mean, at3["buffers"]["1.running_mean"])
        out["captured"] = capture.capture("test")
    model2, opt2 = _make()
    with FsdpCheckpointer(directory, job_id=job) as ckpt:
        out["loaded"] = ckpt.load(model2, opt2)
        extra = ckpt.extra
    out["sampler"] = (extra["sampler"], at3["sampler"])
    out["rng"] = torch.equal(extra["rng"]["torch"], at3["torch"])
    out["buffers"] = [name for name, b in model2.named_buffers() if not torch.equal(b, at3["buffers"][name])]
    with FsdpCheckpointer(f"{directory}-bad", job_id=f"{job}b") as ckpt:
        ckpt.load(model2, opt2)
        ckpt.save_on_failure(state, optimizer=opt2, boundary_state=lambda: {"epoch": 1})
        _step(model2, opt2)
        try:
            ckpt.save(1, model2, opt2, extra=state())
        except StateMismatchError as exc:
            out["mismatch"] = str(exc)
    return out


def test_a_capture_past_the_boundary_writes_the_boundary_state(tmp_path, job_id):
    for rank, out in enumerate(run_ranks(_capture_past_the_boundary, 2, str(tmp_path / "ckpt"), job_id,
                                         timeout=120)):
        assert out["moved"] and out["captured"] == 3 and out["loaded"] == 3, (rank, out)
        assert out["sampler"] == ({"consumed": 24}, {"consumed": 24}), (rank, out["sampler"])
        assert out["rng"], rank
        assert out["buffers"] == [], (rank, out["buffers"])
        assert "boundary_state" in out.get("mismatch", "") and "/epoch" in out["mismatch"], (rank, out)
