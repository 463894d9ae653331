"""DeepSpeedCheckpointer on an S3 URL (moto), end to end: the flash step commits in the
bucket, the saver exports the DeepSpeed tag and ``latest`` into it (the same bytes a
local export of the step writes), DeepSpeed's own file calls go to a private local
scratch directory, and a new checkpointer loads from memory and, once memory is gone,
from the bucket's flash shards."""

import os

import pytest

from tests._fork import run_ranks
from tests.objectstore.conftest import bucket, moto_server, raw_fs, s3  # noqa: F401 -- fixtures

from . import _ds_train
from .test_ds_engine_kinds import _state


def _equal(live: dict, saved: dict):
    """Whether ``live`` (tensors by path) equals ``saved`` (numpy arrays: they pickle
    between processes), else what differs."""
    import torch
    if sorted(live) != sorted(saved):
        return f"keys differ: {sorted(set(live) ^ set(saved))}"
    return sorted(k for k in live if not torch.equal(live[k], torch.from_numpy(saved[k]))) or True

TAG = "global_step2"


def _train_and_exit(rank, world, url, job):
    """Saves steps 1 (memory only) and 2 (persisted, exported) and exits without closing:
    its memory outlives the process."""
    from flashckpt.deepspeed import DeepSpeedCheckpointer
    _ds_train.join_group(rank)
    engine = _ds_train.make_engine(1)
    ck = DeepSpeedCheckpointer(engine, url, job_id=job, persist_every=2)
    for step in (1, 2):
        _ds_train.train_step(engine, rank, step)
        ck.save(step, client_state={"seen": 8 * step})
    ck.wait()
    return {"latest_step": ck.latest_step(), "state": {k: v.numpy() for k, v in _state(engine).items()}}


def _load_in_a_new_process(rank, world, url, job, reference):
    from flashckpt.deepspeed import DeepSpeedCheckpointer
    sources = _ds_train.join_group(rank)
    fresh = _ds_train.make_engine(1)
    with DeepSpeedCheckpointer(fresh, url, job_id=job) as ck:
        step = ck.load()
        return {"step": step, "source": sources[-1], "client": ck.client_state.get("seen"),
                "equal": _equal(_state(fresh), reference[rank])}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2])
def test_a_zero1_job_saves_exports_and_loads_through_the_bucket(bucket, tmp_path, monkeypatch, job_id,  # noqa: F811
                                                                 world):
    from flashckpt.deepspeed import _export

    monkeypatch.chdir(tmp_path)
    url = f"s3://{bucket}/run"
    saved = run_ranks(_train_and_exit, world, url, job_id + "a", timeout=280)
    assert [out["latest_step"] for out in saved] == [2] * world
    reference = [out["state"] for out in saved]
    for name, suffix in (("memory", "a"), ("storage", "b")):  # "a" closes: its memory is gone for "b"
        for out in run_ranks(_load_in_a_new_process, world, url, job_id + suffix, reference, timeout=280):
            assert out["step"] == 2 and out["source"] == name, out
            assert out["client"] == 16 and out["equal"] is True, out
    assert os.listdir(tmp_path) == [], "a local directory was made for the URL"
    fs = raw_fs()
    fs.invalidate_cache()
    assert fs.exists(f"{bucket}/run/flashckpt/step-2/metadata.json")
    assert fs.cat_file(f"{bucket}/run/latest") == TAG.encode()
    local = tmp_path / "local"  # the same step exported from the bucket's shards into a local directory
    _export.export(f"{url}/flashckpt", 2, {"save_dir": str(local), "tag": TAG, "save_latest": True})
    names = sorted(os.listdir(local / TAG))
    assert sorted(os.path.basename(k) for k in fs.find(f"{bucket}/run/{TAG}")) == names
    assert len(names) == 1 + world  # model states, one optimizer state file per rank
    for name in names:
        assert fs.cat_file(f"{bucket}/run/{TAG}/{name}") == (local / TAG / name).read_bytes(), name


def _stock_tag(rank, world, url, job):
    from flashckpt import CheckpointNotFoundError
    from flashckpt.deepspeed import DeepSpeedCheckpointer
    _ds_train.join_group(rank)
    engine = _ds_train.make_engine(1)
    with DeepSpeedCheckpointer(engine, f"{url}/empty", job_id=job + "e") as ck:
        out = {"empty": ck.load()}
    with DeepSpeedCheckpointer(engine, url, job_id=job + "s") as ck:
        try:
            ck.load()
            out["stock"] = "loaded"
        except CheckpointNotFoundError as exc:
            out["stock"] = str(exc)
    return out


@pytest.mark.timeout(200)
def test_a_bucket_with_no_flash_step_loads_nothing_and_a_stock_tag_there_is_a_clear_error(
        bucket, tmp_path, monkeypatch, job_id):  # noqa: F811
    monkeypatch.chdir(tmp_path)
    url = f"s3://{bucket}/run"
    raw_fs().pipe({f"{bucket}/run/latest": b"global_step9",
                   f"{bucket}/run/global_step9/mp_rank_00_model_states.pt": b"stock"})
    [out] = run_ranks(_stock_tag, 1, url, job_id, timeout=180)
    assert out["empty"] is None
    assert "holds DeepSpeed tag 'global_step9'" in out["stock"] and "loads from its flash step only" in out["stock"]
    assert os.listdir(tmp_path) == []


def _retained(rank, world, url, job):
    from flashckpt.deepspeed import DeepSpeedCheckpointer
    _ds_train.join_group(rank)
    engine = _ds_train.make_engine(1)
    with DeepSpeedCheckpointer(engine, url, job_id=job, persist_every=1, keep_last=1) as ck:
        for step in (1, 2, 3):
            _ds_train.train_step(engine, rank, step)
            ck.save(step)
            ck.wait()
        return ck.latest_step(), ck.load(tag="global_step3")  # the tag's step, found in the bucket


@pytest.mark.timeout(200)
def test_keep_last_retires_the_tags_in_the_bucket_with_their_steps(bucket, job_id):  # noqa: F811
    url = f"s3://{bucket}/run"
    assert run_ranks(_retained, 1, url, job_id, timeout=180) == [(3, 3)]
    fs = raw_fs()
    fs.invalidate_cache()
    assert sorted(k.rsplit("/", 1)[-1] for k in fs.ls(f"{bucket}/run/flashckpt") if "step-" in k) == ["step-3"]
    tags = sorted(k.rsplit("/", 1)[-1] for k in fs.ls(f"{bucket}/run") if "global_step" in k)
    assert tags == ["global_step3"] and fs.cat_file(f"{bucket}/run/latest") == b"global_step3"
