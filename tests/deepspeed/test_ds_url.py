"""DeepSpeed and object-store URLs: a URL that cannot be served is a clear error (it never
becomes a local ``./s3:/...`` directory), ``engine.save_checkpoint`` to a URL is refused
before DeepSpeed writes there, and the saver's DeepSpeed exporter writes a tag into a
bucket through the storage layer when the step was committed there (the whole job:
``test_ds_bucket.py``)."""

import os
import tempfile
import types

import pytest

from flashckpt import CheckpointError
from flashckpt.deepspeed import DeepSpeedCheckpointer, FlashCheckpointEngine
from tests.objectstore.conftest import bucket, moto_server, raw_fs, s3  # noqa: F401 -- fixtures

from ..checkpoint import test_export_hold
from .test_ds_export_memory import STEP, TAG, _held, committed  # noqa: F401 -- a fixture


def _engine() -> types.SimpleNamespace:
    """What the checkpointer needs of a DeepSpeed engine before it opens anything."""
    return types.SimpleNamespace(save_checkpoint=None, checkpoint_engine="stock")


def test_a_url_that_cannot_be_served_is_a_clear_error_and_never_becomes_a_local_directory(
        tmp_path, monkeypatch, job_id):
    monkeypatch.chdir(tmp_path)
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "FSSPEC_S3"):
        monkeypatch.delenv(var, raising=False)
    engine = _engine()
    with pytest.raises(CheckpointError, match=r"s3://bucket/run1/flashckpt is not writable"):
        DeepSpeedCheckpointer(engine, "s3://bucket/run1", job_id=job_id)
    assert os.listdir(tmp_path) == [] and engine.checkpoint_engine == "stock"


def test_engine_save_checkpoint_to_a_url_is_refused_before_deepspeed_writes_there(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    flash = FlashCheckpointEngine(lambda *args: None)
    with pytest.raises(CheckpointError, match="cannot be an object-store URL"):
        flash.makedirs("s3://bucket/run1", exist_ok=True)  # DeepSpeed's first call in save_checkpoint
    assert os.listdir(tmp_path) == []


def test_the_exporter_puts_the_tag_and_latest_into_the_bucket_and_retains_there(
        committed, tmp_path, bucket):  # noqa: F811
    """The saver's path (persist the held slot to the bucket, commit, export from the
    held image): the tag's files are those a local export writes, byte for byte; a tag
    whose step is no longer committed is deleted from the bucket."""
    storage, expected = committed
    url = f"s3://{bucket}/run1"
    fs = raw_fs()
    fs.pipe({f"{bucket}/run1/global_step1/mp_rank_00_model_states.pt": b"retired",
             f"{bucket}/run1/.flashckpt-tags.json": b'[["global_step1", 1, "gone"]]'})
    path, info = _held(storage, tmp_path, url)
    info["directory"] = f"{url}/flashckpt"
    assert test_export_hold.export_held(path, info) == [None]
    assert fs.exists(f"{bucket}/run1/flashckpt/step-{STEP}/metadata.json")
    assert fs.cat_file(f"{bucket}/run1/latest") == TAG.encode()
    fs.invalidate_cache()
    names = sorted(os.listdir(expected))
    assert sorted(os.path.basename(k) for k in fs.find(f"{bucket}/run1/{TAG}")) == names
    for name in names:
        with open(os.path.join(expected, name), "rb") as f:
            assert fs.cat_file(f"{bucket}/run1/{TAG}/{name}") == f.read(), name
    assert not fs.exists(f"{bucket}/run1/global_step1/mp_rank_00_model_states.pt"), "a retired tag was kept"


def test_the_scratch_of_a_url_is_held_while_used_and_a_crashed_runs_goes(tmp_path, monkeypatch, bucket, job_id):  # noqa: F811
    """DeepSpeed's local scratch for a URL is held by the live checkpointer (``flashckpt gc``
    and the next run keep it); one a crashed trainer left is removed when the next starts."""
    from flashckpt.storage._scratch import remove_dead_scratch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    crashed = tmp_path / "flashckpt-deepspeed-crashed1"  # no process holds it
    crashed.mkdir()
    engine = _engine()
    with DeepSpeedCheckpointer(engine, f"s3://{bucket}/run1", job_id=job_id) as ck:
        assert not crashed.exists()
        assert os.path.dirname(ck._scratch) == str(tmp_path) and remove_dead_scratch() == ([], [ck._scratch])
    assert not os.path.exists(ck._scratch) and engine.checkpoint_engine == "stock"
