"""Node-local directories, a megatron load (GPTModel, TP=2 on 2 gloo ranks of one node): a
rank whose memory lacks the agreed step but whose own node's directory holds its shard is
read from there straight into the model's tensors (one copy, as ``Engine.load`` does), never
disk -> slot -> tensors; the other rank reads the blocks it needs from that shard too
(replicated blocks are saved by tensor-parallel rank 0 only), also when it loads with
another tensor-parallel size (TP=1, DP=2: every block resharded from this node's copies).

The node-local agreement is stood in for as in ``tests/fsdp/test_fsdp_node_local_one_copy.py``:
asked for ``direct``, rank 0 is named in ``own_disk``; not asked, it brings its shard into
its slot first (``_read_own``), as a real node-local agreement does. Rank 1 holds the step
in memory either way."""

import os
import shutil

import pytest
import torch
import torch.distributed as dist

from tests._fork import run_ranks

from . import _gpt

pytest.importorskip("megatron.core")

STEP = 5
INTACT: list[str] = []
"""Damaged case: rank 0's shard as saved, which the agreement without ``direct`` stands in
for the peer node's copy with."""


def _agree_node_local(sources, step=None, *, direct=False, timeout=None):
    """What ``agree`` gives on node-local directories when rank 0's memory is empty and only
    its own node's directory holds its shard; rank 1 holds the step in memory."""
    from flashckpt.restore._node_local import _read_own
    from flashckpt.restore._sources import Agreement, Source

    sources.ready()
    rank = sources.placement.storage_rank
    if INTACT and rank == 0 and not direct:  # the fallback finds an intact copy (a peer node's, really)
        shutil.copyfile(INTACT[0], sources.storage.shard_path(STEP, 0)[0])
    # rank 1: its memory copy; rank 0 without direct: disk -> slot; every rank's done before any reads
    sources.on_all_ranks(lambda: _read_own(sources, STEP) if rank == 1 or not direct else None, "bringing")
    return Agreement(STEP, Source.MEMORY, STEP, (), frozenset({0}) if direct else frozenset())


def _damage(path: str) -> None:
    """Keep ``path`` aside in ``INTACT``, then flip a byte in the middle of its data."""
    shutil.copyfile(path, path + ".intact")
    INTACT.append(path + ".intact")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def _load(rank: int, world: int, directory: str, job: str, tp: int, damaged: bool = False) -> None:
    from megatron.core import parallel_state as ps
    from flashckpt import _engine
    from flashckpt.megatron import MegatronCheckpointer

    model = _gpt.build(2)
    _gpt.perturb(model, 100 + rank)
    blocks = [None] * world
    dist.all_gather_object(blocks, _gpt.main_blocks(model.sharded_state_dict()))
    with MegatronCheckpointer(directory, job_id=job) as ck:
        ck.save(STEP, model.sharded_state_dict(), persist=True)
        ck.wait()
        dist.barrier()  # both shards durable: the step is committed
        if damaged and rank == 0:
            _damage(ck.engine.storage.shard_path(STEP, 0)[0])
        dist.barrier()
    ps.destroy_model_parallel()
    _engine.agree = _agree_node_local  # the engine's agreement, as on node-local directories
    model = _gpt.build(tp, seed=7)
    expected = _gpt.expected_blocks(model.sharded_state_dict(), _gpt.consolidate(blocks))
    with MegatronCheckpointer(directory, job_id=job) as ck:
        state, step = ck.load(model.sharded_state_dict())
        assert step == STEP and ck.last_load.source == "memory", (step, ck.last_load)
        held = STEP in ck.engine.memory_steps()
        assert held == (rank == 1 or damaged), f"rank {rank}: step {STEP} in its slot after the load: {held}"
        model.load_state_dict(state)
    got = model.state_dict()
    bad = [path for path, value in expected if not torch.equal(got[path], value)]
    assert not bad, f"rank {rank}: loaded other values for {bad}"
    ps.destroy_model_parallel()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", [2, 1])
def test_a_rank_reading_its_own_directory_fills_the_model_without_its_slot(tmp_path, job_id, tp):
    run_ranks(_load, 2, str(tmp_path / "ckpt"), job_id, tp, timeout=280)


@pytest.mark.timeout(300)
def test_a_damaged_shard_in_its_own_directory_is_loaded_from_another_copy(tmp_path, job_id):
    """The read straight from the own directory fails its checksum on rank 0: every rank
    then loads through the agreement without ``direct`` (disk -> slot, from the copy that is
    intact), with the saved values."""
    run_ranks(_load, 2, str(tmp_path / "ckpt"), job_id, 2, True, timeout=280)
