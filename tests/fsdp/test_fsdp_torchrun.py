"""torchrun restart: rank 1 is killed with SIGKILL after a save that reached only
memory; both restarted ranks resume FSDP2 training from memory and end with the loss
curve and the bit-identical model and optimizer state of an uninterrupted run."""

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "_torchrun_fsdp.py")


def test_torchrun_restart_resumes_from_memory_with_the_same_loss_curve(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           SCRIPT, str(tmp_path / "ckpt"), str(out), "8", "5"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        report = json.loads((out / f"rank{rank}.json").read_text())
        assert report["restart"] == 1
        assert report["loaded_step"] == 5 and report["source"] == "memory"
        assert len(report["losses"]) == 8
        assert report["losses"] == report["reference_losses"]
        assert report["identical"]
