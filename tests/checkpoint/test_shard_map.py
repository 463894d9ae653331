"""An exporter reads each shard from disk once.

The Hugging Face and TF exporters write their files from a read-only map of the
committed shard. They used to verify the shard with a full read that dropped the pages
it had read from the cache (as a load does), and then the writes read every page from
disk again through the map. ``ShardReader.map_verified`` verifies with a read that
leaves the pages in the cache, so the writes read the verified pages from memory.
"""

import os

import numpy as np
import pytest

from flashckpt._errors import CorruptCheckpointError
from flashckpt.restore._shard_read import _resident_pages, open_shard
from flashckpt.storage._local import LocalStorage
from flashckpt.torch._image_views import read_shard, unpickler

from .test_storage_lineage import image, token

NBYTES = 24 << 20  # six checksum blocks


def _committed(tmp_path) -> tuple[LocalStorage, str]:
    """A committed one-rank step 4 whose shard is not in the page cache."""
    storage, tok = LocalStorage(tmp_path), token()
    storage.write_shard(4, 0, tok, image(4, tok, NBYTES))
    assert storage.try_commit(4, 1, tok, 0, branch=-1)
    path = os.path.join(storage.step_dir(4), "rank-0.safetensors")
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    return storage, path


def test_the_hf_exporter_leaves_the_pages_it_verified_in_memory_for_its_writes(tmp_path):
    storage, _ = _committed(tmp_path)
    with open_shard(storage, 4, 0) as reader:
        tree, mm = read_shard(reader, unpickler(False, "no pickles here"))
        resident = _resident_pages(reader.fileno(), reader.size)
    assert np.all(tree["w"] == 4) and tree["w"].nbytes == NBYTES
    assert resident.count(1) >= 0.9 * len(resident), f"{resident.count(1)} of {len(resident)} pages cached"
    del tree
    mm.close()


def test_a_damaged_block_of_a_mapped_shard_is_named(tmp_path):
    storage, path = _committed(tmp_path)
    with open(path, "r+b") as f:
        f.seek(13 << 20)
        f.write(b"\xff")
    with open_shard(storage, 4, 0) as reader:
        with pytest.raises(CorruptCheckpointError, match=r"bytes 12582912-16777216 does not match"):
            reader.map_verified()


def test_a_shard_shorter_than_its_commit_is_refused_before_it_is_mapped(tmp_path):
    storage, path = _committed(tmp_path)
    with open_shard(storage, 4, 0) as reader:
        os.truncate(path, 5 << 20)  # after the header was read: a map of it would fault past the end
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            reader.map_verified()
