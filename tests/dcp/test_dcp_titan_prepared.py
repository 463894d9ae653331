"""torchtitan's checkpoint manager on flashckpt readies the first save of a fresh start at
``load`` (``flashckpt.dcp.prepare``): that save maps no fresh shared memory."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from flashckpt.dcp._run import run_for
from flashckpt.memory import _slot

pytest.importorskip("torchtitan")

from flashckpt.dcp.torchtitan import FlashCheckpointManager  # noqa: E402

from ..titan import _pieces  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:'set_vital' is deprecated"),
              pytest.mark.skipif(not _slot._POPULATE_WRITE, reason="the kernel lacks MADV_POPULATE_WRITE")]


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_fresh_start_readies_the_first_save(tmp_path, populates, one_rank):
    training = _pieces.build(seed=0)
    config = FlashCheckpointManager.Config(enable=True, folder="checkpoint", interval=2)
    checkpointer = _pieces.manager(config, training, str(tmp_path))
    try:
        assert checkpointer.load() is False  # a fresh start
        run_for(str(tmp_path / "checkpoint" / ".flashckpt"), None).engine.slots.prepared()  # training runs
        training.step()
        training.step()
        before = len(populates)
        checkpointer.save(2)
        assert populates[before:] == [], "the first save populated slot pages itself"
    finally:
        checkpointer.close()
