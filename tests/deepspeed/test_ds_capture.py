"""``DeepSpeedCheckpointer.save_on_failure``: its arguments and boundary in one process, then
under torchrun (ZeRO-2, gloo), one launch.

In the one process, a capture after the main thread went past step 3's boundary (step 4's
batch drawn, the RNG used) writes step 3's ``boundary_state`` over the client state.

Attempt 0: rank 1 is SIGKILLed inside step 8's backward; rank 0 captures step 7, but ZeRO
state is per rank and rank 1 has no capture, so the restart loads the save of step 5.
Attempt 1: the whole job gets SIGTERM after step 12; both ranks capture 12 and the restart
loads it from memory (a failure capture), with step 12's parameters and client state.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests._fork import run_ranks

from . import _ds_train

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _one_process(rank, world, directory, job):
    import deepspeed
    from flashckpt import StateMismatchError
    from flashckpt.deepspeed import DeepSpeedCheckpointer
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed.init_distributed("gloo")
    out = {}

    def outcome(fn):
        try:
            return ("ok", fn())
        except Exception as exc:  # the test asserts on class and message
            return (type(exc).__name__, str(exc))

    engine = _ds_train.make_engine(2)
    with DeepSpeedCheckpointer(engine, os.path.join(directory, "bad"), job_id=job + "a") as ck:
        out["other_optimizer"] = outcome(lambda: ck.save_on_failure(optimizer=torch.optim.SGD(
            engine.module.parameters(), lr=0.1)))
        ck.save_on_failure(lambda: {"other": 1})
        out["twice"] = outcome(ck.save_on_failure)
        _ds_train.train_step(engine, rank, 1)
        try:
            ck.save(1, client_state={"marker": "m"})
        except StateMismatchError as exc:
            out["mismatch"] = str(exc)

    engine = _ds_train.make_engine(2)
    with DeepSpeedCheckpointer(engine, os.path.join(directory, "probe"), job_id=job + "b") as ck:
        capture = ck.save_on_failure()
        seen = {}
        engine.optimizer.optimizer.register_step_pre_hook(  # ZeRO's torch optimizer: inside engine.step
            lambda *_: seen.setdefault("mid", capture.capture("mid-update probe")))
        _ds_train.train_step(engine, rank, 1)
        out["mid_update"] = seen["mid"]
        assert engine.__dict__.get("step") is not None
    out["step_restored"] = "step" not in engine.__dict__

    engine = _ds_train.make_engine(2)
    with DeepSpeedCheckpointer(engine, os.path.join(directory, "run"), job_id=job + "c") as ck:
        ck.save_on_failure(lambda: {"marker": f"gs-{engine.global_steps}"})
        _ds_train.train_to_5(ck, engine, rank)
        expected = _ds_train.consolidated(engine)
        out["captured"] = ck.capture_failure("test")
        ck.wait()
        out["latest"] = ck.latest_step()
    engine = _ds_train.make_engine(2)
    with DeepSpeedCheckpointer(engine, os.path.join(directory, "run"), job_id=job + "c") as ck:
        out["loaded"] = ck.load()
        out["client"] = ck.client_state.get("marker")
        out["same"] = all(torch.equal(v, _ds_train.consolidated(engine)[k]) for k, v in expected.items())
    out["tag"] = os.path.isfile(os.path.join(directory, "run", "global_step5", "mp_rank_00_model_states.pt"))
    out.update(_past_the_boundary(directory, job))
    return out


def _past_the_boundary(directory, job):
    """A capture after step 4's batch was drawn and the RNG used writes step 3's
    ``boundary_state`` over the client state; one naming what it lacks fails the first save."""
    import flashckpt
    from flashckpt import StateMismatchError
    from flashckpt.deepspeed import DeepSpeedCheckpointer
    position, out = {"consumed": 0}, {}

    def state():
        return {"sampler": dict(position), "rng": flashckpt.rng_state()}

    engine = _ds_train.make_engine(2)
    with DeepSpeedCheckpointer(engine, os.path.join(directory, "boundary"), job_id=job + "d") as ck:
        ck.save_on_failure(state, boundary_state=state)
        for step in range(1, 4):
            position["consumed"] += _ds_train.MICRO_BATCH  # the batch is drawn
            _ds_train.train_step(engine, 0, step)
        at3 = {"sampler": dict(position), "torch": torch.get_rng_state()}
        position["consumed"] += _ds_train.MICRO_BATCH  # step 4: its batch drawn, the RNG used
        torch.rand(3)
        out["boundary_captured"] = ck.capture_failure("test")
    engine = _ds_train.make_engine(2)
    with DeepSpeedCheckpointer(engine, os.path.join(directory, "boundary"), job_id=job + "d") as ck:
        out["boundary_loaded"] = ck.load()
        client = ck.client_state
    out["boundary_sampler"] = (client["sampler"], at3["sampler"])
    out["boundary_rng"] = torch.equal(client["rng"]["torch"], at3["torch"])
    with DeepSpeedCheckpointer(engine, os.path.join(directory, "bad-boundary"), job_id=job + "e") as ck:
        ck.save_on_failure(state, boundary_state=lambda: {"epoch": 1})
        _ds_train.train_step(engine, 0, 1)
        try:
            ck.save(1, client_state=state())
        except StateMismatchError as exc:
            out["boundary_mismatch"] = str(exc)
    return out


def test_arguments_and_the_boundary_in_one_process(tmp_path, job_id):
    out, = run_ranks(_one_process, 1, str(tmp_path), job_id, timeout=180)
    assert out["other_optimizer"][0] == "ValueError" and "engine's own" in out["other_optimizer"][1]
    assert out["twice"][0] == "RuntimeError"
    assert "state_fn() returns another tree" in out["mismatch"] and "marker" in out["mismatch"], out["mismatch"]
    assert out["mid_update"] is None  # inside engine.step (the ZeRO step): nothing captured
    assert out["step_restored"]
    assert out["captured"] == 5 and out["latest"] == 5 and out["tag"], out
    assert out["loaded"] == 5 and out["client"] == "gs-5" and out["same"], out
    assert out["boundary_captured"] == 3 and out["boundary_loaded"] == 3, out
    assert out["boundary_sampler"] == ({"consumed": 12}, {"consumed": 12}) and out["boundary_rng"], out
    assert "boundary_state" in out["boundary_mismatch"] and "/epoch" in out["boundary_mismatch"], out


def _buffers_past_the_boundary(rank, world, directory, job, stage, bf16):
    """Steps 1-3 of a BatchNorm model, step 4's forward (the running statistics move), a
    capture, then step 4's update; a new engine loads the capture."""
    from flashckpt.deepspeed import DeepSpeedCheckpointer
    _ds_train.join_group(rank)
    out = {}
    engine = _ds_train.make_engine(stage, batchnorm=True, bf16=bf16)
    with DeepSpeedCheckpointer(engine, directory, job_id=job) as ck:
        ck.save_on_failure()
        for step in (1, 2, 3):
            _ds_train.train_step(engine, rank, step)
        out["at3"] = _ds_train.buffers(engine)
        loss = _ds_train.forward(engine, rank, 4)
        out["moved"] = _ds_train.buffers(engine)
        out["captured"] = ck.capture_failure("test")
        out["live"] = _ds_train.buffers(engine)  # the capture leaves the live statistics alone
        engine.backward(loss)
        engine.step()  # training goes on after an explicit capture
        out["after_step"] = _ds_train.buffers(engine)
        ck.wait()
    engine = _ds_train.make_engine(stage, batchnorm=True, bf16=bf16)
    with DeepSpeedCheckpointer(engine, directory, job_id=job) as ck:
        out["loaded"] = ck.load()
        out["restored"] = _ds_train.buffers(engine)
    return out


