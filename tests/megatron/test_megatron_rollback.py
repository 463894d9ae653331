"""A rollback inside one process through MegatronCheckpointer (a GPTModel on one gloo rank):
save 1..6 (all persisted), ``load(step=2)``, then save 4 on another course. Step 4 of the
new line, not the abandoned 6, is the newest: the same checkpointer and a new process
both load step 4 with the new line's weights. Each load is recorded by the engine
(``last_load``), whatever its path: fresh start, memory or storage."""

import pytest
import torch

from tests._fork import run_ranks

from . import _gpt

pytest.importorskip("megatron.core")


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _differs(model, want: dict) -> list[str]:
    got = _state(model)
    return [k for k in want if not torch.equal(got[k], want[k])]


def _rollback(rank, world, directory, job):
    from megatron.core import parallel_state as ps
    from flashckpt.megatron import MegatronCheckpointer

    model = _gpt.build(1)
    with MegatronCheckpointer(directory, job_id=job, keep_last=0) as ck:
        for step in range(1, 7):
            _gpt.perturb(model, step)
            ck.save(step, model.sharded_state_dict())
        ck.wait()
        six = _state(model)
        state, step = ck.load(model.sharded_state_dict(), step=2)  # the rollback: 3..6 are abandoned
        assert step == 2
        model.load_state_dict(state)
        _gpt.perturb(model, 104)  # another course than the first one's step 4
        ck.save(4, model.sharded_state_dict())
        ck.wait()
        four = _state(model)
        assert _differs(model, six), "the new step 4 must not equal the abandoned step 6"
        assert ck.latest_step() == 4, f"the newest committed step is {ck.latest_step()}, not the new line's 4"

        _gpt.perturb(model, 999)  # the next load must overwrite this
        state, step = ck.load(model.sharded_state_dict())
        assert step == 4
        model.load_state_dict(state)
        assert not _differs(model, four), "the same checkpointer loaded other weights than the new line's step 4"
    ps.destroy_model_parallel()
    return {k: v.numpy() for k, v in four.items()}


def _restart(rank, world, directory, job):
    from megatron.core import parallel_state as ps
    from flashckpt.megatron import MegatronCheckpointer

    model = _gpt.build(1, seed=11)
    with MegatronCheckpointer(directory, job_id=job) as ck:
        state, step = ck.load(model.sharded_state_dict())
        model.load_state_dict(state)
    ps.destroy_model_parallel()
    return step, {k: v.numpy() for k, v in _state(model).items()}


@pytest.mark.timeout(300)
def test_a_rollback_in_one_process_makes_the_new_line_the_newest(tmp_path, job_id):
    directory = str(tmp_path / "ckpt")
    [four] = run_ranks(_rollback, 1, directory, job_id, timeout=280)
    [(step, got)] = run_ranks(_restart, 1, directory, job_id, timeout=280)
    assert step == 4, f"a new process loaded step {step}, not the new line's step 4"
    bad = [k for k in four if not (got[k] == four[k]).all()]
    assert not bad, f"a new process loaded step {step} without the new line's weights: {bad}"
