"""Node-local directories, the engine's own load: a rank whose memory lacks the agreed step
but whose own node's directory holds its shard reads it from there straight into the
caller's tensors (one copy), not disk -> slot -> tensors; the plain values are written only
once every rank's copy succeeded, as for a load from memory."""

from types import SimpleNamespace

import torch

from flashckpt._placement import SingleProcess
from flashckpt.restore._load import load_agreed
from flashckpt.restore._node_local import agree_node_local
from flashckpt.restore._sources import Agreement, Source, Sources
from flashckpt.storage._local import LocalStorage
from flashckpt.torch import Checkpointer

LINE = "0000000000001000abcdef01"
K5 = (LINE, 5)


def _sources(asked: list) -> SimpleNamespace:
    """Two ranks on nodes n0 and n1, no replicas; ``asked`` records the collective steps."""
    return SimpleNamespace(
        placement=SimpleNamespace(nodes=("n0", "n1")),
        replicas=SimpleNamespace(endpoints={"n0": ("10.0.0.1", 1), "n1": ("10.0.0.2", 1)}),
        storage=SimpleNamespace(root="/ck"), collective=SimpleNamespace(rank=0),
        on_all_ranks=lambda fn, what: asked.append(what))


def _views() -> list[dict]:
    """Rank 0 lost its memory, its node's directory holds step 5; rank 1 holds 5 in memory
    only (its node's directory is empty)."""
    return [{"storage_rank": 0, "mine": [], "replicas": [], "disk": [[list(K5), [0]]]},
            {"storage_rank": 1, "mine": [list(K5)], "replicas": [], "disk": []}]


def test_a_direct_agreement_names_the_ranks_that_read_their_own_directory():
    asked: list = []
    agreement = agree_node_local(_sources(asked), _views(), None, direct=True)
    assert (agreement.step, agreement.source, agreement.own_disk) == (5, Source.MEMORY, frozenset({0}))
    assert agree_node_local(_sources([]), _views(), None).own_disk == frozenset()  # adapters bring it to memory


class _NoSlots:
    def __getattr__(self, name: str):
        raise AssertionError(f"a rank reading its own directory touched its slots ({name})")


def test_a_rank_named_in_own_disk_reads_its_shard_straight_into_the_state(tmp_path, job_id):
    with Checkpointer(tmp_path, job_id=job_id) as ck:
        ck.save(5, {"w": torch.arange(8.0), "tag": "five"}).wait(timeout=60)
    sources = Sources(SingleProcess(), SimpleNamespace(storage_rank=0, storage_world=1), LocalStorage(str(tmp_path)),
                      _NoSlots(), None, None, lambda: None, lambda timeout: None, False)
    state = {"w": torch.zeros(8), "tag": "none"}
    got = load_agreed(sources, state, Agreement(5, Source.MEMORY, None, (), frozenset({0})))
    assert got == (5, Source.MEMORY)
    assert state["w"].tolist() == list(range(8)) and state["tag"] == "five"
