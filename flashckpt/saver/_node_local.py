"""The saver's side of node-local directories (see ``flashckpt.replicas._node_local``).

**Replicas to disk.** In node-local mode (see ``flashckpt.replicas._node_local``) node ``k``'s directory commits the
shards of its ring predecessor's ranks too. Those arrive as peer replicas; when a replica
is of a save that was due for storage, and this node's directory lists its rank in the
run's scope, :class:`ReplicaPersister` writes it there on a thread of the saver, after it
arrived (never while a push or a save waits), and commits the step once the scope is
complete. A step whose commit that write completes (its rank's own shard was durable first)
is exported there too, on the saver's export queue, as the rank's own persist would have
(a DeepSpeed tag, an HF folder: every shard the export reads is in the directory then,
whichever node's copy completed it last); the replica counts as written once that export
ran. It keeps only the newest due replica per rank: a slower disk skips steps, it never
queues them without bound. It remembers how the newest replica of each rank went
(pending, written, or failed with the error), and :meth:`ReplicaPersister.status` tells the
ranks' own node (the ``status`` op of ``flashckpt.replicas._protocol``): a replica this node
could not write is an error in the predecessor's ``flush``, never only a log line here.

**Shards to peers.** :func:`serve_shard` sends a committed shard of this node's directory
to an authenticated peer whose node lost its own (the ``fetch_shard`` op of
``flashckpt.replicas._protocol``): only from a node-local directory, only a committed step of the
asked line, through the storage's safe reader, and withdrawn unless every block matches
the checksums recorded at commit (bytes damaged at rest never travel as good ones).
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import threading
from typing import Any

from ..storage._checksum import block_crcs
from .._errors import CheckpointError
from ..replicas._node_local import SCOPE_FILE, read_scope
from ._exporters import ExportQueue
from ._persist import persist_slot
from ..replicas._protocol import send_image, send_message
from ..storage._step_meta import line_key
from ..storage._local import LocalStorage

__all__ = ["BUSY", "ReplicaPersister", "serve_shard", "wants_on_disk"]

PENDING, BUSY, WRITTEN, FAILED, UNKEPT = "pending", "busy", "written", "failed", "unkept"
"""What the ``status`` op says of one rank's replica of a step (BUSY: being written, committed,
or exported after its write committed the step; UNKEPT: this node's directory does not keep
that rank for that run, e.g. a step of a run before this node was replaced)."""
_SKIPPED = "skipped"
"""A replica replaced before it was written: whether its shard is here, the directory says."""

log = logging.getLogger("flashckpt.replica")


def wants_on_disk(push: dict[str, Any]) -> bool:
    """Whether a received push is a save due for storage that this node's directory commits
    (a node-local directory whose scope for that run lists the rank)."""
    info = push.get("info") or {}
    if not (push.get("persist") and info.get("persist")):
        return False
    directory, token = info.get("directory"), info.get("token")
    if not isinstance(directory, str) or not isinstance(token, str):
        return False
    return push.get("storage_rank") in (read_scope(directory, token) or ())


class ReplicaPersister:
    """Writes received replicas to this node's directory on one background thread."""

    def __init__(self, exports: ExportQueue | None = None) -> None:
        self._exports = exports
        """The saver's export queue, for the steps a replica's write commits (None: exported inline)."""
        self._due: dict[int, tuple[str, int, dict[str, Any], int]] = {}
        """storage rank -> (replica slot, generation, info, step) of its newest replica to write."""
        self._outcomes: dict[tuple[str, str, int], tuple[int, str, str]] = {}
        """(directory, token, storage rank) -> (step, PENDING/WRITTEN/FAILED, error) of its newest replica."""
        self._cond = threading.Condition()
        self._writing = False
        self._stopped = False
        self._thread: threading.Thread | None = None

    def offer(self, path: str, generation: int, info: dict[str, Any], step: int) -> None:
        """Write the replica of ``step`` at ``path`` (holding ``generation``) as ``info`` says, soon."""
        with self._cond:
            self._due[int(info["storage_rank"])] = (path, generation, info, step)
            self._record(info, step, PENDING)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="flashckpt-replica-persist", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _record(self, info: dict[str, Any], step: int, state: str, error: str = "") -> None:
        key = (str(info.get("directory")), str(info.get("token")), int(info["storage_rank"]))
        if step >= self._outcomes.get(key, (-1, "", ""))[0]:
            self._outcomes[key] = (step, state, error)

    def status(self, directory: str, token: str, step: int, ranks: list[int]) -> dict[str, list[str]]:
        """str(rank) -> [state, error] of each rank's replica of ``step`` here: BUSY (being
        written here, or the step its write committed being exported), WRITTEN (its shard is
        durable in ``directory``), FAILED (this node could not write it, or export the step its
        write committed; the error), else PENDING (not arrived, or not written yet)."""
        answer = {}
        for rank in ranks:
            with self._cond:
                outcome = self._outcomes.get((directory, token, rank))
            if outcome is not None and outcome[0] == step and outcome[1] == BUSY:
                answer[str(rank)] = [BUSY, ""]  # its shard may be durable, its commit or export not done yet
            elif _on_disk(directory, token, step, rank):
                answer[str(rank)] = [WRITTEN, ""]
            elif outcome is not None and outcome[0] == step and outcome[1] == FAILED:
                answer[str(rank)] = [FAILED, outcome[2]]
            else:
                answer[str(rank)] = [PENDING, ""]
        return answer

    def busy(self) -> bool:
        """A replica is being written or waits to be (the saver lingers for it)."""
        with self._cond:
            return self._writing or bool(self._due)

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and not self._due:
                    self._cond.wait()
                if self._stopped:
                    return
                rank = min(self._due)
                path, generation, info, step = self._due.pop(rank)
                self._record(info, step, BUSY)
                self._writing = True
            try:
                result = persist_slot(path, generation, info, exports=self._exports)
                if result.skipped:
                    log.info("the replica of rank %d in %s was replaced before it was written to %s", rank, path,
                             info["directory"])
                    with self._cond:
                        self._record(info, step, _SKIPPED)
                elif result.export is not None and self._exports is not None:  # BUSY until it ran
                    self._exports.submit(result.export, lambda error, i=info, s=step: self._exported(i, s, error))
                else:
                    with self._cond:
                        self._record(info, step, WRITTEN)
            except Exception as exc:  # noqa: BLE001 -- a failed write leaves only a tmp shard; the next one may succeed
                log.exception("writing the replica of rank %d to %s failed", rank, info.get("directory"))
                with self._cond:
                    self._record(info, step, FAILED, f"{type(exc).__name__}: {exc}")
            finally:
                with self._cond:
                    self._writing = False

    def _exported(self, info: dict[str, Any], step: int, error: Exception | None) -> None:
        """The export of the step a replica's write committed ran (``error`` None) or failed."""
        with self._cond:
            if error is None:
                self._record(info, step, WRITTEN)
            else:
                self._record(info, step, FAILED, f"its write committed step {step}, whose export failed: "
                                                 f"{type(error).__name__}: {error}")


