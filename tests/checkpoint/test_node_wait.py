"""The engine's ``wait()`` on node-local directories (issue 43): which step's copies it waits for
(``flashckpt.replicas._node_wait``); the copies themselves are ``test_replica_link``'s, the whole
path ``tests/deepspeed/test_ds_node_local_tags.py``'s."""

from flashckpt.replicas._node_wait import NodeWait


class _Mode:
    """A node-local mode that records what it was asked to wait for."""

    def __init__(self) -> None:
        self.settled: list[tuple[str, int]] = []

    def settle(self, replicas, storage, token: str, step: int, timeout: float | None) -> None:
        self.settled.append((token, step))


def test_wait_waits_for_the_newest_step_asked_to_persist_once():
    mode = _Mode()
    node = NodeWait(mode, replicas=None, storage=None)
    node.wait(None)  # nothing asked yet
    node.asked(1, "a", True)
    node.asked(2, "a", False)  # only in memory: not waited for
    node.wait(None)
    node.wait(None)  # seen already
    node.asked(3, "a", True)
    node.asked(3, "b", True)  # a new line's step 3
    node.wait(5.0)
    assert mode.settled == [("a", 1), ("b", 3)]


def test_a_shared_directory_or_a_rank_that_does_not_persist_waits_for_nothing():
    node = NodeWait(None, replicas=None, storage=None)
    node.asked(1, "a", True)
    node.wait(None)  # would raise on a None mode
