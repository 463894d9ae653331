"""torchtitan's checkpoint manager on flashckpt with a chained folder,
``--checkpoint.folder flashckpt::s3://<bucket>/titan``, on moto's S3 server (one rank, FSDP2
over a gloo group of one): saves only in memory survive ``kill -9`` and a new process
resumes from memory through a new manager, while stock torchtitan on the ``s3://`` folder
finds nothing to resume; the saver exports the ``step-N`` folders into the bucket as stock
DCP checkpoints; a step committed whose files are gone resumes from flashckpt's store;
torchtitan's purge (``keep_latest_k``) removes old ``step-N`` folders from the bucket."""

from __future__ import annotations

import uuid

import fsspec
import pytest
import torch.distributed as dist

from flashckpt.dcp import Latest
from flashckpt.dcp.torchtitan import FlashCheckpointManager
from tests.objectstore.conftest import bucket, moto_server, raw_fs, s3, use_endpoint  # noqa: F401 -- fixtures

from .._fork import run_ranks
from ..dcp._common import killed_then_restarted, object_names, wait_for_object
from . import _pieces, _ranks

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


@pytest.fixture(scope="module")
def resumed(moto_server, tmp_path_factory):  # noqa: F811
    """1 rank saves steps 1-3 in memory only into a chained folder and is killed; a new rank
    resumes with flashckpt's manager, trains and saves step 4 and closes. fsspec stays
    configured for the server (here and in the forked ranks) while the module's tests run."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        conf = use_endpoint(moto_server.endpoint, monkeypatch)
        name = f"ckpt-{uuid.uuid4().hex[:12]}"
        fsspec.filesystem("s3", **conf).mkdir(name)
        folder = f"s3://{name}/titan"
        root = str(tmp_path_factory.mktemp("titan-chained"))
        results = killed_then_restarted(root, _ranks.save_then_die, _ranks.resume, world=1,
                                        args=(f"flashckpt::{folder}",))
        yield folder, results, root


def test_a_chained_folder_resumes_from_memory_after_kill_9(resumed):
    folder, [result], _ = resumed
    assert result["stock_before"] == (None, False)  # stock torchtitan on the s3:// folder: nothing to resume
    assert result["latest"] == Latest(3, f"{folder}/step-3", "memory")
    assert result["source"] == "memory", result
    assert result["loaded"] and result["step"] == 3 and result["same"] and result["same_batch"], result


def test_the_bucket_holds_stock_step_folders(resumed):
    folder, _, _ = resumed
    wait_for_object(raw_fs(), f"{folder}/step-4/.metadata")
    assert object_names(raw_fs(), f"{folder}/step-4") == [".metadata", "__0_0.distcp"]


def test_a_step_committed_but_never_exported_resumes_from_the_store(resumed):
    """Step 4's stock files gone from the bucket (as when its saver died between the commit and
    the export) and memory freed: a new manager finds step 4 committed in the run's store, and
    torchtitan's check that ``step-4`` is a folder passes through flashckpt's file system."""
    folder, _, root = resumed
    wait_for_object(raw_fs(), f"{folder}/step-4/.metadata")
    raw_fs().rm(f"{folder}/step-4", recursive=True)
    [result] = run_ranks(_ranks.resume_stock, 1, root, f"flashckpt::{folder}", FlashCheckpointManager)
    assert result["loaded"] and result["step"] == 4 and result["same"] and result["source"] == "storage", result


def test_purge_removes_old_step_folders_from_the_bucket(s3, bucket, tmp_path):  # noqa: F811
    """keep_latest_k=2 over step-1..3 in the bucket: torchtitan's purge thread removes step-1
    through flashckpt's file system."""
    folder = f"s3://{bucket}/run"
    for step in (1, 2, 3):
        raw_fs().pipe(f"{folder}/step-{step}/.metadata", b"m")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        config = FlashCheckpointManager.Config(enable=True, folder=f"flashckpt::{folder}", keep_latest_k=2)
        checkpointer = _pieces.manager(config, _pieces.build(seed=0), str(tmp_path))
        checkpointer._purge_stale_checkpoints()  # what a save ends with
        checkpointer.close()  # joins the purge thread
    finally:
        dist.destroy_process_group()
    raw_fs().invalidate_cache()
    assert sorted(p.rsplit("/", 1)[1] for p in raw_fs().ls(folder)) == ["step-2", "step-3"]
