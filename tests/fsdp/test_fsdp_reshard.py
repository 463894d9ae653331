"""Resharding: FSDP2 saved on 4 ranks loads on 2, 3 and 1, and 2 -> 4; FSDP1 saved on 2
loads on 1 (FSDP1) and on 3 (FSDP2); a DCP checkpoint imported by ``convert`` loads on 3;
HSDP (2 replicas x 2 shards) loads as FSDP on the same 4 ranks (another mesh).
Parameters and optimizer moments equal the consolidated originals exactly, on a model
whose dimensions are not divisible by the world size, and each rank reads exactly the
bytes of its new shards (``_fsdp_ranks.load``)."""

import os

import pytest

from flashckpt.restore._reshard import chunk_pieces, read_sources
from flashckpt.storage._local import LocalStorage

from .conftest import assert_ok


def test_fsdp2_pieces_follow_torch_chunk(ran4, fsdp_root):
    assert_ok(ran4, "save w4")
    sources = read_sources(LocalStorage(os.path.join(fsdp_root, "w4")), 3)
    for name, shape in [("l1.weight", (13, 6)), ("head.weight", (3, 5)), ("l2.bias", (5,))]:
        for rank, src in enumerate(sources):
            assert src.piece(f"model/{name}") == chunk_pieces(shape, 4)[rank], (name, rank)
    assert sources[3].piece("model/head.weight").lengths == (0, 5)  # 3 rows on 4 ranks: one empty shard


def test_2_to_4(ran4):
    assert_ok(ran4, "2->4")


def test_another_mesh_same_world_hsdp_to_fsdp(ran4, fsdp_root):
    """HSDP's replicated pieces are read once; the 4-rank FSDP load reshards them."""
    assert_ok(ran4, "save h4")
    sources = read_sources(LocalStorage(os.path.join(fsdp_root, "h4")), 3)
    pieces = [src.piece("model/l1.weight") for src in sources]
    assert pieces[0] == pieces[2] and pieces[1] == pieces[3] and pieces[0] != pieces[1]  # replicas 0,1 x shards
    assert_ok(ran4, "hsdp 2x2->fsdp 4")


def test_4_to_2(ran2b):
    assert_ok(ran2b, "4->2")


@pytest.mark.parametrize("check", ["4->3", "fsdp1 2->fsdp2 3", "dcp 4->3"])
def test_on_3(ran3, check):
    assert_ok(ran3, check)


@pytest.mark.parametrize("check", ["4->1", "fsdp1 2->1"])
def test_on_1(ran1, check):
    assert_ok(ran1, check)
