"""Rank functions for the FSDP tests (run by ``tests._fork.run_ranks``).

Spawning a gloo group costs seconds on a loaded 2-core machine, so each function runs
several checks in one group and returns ``{check name: "ok" or the traceback}``; the
tests assert on those entries one by one.
"""

from __future__ import annotations

import os
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from ._fsdp_common import assert_equal_states, full_state, local_state, make, train_step


def run_checks(checks: list[tuple[str, Callable[[], Any]]]) -> dict[str, str]:
    """Run each check on this rank; stop at the first failure on any rank (the others
    would wait in a collective the failed rank never reaches)."""
    results: dict[str, str] = {}
    for name, check in checks:
        try:
            check()
            results[name] = "ok"
        except Exception:  # reported to the test, which fails with the traceback
            results[name] = traceback.format_exc()
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, results[name] == "ok")
        if not all(everyone):
            break
    return results


class LoadEvents:
    def __init__(self) -> None:
        from flashckpt import _events
        self.loads: list[dict] = []
        _events.subscribe(lambda event, **info: self.loads.append(info) if event == "load" else None)

    @property
    def last(self) -> dict:
        return self.loads[-1]


def _expect_error(fn: Callable[[], Any], cls: type, *fragments: str) -> str:
    try:
        fn()
    except cls as exc:
        message = str(exc)
        for fragment in fragments:
            assert fragment in message, f"{fragment!r} not in: {message}"
        return message
    raise AssertionError(f"no {cls.__name__} raised")


# -- the operations a plan is made of ---------------------------------------------------

def round_trip(rank: int, root: str, job: str, fsdp: int) -> None:
    """Save, then load from memory and from storage into other weights; continue training."""
    from flashckpt.torch import FsdpCheckpointer
    events = LoadEvents()
    directory = os.path.join(root, f"same{fsdp}")
    model, opt = make(0, fsdp=fsdp)
    with FsdpCheckpointer(directory, job_id=f"{job}s{fsdp}") as ck:
        assert ck.load(model, opt) is None  # nothing saved yet: a fresh start
        for step in range(1, 4):
            train_step(model, opt, rank, step)
        ck.save(3, model, opt, extra={"sampler": {"epoch": 0, "pos": 24 + rank}}, persist=True)
        saved = local_state(model, opt)
        reference = [train_step(model, opt, rank, step) for step in (4, 5)]  # the uninterrupted run
        final = local_state(model, opt)
        ck.wait()

        restored, restored_opt = make(1, fsdp=fsdp, lr=0.5)  # other weights, other lr
        assert ck.load(restored, restored_opt) == 3
        assert events.last["source"] == "memory"
        assert_equal_states(local_state(restored, restored_opt), saved, "from memory: ")
        assert ck.extra == {"sampler": {"epoch": 0, "pos": 24 + rank}}
        assert restored_opt.param_groups[0]["lr"] == 0.01
        assert [train_step(restored, restored_opt, rank, step) for step in (4, 5)] == reference
        assert_equal_states(local_state(restored, restored_opt), final, "continued: ")

    with FsdpCheckpointer(directory, job_id=f"{job}s{fsdp}b") as other:  # a new job: nothing in memory
        restored, restored_opt = make(2, fsdp=fsdp)
        assert other.load(restored, restored_opt) == 3
        assert events.last["source"] == "storage" and not events.last.get("resharded")
        assert_equal_states(local_state(restored, restored_opt), saved, "from storage: ")
        assert [train_step(restored, restored_opt, rank, step) for step in (4, 5)] == reference


