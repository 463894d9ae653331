"""Real gloo process groups: agreement on load, DDP placement, torchrun restarts."""

import glob
import json
import os
import subprocess
import sys

import torch

from flashckpt.torch import Checkpointer, DdpCheckpointer

from tests._fork import run_ranks
from ._torchrun_train import train_reference
from flashckpt._names import job_prefix


def _state(rank: int, step: int) -> dict:
    return {"w": torch.full((1000,), float(step * 10 + rank)), "step": step}


def _save_then_restart(rank: int, world: int, directory: str, job: str, drop_rank1_memory: bool):
    from flashckpt import _events
    ck = Checkpointer(directory, job_id=job, persist_every=1000)
    ck.save(1, _state(rank, 1), persist=True)
    ck.save(2, _state(rank, 2), persist=True)
    ck.wait()
    if rank == 0:
        ck.save(3, _state(rank, 3))  # rank 1 died before saving step 3
    ck._engine._client.close()       # "crash": no flush, memory stays
    torch.distributed.barrier()
    if drop_rank1_memory and rank == 1:  # rank 1 comes back on a new machine
        for path in glob.glob(job_prefix(job) + ".rank1.*"):
            os.unlink(path)
    torch.distributed.barrier()
    sources = []
    _events.subscribe(lambda event, **info: sources.append(info.get("source")) if event == "load" else None)
    restarted = Checkpointer(directory, job_id=job)
    state = _state(rank, 0)
    step = restarted.load(state)
    restarted.close()
    return step, sources[-1], state["w"][0].item(), state["step"]


def test_ranks_agree_on_the_newest_step_all_hold_in_memory(tmp_path, job_id):
    results = run_ranks(_save_then_restart, 2, str(tmp_path), job_id, False)
    assert results == [(2, "memory", 20.0, 2), (2, "memory", 21.0, 2)]


def test_rank_without_memory_makes_all_ranks_load_storage(tmp_path, job_id):
    results = run_ranks(_save_then_restart, 2, str(tmp_path), job_id, True)
    assert results == [(2, "storage", 20.0, 2), (2, "storage", 21.0, 2)]


def _fallback_into_an_empty_dict(rank: int, world: int, directory: str, job: str):
    from flashckpt import CheckpointError
    from flashckpt.memory._rank_slots import RankSlots
    ck = Checkpointer(directory, job_id=job, persist_every=1000)
    ck.save(1, {"w1": torch.full((10,), 1.0 + rank), "tag": "one"}, persist=True)
    ck.wait()
    ck.save(2, {"w2": torch.full((10,), 2.0 + rank), "tag": "two"})  # memory only, other keys (as DeepSpeed tags)
    ck._engine._client.close()  # "crash": no flush, memory stays
    torch.distributed.barrier()
    if rank == 1:
        def changed(*args, **kwargs):
            raise CheckpointError("memory slot changed while loading")
        RankSlots.copy_out = changed
    restarted = Checkpointer(directory, job_id=job)
    target: dict = {}
    step = restarted.load(target)
    restarted.close()
    return step, sorted(target), target["tag"], target["w1"][0].item()


def test_a_memory_load_failing_on_one_rank_writes_nothing_plain_before_the_fallback(tmp_path, job_id):
    """Rank 0's copy succeeded, rank 1's did not: rank 0 must not have written step 2's plain
    values into the state, or the committed step's load into it finds keys of another step."""
    results = run_ranks(_fallback_into_an_empty_dict, 2, str(tmp_path), job_id)
    assert results == [(1, ["tag", "w1"], "one", 1.0), (1, ["tag", "w1"], "one", 2.0)]


def _ddp(rank: int, world: int, directory: str, job: str):
    ck = DdpCheckpointer(directory, job_id=job)
    model = torch.nn.Linear(50, 5)
    torch.manual_seed(0)
    torch.nn.init.normal_(model.weight)  # same on every rank: replicated
    ck.save(4, {"model": model.state_dict(), "step": 4})
    ck.wait()
    slots = sorted(os.path.basename(p) for p in glob.glob(job_prefix(job) + ".rank*.slot*"))
    fresh = torch.nn.Linear(50, 5)
    state = {"model": fresh.state_dict(), "step": 0}
    step = ck.load(state)
    same = torch.equal(fresh.weight, model.weight)
    torch.distributed.barrier()
    ck.close()
    return step, same, slots


def test_ddp_keeps_one_copy_per_node_and_one_on_storage(tmp_path, job_id):
    results = run_ranks(_ddp, 2, str(tmp_path), job_id)
    assert [r[:2] for r in results] == [(4, True), (4, True)]
    assert all(all(".rank0." in s for s in r[2]) for r in results)  # only local rank 0 wrote memory
    assert sorted(os.listdir(tmp_path / "step-4")) == ["metadata.json", "rank-0.done", "rank-0.safetensors"]
    assert json.loads((tmp_path / "step-4" / "metadata.json").read_text())["world_size"] == 1


def _one_rank_fails_loading(rank: int, world: int, directory: str, job: str):
    ck = Checkpointer(directory, job_id=job)
    ck.save(1, {"w": torch.zeros(10)})
    ck.wait()
    state = {"w": torch.zeros(10 if rank == 0 else 11)}  # rank 1 has the wrong shape
    try:
        ck.load(state)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    finally:
        ck.close()
    return None


def test_one_ranks_load_error_reaches_every_rank_without_hanging(tmp_path, job_id):
    results = run_ranks(_one_rank_fails_loading, 2, str(tmp_path), job_id, timeout=60)
    for name, message in results:
        assert name == "StateMismatchError" and "rank 1:" in message and "F32[11]" in message


TORCHRUN_SCRIPT = os.path.join(os.path.dirname(__file__), "_torchrun_train.py")


def test_torchrun_restart_resumes_from_memory_on_all_ranks(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           TORCHRUN_SCRIPT, str(tmp_path / "ckpt"), str(out), "12", "6"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        report = json.loads((out / f"rank{rank}.json").read_text())
        assert report["restart"] == 1
        assert report["loaded_step"] == 6 and report["source"] == "memory"
        final = torch.load(out / f"final{rank}.pt")
        ref = train_reference(rank, 12)  # the same training, uninterrupted
        assert torch.equal(final["weight"], ref["weight"]) and torch.equal(final["bias"], ref["bias"])
