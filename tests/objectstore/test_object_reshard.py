"""Resharding loads on a bucket: an FSDP2 checkpoint saved by 2 gloo ranks to S3 loads
on 1 and on 3 ranks, exactly, and the 3-rank load fetches through the wire (counted by a
relay in front of the server) well below whole shards: each new rank GETs the byte
ranges of its rows (widened to the object store's 1 MiB checksum blocks), not the whole
shards that hold them (twice the checkpoint: the middle rank's rows lie in both old
shards)."""

from __future__ import annotations

import glob
import os

from flashckpt._names import job_prefix

from tests._fork import run_ranks
from . import _reshard_ranks
from .conftest import proxy_to, use_endpoint
from .test_object_storage import store


def _clean(job: str) -> None:
    for path in glob.glob(job_prefix(job) + "*"):
        if not path.endswith((".sock", ".saver.lock")):
            os.unlink(path)


def test_fsdp_saved_on_2_loads_on_1_and_3_by_ranges(moto_server, url, job_id, monkeypatch, tmp_path):
    try:
        originals = str(tmp_path / "originals.pt")
        run_ranks(_reshard_ranks.save, 2, url, job_id + "s", originals, timeout=240)
        storage = store(url)
        meta = storage.metadata(3)
        total = sum(s["size"] for s in meta["shards"].values())
        assert meta["world_size"] == 2 and total > 4 << 20, meta
        one = run_ranks(_reshard_ranks.load, 1, url, job_id + "1", originals, timeout=240)
        assert one[0]["source"] == "storage" and one[0]["resharded"], one
        with proxy_to(moto_server) as proxy:
            use_endpoint(proxy.endpoint, monkeypatch)  # the ranks inherit FSSPEC_S3: every GET crosses the relay
            three = run_ranks(_reshard_ranks.load, 3, url, job_id + "3", originals, timeout=240)
            fetched = proxy.sent_down
        for event in three:
            assert event["source"] == "storage" and event["resharded"], event
            assert event["bytes_read"] == event["needed"], event
        needed = sum(e["needed"] for e in three)
        whole = 2 * total  # whole shards: rank 0 reads old shard 0, rank 2 old shard 1, rank 1 both
        print(f"shards {total} B, the 3 ranks' new shards {needed} B, fetched {fetched} B, whole shards {whole} B")
        # Each range is widened to whole checksum blocks (verified as read) and every rank
        # verifies each source's header block: 1.45 x needed here; 2.3 x with 4 MiB blocks.
        assert needed <= fetched < 0.8 * whole, (fetched, needed, whole)
    finally:
        for suffix in ("s", "1", "3"):
            _clean(job_id + suffix)
