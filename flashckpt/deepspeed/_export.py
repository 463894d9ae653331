"""Write DeepSpeed's own checkpoint layout from a committed flashckpt step.

Runs in the node's saver process after the step commits (see ``flashckpt.saver._exporters``),
never in the trainer. Each rank's committed shard holds
``{"deepspeed": {"tag", "save_dir", "files": {relative path: state dict}}}``; every
state dict is written with ``torch.save`` to ``<save_dir>/<relative path>`` exactly as
DeepSpeed's default ``TorchCheckpointEngine`` would, its tensors viewing the image the
saver just persisted (still held in shared memory) or the other ranks' mapped shards:
nothing is read back or copied first. The tag is written to
``<save_dir>/<tag>.tmp-flashckpt`` and renamed into place, and only then is
``<save_dir>/latest`` replaced (atomically), so stock ``engine.load_checkpoint`` and
``zero_to_fp32.py`` never see a half-written tag.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any, Iterable

from .._errors import CheckpointError
from ..saver._exporters import ImageHold
from ..storage._files import fsync_dir, write_atomic
from ..storage._local import LocalStorage
from ..torch._image_views import step_trees, unpickler
from . import _objects

__all__ = ["export", "write_tag"]

log = logging.getLogger(__name__)

_MANIFEST = ".flashckpt-tags.json"


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
    storage = LocalStorage(directory)
    meta = storage.metadata(step)
    save_dir, tag = params["save_dir"], params["tag"]
    final = os.path.join(save_dir, tag)
    pending = f"{final}.tmp-flashckpt"
    shutil.rmtree(pending, ignore_errors=True)
    os.makedirs(pending)
    unpickle = unpickler(bool(params.get("allow_pickle", False)),
                         "the shard holds pickled entries; the checkpointer had allow_pickle=False")
    try:
        with step_trees(storage, step, meta["world_size"], memory, unpickle) as ranks:
            count = write_tag((tree["deepspeed"]["files"] for tree in ranks), tag, pending)
    except BaseException:
        shutil.rmtree(pending, ignore_errors=True)
        raise
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(pending, final)
    fsync_dir(save_dir)
    if params.get("save_latest", True):
        write_atomic(os.path.join(save_dir, "latest"), tag.encode())
    _retain(storage, save_dir, tag, step, meta.get("token"), int(params.get("keep_last", 0)))
    log.info("exported step %d as DeepSpeed tag %s (%d files)", step, final, count)


def _retain(storage: LocalStorage, save_dir: str, tag: str, step: int, token: Any, keep_last: int) -> None:
    """Delete the tags this exporter wrote whose flashckpt step is no longer committed as
    they were written (retired by ``keep_last``, or abandoned by a newer line: a run that
    loaded an older step and saved); the directory's lineage decides, not tag order.
    Entries of an older manifest (tag names only) keep the newest ``keep_last`` (0 keeps all)."""
    manifest = os.path.join(save_dir, _MANIFEST)
    try:
        with open(manifest) as f:
            entries = [e if isinstance(e, list) else [e, None, None] for e in json.load(f)]
    except (FileNotFoundError, ValueError, TypeError):
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
            shutil.rmtree(os.path.join(save_dir, old), ignore_errors=True)
    write_atomic(manifest, json.dumps(keep).encode())