@pytest.mark.parametrize("stage, bf16", [(2, False), (3, False), (2, True), (3, True)],
                         ids=["zero2", "zero3", "bf16-zero2", "bf16-zero3"])
def test_forward_changed_buffers_are_captured_as_of_the_boundary(tmp_path, job_id, stage, bf16):
    """ZeRO-2 and ZeRO-3, fp32 and bf16 (the module and its running statistics in bf16, the
    update's fp32 master weights DeepSpeed's), one process: a capture after step 4's forward
    moved BatchNorm's running statistics writes those of step 3 (the boundary), and leaves
    the live ones as they are."""
    out, = run_ranks(_buffers_past_the_boundary, 1, str(tmp_path / "bn"), job_id, stage, bf16, timeout=180)
    assert out["captured"] == 3 and out["loaded"] == 3, out
    at3, moved = out["at3"], out["moved"]
    assert at3["1.running_mean"].dtype == (torch.bfloat16 if bf16 else torch.float32)
    assert not torch.equal(at3["1.running_mean"], moved["1.running_mean"])  # the forward moved them
    assert int(moved["1.num_batches_tracked"]) == 4
    for name in at3:
        assert torch.equal(out["restored"][name], at3[name]), (name, out["restored"][name], at3[name])
        assert torch.equal(out["live"][name], moved[name]), name
        assert torch.equal(out["after_step"][name], moved[name]), name


@pytest.mark.timeout(300)
def test_capture_loads_only_where_every_rank_captured(tmp_path, job_id):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, FLASHCKPT_TEST_JOB=job_id, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=2",
         "--monitor-interval=0.1", os.path.join(HERE, "_ds_capture.py"), str(ckpt), str(out)],
        env=env, capture_output=True, text=True, timeout=280)
    log = proc.stdout[-3000:] + proc.stderr[-8000:]
    assert proc.returncode == 0, log
    assert "captured step 7" in proc.stderr, log  # rank 0's, never loaded: rank 1 has none
    for rank in range(2):
        first = json.loads((out / f"load-{rank}-1.json").read_text())
        assert first["step"] == 5 and not first["captured"] and first["client"] == "gs-5", (rank, first, log)
        second = json.loads((out / f"load-{rank}-2.json").read_text())
        assert second == {"step": 12, "source": "memory", "captured": True, "client": "gs-12"}, (rank, second, log)
        at12, loaded = torch.load(out / f"at12-{rank}.pt"), torch.load(out / f"loaded-{rank}-2.pt")
        assert at12.keys() == loaded.keys()
        for name in at12:
            assert torch.equal(at12[name], loaded[name]), name
    assert os.path.isfile(ckpt / "global_step15" / "mp_rank_00_model_states.pt")  # the run finished and exported
