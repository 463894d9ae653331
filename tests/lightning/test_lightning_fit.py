"""A real Lightning Trainer fit on CPU saving through FlashCheckpointIO: killed with SIGKILL
after a returned save, resumed with ``ckpt_path="last"`` from memory to exactly the weights
the killed run had at that step."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from ._fit import Tiny

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


def test_killed_ddp_fit_resumes_from_memory(tmp_path):
    """DDP on two processes (Lightning's own launcher, gloo); the in-process IO tests cover one."""
    devices = 2
    common = ["--devices", str(devices), "--steps", str(STEPS), "--every", "2"]
    killed = ["--kill-at", str(KILL_AT), "--record-at", str(KILL_AT)]  # records step 4's weights, then dies
    assert fit(tmp_path / "run", tmp_path / "killed", *common, *killed) == -9
    assert os.path.exists(tmp_path / "run" / "last.ckpt")  # a placeholder at least: "last" finds it
    fit(tmp_path / "run", tmp_path / "resumed", *common, "--resume")
    for rank in range(devices):
        resumed = report(tmp_path / "resumed", rank)
        assert resumed["source"] == "memory", resumed
        assert resumed["start_step"] == KILL_AT
        assert resumed["restored"] == report(tmp_path / "killed", rank)["recorded"]
        assert resumed["end_step"] == STEPS
    # once the fit ended, the stock files are there: torch.load reads them without flashckpt
    stock = torch.load(tmp_path / "run" / "last.ckpt", weights_only=False)
    assert stock["global_step"] == STEPS
    assert list(stock["state_dict"]) == list(Tiny().state_dict())
