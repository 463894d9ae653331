"""DeepSpeed bad input: a missing tag, another ZeRO stage, another model, a partial step —
clear errors on every rank, and the previous tag still loads."""

import os

import pytest
import torch

from tests._fork import run_ranks

from . import _ds_train


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as exc:  # the test asserts on class and message
        return (type(exc).__name__, str(exc))


def _bad_inputs(rank, world, directory, job):
    import deepspeed
    import torch.distributed as dist
    from flashckpt.deepspeed import DeepSpeedCheckpointer
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed.init_distributed("gloo")

    engine = _ds_train.make_engine(1)
    ck = DeepSpeedCheckpointer(engine, directory, job_id=job + "a")
    _ds_train.train_step(engine, rank, 1)
    ck.save(1)
    after_1 = _ds_train.consolidated(engine)
    _ds_train.train_step(engine, rank, 2)
    ck.save(2)
    ck.wait()
    out = {}

    def fresh(stage, suffix, hidden=16):
        return DeepSpeedCheckpointer(_ds_train.make_engine(stage, hidden), directory, job_id=job + suffix)

    other = fresh(1, "b")
    out["missing_tag"] = _outcome(lambda: other.load(tag="global_step99"))
    other.close()
    other = fresh(2, "c")
    out["other_stage"] = _outcome(other.load)
    other.close()
    other = fresh(1, "d", hidden=24)
    out["other_model"] = _outcome(other.load)
    other.close()

    dist.barrier()
    if rank == 0:  # one rank's shard of the newest step goes missing
        os.unlink(os.path.join(directory, "flashckpt", "step-2", "rank-1.safetensors"))
    dist.barrier()
    restored = fresh(1, "e")
    out["partial"] = _outcome(restored.load)
    out["previous"] = _outcome(lambda: restored.load(tag="global_step1"))
    now = _ds_train.consolidated(restored.engine)
    out["previous_equal"] = all(torch.equal(now[k], v) for k, v in after_1.items())
    out["client_after_previous"] = restored.client_state.get("marker", "none")
    restored.close()
    ck.close()
    return out


@pytest.mark.timeout(240)
def test_bad_input_gives_clear_errors_and_keeps_previous_tag(tmp_path, job_id):
    results = run_ranks(_bad_inputs, 2, str(tmp_path / "ckpt"), job_id, timeout=220)
    for out in results:
        kind, message = out["missing_tag"]
        assert kind == "CheckpointNotFoundError" and "global_step99" in message and "global_step2" in message
        kind, message = out["other_stage"]
        assert kind == "StateMismatchError" and "ZeRO stage 1" in message and "stage 2" in message
        kind, message = out["other_model"]
        assert kind == "StateMismatchError" and "another model" in message and "0.weight" in message
        kind, message = out["partial"]
        assert kind == "CheckpointNotFoundError" and "rank-1.safetensors" in message
        assert out["previous"] == ("ok", 1)
        assert out["previous_equal"] and out["client_after_previous"] == "none"
