"""A capture holds the state as of the step boundary: data position, RNG states and the
buffers that ``forward`` changes (BatchNorm statistics) of step k, though the main thread
went on into step k+1 (drew its batch, used the RNGs, ran its forward) before the failure."""

from __future__ import annotations

import copy
import os
import random
import signal

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import flashckpt
from flashckpt import StateMismatchError
from flashckpt.torch import Checkpointer

from .._fork import Forked, run_script
from . import _train_boundary as job

SCRIPT = os.path.join(os.path.dirname(__file__), "_train_boundary.py")
STEPS = 32  # two epochs of 16 batches; saves at 8, 16, 24, ...


def _run(tmp_path, attempt: int, *fail: int) -> tuple[int, str]:
    proc = Forked(run_script, SCRIPT, [str(tmp_path / "ckpt"), str(tmp_path), str(STEPS), str(attempt),
                                        *map(str, fail)])
    code = proc.wait(90)
    return code, proc.stderr.read() + f"\n[exit {code}]"


def test_restart_from_a_capture_past_the_boundary_runs_as_if_uninterrupted(tmp_path):
    """SIGTERM inside step 22's backward, the main thread blocked in C++: the watcher thread
    captures step 21; the restart loads it and trains the same batches, in the same order,
    with the same dropout and noise, to the same weights and BatchNorm statistics as one
    uninterrupted run."""
    model, opt, sampler, loader = job.make()
    order = job.train(model, opt, sampler, loader, 0, STEPS)
    reference = model.state_dict()

    code, err = _run(tmp_path, 0, 22)
    assert code in (-signal.SIGTERM, 128 + signal.SIGTERM), err
    assert "captured step 21" in err and "watcher thread" in err, err
    code, err = _run(tmp_path, 1)
    assert code == 0, err
    result = torch.load(tmp_path / "attempt1.pt")
    assert result["loaded"] == 21, err
    assert result["order"] == order[21:]
    for name, value in reference.items():
        assert torch.equal(result["model"][name], value), name


def _bn_job():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model, opt) -> None:
    opt.zero_grad()
    model(torch.randn(8, 4)).square().mean().backward()
    opt.step()


def test_forward_changed_buffers_are_captured_as_of_the_boundary(tmp_path, job_id):
    """Without ``boundary_state`` (the existing call): a capture after step 3, with step 4's
    forward run, writes step 3's BatchNorm statistics, not those of the forward after it."""
    model, opt = _bn_job()
    with Checkpointer(tmp_path, job_id=job_id, persist_every=1000) as ckpt:
        capture = ckpt.save_on_failure(lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
                                       optimizer=opt)
        for _ in range(3):
            _step(model, opt)
        at_boundary = {k: v.clone() for k, v in model.state_dict().items()}
        model(torch.randn(8, 4))  # step 4's forward
        assert not torch.equal(model.state_dict()["1.running_mean"], at_boundary["1.running_mean"])
        assert capture.capture("test") == 3
    model2, opt2 = _bn_job()
    with Checkpointer(tmp_path, job_id=job_id) as ckpt:
        assert ckpt.load({"model": model2.state_dict(), "optim": opt2.state_dict()}) == 3
    for name, value in model2.state_dict().items():
        assert torch.equal(value, at_boundary[name]), name


