"""``FlashCheckpointCallback(save_on_failure=True)``: a failed Trainer run resumes at the
last finished step, not at the last save (one process; then DDP under torchrun, one launch).

One run of 10 steps with folders every 3 takes two failures: SIGTERM once step 5 finished
(attempt 0), then an exception out of ``train()`` once step 7 finished (attempt 1). Without
capture the restarts resume at 3 and 6; with it, at 5 and 7 (each captured step written out
as its ``checkpoint-N``), and the last attempt ends with the weights of an uninterrupted run.
"""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from tests._fork import Forked, run_script

from ._hf import shm_left

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_capture_hf.py")


def _attempt(out, report, attempt: int, *fault: str, env: dict | None = None) -> tuple[int, str]:
    proc = Forked(run_script, SCRIPT, [str(out), str(report), str(attempt), *fault], env=env)
    code = proc.wait(120)
    return code, proc.stderr.read()


def test_save_on_failure_must_be_a_bool():
    from flashckpt.hf import FlashCheckpointCallback
    with pytest.raises(TypeError, match="save_on_failure must be a bool"):
        FlashCheckpointCallback(save_on_failure="yes")


@pytest.mark.timeout(300)
def test_sigterm_and_an_exception_resume_at_the_captured_steps(tmp_path, reference_10):
    out, report = tmp_path / "run", tmp_path / "report"
    report.mkdir()
    code, err = _attempt(out, report, 0, "term:0:5:0")
    assert code in (-signal.SIGTERM, 128 + signal.SIGTERM), err[-4000:]
    assert "captured step 5" in err, err[-4000:]

    code, err = _attempt(out, report, 1, "raise:0:7:1")
    assert code != 0 and "injected failure after step 7" in err, err[-4000:]
    assert "captured step 7" in err, err[-4000:]
    assert json.loads((report / "attempt1-rank0.json").read_text())["resumed_at"] == 5
    assert os.path.isdir(out / "checkpoint-7")  # written out before the exception left train()

    code, err = _attempt(out, report, 2)
    assert code == 0, err[-4000:]
    assert json.loads((report / "attempt2-rank0.json").read_text())["resumed_at"] == 7
    final = torch.load(report / "final0.pt")
    for a, b in zip(reference_10, final):
        assert torch.equal(a, b)  # the captured steps held exactly an uninterrupted run's state
    assert {"checkpoint-5", "checkpoint-7", "checkpoint-9", "checkpoint-10"} <= set(os.listdir(out))
    assert not shm_left(str(out))


def _one_rank(deepspeed: str | None, attempt: int) -> dict:
    """The environment of a torchrun rank of a world of one (``deepspeed``: see :func:`_torchrun`)."""
    if deepspeed is None:
        return {}
    from tests._net import free_port
    return {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()), "TORCHELASTIC_RESTART_COUNT": str(attempt), "DS_ACCELERATOR": "cpu",
            "FLASHCKPT_TEST_HF_DS": deepspeed}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("deepspeed", [None, "1", "3"], ids=["plain", "zero2", "zero3"])
def test_forward_changed_buffers_are_captured_as_of_the_boundary(tmp_path, deepspeed):
    """A BatchNorm model, one process (also under the Trainer's DeepSpeed, ZeRO-2 and ZeRO-3, a
    world of one): SIGTERM once step 6's forward moved the running statistics, while the main
    thread waits in C++; the watcher thread captures step 5 with the statistics of step 5's end
    (``on_step_end``), in the model file and in DeepSpeed's tag (ZeRO-3: the tag alone, no
    weights file), and the restart resumes from it."""
    from safetensors.torch import load_file

    out, report = tmp_path / "run", tmp_path / "report"
    report.mkdir()
    code, err = _attempt(out, report, 0, "fwdterm:0:5:0", env={"FLASHCKPT_TEST_HF_BN": "1", **_one_rank(deepspeed, 0)})
    assert code in (-signal.SIGTERM, 128 + signal.SIGTERM), err[-4000:]
    assert "captured step 5" in err and "watcher thread" in err, err[-4000:]
    at5, moved = torch.load(report / "buffers0-5.pt"), torch.load(report / "buffers0-moved.pt")
    assert int(moved["norm.num_batches_tracked"]) == 6 and not torch.equal(at5["norm.running_mean"],
                                                                            moved["norm.running_mean"])
    # writes the captured step's folder, resumes from it
    code, err = _attempt(out, report, 1, env={"FLASHCKPT_TEST_HF_BN": "1", **_one_rank(deepspeed, 1)})
    assert code == 0, err[-4000:]
    assert json.loads((report / "attempt1-rank0.json").read_text())["resumed_at"] == 5
    written = [] if deepspeed == "3" else [load_file(out / "checkpoint-5" / "model.safetensors")]
    if deepspeed:  # ZeRO-3's file: the partitioned parameters empty, the buffers whole
        name = "zero_pp_rank_0_mp_rank_00_model_states.pt" if deepspeed == "3" else "mp_rank_00_model_states.pt"
        written.append(torch.load(out / "checkpoint-5" / "global_step5" / name, weights_only=False)["module"])
    for saved in written:
        for name, value in at5.items():
            assert torch.equal(saved[name], value), (name, saved[name], value)
    assert not shm_left(str(out))