def model_only(rank: int, root: str, job: str) -> None:
    from flashckpt import StateMismatchError
    from flashckpt.torch import FsdpCheckpointer
    model, opt = make(0)
    train_step(model, opt, rank, 1)
    with FsdpCheckpointer(os.path.join(root, "model-only"), job_id=f"{job}m") as ck:
        ck.save(1, model, opt, persist=True)
        ck.save(2, model, persist=True)  # without the optimizer
        ck.wait()
        fresh, fresh_opt = make(3)
        assert ck.load(fresh, step=1) == 1  # the model alone, from a step with optimizer state
        assert_equal_states(local_state(fresh, fresh_opt)["model"], local_state(model, opt)["model"])
        assert ck.load(fresh) == 2
        _expect_error(lambda: ck.load(fresh, fresh_opt), StateMismatchError, "step 2", "holds no optimizer state")


def fresh_optimizer(rank: int, root: str, job: str) -> None:
    """A save before the optimizer's first step leaves it fresh (get_state_dict would
    have stepped it), and loading that step makes another optimizer fresh again."""
    from flashckpt.torch import FsdpCheckpointer
    reference, reference_opt = make(0)
    expected = [train_step(reference, reference_opt, rank, step) for step in (1, 2)]
    model, opt = make(0, lr=0.01)
    with FsdpCheckpointer(os.path.join(root, "fresh"), job_id=f"{job}f") as ck:
        ck.save(0, model, opt, persist=True)
        assert not opt.state
        assert [train_step(model, opt, rank, step) for step in (1, 2)] == expected
        other, other_opt = make(4, lr=0.5)
        train_step(other, other_opt, rank, 1)  # has state, which the fresh step 0 must clear
        assert ck.load(other, other_opt, step=0) == 0
        assert not other_opt.state and other_opt.param_groups[0]["lr"] == 0.01
        assert [train_step(other, other_opt, rank, step) for step in (1, 2)] == expected


