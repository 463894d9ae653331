"""flashckpt.tf.Checkpointer on an S3 URL (moto): the step commits in the bucket, the
saver's export puts a stock TF checkpoint into it (``step-<N>/tf/``: the files a local
export of the step writes, and a ``checkpoint`` state file that finds them), a new
checkpointer loads from memory and, once memory is gone, from the bucket; exporting
from the trainer to a URL is a clear error (TF writes that prefix's files itself)."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from flashckpt import CheckpointError, _events
from flashckpt.tf import Checkpointer
from tests.objectstore.conftest import bucket, moto_server, raw_fs, s3, url  # noqa: F401 -- fixtures

from ._models import dense_model, same, values


@pytest.fixture
def sources():
    seen = []

    def listen(event, **info):
        if event == "load":
            seen.append(info["source"])

    _events.subscribe(listen)
    yield seen
    _events.unsubscribe(listen)


def test_save_export_and_load_through_the_bucket(url, bucket, tmp_path, job_id, sources):  # noqa: F811
    model = dense_model()
    saved = values(model)
    with Checkpointer(url, model, job_id=job_id + "a") as ckpt:
        ckpt.save(4, export=True)
        ckpt.wait()
        local = ckpt.export(tmp_path / "local" / "ckpt", step=4)  # read from the bucket's shard
        again = dense_model(trained=False, seed=1)
        assert Checkpointer(url, again, job_id=job_id + "a").load() == 4 and sources[-1] == "memory"
        assert same(values(again), saved)
    fresh = dense_model(trained=False, seed=2)
    with Checkpointer(url, fresh, job_id=job_id + "b") as other:
        assert other.load() == 4 and sources[-1] == "storage"
    assert same(values(fresh), saved)

    fs = raw_fs()
    fs.invalidate_cache()
    top = f"{url[len('s3://'):]}/step-4"
    assert fs.exists(f"{top}/metadata.json")
    names = sorted(os.path.basename(k) for k in fs.find(f"{top}/tf"))
    assert names == sorted(os.listdir(tmp_path / "local")), names
    for name in names:
        if name != "checkpoint":  # the state file records when it was written
            assert fs.cat_file(f"{top}/tf/{name}") == (tmp_path / "local" / name).read_bytes(), name
    fs.get(f"{top}/tf/", str(tmp_path / "downloaded") + "/", recursive=True)
    restored = dense_model(trained=False, seed=3)
    restored.optimizer.build(restored.trainable_variables)
    found = tf.train.latest_checkpoint(str(tmp_path / "downloaded"))
    assert found is not None and os.path.basename(found) == os.path.basename(local)
    tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).restore(found).assert_consumed()
    assert same(values(restored), saved)


def test_exporting_from_the_trainer_to_a_url_is_a_clear_error(tmp_path, job_id, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with Checkpointer(tmp_path / "flash", dense_model(), job_id=job_id) as ckpt:
        ckpt.save(1)
        with pytest.raises(CheckpointError, match=r"local prefix, not s3://bucket/out/ckpt"):
            ckpt.export("s3://bucket/out/ckpt")
    assert sorted(os.listdir(tmp_path)) == ["flash"], "a local directory was made for the URL"


def test_keep_last_retires_the_tf_checkpoints_in_the_bucket_with_their_steps(url, job_id):  # noqa: F811
    with Checkpointer(url, dense_model(), job_id=job_id, keep_last=1) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, export=True)
            ckpt.wait()
    fs = raw_fs()
    fs.invalidate_cache()
    root = url[len("s3://"):]
    assert sorted({k[len(root) + 1:].split("/")[0] for k in fs.find(root) if "/step-" in k}) == ["step-3"]
    assert fs.exists(f"{root}/step-3/tf/checkpoint")


_TRAINER = textwrap.dedent("""
    import sys
    import numpy as np
    from flashckpt.tf import Checkpointer
    from tests.tf._models import dense_model, values
    url, job, out = sys.argv[1:]
    model = dense_model()
    ckpt = Checkpointer(url, model, job_id=job)
    ckpt.save(5, export=True)
    ckpt.wait()
    np.savez(out, *values(model))
""")  # exits without close: the step stays in memory


def test_a_new_process_loads_from_memory_then_from_the_bucket(url, tmp_path, job_id, sources):  # noqa: F811
    out = tmp_path / "saved.npz"
    done = subprocess.run([sys.executable, "-c", _TRAINER, url, job_id, str(out)], capture_output=True, text=True,
                          timeout=240, cwd=os.getcwd())
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(out) as f:
        saved = [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]
    for suffix, source in (("", "memory"), ("b", "storage")):  # the first closes: memory is gone for "b"
        model = dense_model(trained=False, seed=4)
        with Checkpointer(url, model, job_id=job_id + suffix) as ckpt:
            assert ckpt.load() == 5 and sources[-1] == source
        assert same(values(model), saved)