@pytest.mark.parametrize("workers", [0, 2])
def test_boundary_state_gives_the_sampler_and_rng_of_the_boundary(tmp_path, job_id, workers):
    """``boundary_state``'s values as of the last boundary replace the live ones: the
    sampler's position before the next batch was drawn, the RNG states before they were used.
    With two prefetching workers through ``CountingLoader``, which counts what the loop got."""
    from elastic import CountingLoader

    model, opt, sampler, loader = job.make()
    if workers:
        loader = CountingLoader(DataLoader(loader.dataset, job.BATCH, sampler=sampler, num_workers=workers,
                                           generator=torch.Generator()))

    def state():
        return {"model": model.state_dict(), "optim": opt.state_dict(), "sampler": sampler.state_dict(),
                "rng": flashckpt.rng_state()}

    with Checkpointer(tmp_path, job_id=job_id, persist_every=1000) as ckpt:
        capture = ckpt.save_on_failure(state, optimizer=opt, boundary_state=lambda: {
            "sampler": sampler.state_dict(), "rng": flashckpt.rng_state()})
        seen = {}

        def at(step: int) -> None:
            if step == 5:
                seen["state"] = {"sampler": sampler.state_dict(), "torch": torch.get_rng_state(),
                                 "python": random.getstate(), "numpy": np.random.get_state()[1].copy()}
            if step == 6:
                seen["captured"] = capture.capture("inside step 6's backward")

        job.train(model, opt, sampler, loader, 0, 6, in_backward=at)
        assert seen["captured"] == 5
    model2, opt2, sampler2, _ = job.make()
    loaded = {"model": model2.state_dict(), "optim": opt2.state_dict(), "sampler": sampler2.state_dict(),
              "rng": flashckpt.rng_state()}
    with Checkpointer(tmp_path, job_id=job_id) as ckpt:
        assert ckpt.load(loaded) == 5
    assert loaded["sampler"] == seen["state"]["sampler"]
    assert loaded["sampler"]["segments"][-1]["consumed"] == 5 * job.BATCH
    flashckpt.set_rng_state(loaded["rng"])
    assert torch.equal(torch.get_rng_state(), seen["state"]["torch"])
    assert random.getstate() == seen["state"]["python"]
    assert np.array_equal(np.random.get_state()[1], seen["state"]["numpy"])


def test_boundary_state_not_in_the_tree_fails_the_first_save(tmp_path, job_id):
    model, opt = _bn_job()
    with Checkpointer(tmp_path, job_id=job_id) as ckpt:
        ckpt.save_on_failure(lambda: {"model": model.state_dict()}, optimizer=opt,
                             boundary_state=lambda: {"sampler": {"consumed": 3}})
        _step(model, opt)
        with pytest.raises(StateMismatchError, match="boundary_state.*sampler"):
            ckpt.save(1, {"model": model.state_dict()})


