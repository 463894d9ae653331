"""``DeepSpeedCheckpointer.save_on_failure`` under torchrun (ZeRO-2, gloo), one launch.

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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


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
