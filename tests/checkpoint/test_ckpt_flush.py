"""What a flush writes: the newest step, and an older one only when the newest cannot commit.

Two ranks of one job live in this process (and, for the dead peer, a spawned process):
engines with hand-made placements, so the saver sees two trainers of one node.
"""

import multiprocessing as mp
import os
import signal

import torch

from flashckpt._engine import Engine, Options, Placement, new_token
from flashckpt.storage._local import LocalStorage
from flashckpt.torch import _tensors  # noqa: F401  (registers torch tensors as leaves)


def _engine(directory: str, job_id: str, rank: int, token: str) -> Engine:
    placement = Placement(local_rank=rank, memory_rank=rank, writes_memory=True, storage_rank=rank,
                          storage_world=2, persists=True, token=token)
    return Engine(directory, Options(persist_every=1000, keep_last=0, job_id=job_id), placement)


def _state(step: int) -> dict:
    return {"w": torch.full((4096,), float(step))}


def _rank1_saves_then_dies(directory: str, job_id: str, token: str, steps: list[int]) -> None:
    engine = _engine(directory, job_id, 1, token)
    for step in steps:
        engine.save(step, _state(step))
    os.kill(os.getpid(), signal.SIGKILL)  # mid-training: no close, no flush of its own


def test_clean_close_of_all_ranks_commits_only_the_newest_step(tmp_path, job_id):
    token = new_token()
    ranks = [_engine(str(tmp_path), job_id, rank, token) for rank in (0, 1)]
    for step in (5, 6):
        for engine in ranks:
            engine.save(step, _state(step))
    for engine in ranks:
        engine.close()
    storage = LocalStorage(str(tmp_path))
    assert storage.committed_steps() == [6]
    assert [n for n in os.listdir(tmp_path) if n.startswith("step-")] == ["step-6"]  # no leftovers


def test_a_peer_dead_before_the_newest_save_leaves_the_older_step_committed(tmp_path, job_id):
    """Rank 1 died holding step 5 only; rank 0 holds 5 and 6. Step 6 can never commit, so
    rank 0's flush also writes its copy of 5, which the saver's crash flush of rank 1 completes."""
    token = new_token()
    rank0 = _engine(str(tmp_path), job_id, 0, token)
    rank0.save(5, _state(5))
    peer = mp.get_context("spawn").Process(target=_rank1_saves_then_dies, args=(str(tmp_path), job_id, token, [5]))
    peer.start()
    peer.join(60)
    assert peer.exitcode == -signal.SIGKILL
    rank0.save(6, _state(6))
    rank0.close()
    storage = LocalStorage(str(tmp_path))
    assert storage.latest_step() == 5 and storage.committed_steps() == [5]
    got = {"w": torch.zeros(4096)}
    reader = _engine(str(tmp_path), job_id, 0, token)
    reader.discard_newer_than(-1)  # read storage, not what is left in memory
    assert reader.load(got) == 5 and torch.equal(got["w"], _state(5)["w"])
    reader.close()
