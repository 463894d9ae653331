"""Write a committed DCP step as stock DCP files: ``.metadata`` and ``__<rank>_0.distcp``.

Runs in the node's saver once the step commits (the ``dcp`` exporter, see
``flashckpt.saver._exporters``), or in a reader that finds a committed step whose files were
never written (a saver killed between the commit and the export). Each rank's file is the
concatenation its recipe gives of its framing bytes and tensors (see
:mod:`flashckpt.dcp._writer`), read from the image just persisted, still in shared memory,
or from the rank's committed shard.

- A local id: the files are written into a staging folder beside it, ``.metadata`` last,
  each fsynced, and the folder is renamed into place: a reader sees the whole checkpoint or none.
- An object-store id (``s3://bucket/run/step-100``): a store has no rename, so each rank's
  file is uploaded as ``<id>/__<rank>_0.distcp`` through the storage layer (multipart for a
  large one, the parts copied out of the image one at a time), then ``.metadata``, last: DCP's
  own sign of a whole checkpoint. A ``.metadata`` of another save there is deleted first, and
  other objects under the id once the files are up. Writing the same step again writes the
  same objects (a reader that finds the step unexported may do so while the saver does).
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, BinaryIO

import torch

from .._errors import CheckpointError
from ..saver._exporters import ImageHold
from ..storage._files import fsync_dir
from ..storage._folders import LocalFolders
from ..storage._object import object_backend
from ..storage._uploads import Joined
from ..storage._url import open_storage
from ..torch._image_views import step_trees, unpickler
from ._run import is_url

__all__ = ["METADATA", "export", "rank_pieces", "raw_bytes", "write_rank_file"]

log = logging.getLogger(__name__)

METADATA = ".metadata"
DISTCP = re.compile(r"__(\d+)_(\d+)\.distcp")
"""The name of a rank's data file (DCP's ``FileSystemWriter``: one file a rank)."""


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def rank_pieces(dcp: dict[str, Any]) -> list[memoryview]:
    """One rank's ``.distcp`` bytes from its saved tree's ``dcp`` part, as the buffers they are
    in the image (its framing and its tensors' bytes, interleaved), in order; not copied."""
    frames = raw_bytes(dcp["frames"])
    recipe = dcp["recipe"].tolist()
    data = dcp["data"]
    pieces: list[memoryview] = []
    at = 0
    for i in range(0, len(recipe), 3):
        before, index, after = recipe[i:i + 3]
        pieces.append(frames[at:at + before])
        at += before
        if index >= 0:
            pieces.append(raw_bytes(data[index]))
        pieces.append(frames[at:at + after])
        at += after
    size = sum(p.nbytes for p in pieces)
    if size != dcp["file_bytes"] or at != len(frames):
        raise CheckpointError(f"the DCP file {dcp['file']} of {dcp['checkpoint_id']} came out {size} bytes, "
                              f"its recipe says {dcp['file_bytes']}")
    return pieces


def write_rank_file(f: BinaryIO, dcp: dict[str, Any]) -> int:
    """Write one rank's ``.distcp`` bytes from its saved tree's ``dcp`` part; returns their count."""
    return sum(f.write(piece) for piece in rank_pieces(dcp))


def export(directory: str, step: int, params: dict[str, Any], *, memory: ImageHold | None = None) -> None:
    """Write the stock DCP files of committed ``step`` of the store ``directory`` into
    ``params["checkpoint_id"]``, a local folder or an object-store URL (see module doc)."""
    storage = open_storage(directory)
    target = params["checkpoint_id"]
    refuse = unpickler(False, "a DCP step holds no pickled entries")
    with step_trees(storage, step, storage.metadata(step)["world_size"], memory, refuse) as ranks:
        files = [tree["dcp"] for tree in ranks]
        for dcp in files:
            if dcp["checkpoint_id"] != target:
                raise CheckpointError(f"step {step} of {directory} holds {dcp['checkpoint_id']}, not {target}")
        metadata = next((bytes(raw_bytes(dcp["metadata"])) for dcp in files if "metadata" in dcp), None)
        if metadata is None:
            raise CheckpointError(f"step {step} of {directory} holds no DCP .metadata")
        total = (_write_to_store if is_url(target) else _write_local)(target, files, metadata)
        files.clear()
    log.info("wrote DCP checkpoint %s (step %d, %.1f MiB)", target, step, total / 2**20)


def _write_local(target: str, files: list[dict[str, Any]], metadata: bytes) -> int:
    """The files into a staging folder beside ``target``, ``.metadata`` last, each fsynced;
    then the folder renamed into place."""
    parent, name = os.path.dirname(target), os.path.basename(target)
    os.makedirs(parent, exist_ok=True)
    folders = LocalFolders(parent)
    pending = folders.stage(name)
    total = 0
    try:
        for dcp in files:
            with open(os.path.join(pending, dcp["file"]), "wb") as f:
                total += write_rank_file(f, dcp)
                f.flush()
                os.fsync(f.fileno())
        with open(os.path.join(pending, METADATA), "wb") as f:  # last: DCP's own sign of a whole checkpoint
            f.write(metadata)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(pending)
        folders.publish(name, pending, keep=lambda entry: entry != METADATA and not DISTCP.fullmatch(entry))
    except BaseException:
        folders.discard(pending)
        raise
    return total


def _write_to_store(target: str, files: list[dict[str, Any]], metadata: bytes) -> int:
    """The files as objects under URL ``target`` through the storage layer's uploads (in parts
    when large, straight from the image), ``.metadata`` last (see module doc)."""
    store = object_backend(target)
    before = store.list()
    if METADATA in before and not _holds(store, before[METADATA].size, metadata):
        store.delete([METADATA])  # a reader never pairs an older .metadata with the files written now
    total = 0
    for dcp in files:
        data = Joined(rank_pieces(dcp))
        store.write(dcp["file"], data)
        total += len(data)
    written = {dcp["file"] for dcp in files}
    stale = [name for name in before if name != METADATA and name not in written]
    if stale:  # an older save's files (of more ranks, say): the folder holds this save alone
        store.delete(stale)
    store.write(METADATA, memoryview(metadata))
    return total


def _holds(store: Any, size: int, data: bytes) -> bool:
    """Whether the store's ``.metadata`` (of ``size`` bytes) is ``data`` already."""
    if size != len(data):
        return False
    try:
        return store.read_small(METADATA, size) == data
    except CheckpointError:
        return False
