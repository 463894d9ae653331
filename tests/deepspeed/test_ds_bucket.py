"""DeepSpeedCheckpointer on an S3 URL (moto), end to end: the flash step commits in the
bucket, the saver exports the DeepSpeed tag and ``latest`` into it (the same bytes a
local export of the step writes), DeepSpeed's own file calls go to a private local
scratch directory, and a new checkpointer loads from memory and, once memory is gone,
from the bucket's flash shards."""

import os

import pytest

from tests.checkpoint._dist import run_ranks
from tests.objectstore.conftest import bucket, moto_server, raw_fs, s3  # noqa: F401 -- fixtures

from . import _ds_train
from .test_ds_engine_kinds import _state


def _equal(a: dict, b: dict):
    import torch
    if sorted(a) != sorted(b):
        return f"keys differ: {sorted(set(a) ^ set(b))}"
    return sorted(k for k in a if not torch.equal(a[k], b[k])) or True

TAG = "global_step2"


def _through_the_bucket(rank, world, url, job):
    from flashckpt.deepspeed import DeepSpeedCheckpointer
    sources = _ds_train.join_group(rank)

    engine = _ds_train.make_engine(1)
    ck = DeepSpeedCheckpointer(engine, url, job_id=job + "a", persist_every=2)
    _ds_train.train_step(engine, rank, 1)
    ck.save(1)
    _ds_train.train_step(engine, rank, 2)
    ck.save(2, client_state={"seen": 16})
    ck.wait()
    reference = _state(engine)
    out = {"latest_step": ck.latest_step()}
    for name, suffix in (("memory", "a"), ("storage", "b")):  # "b": a new job, nothing in memory
        if suffix == "b":
            ck.close()
        fresh = _ds_train.make_engine(1)
        other = DeepSpeedCheckpointer(fresh, url, job_id=job + suffix)
        step = other.load()
        out[name] = {"step": step, "source": sources[-1], "client": other.client_state.get("seen"),
                     "equal": _equal(_state(fresh), reference)}
        other.close()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2])
def test_a_zero1_job_saves_exports_and_loads_through_the_bucket(bucket, tmp_path, monkeypatch, job_id,  # noqa: F811
                                                                 world):
    from flashckpt.deepspeed import _export

    monkeypatch.chdir(tmp_path)
    url = f"s3://{bucket}/run"
    for out in run_ranks(_through_the_bucket, world, url, job_id, timeout=280):
        assert out["latest_step"] == 2
        for name in ("memory", "storage"):
            assert out[name]["step"] == 2 and out[name]["source"] == name, out[name]
            assert out[name]["client"] == 16 and out[name]["equal"] is True, out[name]
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
