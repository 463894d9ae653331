"""Node-local directories, a DeepSpeed load (2 gloo ranks): a rank whose memory lacks the
agreed step but whose own node's directory holds its shard reads it from there straight
into the engine's own tensors (one copy), never disk -> slot -> tensors; its layout is
checked from that shard's header before anything is written.

The node-local agreement is stood in for as in ``tests/fsdp/test_fsdp_node_local_one_copy.py``."""

import pytest
import torch

from tests._fork import run_ranks
from tests.fsdp.test_fsdp_node_local_one_copy import STEP, _agree_node_local

from . import _ds_train
from .test_ds_load_places import _live


def _load(rank, world, directory, job):
    from flashckpt import _engine
    from flashckpt.deepspeed import DeepSpeedCheckpointer
    sources = _ds_train.join_group(rank)

    engine = _ds_train.make_engine(1)
    ck = DeepSpeedCheckpointer(engine, directory, job_id=job, persist_every=1)
    _ds_train.train_step(engine, rank, 1)
    ck.save(STEP)
    ck.wait()
    saved = {k: v.clone() for k, v in _live(engine).items()}
    ck.close()  # its memory goes: rank 0 has the step on its own directory only
    _engine.agree = _agree_node_local

    restarted = _ds_train.make_engine(1)
    _ds_train.train_step(restarted, rank, 7)
    pointers = {k: v.data_ptr() for k, v in _live(restarted).items()}
    loading = DeepSpeedCheckpointer(restarted, directory, job_id=job)
    step = loading.load()
    after = _live(restarted)
    out = {"step": step, "source": sources[-1], "held": STEP in loading._flash.memory_steps(),
           "equal": sorted(k for k in saved if not torch.equal(after[k], saved[k])) or True,
           "moved": sorted(k for k in after if after[k].data_ptr() != pointers.get(k)) or None}
    loading.close()
    return out


@pytest.mark.timeout(240)
def test_a_rank_reading_its_own_directory_fills_the_engine_without_its_slot(tmp_path, job_id):
    for rank, out in enumerate(run_ranks(_load, 2, str(tmp_path / "ckpt"), job_id, timeout=220)):
        assert out["step"] == STEP and out["source"] == "memory", out
        assert out["held"] == (rank == 1), f"rank {rank}: step {STEP} in its slot after the load: {out['held']}"
        assert out["equal"] is True, out["equal"]
        assert out["moved"] is None, f"loaded into new tensors: {out['moved']}"
