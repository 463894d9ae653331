"""``FlashCheckpointCallback(save_on_failure=True)``: a failed Trainer run resumes at the
last finished step, not at the last save.

One run of 10 steps with folders every 3 takes two failures: SIGTERM once step 5 finished
(attempt 0), then an exception out of ``train()`` once step 7 finished (attempt 1). Without
capture the restarts resume at 3 and 6; with it, at 5 and 7 (each captured step written out
as its ``checkpoint-N``), and the last attempt ends with the weights of an uninterrupted run.
"""

import json
import os
import signal

import pytest
import torch

from tests._fork import Forked, run_script

from ._hf import shm_left

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_capture_hf.py")


def _attempt(out, report, attempt: int, *fault: str) -> tuple[int, str]:
    proc = Forked(run_script, SCRIPT, [str(out), str(report), str(attempt), *fault])
    code = proc.wait(120)
    return code, proc.stderr.read()


@pytest.mark.timeout(300)
def test_sigterm_and_an_exception_resume_at_the_captured_steps(tmp_path, reference_10):
    out, report = tmp_path / "run", tmp_path / "report"
    report.mkdir()
    code, err = _attempt(out, report, 0, "term:5")
    assert code in (-signal.SIGTERM, 128 + signal.SIGTERM), err[-4000:]
    assert "captured step 5" in err, err[-4000:]

    code, err = _attempt(out, report, 1, "raise:7")
    assert code != 0 and "injected failure after step 7" in err, err[-4000:]
    assert "captured step 7" in err, err[-4000:]
    assert json.loads((report / "attempt1.json").read_text())["resumed_at"] == 5
    assert os.path.isdir(out / "checkpoint-7")  # written out before the exception left train()

    code, err = _attempt(out, report, 2)
    assert code == 0, err[-4000:]
    assert json.loads((report / "attempt2.json").read_text())["resumed_at"] == 7
    final = torch.load(report / "final.pt")
    for a, b in zip(reference_10, final):
        assert torch.equal(a, b)  # the captured steps held exactly an uninterrupted run's state
    assert {"checkpoint-5", "checkpoint-7", "checkpoint-9", "checkpoint-10"} <= set(os.listdir(out))
    assert not shm_left(str(out))