def _torchrun(out, report, restarts: int, *faults: str, deepspeed: str | None = None) -> subprocess.CompletedProcess:
    """One torchrun launch of the script on two gloo ranks; ``deepspeed``: "1" (ZeRO-2) or "3" (ZeRO-3)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(SCRIPT)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--max-restarts={restarts}", "--monitor-interval=0.1", SCRIPT, str(out), str(report), "-", *faults]
    env = dict(os.environ, PYTHONPATH=root)
    if deepspeed is not None:
        env.update(DS_ACCELERATOR="cpu", FLASHCKPT_TEST_HF_DS=deepspeed)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("deepspeed", [None, "3"], ids=["ddp", "zero3"])
def test_ddp_resumes_at_a_capture_only_where_every_rank_captured(tmp_path, deepspeed):
    """Attempt 0: rank 1 is SIGKILLed once step 5 finished; rank 0 captures 5 alone, so the
    restart resumes at the folder of step 3. Attempt 1: both ranks get SIGTERM once step 7
    finished; both capture it and the restart resumes at 7. Under ZeRO-3 (the Trainer's
    DeepSpeed, weights gathered at saves) each rank captures its own partitions without a
    collective, and the captured folder has DeepSpeed's tag but no model.safetensors. (Not
    compared with an uninterrupted run's weights: that launch took 85-100 s of the suite;
    test_hf_torchrun.py compares a ZeRO-2 restart from memory with one.)"""
    out, report = tmp_path / "run", tmp_path / "report"
    report.mkdir()
    proc = _torchrun(out, report, 2, "kill9:1:5:0", "term:0:7:1", "term:1:7:1", deepspeed=deepspeed)
    log = proc.stderr[-6000:]
    assert proc.returncode == 0, log
    assert "captured step 5" in proc.stderr and "captured step 7" in proc.stderr, log
    for rank in (0, 1):
        assert json.loads((report / f"attempt1-rank{rank}.json").read_text())["resumed_at"] == 3, log
        assert json.loads((report / f"attempt2-rank{rank}.json").read_text())["resumed_at"] == 7, log
    final = torch.load(report / "final0.pt")
    for a, b in zip(final, torch.load(report / "final1.pt")):
        assert torch.equal(a, b)
    assert "checkpoint-5" not in os.listdir(out)  # rank 0's lone capture never committed
    if deepspeed is None:
        return
    assert proc.stderr.count("captured step 7") == 2, log
    captured, saved = set(os.listdir(out / "checkpoint-7")), set(os.listdir(out / "checkpoint-9"))
    assert {"global_step7", "latest", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth"} <= captured
    assert saved - captured == {"model.safetensors", "global_step9"}, (saved, captured)  # weights: regular saves only
    assert all(a.numel() > 0 for a in final)
    assert not shm_left(str(out))


@pytest.mark.timeout(300)
def test_deepspeed_integration_resumes_at_the_captured_step(tmp_path):
    """The Trainer's DeepSpeed (ZeRO-2, two gloo ranks): SIGTERM to both once step 7 finished;
    DeepSpeed's engine.step (inside accelerate's backward) begins the update, on_step_end
    ends it; the restart resumes at checkpoint-7, DeepSpeed's tag included."""
    out, report = tmp_path / "run", tmp_path / "report"
    report.mkdir()
    proc = _torchrun(out, report, 1, "term:0:7:0", "term:1:7:0", deepspeed="1")
    log = proc.stderr[-6000:]
    assert proc.returncode == 0, log
    assert proc.stderr.count("captured step 7") == 2, log
    for rank in (0, 1):
        assert json.loads((report / f"attempt1-rank{rank}.json").read_text())["resumed_at"] == 7, log
    assert os.path.isdir(out / "checkpoint-7" / "global_step7"), os.listdir(out / "checkpoint-7")
