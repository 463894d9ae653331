"""Node-local directories, an FSDP load (2 gloo ranks): a rank whose memory lacks the agreed
step but whose own node's directory holds its shard reads it from there straight into the
model and optimizer (one copy, as ``Engine.load`` does), never disk -> slot -> tensors.

The node-local agreement is stood in for (its two outcomes are
``tests/checkpoint/test_node_local_one_copy.py``'s): asked for ``direct``, rank 0 is named in
``own_disk``; not asked, it brings its shard into its slot first (``_read_own``), as a real
node-local agreement does. Rank 1 holds the step in memory either way."""

import pytest
import torch.distributed as dist

from tests._fork import run_ranks

from ._fsdp_common import assert_equal_states, full_state, make, train_step

STEP = 5


def _agree_node_local(sources, step=None, *, direct=False, timeout=None):
    """What ``agree`` gives on node-local directories when rank 0's memory is empty and only
    its own node's directory holds its shard; rank 1 holds the step in memory."""
    from flashckpt.restore._node_local import _read_own
    from flashckpt.restore._sources import Agreement, Source

    sources.ready()
    rank = sources.placement.storage_rank
    if rank == 1 or not direct:
        _read_own(sources, STEP)  # rank 1: its memory copy; rank 0 without direct: disk -> slot
    return Agreement(STEP, Source.MEMORY, STEP, (), frozenset({0}) if direct else frozenset())


def _load(rank: int, world: int, directory: str, job: str) -> None:
    from flashckpt import _engine
    from flashckpt.torch import FsdpCheckpointer

    model, opt = make(0)
    with FsdpCheckpointer(directory, job_id=job) as ck:
        train_step(model, opt, rank, 1)
        ck.save(STEP, model, opt, extra={"step": STEP}, persist=True).wait(timeout=60)
        dist.barrier()  # both shards durable: the step is committed
    want = full_state(model, opt)
    _engine.agree = _agree_node_local  # the engine's agreement, as on node-local directories
    model, opt = make(1)
    with FsdpCheckpointer(directory, job_id=job) as ck:
        assert ck.load(model, opt) == STEP and ck.extra == {"step": STEP}
        assert ck.last_load.source == "memory"
        held = STEP in ck.engine.memory_steps()
        assert held == (rank == 1), f"rank {rank}: step {STEP} in its slot after the load: {held}"
        assert_equal_states(full_state(model, opt), want, f"rank {rank}: ")


@pytest.mark.timeout(200)
def test_a_rank_reading_its_own_directory_fills_the_model_without_its_slot(tmp_path, job_id):
    run_ranks(_load, 2, str(tmp_path / "ckpt"), job_id, timeout=180)
