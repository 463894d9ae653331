"""Lineage through MegatronCheckpointer (issue 24, item 1), a GPTModel on one gloo rank: a
run loads step 3 of a 1..6 run and saves 4 and 5; the new line commits and is the newest,
the old 4..6 are gone, retention keeps the newest 3 by line, and a third run reads the new
values."""

import os

import pytest
import torch

from tests._fork import run_ranks

from . import _gpt


def _steps(directory: str) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(directory) if n.startswith("step-") and n[5:].isdigit())


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _rollback(rank, world, directory, job):
    from megatron.core import parallel_state as ps
    from flashckpt.storage._local import LocalStorage
    from flashckpt.megatron import MegatronCheckpointer

    storage = LocalStorage(directory)
    model = _gpt.build(1)
    with MegatronCheckpointer(directory, job_id=job, keep_last=0) as ck:  # keeps 1..6 to roll back to
        for step in range(1, 7):
            _gpt.perturb(model, step)
            ck.save(step, model.sharded_state_dict())
        ck.wait()
    assert _steps(directory) == [1, 2, 3, 4, 5, 6]
    ps.destroy_model_parallel()

    model = _gpt.build(1, seed=7)
    saved = {}
    with MegatronCheckpointer(directory, job_id=job, keep_last=3) as ck:
        state, step = ck.load(model.sharded_state_dict(), step=3)
        assert step == 3
        model.load_state_dict(state)
        for step in (4, 5):
            _gpt.perturb(model, 100 + step)  # another course than the first run's
            ck.save(step, model.sharded_state_dict())
            saved[step] = _state(model)
            ck.wait()
            assert ck.latest_step() == step and storage.latest_step() == step
            assert storage.metadata(step)["branch"] == 3
            assert _steps(directory) == ([2, 3, 4] if step == 4 else [3, 4, 5])  # old 4..6 gone, 3 by line
    ps.destroy_model_parallel()

    for want in (None, 4):
        model = _gpt.build(1, seed=11)
        with MegatronCheckpointer(directory, job_id=job, keep_last=3) as ck:
            state, step = ck.load(model.sharded_state_dict(), step=want)
        assert step == (want or 5)
        model.load_state_dict(state)
        got = _state(model)
        bad = [k for k in saved[step] if not torch.equal(got[k], saved[step][k])]
        assert not bad, f"step {step}: {bad}"
        ps.destroy_model_parallel()


@pytest.mark.timeout(300)
def test_megatron_rollback_starts_a_line_that_commits_and_retains_by_line(tmp_path, job_id):
    run_ranks(_rollback, 1, str(tmp_path / "ckpt"), job_id, timeout=280)
