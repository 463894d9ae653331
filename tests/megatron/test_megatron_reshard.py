"""megatron-core GPTModel (CPU, local spec, gloo): save with TP=2 or DP=2, load with TP=1 /
DP=1 reading only the needed ranges; dist_checkpointing strategies; restart from memory."""

import glob
import json
import os
import struct
import uuid

import pytest
import torch

from tests._fork import run_ranks

from . import _gpt
from flashckpt._names import job_prefix

STEP = 5


def _save_job(rank, world, tp, dirs, job):
    """Perturbed model, saved by the checkpointer, by dist_checkpointing with our strategies
    (sync and async), and memory-only by a checkpointer that is never closed (a crash)."""
    from megatron.core import dist_checkpointing, parallel_state as ps
    from flashckpt.megatron import FlashSaveStrategy, MegatronCheckpointer

    model = _gpt.build(tp)
    _gpt.perturb(model, 100 + rank)
    blocks = _gpt.main_blocks(model.sharded_state_dict())
    with MegatronCheckpointer(dirs["flash"], job_id=job + "a") as ck:
        ck.save(STEP, model.sharded_state_dict())
    if "strategy" in dirs:
        with MegatronCheckpointer(dirs["strategy"], job_id=job + "s") as ck:
            for name, use_async in (("iter_0000005", False), ("iter_0000006", True)):
                target = os.path.join(dirs["strategy"], name)
                os.makedirs(target, exist_ok=True)
                request = dist_checkpointing.save(model.sharded_state_dict(), target,
                                                  sharded_strategy=FlashSaveStrategy(ck), async_sharded_save=use_async)
                if use_async:
                    # what AsyncCallsQueue does with it (the queue itself all-reduces on CUDA in
                    # megatron-core 0.16, so it cannot run here): the async part, then finalize
                    assert request.async_fn is None  # nothing left for a background worker
                    for finalize in request.finalize_fns:
                        finalize()
    if "memory" in dirs:
        ck = MegatronCheckpointer(dirs["memory"], job_id=job + "m", persist_every=1000)
        ck.save(STEP, model.sharded_state_dict())  # and the process ends without close()
    ps.destroy_model_parallel()
    return blocks


def _mismatches(model, expected):
    state = model.state_dict()
    return [path for path, value in expected if not torch.equal(state[path], value)]


def _load_job(rank, world, dirs, job, full_tp, full_dp):
    """TP=1, DP=1: load the TP=2 and the DP=2 checkpoints, and the strategy checkpoints."""
    from megatron.core import dist_checkpointing, parallel_state as ps
    from flashckpt import _events
    from flashckpt.megatron import FlashLoadStrategy, MegatronCheckpointer

    loads = []
    _events.subscribe(lambda event, **info: loads.append(info) if event == "load" else None)
    out = {}
    for name, full in (("tp", full_tp), ("dp", full_dp)):
        model = _gpt.build(1, seed=7)
        expected = _gpt.expected_blocks(model.sharded_state_dict(), full)
        with MegatronCheckpointer(dirs[name], job_id=job + name) as ck:
            state, step = ck.load(model.sharded_state_dict())
        model.load_state_dict(state)
        out[name] = {"step": step, "checked": len(expected), "bad": _mismatches(model, expected),
                     "source": loads[-1]["source"]}
        ps.destroy_model_parallel()
    for name in ("iter_0000005", "iter_0000006"):
        model = _gpt.build(1, seed=7)
        expected = _gpt.expected_blocks(model.sharded_state_dict(), full_tp)
        with MegatronCheckpointer(dirs["strategy"], job_id=job + "s") as ck:
            # "return_all" also checks keys against the strategy's load_sharded_metadata
            state, missing, unexpected = dist_checkpointing.load(
                model.sharded_state_dict(), os.path.join(dirs["strategy"], name),
                sharded_strategy=FlashLoadStrategy(ck), strict="return_all")
        model.load_state_dict(state)
        out[name] = {"checked": len(expected), "bad": _mismatches(model, expected),
                     "missing": sorted(missing), "unexpected": sorted(unexpected)}
        ps.destroy_model_parallel()
    return out