def test_a_load_forgets_what_the_last_boundary_kept():
    """A rollback (a load of step 2 after step 4) replaces the state that step 4's boundary
    kept: a capture of the loaded step, saved again before any update (what a replicated
    state's capture writes where the node lacks it), writes the loaded statistics."""
    from types import SimpleNamespace

    from flashckpt._capture import FailureCapture

    model, opt = _bn_job()
    state = lambda: {"model": model.state_dict(), "optim": opt.state_dict()}  # noqa: E731
    written, last = {}, [None]
    capture = FailureCapture(state, opt, save=lambda step, tree: written.update({step: copy.deepcopy(tree)}),
                             last_load=lambda: last[0])
    for _ in range(4):
        _step(model, opt)
    loaded = {k: torch.rand_like(v) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    with capture.loading():  # the load of step 2, in place
        for name, value in model.state_dict().items():
            value.copy_(loaded[name])
        last[0] = SimpleNamespace(step=2)
    with capture.saving(2, state()):
        pass
    assert capture.capture("test") == 2
    for name, value in written[2]["model"].items():
        assert torch.equal(value, loaded[name]), name


def test_module_buffers_kept_for_an_adapter_save_within_the_bound(caplog):
    """``ModuleBuffers`` (DeepSpeed's and the Trainer's captures, whose own saves build the
    tree): the buffers kept at the boundary replace their views anywhere in a tree, the live
    ones and the caller's tree untouched, and a tree without them (copies) is warned about; past
    max(4 MiB, 1% of the optimizer's bytes, a wrapper looked through) none is kept, with the
    warning."""
    from types import SimpleNamespace

    from flashckpt._boundary import BoundarySnapshot, ModuleBuffers

    model, opt = _bn_job()
    snapshot = BoundarySnapshot(dict, None, None, buffers=ModuleBuffers(model, SimpleNamespace(optimizer=opt)))
    _step(model, opt)
    snapshot.take()
    at_boundary = {k: v.clone() for k, v in model[1].state_dict().items()}
    model(torch.randn(8, 4))
    moved = model[1].running_mean.clone()
    tree = {"files": {"m.pt": {"module": model.state_dict()}}, "tuple": (model[1].running_var,)}
    got = snapshot.swap(tree)
    for name, value in at_boundary.items():
        assert torch.equal(got["files"]["m.pt"]["module"][f"1.{name}"], value), name
    assert torch.equal(got["tuple"][0], at_boundary["running_var"])
    assert got["files"]["m.pt"]["module"]["0.weight"] is tree["files"]["m.pt"]["module"]["0.weight"]
    assert torch.equal(model[1].running_mean, moved)  # the live statistics are the forward's
    assert torch.equal(tree["files"]["m.pt"]["module"]["1.running_mean"], moved)
    with caplog.at_level("WARNING", logger="flashckpt"):  # a save that copied the buffers: said, not silent
        snapshot.swap({"m": {k: v.clone() for k, v in model.state_dict().items()}})
    assert "3 of the module's 3 buffer(s) are not in the tree the capture writes" in caplog.text
    caplog.clear()

    big = torch.nn.Module()
    big.register_buffer("ema", torch.zeros(1200, 1024))  # 4.7 MiB, past 4 MiB and 1% of the optimizer's
    snapshot = BoundarySnapshot(dict, None, None, buffers=ModuleBuffers(big, opt))
    with caplog.at_level("INFO", logger="flashckpt"):
        snapshot.take()
    assert "the module's 1 buffer(s) hold 4.7 MiB" in caplog.text and "none is" in caplog.text
    big.ema.add_(1)
    assert snapshot.swap({"ema": big.ema})["ema"] is big.ema


def test_frozen_parameters_are_not_copied_at_every_boundary(tmp_path, job_id, caplog):
    """Tensors outside the optimizer past max(4 MiB, 1% of its bytes) -- a frozen layer of
    4.3 MiB here -- are not copied at each boundary: a warning says so, and a capture writes
    them as they are."""
    torch.manual_seed(0)
    frozen, head = torch.nn.Linear(1024, 1100), torch.nn.Linear(1100, 1)
    frozen.requires_grad_(False)
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    state = lambda: {"frozen": frozen.state_dict(), "head": head.state_dict()}  # noqa: E731
    with Checkpointer(tmp_path, job_id=job_id, persist_every=1000) as ckpt:
        capture = ckpt.save_on_failure(state, optimizer=opt)
        with caplog.at_level("INFO", logger="flashckpt"):
            opt.zero_grad()
            head(frozen(torch.ones(2, 1024))).sum().backward()
            opt.step()
        assert "outside the optimizer hold 4.3 MiB (frozen parameters?)" in caplog.text
        assert "copied at each step boundary" in caplog.text and "module buffers" not in caplog.text
        assert capture.capture("test") == 1


def test_a_buffer_boundary_state_gives_is_written_without_a_warning(tmp_path, job_id, caplog):
    """A module buffer both copied at the boundary and given by ``boundary_state``: a capture
    writes ``boundary_state``'s copy and does not call it replaced."""
    model, opt = _bn_job()
    state = lambda: {"model": model.state_dict(), "optim": opt.state_dict()}  # noqa: E731
    with Checkpointer(tmp_path, job_id=job_id, persist_every=1000) as ckpt:
        capture = ckpt.save_on_failure(state, optimizer=opt,
                                       boundary_state=lambda: {"model": {"1.running_mean": model[1].running_mean}})
        _step(model, opt)
        at_boundary = model[1].running_mean.clone()
        model(torch.randn(8, 4))
        with caplog.at_level("WARNING", logger="flashckpt"):
            assert capture.capture("test") == 1
        assert "no longer the tensor" not in caplog.text, caplog.text
    model2, opt2 = _bn_job()
    with Checkpointer(tmp_path, job_id=job_id) as ckpt:
        assert ckpt.load({"model": model2.state_dict(), "optim": opt2.state_dict()}) == 1
    assert torch.equal(model2[1].running_mean, at_boundary)


def test_a_method_that_raises_as_an_update_begins_leaves_the_step_capturable():
    """``on_update_begins`` methods run in the optimizer's pre-hook: one that raises (a
    coordinator that cannot be reached) fails ``optimizer.step()`` before any parameter
    changed, so a capture afterwards still writes the last finished step."""
    from flashckpt import _capture

    model, opt = _bn_job()
    written = {}
    capture = _capture.FailureCapture(lambda: {"model": model.state_dict()}, opt, last_load=lambda: None,
                                      save=lambda step, tree: written.update({step: copy.deepcopy(tree)}))

    class Unreachable:
        def update_begins(self) -> None:
            raise ConnectionError("the coordinator is down")

    unreachable = Unreachable()
    _step(model, opt)
    _capture.on_update_begins(unreachable.update_begins)
    with pytest.raises(ConnectionError):
        _step(model, opt)
    assert capture.capture("test") == 1
    assert torch.equal(written[1]["model"]["0.weight"], model.state_dict()["0.weight"])