def repeated_saves(rank: int, root: str, job: str) -> None:
    """Every save reads the live state: more training, a scheduler's new learning rate,
    then a new optimizer (new state tensors) with no load between the saves."""
    from flashckpt.torch import FsdpCheckpointer
    model, opt = make(0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with FsdpCheckpointer(os.path.join(root, "repeated"), job_id=f"{job}r") as ck:
        for step in range(1, 4):
            train_step(model, opt, rank, step)
            sched.step()
            ck.save(step, model, opt, extra={"step": step})
        at3 = local_state(model, opt)
        opt = torch.optim.AdamW(model.parameters(), lr=0.2)
        train_step(model, opt, rank, 4)
        ck.save(4, model, opt, extra={"step": 4})
        at4 = local_state(model, opt)

        other, other_opt = make(5)
        assert ck.load(other, other_opt, step=3) == 3 and ck.extra == {"step": 3}
        assert_equal_states(local_state(other, other_opt), at3, "step 3: ")
        assert other_opt.param_groups[0]["lr"] == 0.01 * 0.5 ** 3
        assert ck.load(other, other_opt) == 4 and ck.extra == {"step": 4}
        assert_equal_states(local_state(other, other_opt), at4, "step 4, new optimizer: ")
        assert other_opt.param_groups[0]["lr"] == 0.2


def bad_input(rank: int, root: str, job: str) -> None:
    from flashckpt import StateMismatchError
    from flashckpt.torch import FsdpCheckpointer
    model, opt = make(0)
    train_step(model, opt, rank, 1)
    with FsdpCheckpointer(os.path.join(root, "bad"), job_id=f"{job}x") as ck:
        ck.save(1, model, opt, persist=True)
        ck.wait()
        bigger, bigger_opt = make(0, extra_layer=True)
        _expect_error(lambda: ck.load(bigger, bigger_opt), StateMismatchError,
                      "only in state: ['more.weight', 'more.bias']")
        wider, wider_opt = make(0, hidden=14)
        _expect_error(lambda: ck.load(wider, wider_opt), StateMismatchError,
                      "model/l1.weight: checkpoint has global shape [13, 6], state has [14, 6]",
                      "model/norm.weight", "optim/state/l1.weight/exp_avg")
        assert ck.load(model, opt) == 1  # a failed load leaves the checkpointer usable
    with FsdpCheckpointer(os.path.join(root, "bad2"), job_id=f"{job}y") as ck:
        bigger, bigger_opt = make(0, extra_layer=True)
        train_step(bigger, bigger_opt, rank, 1)
        ck.save(1, bigger, bigger_opt, persist=True)
        _expect_error(lambda: ck.load(model, opt), StateMismatchError,
                      "only in checkpoint: ['more.weight', 'more.bias']")


def capture_bad_input(rank: int, root: str, job: str) -> None:
    """save_on_failure before any load or save names a model, with another optimizer than
    the loaded one, and on FSDP1 (whose sharded state dict is collective): clear errors."""
    from flashckpt import CheckpointError
    from flashckpt.torch import FsdpCheckpointer
    model, opt = make(0)
    with FsdpCheckpointer(os.path.join(root, "capture-bad"), job_id=f"{job}c") as ck:
        _expect_error(lambda: ck.save_on_failure(dict, optimizer=opt), CheckpointError,
                      "save_on_failure", "load(model, optimizer)")
        ck.load(model, opt)
        other = torch.optim.SGD(model.parameters(), lr=0.1)
        _expect_error(lambda: ck.save_on_failure(dict, optimizer=other), ValueError, "not the optimizer")
        _expect_error(lambda: ck.save_on_failure(dict, optimizer=opt, steps_per_update=0), ValueError,
                      "steps_per_update must be >= 1")
        ck.load(model)
        _expect_error(lambda: ck.save_on_failure(dict, optimizer=opt), ValueError, "not the optimizer")
    v1, v1_opt = make(0, fsdp=1)
    with FsdpCheckpointer(os.path.join(root, "capture-bad1"), job_id=f"{job}c1") as ck:
        ck.load(v1, v1_opt)
        _expect_error(lambda: ck.save_on_failure(dict, optimizer=v1_opt), CheckpointError, "FSDP1", "collective")


def capture_accumulate(rank: int, root: str, job: str) -> None:
    """steps_per_update=4 (gradient accumulation, saves in micro-batches): two updates after
    save(0) fit save(8); the step is 12 one update later. The fresh optimizer's step that
    get_state_dict makes inside each save(0) is no update (no warning, the count stays)."""
    import logging

    from flashckpt.torch import FsdpCheckpointer
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("flashckpt").addHandler(handler)
    model, opt = make(0)
    with FsdpCheckpointer(os.path.join(root, "capture-accum"), job_id=f"{job}ca") as ck:
        assert ck.load(model, opt) is None
        capture = ck.save_on_failure(lambda: {"n": rank}, optimizer=opt, steps_per_update=4)
        ck.save(0, model, opt, extra={"n": rank})
        ck.save(0, model, opt, extra={"n": rank})  # from a saved step now: the fresh optimizer's step is checked
        assert not opt.state and capture.current_step == 0, capture.current_step
        for step in (1, 2):
            train_step(model, opt, rank, step)
        ck.save(8, model, opt, extra={"n": rank})
        train_step(model, opt, rank, 3)
        assert capture.current_step == 12, capture.current_step
    logging.getLogger("flashckpt").removeHandler(handler)
    assert not any("steps_per_update" in line for line in lines), lines


def save(rank: int, world: int, root: str, job: str, name: str, fsdp: int = 2, seed: int = 0,
         dcp_dir: str | None = None, mesh: tuple[int, int] | None = None) -> None:
    """Train 3 steps, save step 3 to ``root/name`` (and with DCP to ``dcp_dir``); the
    consolidated originals go to ``root/name.pt``."""
    from flashckpt.torch import FsdpCheckpointer
    model, opt = make(seed, fsdp=fsdp, mesh=mesh)
    for step in range(1, 4):
        train_step(model, opt, rank, step)
    with FsdpCheckpointer(os.path.join(root, name), job_id=f"{job}{name}") as ck:
        ck.save(3, model, opt, extra={"world": world}, persist=True)
    full = full_state(model, opt)
    if rank == 0:
        torch.save(full, os.path.join(root, f"{name}.pt"))
    if dcp_dir is not None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
        msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=False))
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)


