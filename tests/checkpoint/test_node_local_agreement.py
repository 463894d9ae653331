"""The node-local load agreement when fetching from peer memory fails: it restores the newest
step every rank can get from some node's directory, or raises naming what is missing; it
never fails with an IndexError because no step lies on every node's own disk."""

from types import SimpleNamespace

import pytest

from flashckpt.restore._sources import Source
from flashckpt._errors import CheckpointError, CheckpointNotFoundError
from flashckpt.restore._node_local import agree_node_local

LINE = "0000000000001000abcdef01"
K4, K5, K6 = ((LINE, s) for s in (4, 5, 6))


def _engine(brought: list) -> SimpleNamespace:
    """Two ranks on nodes n0 and n1; fetching from peer memory fails."""
    return SimpleNamespace(
        placement=SimpleNamespace(nodes=("n0", "n1")),
        replicas=SimpleNamespace(endpoints={"n0": ("10.0.0.1", 1), "n1": ("10.0.0.2", 1)},
                                 holders=lambda views: ({}, None),
                                 fetch_missing=lambda step, holders, committed: (False, Source.STORAGE)),
        storage=SimpleNamespace(root="/ck"), collective=SimpleNamespace(rank=0),
        on_all_ranks=lambda fn, what: brought.append(what))


def _views(disk0: list, disk1: list) -> list[dict]:
    return [{"storage_rank": r, "mine": [list(K6)], "replicas": [], "disk": d} for r, d in ((0, disk0), (1, disk1))]


def test_a_failed_fetch_restores_from_a_peers_directory_when_no_disk_holds_it_for_every_rank():
    brought: list = []
    views = _views([[list(K5), [0, 1]]], [])  # node 1's directory was lost with it
    agreement = agree_node_local(_engine(brought), views, None)
    assert (agreement.step, agreement.source) == (5, Source.MEMORY) and brought == ["restoring step 5 on every rank"]


def test_a_failed_fetch_with_no_common_step_on_disk_raises_naming_it():
    views = _views([[list(K4), [0]]], [[list(K5), [1]]])
    with pytest.raises(CheckpointNotFoundError, match="no older step has a copy for every rank"):
        agree_node_local(_engine([]), views, None)


def test_steps_of_another_world_in_the_directories_are_an_error_naming_them_not_a_fresh_start():
    # three nodes saved step 5; node 1 was lost and two remain: nothing of this world anywhere
    fresh = [{**view, "mine": []} for view in _views([], [])]
    assert agree_node_local(_engine([]), fresh, None).step is None  # nothing anywhere: a fresh start
    views = [{**view, "other_worlds": [[5, 3]]} for view in fresh]
    with pytest.raises(CheckpointError, match=r"hold step 5 saved by 3 ranks \(on node\(s\) n0, n1\), and nothing "
                                              r"saved by this run's 2: .* cannot change the number of ranks"):
        agree_node_local(_engine([]), views, None)
