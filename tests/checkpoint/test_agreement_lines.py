"""The one agreement rule on a shared directory names memory copies by (line, step), as the
node-local rule does: a peer's replica of an abandoned line's higher step number never
stands for the newest copy (it would lose to storage and a newer line's memory copy with it)."""

from types import SimpleNamespace

from flashckpt.restore._agreement import agree
from flashckpt.restore._sources import Source

OLD, NEW = "0000000000001000abcdef01", "0000000000002000abcdef01"
A6, B4, B5 = [OLD, 6], [NEW, 4], [NEW, 5]


def _sources(views: list[dict], fetched: list) -> SimpleNamespace:
    """Two ranks on nodes n0 and n1 of a shared directory; node n0 keeps rank 1's replicas."""
    def fetch_missing(step, holders, committed):
        fetched.append((step, sorted(holders)))
        return step, Source.MEMORY
    return SimpleNamespace(
        ready=lambda: None, collective=SimpleNamespace(rank=0), node_local=None,
        placement=SimpleNamespace(nodes=("n0", "n1")), storage=SimpleNamespace(root="/ck"),
        replicas=SimpleNamespace(endpoints={"n0": ("10.0.0.1", 1), "n1": ("10.0.0.2", 1)},
                                 holders=lambda views: {(1, 6): [("10.0.0.1", 1)], (1, 5): [("10.0.0.1", 1)]},
                                 fetch_missing=fetch_missing),
        on_all_ranks=lambda fn, what: views)


def test_the_newest_line_in_memory_wins_over_a_higher_step_of_an_abandoned_line():
    views = [{"memory": [5, 6], "mine": [A6, B5], "committed": [4], "newest": tuple(B4), "storage_rank": 0,
              "replicas": [(1, 6, A6), (1, 5, B5)]},
             {"memory": [], "mine": [], "committed": None, "newest": None, "storage_rank": 1, "replicas": []}]
    fetched: list = []
    agreement = agree(_sources(views, fetched), None)
    assert (agreement.step, agreement.source) == (5, Source.MEMORY)
    assert fetched == [(5, [(1, 5), (1, 6)])]  # rank 1 fetches the new line's step 5 from node n0