def _on_disk(directory: str, token: str, step: int, rank: int) -> bool:
    """Whether rank ``rank``'s shard of ``step`` (run ``token``) is durable in ``directory``:
    its done marker in the pending step, or the step committed by that run."""
    if os.path.exists(os.path.join(directory, f"step-{step}.tmp-{token}", f"rank-{rank}.done")):
        return True
    try:
        return LocalStorage(directory).metadata(step).get("token") == token
    except (CheckpointError, OSError):
        return False


def serve_shard(sock: socket.socket, want: dict[str, Any]) -> bool:
    """Send the committed shard ``want`` names (directory, storage_rank, storage_world, step,
    line) from this node's node-local directory, or a not-found answer. True if sent whole."""
    directory, step, rank = want.get("directory"), want.get("step"), want.get("storage_rank")
    try:
        if not (isinstance(directory, str) and os.path.isabs(directory) and isinstance(step, int)
                and isinstance(rank, int) and os.path.isfile(os.path.join(directory, SCOPE_FILE))):
            raise CheckpointError("not a node-local checkpoint directory of this job")
        storage = LocalStorage(directory)
        meta = storage.metadata(step)
        if line_key(meta.get("token")) != want.get("line") or meta["world_size"] != want.get("storage_world"):
            raise CheckpointError(f"step {step} there belongs to another run or world size")
        f, record = storage.open_shard(step, rank)
    except CheckpointError as exc:
        send_message(sock, {"ok": False, "error": str(exc)})
        return False
    with f:
        size = record["size"]
        mapped = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) if size else None
    try:
        view = memoryview(mapped) if mapped is not None else memoryview(b"")
        send_message(sock, {"ok": True, "step": step, "image_len": size,
                            "info": {"token": meta.get("token"), "branch": meta.get("branch", -1)}})
        intact = lambda: ("block_size" in record  # noqa: E731
                          and block_crcs(view, record["block_size"]) == record["block_crc32"])
        sent = send_image(sock, view, intact)
        if not sent:
            log.error("%s/step-%d: rank %d's shard does not match its recorded checksums; not sent", directory,
                      step, rank)
        view.release()
        return sent
    finally:
        if mapped is not None:
            mapped.close()
