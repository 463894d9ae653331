"""A node-local flush told by the replica link (issue 43, item 1): a copy the next node could
not write is an error naming the step and the node, and a lost peer is seen within seconds,
not after a fixed 20 s wait.

Two replica services on 127.0.0.1 stand for two nodes' savers (``test_replica``'s pair):
node n0's pushes its rank 0 to node n1's, which writes it to its node-local directory. The
flushing rank is node n0's, with a stand-in engine whose own directory's commit the test
sets. Faults at chosen points: n1's write of the replica fails (its ``persist_slot``), n1's
saver is killed (its endpoint closed: refused) or stopped (an endpoint that takes the
connection and never answers).
"""

from __future__ import annotations

import os
import socket
import time
from types import SimpleNamespace

import pytest

from flashckpt.replicas._link import Copies, silent_nodes
from flashckpt.replicas._node_local import NodeLocal, write_scope
from flashckpt.replicas._protocol import ReplicaError, new_secret
from flashckpt.replicas._service import ReplicaService
from flashckpt.restore._ranks import flush_on_every_rank
from flashckpt.saver import _node_local as saver_node_local
from flashckpt.storage._step_meta import line_key

from .test_replica import jobs, make_slot, wait_for  # noqa: F401 -- jobs: a fixture

TOKEN = "t" * 24  # make_slot's
STEP = 5
RING = {"n0": (0, 1), "n1": (0, 1)}  # two nodes: each directory commits both ranks


class _OwnDirectory:
    """Node n0's directory as the flush sees it: step 5 committed by this run, or never."""

    def __init__(self, root: str, committed: bool) -> None:
        self.root, self.committed = root, committed

    def newer_than_committed(self, token: str, step: int) -> bool:
        return not self.committed

    def metadata(self, step: int) -> dict:
        return {"token": TOKEN} if self.committed else {}

    def latest_step(self) -> int | None:
        return STEP if self.committed else None


class _Rank:
    """Node n0's rank 0 (the engine surface a node-local flush uses), step 5 in its memory."""

    def __init__(self, storage: _OwnDirectory, endpoints: dict, secret: str, rank: int = 0) -> None:
        self.storage = storage
        self.placement = SimpleNamespace(storage_rank=rank, secret=secret)
        self.replicas = SimpleNamespace(copies=lambda storage, token, step, timeout, **where: Copies(
            storage, token, step, rank, endpoints=endpoints, secret=secret, bound=timeout, **where))

    def memory_keys(self) -> dict:
        return {STEP: (line_key(TOKEN), STEP)}

    def memory_info(self, step: int) -> dict:
        return {"token": TOKEN}

    def persist(self, step: int) -> None:
        pass

    def wait(self, timeout: float | None = None, *, copies: bool = True) -> None:
        pass


@pytest.fixture
def ring(jobs, tmp_path):  # noqa: F811
    """(n0's service, n1's service, secret, directory): n0 pushes to n1; the directory is node-local."""
    secret = new_secret()
    services = [ReplicaService(job) for job in jobs]
    for service in services:
        service.configure(secret, "127.0.0.1", "127.0.0.1")
    services[0].set_peer(services[1].endpoint)
    directory = str(tmp_path / "ck")
    os.makedirs(directory)
    write_scope(directory, TOKEN, [0, 1])
    yield services[0], services[1], secret, directory
    for service in services:
        service.close()


def push_step(sender: ReplicaService, job: str, directory: str) -> None:
    """Rank 0's step 5, due for storage, offered to n0's pusher (as its trainer's save is)."""
    msg = make_slot(job, STEP, os.urandom(1 << 20), directory=directory)
    sender.offer({**msg, "persist": True})


def flush(sender, receiver, secret, directory, *, committed: bool, timeout: float = 60.0, node: str = "n0") -> float:
    """Node ``node``'s rank (n0: rank 0, n1: rank 1) flushes step 5; the seconds it took."""
    rank = _Rank(_OwnDirectory(directory, committed), {"n0": sender.endpoint, "n1": receiver.endpoint}, secret,
                 rank=int(node[1:]))
    began = time.monotonic()
    NodeLocal(node=node, scopes=RING).flush(rank, timeout)
    return time.monotonic() - began


def failing(errno: int, text: str):
    """A ``persist_slot`` that fails as a disk would."""
    def persist_slot(*args, **kwargs):
        raise OSError(errno, text)
    return persist_slot


def test_a_replica_the_next_node_could_not_write_fails_the_flush_naming_step_and_node(ring, jobs, monkeypatch):
    sender, receiver, secret, directory = ring

    monkeypatch.setattr(saver_node_local, "persist_slot", failing(28, "No space left on device"))  # n1's write
    push_step(sender, jobs[0], directory)
    with pytest.raises(ReplicaError) as failed:
        flush(sender, receiver, secret, directory, committed=True)
    message = str(failed.value)
    assert f"step {STEP}" in message and "node n1" in message and "rank 0" in message, message
    assert "No space left on device" in message, message