def _restart_job(rank, world, dirs, job, full_tp):
    """Same layout (TP=2) as the crashed job: restores from memory; then bad input."""
    from megatron.core import parallel_state as ps
    from flashckpt import CheckpointError, StateMismatchError, _events
    from flashckpt.megatron import MegatronCheckpointer

    loads = []
    _events.subscribe(lambda event, **info: loads.append(info) if event == "load" else None)
    model = _gpt.build(2, seed=7)
    expected = _gpt.expected_blocks(model.sharded_state_dict(), full_tp)
    with MegatronCheckpointer(dirs["memory"], job_id=job + "m", persist_every=1000) as ck:
        state, step = ck.load(model.sharded_state_dict())
    model.load_state_dict(state)
    out = {"step": step, "source": loads[-1]["source"], "checked": len(expected), "bad": _mismatches(model, expected)}
    ps.destroy_model_parallel()

    other = _gpt.build(2, seed=7, hidden=48)  # another model
    with MegatronCheckpointer(dirs["flash"], job_id=job + "x") as ck:
        try:
            ck.load(other.sharded_state_dict())
            out["other_model"] = None
        except StateMismatchError as exc:
            out["other_model"] = str(exc)
        with pytest.raises(CheckpointError, match="no flashckpt.json"):
            from flashckpt.megatron import FlashLoadStrategy
            FlashLoadStrategy(ck).load({}, dirs["flash"])
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    job = "t" + uuid.uuid4().hex[:10]
    tp = {"flash": str(root / "tp2"), "strategy": str(root / "strategy"), "memory": str(root / "memory")}
    dp = {"flash": str(root / "dp2")}
    blocks_tp = run_ranks(_save_job, 2, 2, tp, job + "tp", timeout=240)
    blocks_dp = run_ranks(_save_job, 2, 1, dp, job + "dp", timeout=240)
    yield {"root": root, "job": job, "tp": tp, "dp": dp,
           "full_tp": _gpt.consolidate(blocks_tp), "full_dp": _gpt.consolidate(blocks_dp),
           "blocks_dp": blocks_dp}
    for path in glob.glob(job_prefix(job) + "*"):
        if not path.endswith((".sock", ".saver.lock")):
            os.unlink(path)


def _tensor_entries(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return [k for k in header if k != "__metadata__"]


@pytest.mark.timeout(300)
def test_tp2_and_dp2_checkpoints_load_with_tp1_dp1(saved):
    full_tp, full_dp = saved["full_tp"], saved["full_dp"]
    assert not any(torch.isnan(t).any() for t in full_tp.values())  # the TP=2 blocks tile every tensor
    # data parallel: only replica 0 writes; rank 1's shard holds no tensor
    assert saved["blocks_dp"][1] == []
    assert _tensor_entries(os.path.join(saved["dp"]["flash"], f"step-{STEP}", "rank-1.safetensors")) == []
    assert _tensor_entries(os.path.join(saved["tp"]["flash"], f"step-{STEP}", "rank-1.safetensors"))

    dirs = {"tp": saved["tp"]["flash"], "dp": saved["dp"]["flash"], "strategy": saved["tp"]["strategy"]}
    (out,) = run_ranks(_load_job, 1, dirs, saved["job"] + "L", full_tp, full_dp, timeout=240)
    for name in ("tp", "dp", "iter_0000005", "iter_0000006"):
        assert out[name]["checked"] >= 20 and out[name]["bad"] == [], (name, out[name])
    for name in ("iter_0000005", "iter_0000006"):
        assert out[name]["missing"] == [] and out[name]["unexpected"] == [], (name, out[name])
    assert out["tp"]["step"] == STEP and out["tp"]["source"] == "storage"
    assert out["dp"]["step"] == STEP
    # megatron wrote its own metadata, naming our backend
    meta = json.loads((saved["root"] / "strategy" / "iter_0000006" / "metadata.json").read_text())
    assert meta["sharded_backend"] == "flashckpt"


@pytest.mark.timeout(300)
def test_same_layout_restart_from_memory_and_bad_input(saved):
    results = run_ranks(_restart_job, 2, saved["tp"], saved["job"] + "tp", saved["full_tp"], timeout=240)
    for out in results:
        assert out["step"] == STEP and out["source"] == "memory"
        assert out["checked"] >= 20 and out["bad"] == []
        assert out["other_model"] is not None and "global shape" in out["other_model"]


def test_a_flipped_byte_in_a_saved_block_is_a_checksum_error(saved, tmp_path):
    """Storage reads for another layout verify the checksums of the blocks they touch."""
    import shutil

    from flashckpt import CorruptCheckpointError
    from flashckpt.restore._shard_read import open_shard
    from flashckpt.storage._local import LocalStorage

    shutil.copytree(saved["tp"]["flash"], tmp_path / "ck")
    storage = LocalStorage(str(tmp_path / "ck"))
    path, _ = storage.shard_path(STEP, 0)
    with open_shard(storage, STEP, 0) as reader:
        entry = max(reader.image.entries, key=lambda e: e.nbytes)
        at = reader.body_start + entry.offset
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0xFF]))
    with pytest.raises(CorruptCheckpointError, match=r"rank-0\.safetensors: checksum"):
        with open_shard(storage, STEP, 0) as reader:  # the file is one block: the header's check reads it
            reader.verify_header()
            reader.readinto(memoryview(bytearray(entry.nbytes)), at)
