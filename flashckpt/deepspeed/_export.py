"""Write DeepSpeed's own checkpoint layout from a committed flashckpt step.

Runs in the node's saver process after the step commits (see ``flashckpt.saver._exporters``),
never in the trainer. Each rank's committed shard holds
``{"deepspeed": {"tag", "save_dir", "files": {relative path: state dict}}}``; every
state dict is written with ``torch.save`` exactly as DeepSpeed's default
``TorchCheckpointEngine`` would, its tensors viewing the image the saver just persisted
(still held in shared memory) or the other ranks' mapped shards: nothing is read back or
copied first. ``save_dir`` is a local directory or an object-store URL: the tag is
written into a staging directory and published whole through the storage layer's
folders (:mod:`flashckpt.storage._folders`: renamed into place locally, uploaded to a
bucket), and only then is ``<save_dir>/latest`` replaced (atomically), so stock
``engine.load_checkpoint`` and ``zero_to_fp32.py`` never see a half-written tag.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Iterable

from .._errors import CheckpointError
from ..saver._exporters import ImageHold
from ..storage._files import fsync_dir
from ..storage._folders import Folders, folders_at
from ..storage._local import LocalStorage
from ..storage._url import open_storage
from ..torch._image_views import step_trees, unpickler
from . import _objects

__all__ = ["export", "write_tag"]

log = logging.getLogger(__name__)

_MANIFEST = ".flashckpt-tags.json"
_MAX_MANIFEST = 1 << 20


def write_tag(files_by_rank: Iterable[dict[str, Any]], tag: str, tag_dir: str) -> int:
    """Write every rank's DeepSpeed files (path relative to the save directory -> state
    dict as :func:`flashckpt.deepspeed._objects.encode` left it) into ``tag_dir`` with
    ``torch.save``, each fsynced, as DeepSpeed's default engine writes them; a file two
    ranks both hold is written once. Returns the number of files."""
    import torch

    written: set[str] = set()
    for files in files_by_rank:
        for rel, state in files.items():
            if rel in written:
                continue
            written.add(rel)
            target = os.path.join(tag_dir, os.path.relpath(rel, tag))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as f:
                torch.save(_objects.decode(state), f)
                f.flush()
                os.fsync(f.fileno())
    fsync_dir(tag_dir)
    return len(written)


def export(directory: str, step: int, params: dict[str, Any], *, memory: ImageHold | None = None) -> None:
    """Write the DeepSpeed tag of committed ``step`` of ``directory`` (see module doc);
    rank ``memory.rank``'s files from ``memory``, the image the saver just persisted (let
    go once the files are written), instead of its shard."""
    storage = open_storage(directory)
    meta = storage.metadata(step)
    save_dir, tag = params["save_dir"], params["tag"]
    folders = folders_at(save_dir)
    pending = folders.stage(tag)
    unpickle = unpickler(bool(params.get("allow_pickle", False)),
                         "the shard holds pickled entries; the checkpointer had allow_pickle=False")
    try:
        with step_trees(storage, step, meta["world_size"], memory, unpickle) as ranks:
            count = write_tag((tree["deepspeed"]["files"] for tree in ranks), tag, pending)
        folders.publish(tag, pending)
    except BaseException:
        folders.discard(pending)
        raise
    if params.get("save_latest", True):
        folders.write_atomic("latest", tag.encode())
    _retain(storage, folders, tag, step, meta.get("token"), int(params.get("keep_last", 0)))
    log.info("exported step %d as DeepSpeed tag %s/%s (%d files)", step, folders.root, tag, count)


def _retain(storage: LocalStorage, folders: Folders, tag: str, step: int, token: Any, keep_last: int) -> None:
    """Delete the tags this exporter wrote whose flashckpt step is no longer committed as
    they were written (retired by ``keep_last``, or abandoned by a newer line: a run that
    loaded an older step and saved); the directory's lineage decides, not tag order.
    Entries of an older manifest (tag names only) keep the newest ``keep_last`` (0 keeps all)."""
    try:
        entries = [e if isinstance(e, list) else [e, None, None]
                   for e in json.loads(folders.read_small(_MANIFEST, _MAX_MANIFEST) or b"[]")]
    except (ValueError, TypeError):
        entries = []
    entries = [e for e in entries if len(e) == 3 and isinstance(e[0], str) and e[0] != tag]
    committed = set(storage.committed_steps())

    def written_step_still_committed(entry: list) -> bool:
        _, at, by = entry
        if at is None:  # an older manifest: kept by count below
            return True
        if at not in committed:
            return False
        try:
            return storage.metadata(at).get("token") == by
        except CheckpointError:
            return False

    keep = [e for e in entries if written_step_still_committed(e)]
    drop = [e for e in entries if e not in keep]
    keep.append([tag, step, token])
    if keep_last > 0:
        drop += keep[:-keep_last]
        keep = keep[-keep_last:]
    for old, _, _ in drop:
        if old != tag and os.path.basename(old) == old and old not in (".", ".."):
            folders.remove(old)
    folders.write_atomic(_MANIFEST, json.dumps(keep).encode())