def test_the_node_that_could_not_write_its_predecessors_replica_fails_its_own_flush(ring, jobs, monkeypatch):
    """n1's directory cannot commit step 5 without rank 0's shard, which n1's saver failed to write."""
    sender, receiver, secret, directory = ring
    monkeypatch.setattr(saver_node_local, "persist_slot", failing(5, "Input/output error"))
    push_step(sender, jobs[0], directory)
    with pytest.raises(ReplicaError) as failed:
        flush(sender, receiver, secret, directory, committed=False, node="n1")
    message = str(failed.value)
    assert f"step {STEP}" in message and "node n1" in message and "predecessor's shard of rank 0" in message, message
    assert "Input/output error" in message, message


def test_a_flush_returns_once_the_next_node_wrote_the_replica(ring, jobs):
    """The flush waits for n1's write of rank 0's shard (before: it returned once this node committed)."""
    sender, receiver, secret, directory = ring
    push_step(sender, jobs[0], directory)
    assert flush(sender, receiver, secret, directory, committed=True) < 30
    pending = os.path.join(directory, f"step-{STEP}.tmp-{TOKEN}")
    assert os.path.exists(os.path.join(pending, "rank-0.done")), os.listdir(directory)


def _silent_endpoint() -> tuple[socket.socket, tuple[str, int]]:
    """An endpoint that takes connections and never answers: a stopped (SIGSTOP) saver."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    return sock, sock.getsockname()


@pytest.mark.parametrize("fault", ["killed", "stopped"])
def test_a_lost_predecessor_fails_the_flush_within_seconds(ring, fault):
    """n0's directory cannot commit step 5 without rank 1's shard from n1; n1's saver is lost."""
    sender, receiver, secret, directory = ring
    receiver.close()
    silent = None
    if fault == "stopped":
        silent, endpoint = _silent_endpoint()
        receiver = SimpleNamespace(endpoint=endpoint)
    try:
        began = time.monotonic()
        with pytest.raises(ReplicaError) as lost:
            flush(sender, receiver, secret, directory, committed=False, timeout=60.0)
        took = time.monotonic() - began
    finally:
        if silent is not None:
            silent.close()
    message = str(lost.value)
    assert f"step {STEP} cannot commit" in message and "node n1" in message, message
    assert took < 12, took  # a fixed 20 s wait before


def test_a_lost_successor_after_this_node_committed_is_a_warning(ring, caplog):
    """This node committed step 5; only the next node's copy of rank 0 is missing: a warning, soon."""
    sender, receiver, secret, directory = ring
    receiver.close()
    caplog.set_level("WARNING", logger="flashckpt")
    assert flush(sender, receiver, secret, directory, committed=True) < 12
    assert "second copy of rank 0" in caplog.text and "node n1" in caplog.text, caplog.text


def test_close_takes_a_silent_node_for_lost_within_seconds_and_skips_its_agreement(ring, caplog):
    """What ``close()`` asks before its agreement with the other ranks: n1's saver stopped (its
    endpoint takes connections and never answers, as a node gone does) is lost, n0's is not; then
    the agreement, a collective that would wait for the process group's timeout, is skipped."""
    sender, receiver, secret, directory = ring
    assert silent_nodes({"n0": sender.endpoint, "n1": receiver.endpoint}, secret) == []
    receiver.close()
    silent, endpoint = _silent_endpoint()
    try:
        began = time.monotonic()
        assert silent_nodes({"n0": sender.endpoint, "n1": endpoint}, secret) == ["n1"]
        assert time.monotonic() - began < 12
    finally:
        silent.close()

    entered = []

    def hangs(obj):  # on a real group: until its timeout
        entered.append(obj)
        raise RuntimeError("a collective with a lost node")

    def flush():
        raise ReplicaError("step 5 cannot commit")

    caplog.set_level("WARNING", logger="flashckpt")
    with pytest.raises(ReplicaError, match="step 5 cannot commit"):  # this rank's own outcome, still raised
        flush_on_every_rank(SimpleNamespace(rank=0, world_size=2, all_gather=hangs), flush, lost=lambda: ["n1"])
    assert not entered and "node(s) n1 do not answer" in caplog.text, caplog.text


def test_a_node_one_wait_found_lost_is_not_waited_for_again(ring):
    """n1 lost after n0 committed step 5: the first wait warns after the replica link's 5 s of
    silence and records n1; a second wait of the run (``wait()`` then ``close()``'s flush, issue
    43) takes it for lost at its first silence, not after another 5 s."""
    sender, receiver, secret, directory = ring
    receiver.close()
    lost: set[str] = set()

    def waited() -> float:
        copies = Copies(_OwnDirectory(directory, True), TOKEN, STEP, 0, node="n0", ring=["n0", "n1"], scope=(0, 1),
                        endpoints={"n0": sender.endpoint, "n1": receiver.endpoint}, secret=secret, bound=60.0,
                        lost=lost)
        began = time.monotonic()
        copies.wait()
        return time.monotonic() - began

    assert waited() >= 4.5 and lost == {"n1"}
    assert waited() < 2.5
