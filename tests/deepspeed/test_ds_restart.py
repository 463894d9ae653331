"""DeepSpeed ZeRO-1/2/3 under torchrun: kill -9, restart from memory, same losses as an
uninterrupted run; stock DeepSpeed and zero_to_fp32 read the exported tag. One launch
trains an engine of each stage side by side (each launch costs seconds of imports)."""

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
STEPS, KILL_AT, MORE = 6, 3, 2
STAGES = (1, 2, 3)


def _reference_and_stock(rank: int, world: int, directory: str) -> dict:
    """A new job, for each stage: an uninterrupted reference run, then stock DeepSpeed
    loading the exported tag."""
    import deepspeed
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed.init_distributed("gloo")
    results = {}
    for stage in STAGES:
        reference = _ds_train.make_engine(stage)
        losses = {step: _ds_train.train_step(reference, rank, step) for step in range(1, STEPS + MORE + 1)}
        stock = _ds_train.make_engine(stage)
        path, client = stock.load_checkpoint(os.path.join(directory, f"stage{stage}"))  # DeepSpeed's default engine
        loaded_steps = stock.global_steps
        after = {step: _ds_train.train_step(stock, rank, step) for step in range(STEPS + 1, STEPS + MORE + 1)}
        results[stage] = {"reference": losses, "stock_path": path, "client": client["marker"], "stock_after": after,
                          "stock_steps": loaded_steps}
    return results


@pytest.mark.timeout(600)
def test_kill9_restart_from_memory_then_stock_load(tmp_path, job_id):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    env = dict(os.environ, FLASHCKPT_TEST_JOB=job_id, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
         os.path.join(HERE, "_ds_train.py"), ",".join(map(str, STAGES)), str(ckpt), str(out), str(STEPS),
         str(KILL_AT)],
        env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = run_ranks(_reference_and_stock, 2, str(ckpt), timeout=180)

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    for stage in STAGES:
        stage_ckpt, stage_out = ckpt / f"stage{stage}", out / f"stage{stage}"
        for rank in range(2):
            load = json.loads((stage_out / f"load-{rank}-1.json").read_text())
            assert load == {"step": KILL_AT, "source": "memory", "client": f"step-{KILL_AT}"}, stage
            assert not (stage_out / f"losses-{rank}-0.json").exists() or rank == 0, stage

        for rank, by_stage in enumerate(results):
            result = by_stage[stage]
            reference = {int(k): v for k, v in result["reference"].items()}
            resumed = {int(k): v for k, v in json.loads((stage_out / f"losses-{rank}-1.json").read_text()).items()}
            assert sorted(resumed) == list(range(KILL_AT + 1, STEPS + 1)), stage
            assert resumed == {s: reference[s] for s in resumed}, stage  # bit-identical continuation
            # stock DeepSpeed loaded the tag the saver exported (after close() flushed step STEPS)
            assert result["stock_path"].endswith(
                os.path.join(f"global_step{STEPS}", os.path.basename(result["stock_path"]))), stage
            assert result["client"] == f"step-{STEPS}" and result["stock_steps"] == STEPS, stage
            assert result["stock_after"] == {s: reference[s] for s in range(STEPS + 1, STEPS + MORE + 1)}, stage
        assert (stage_ckpt / "latest").read_text() == f"global_step{STEPS}", stage

        # zero_to_fp32.py, DeepSpeed's offline consolidation, works on the exported tag
        consolidated = get_fp32_state_dict_from_zero_checkpoint(str(stage_ckpt))
        final = torch.load(stage_out / "final.pt")
        assert sorted(consolidated) == sorted(final), stage
        for name, value in final.items():
            assert torch.equal(consolidated[name], value), (stage, name)