def load(rank: int, world: int, root: str, job: str, name: str, fsdp: int = 2) -> None:
    """Load ``root/name`` resharded onto this world; equal to its originals exactly,
    reading exactly the bytes of this rank's new shards."""
    from flashckpt.torch import FsdpCheckpointer
    events = LoadEvents()
    originals = torch.load(os.path.join(root, f"{name}.pt"))
    model, opt = make(5, fsdp=fsdp, lr=0.5)
    with FsdpCheckpointer(os.path.join(root, name), job_id=f"{job}{name}{world}") as ck:
        assert ck.load(model, opt) == 3
        assert events.last["source"] == "storage" and events.last["resharded"]
        mine = local_state(model, opt)
        tensors = list(mine["model"].values()) + [t for st in mine["optim"].values() for t in st.values()]
        needed = sum(t.numel() * t.element_size() for t in (x for t in tensors for x in (t if isinstance(t, list) else [t])))
        assert events.last["bytes_read"] == needed, (events.last["bytes_read"], needed)
    assert_equal_states(full_state(model, opt), originals, f"{name} on {world} ranks: ")


def mismatch(rank: int, world: int, root: str, job: str, name: str) -> None:
    """A model with an extra layer: the error lists its keys (resharding path)."""
    from flashckpt import StateMismatchError
    from flashckpt.torch import FsdpCheckpointer
    bigger, bigger_opt = make(0, extra_layer=True)
    with FsdpCheckpointer(os.path.join(root, name), job_id=f"{job}bad{world}") as ck:
        _expect_error(lambda: ck.load(bigger, bigger_opt), StateMismatchError,
                      "only in state: ['more.weight', 'more.bias']")


def damaged(rank: int, world: int, root: str, job: str, name: str) -> None:
    """A truncated shard and a missing shard of the step being resharded: clear errors
    naming the file, on every rank."""
    import shutil

    from flashckpt import CheckpointNotFoundError, CorruptCheckpointError
    from flashckpt.torch import FsdpCheckpointer
    copy = os.path.join(root, f"{name}-damaged-{world}")
    if rank == 0:
        shutil.copytree(os.path.join(root, name), copy)
        shard = os.path.join(copy, "step-3", "rank-2.safetensors")
        os.truncate(shard, os.path.getsize(shard) - 100)
    dist.barrier()
    model, opt = make(5)
    with FsdpCheckpointer(copy, job_id=f"{job}dmg{world}") as ck:
        _expect_error(lambda: ck.load(model, opt), CorruptCheckpointError, "rank-2.safetensors", "truncated")
        dist.barrier()
        if rank == 0:
            shutil.copy(os.path.join(root, name, "step-3", "rank-2.safetensors"), os.path.join(copy, "step-3"))
            os.unlink(os.path.join(copy, "step-3", "rank-3.safetensors"))
        dist.barrier()
        _expect_error(lambda: ck.load(model, opt), CheckpointNotFoundError, "rank-3.safetensors")


OPS = {"round_trip": round_trip, "model_only": model_only, "fresh_optimizer": fresh_optimizer,
       "repeated_saves": repeated_saves, "bad_input": bad_input,
       "capture_bad_input": capture_bad_input, "capture_accumulate": capture_accumulate}
WORLD_OPS = {"save": save, "load": load, "mismatch": mismatch, "damaged": damaged}


def run_plan(rank: int, world: int, root: str, job: str, plan: list[tuple[str, str, dict]]) -> dict[str, str]:
    """Run ``(check name, operation, keyword arguments)`` in order on every rank."""
    checks = []
    for check, op, kwargs in plan:
        if op in OPS:
            checks.append((check, lambda f=OPS[op], kw=kwargs: f(rank, root, job, **kw)))
        else:
            checks.append((check, lambda f=WORLD_OPS[op], kw=kwargs: f(rank, world, root, job, **kw)))
    return run_checks(checks)
