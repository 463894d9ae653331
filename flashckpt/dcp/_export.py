"""Write a committed DCP step as stock DCP files: ``.metadata`` and ``__<rank>_0.distcp``.

Runs in the node's saver once the step commits (the ``dcp`` exporter, see
``flashckpt.saver._exporters``), or in a reader that finds a committed step whose files were
never written (a saver killed between the commit and the export). Each rank's file is the
concatenation its recipe gives of its framing bytes and tensors (see
:mod:`flashckpt.dcp._writer`), read from the image just persisted, still in shared memory,
or from the rank's committed shard. The files are written into a staging folder beside the
checkpoint id, ``.metadata`` last, each fsynced, and the folder is renamed into place: a
reader sees the whole checkpoint or none.
"""

from __future__ import annotations

import logging
import os
from typing import Any, BinaryIO

import torch

from .._errors import CheckpointError
from ..saver._exporters import ImageHold
from ..storage._files import fsync_dir
from ..storage._folders import LocalFolders
from ..storage._url import open_storage
from ..torch._image_views import step_trees, unpickler

__all__ = ["METADATA", "export", "raw_bytes", "write_rank_file"]

log = logging.getLogger(__name__)

METADATA = ".metadata"


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def write_rank_file(f: BinaryIO, dcp: dict[str, Any]) -> int:
    """Write one rank's ``.distcp`` bytes from its saved tree's ``dcp`` part; returns their count."""
    frames = raw_bytes(dcp["frames"])
    recipe = dcp["recipe"].tolist()
    data = dcp["data"]
    at = written = 0
    for i in range(0, len(recipe), 3):
        before, index, after = recipe[i:i + 3]
        written += f.write(frames[at:at + before])
        at += before
        if index >= 0:
            written += f.write(raw_bytes(data[index]))
        written += f.write(frames[at:at + after])
        at += after
    if written != dcp["file_bytes"] or at != len(frames):
        raise CheckpointError(f"the DCP file {dcp['file']} of {dcp['checkpoint_id']} came out {written} bytes, "
                              f"its recipe says {dcp['file_bytes']}")
    return written


def export(directory: str, step: int, params: dict[str, Any], *, memory: ImageHold | None = None) -> None:
    """Write the stock DCP files of committed ``step`` of the store ``directory`` into
    ``params["checkpoint_id"]`` (see module doc)."""
    storage = open_storage(directory)
    target = params["checkpoint_id"]
    parent, name = os.path.dirname(target), os.path.basename(target)
    os.makedirs(parent, exist_ok=True)
    folders = LocalFolders(parent)
    pending = folders.stage(name)
    refuse = unpickler(False, "a DCP step holds no pickled entries")
    total = 0
    try:
        metadata: memoryview | None = None
        with step_trees(storage, step, storage.metadata(step)["world_size"], memory, refuse) as ranks:
            for tree in ranks:
                dcp = tree["dcp"]
                if dcp["checkpoint_id"] != target:
                    raise CheckpointError(f"step {step} of {directory} holds {dcp['checkpoint_id']}, not {target}")
                with open(os.path.join(pending, dcp["file"]), "wb") as f:
                    total += write_rank_file(f, dcp)
                    f.flush()
                    os.fsync(f.fileno())
                if "metadata" in dcp:
                    metadata = bytes(raw_bytes(dcp["metadata"]))
            if metadata is None:
                raise CheckpointError(f"step {step} of {directory} holds no DCP .metadata")
        with open(os.path.join(pending, METADATA), "wb") as f:  # last: DCP's own sign of a whole checkpoint
            f.write(metadata)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(pending)
        folders.publish(name, pending)
    except BaseException:
        folders.discard(pending)
        raise
    log.info("wrote DCP checkpoint %s (step %d, %.1f MiB)", target, step, total / 2**20)
