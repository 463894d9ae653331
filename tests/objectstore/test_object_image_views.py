"""The exporters' views of a step committed in a bucket: a shard there has no file to
map, so it is read whole into memory, every block verified, and a damaged one is an
error naming it."""

import pytest
import torch

from flashckpt import CorruptCheckpointError
from flashckpt.storage._url import open_storage
from flashckpt.torch import Checkpointer
from flashckpt.torch._image_views import step_trees, unpickler

from .conftest import raw_fs


def _committed(url: str, job_id: str) -> torch.Tensor:
    w = torch.arange(300_000, dtype=torch.float32)
    with Checkpointer(url, job_id=job_id) as ck:
        ck.save(4, {"w": w, "step": 4}).wait()
    return w


def test_a_step_in_a_bucket_gives_its_trees_without_a_held_image(url, job_id):
    w = _committed(url, job_id)
    with step_trees(open_storage(url), 4, 1, None, unpickler(False, "no pickles")) as ranks:
        assert torch.equal(ranks[0]["w"], w) and ranks[0]["step"] == 4


def test_a_damaged_shard_in_a_bucket_is_an_error_naming_it(url, job_id):
    _committed(url, job_id)
    storage = open_storage(url)
    key = f"{url[len('s3://'):]}/step-4/{storage.metadata(4)['shards']['0']['file']}"
    fs = raw_fs()
    data = bytearray(fs.cat_file(key))
    data[-10] ^= 0xFF
    fs.pipe_file(key, bytes(data))
    with pytest.raises(CorruptCheckpointError, match="rank-0"):
        with step_trees(open_storage(url), 4, 1, None, unpickler(False, "no pickles")):
            pass
