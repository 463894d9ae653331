"""A rollback within one FSDP run (2 gloo ranks): the checkpointer that saved 10, 20, 30
loads 20 and saves 25, 26, which are then the newest and the only steps kept, whether
step 20 loads with the run's own layout or, the run having switched to HSDP (each rank
holding whole tensors), resharded from storage."""

import os

import pytest
import torch.distributed as dist

from tests._fork import run_ranks

from ._fsdp_common import assert_equal_states, full_state, make, train_step


def _steps(directory: str) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(directory) if n.startswith("step-") and n[5:].isdigit())


def _rollback(rank: int, world: int, directory: str, job: str, reshard: bool) -> None:
    from flashckpt import _events
    from flashckpt.torch import FsdpCheckpointer

    loads = []
    listener = lambda event, **info: loads.append(info) if event == "load" else None  # noqa: E731
    _events.subscribe(listener)
    model, opt = make(0)
    with FsdpCheckpointer(directory, job_id=job, keep_last=2) as ck:
        for step in (10, 20, 30):
            train_step(model, opt, rank, step)
            ck.save(step, model, opt, extra={"step": step})
            if step == 20:
                want = full_state(model, opt)
            ck.wait()
            dist.barrier()  # both shards durable: the step is committed
        assert _steps(directory) == [20, 30]

        model, opt = make(1, mesh=(2, 1)) if reshard else make(1)  # HSDP 2x1: whole tensors on each rank
        assert ck.load(model, opt, step=20) == 20 and ck.extra == {"step": 20}
        assert bool(loads[-1].get("resharded")) is reshard and loads[-1]["step"] == 20
        assert ck.last_load.step == 20 and (ck.last_load.source == "storage" or not reshard)
        assert_equal_states(full_state(model, opt), want, "step 20: ")
        for step in (25, 26):
            train_step(model, opt, rank + 100, step)
            ck.save(step, model, opt, extra={"step": step})
            ck.wait()
            dist.barrier()
            assert ck.latest_step() == step, f"after saving {step} the newest step is {ck.latest_step()}"
        assert _steps(directory) == [25, 26]
    _events.unsubscribe(listener)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("reshard", [False, True], ids=["same layout", "resharded"])
def test_a_rollback_within_one_run_starts_a_line_that_wins_over_the_runs_own_newer_steps(tmp_path, job_id, reshard):
    run_ranks(_rollback, 2, str(tmp_path / "ckpt"), job_id, reshard, timeout=280)
