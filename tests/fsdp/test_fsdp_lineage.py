"""Lineage through FsdpCheckpointer (issue 24, item 1), 2 gloo ranks: a run loads step 3
of a 1..6 run and saves 4 and 5; the new line commits and is the newest, the old 4..6
are gone, retention keeps the newest 3 by line, and a third run reads the new values."""

import os

import pytest
import torch.distributed as dist

from tests._fork import run_ranks

from ._fsdp_common import assert_equal_states, local_state, make, train_step


def _steps(directory: str) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(directory) if n.startswith("step-") and n[5:].isdigit())


def _rollback(rank: int, world: int, directory: str, job: str) -> None:
    from flashckpt.storage._local import LocalStorage
    from flashckpt.torch import FsdpCheckpointer

    storage = LocalStorage(directory)
    model, opt = make(0)
    with FsdpCheckpointer(directory, job_id=job, keep_last=0) as ck:  # keeps 1..6 to roll back to
        for step in range(1, 7):
            train_step(model, opt, rank, step)
            ck.save(step, model, opt, extra={"line": 1, "step": step})
        ck.wait()
    dist.barrier()
    assert _steps(directory) == [1, 2, 3, 4, 5, 6]

    model, opt = make(1, lr=0.5)
    with FsdpCheckpointer(directory, job_id=job, keep_last=3) as ck:
        assert ck.load(model, opt, step=3) == 3 and ck.extra == {"line": 1, "step": 3}
        saved = {}
        for step in (4, 5):
            train_step(model, opt, rank + 100, step)  # another course than the first run's
            ck.save(step, model, opt, extra={"line": 2, "step": step})
            saved[step] = local_state(model, opt)
            ck.wait()
            dist.barrier()  # both shards durable: the step is committed
            assert ck.latest_step() == step and storage.latest_step() == step
            assert _steps(directory) == ([2, 3, 4] if step == 4 else [3, 4, 5])  # old 4..6 gone, 3 by line
            assert storage.metadata(step)["branch"] == 3
    dist.barrier()

    model, opt = make(2)
    with FsdpCheckpointer(directory, job_id=job, keep_last=3) as ck:
        assert ck.load(model, opt) == 5 and ck.extra == {"line": 2, "step": 5}
        assert_equal_states(local_state(model, opt), saved[5], "newest: ")
        assert ck.load(model, opt, step=4) == 4 and ck.extra == {"line": 2, "step": 4}
        assert_equal_states(local_state(model, opt), saved[4], "step 4: ")


@pytest.mark.timeout(300)
def test_fsdp_rollback_starts_a_line_that_commits_and_retains_by_line(tmp_path, job_id):
    run_ranks(_rollback, 2, str(tmp_path / "ckpt"), job_id, timeout=280)
