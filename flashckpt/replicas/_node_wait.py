"""``wait()`` on node-local directories: until each node's directory holds the step asked last.

On a shared directory a step commits (and is exported: a DeepSpeed tag, an HF folder) with
the last rank's shard, so a rank whose persists are done has nothing more to wait for. On
node-local directories (``flashckpt.replicas._node_local``) node ``k`` commits a step only
once its ring predecessor's shards arrived as peer replicas and its saver wrote them, and
that write's commit exports the step (``flashckpt.saver._node_local``): both may come after
this rank's own persist was done. So the engine tells :class:`NodeWait` each step it asks
its saver to persist, and its ``wait`` waits, once its persists are done, for the newest
one's copies as a node-local flush does (:meth:`NodeLocal.settle`, told by the replica link:
:class:`flashckpt.replicas._link.Copies`): this node committed and exported it, and the next
node wrote this rank's shard. A lost peer that step needs is a ``ReplicaError`` within
seconds; while every peer answers the wait is bounded by ``timeout``. Nothing is persisted
anew (that is ``flush``'s job). Once every persisting rank's ``wait`` returned, every node's
directory holds the step and its export.
"""

from __future__ import annotations

from typing import Any

from ._node_local import NodeLocal

__all__ = ["NodeWait"]


class NodeWait:
    """The newest step one persisting rank asked to persist to its node-local directory, and
    the wait for that step's copies (``mode`` None: a shared directory, or a rank that does not
    persist: nothing to wait for)."""

    def __init__(self, mode: NodeLocal | None, replicas: Any, storage: Any) -> None:
        self._mode, self._replicas, self._storage = mode, replicas, storage
        """``replicas``: ``flashckpt.replicas._engine.PeerReplicas``; ``storage``: this node's directory."""
        self._asked: tuple[str, int] | None = None
        """(line token, step) of the newest step asked to persist."""
        self._settled: tuple[str, int] | None = None
        """The step whose copies a wait saw last (waited for once, not at each later wait)."""

    def asked(self, step: int, token: Any, due: bool) -> None:
        """This rank asked its saver to persist ``step`` of line ``token`` (``due``: else nothing)."""
        if due and self._mode is not None and isinstance(token, str):
            self._asked = (token, step)

    def wait(self, timeout: float | None) -> None:
        """Until this node committed and exported the newest step asked to persist and the next
        node wrote this rank's shard of it (call once this rank's persists are done)."""
        asked = self._asked
        if self._mode is None or asked is None or asked == self._settled:
            return
        self._mode.settle(self._replicas, self._storage, *asked, timeout)
        self._settled = asked
