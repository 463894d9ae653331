"""ZeRO-3's failure capture (issue 42): on 2 gloo ranks, each rank captures its partition of
step 5 alone, one after the other (DeepSpeed's save collectives are skipped: a peer may be
dead), and a restart loads it from memory with step 5's parameters and client state."""

import torch

from tests._fork import run_ranks

from . import _ds_train


def _capture(rank, world, directory, job):
    from flashckpt.deepspeed import DeepSpeedCheckpointer
    _ds_train.join_group(rank)
    engine = _ds_train.make_engine(3)
    ck = DeepSpeedCheckpointer(engine, directory, job_id=job)
    ck.save_on_failure(lambda: {"marker": f"gs-{engine.global_steps}"})
    _ds_train.train_to_5(ck, engine, rank)
    expected = {k: v.numpy().copy() for k, v in _ds_train.consolidated(engine).items()}  # tensors pickle as fds
    step = None
    for turn in range(world):  # a capture that waited for a peer would never end
        torch.distributed.barrier()
        if turn == rank:
            step = ck.capture_failure("test")
    return step, expected  # then the process ends unclosed, as a killed one


def _restart(rank, world, directory, job):
    from flashckpt.deepspeed import DeepSpeedCheckpointer
    sources = _ds_train.join_group(rank)
    engine = _ds_train.make_engine(3)
    with DeepSpeedCheckpointer(engine, directory, job_id=job) as ck:
        step = ck.load()
        weights = {k: v.numpy().copy() for k, v in _ds_train.consolidated(engine).items()}
        return step, sources, ck.client_state.get("marker"), weights


def test_zero3_capture_restores_from_memory(tmp_path, job_id):
    directory = str(tmp_path / "run")
    captured = run_ranks(_capture, 2, directory, job_id, timeout=180)
    assert [step for step, _ in captured] == [5, 5]
    restarted = run_ranks(_restart, 2, directory, job_id, timeout=180)
    for step, source, marker, weights in restarted:
        assert (step, source, marker) == (5, ["memory"], "gs-5")
        assert all((weights[k] == v).all() for k, v in captured[0][1].items())
