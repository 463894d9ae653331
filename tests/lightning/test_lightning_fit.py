"""A real Lightning Trainer fit on CPU saving through FlashCheckpointIO: killed with SIGKILL
after a returned save, resumed with ``ckpt_path="last"`` from memory, to the weights of an
uninterrupted run; one process and DDP on two (Lightning's own launcher, gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ._fit import Tiny, trainer_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KILL_AT, STEPS = 4, 6
"""Step 4 ends an epoch (8 samples: 4 steps of 2 on one process, 2 per rank on two), so
the resumed run sees the same batches: Lightning restarts a plain DataLoader's epoch."""


def fit(directory, out, *args: str) -> int:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), ROOT) if p))
    env.pop("MASTER_PORT", None)
    proc = subprocess.run([sys.executable, "-m", "tests.lightning._fit", str(directory), str(out), *args], cwd=ROOT,
                          env=env, timeout=150, capture_output=True, text=True)
    if proc.returncode not in (0, -9):
        raise AssertionError(f"fit failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc.returncode


def report(out, rank: int = 0) -> dict:
    with open(f"{out}-rank{rank}.json") as f:
        return json.load(f)


def reference(tmp_path, devices: int) -> dict:
    """An uninterrupted fit: one process with the stock checkpoint IO in this process, DDP
    (whose ranks' batches a single process does not reproduce bit for bit) launched as the runs are."""
    if devices > 1:
        fit(tmp_path / "ref", tmp_path / "ref", "--devices", str(devices), "--steps", str(STEPS),
            "--record-at", str(KILL_AT))
        return report(tmp_path / "ref")
    trainer, data = trainer_for(str(tmp_path / "ref"), str(tmp_path / "ref"), steps=STEPS, record_at=KILL_AT,
                                flash=False)
    trainer.fit(Tiny(), data)
    return report(tmp_path / "ref")


@pytest.mark.parametrize("devices", [1, 2], ids=["one-process", "ddp-2"])
def test_killed_fit_resumes_from_memory(tmp_path, devices):
    ref = reference(tmp_path, devices)
    common = ["--devices", str(devices), "--steps", str(STEPS), "--every", "2"]
    assert fit(tmp_path / "run", tmp_path / "killed", *common, "--kill-at", str(KILL_AT)) == -9
    assert os.path.exists(tmp_path / "run" / "last.ckpt")  # a placeholder at least: "last" finds it
    fit(tmp_path / "run", tmp_path / "resumed", *common, "--resume")
    for rank in range(devices):
        resumed = report(tmp_path / "resumed", rank)
        assert resumed["source"] == "memory", resumed
        assert resumed["start_step"] == KILL_AT
        assert torch.allclose(torch.tensor(resumed["restored"]), torch.tensor(ref["recorded"]), atol=1e-6)
        assert resumed["end_step"] == STEPS
        assert torch.allclose(torch.tensor(resumed["final"]), torch.tensor(ref["final"]), atol=1e-6)
    # once the fit ended, the stock files are there: torch.load reads them without flashckpt
    stock = torch.load(tmp_path / "run" / "last.ckpt", weights_only=False)
    assert stock["global_step"] == STEPS
    assert list(stock["state_dict"]) == list(torch.load(tmp_path / "ref" / "last.ckpt", weights_only=False)["state_dict"])
