"""The Lightning exporter: a committed flashckpt step -> Lightning's own ``.ckpt`` file.

Runs in the node's saver process once the step commits (``flashckpt.saver._exporters``),
never in the trainer, and imports no Lightning. The step's one shard (rank 0: the state
is replicated) holds the Trainer's checkpoint dict; its tensors view the image the saver
just persisted, still in shared memory, and ``torch.save`` writes the file
``<dirpath>/<file>`` as ``TorchCheckpointIO`` would (into a hidden temporary file,
fsynced, renamed), so stock ``torch.load`` / ``Trainer.fit(ckpt_path=...)`` read it
without flashckpt. The rename happens only while the path still exists (a placeholder or
an older file, see :mod:`flashckpt.lightning._files`): a file Lightning removed meanwhile
is not written back.

``params`` (JSON, from the trainer): ``dirpath`` (Lightning's directory) and ``file``
(a plain name inside it).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ..saver._exporters import ImageHold
from ..storage._files import fsync_dir
from ..storage._url import open_storage
from ..torch._image_views import step_trees, unpickler
from . import _files

__all__ = ["export"]

log = logging.getLogger(__name__)


def export(directory: str, step: int, params: dict[str, Any], *, memory: ImageHold | None = None) -> None:
    """Write committed ``step`` of ``directory`` as ``params["file"]`` in ``params["dirpath"]``
    (see the module doc); rank 0's tree from ``memory`` when given (let go once written)."""
    dirpath = params["dirpath"]
    name = _files.check_name(params["file"], dirpath)
    final = os.path.join(dirpath, name)
    if not os.path.lexists(final):  # removed by Lightning (top-k) before its export ran
        if memory is not None:
            memory.release()
        log.info("step %d: %s was removed before its export; not written", step, final)
        return
    storage = open_storage(directory)
    unpickle = unpickler(bool(params.get("allow_pickle", False)),
                         "the checkpoint holds pickled entries; the IO had allow_pickle=False")
    tmp = os.path.join(dirpath, f".{name}.tmp-flashckpt-{os.getpid()}")
    try:
        with step_trees(storage, step, 1, memory, unpickle) as trees:
            with open(tmp, "wb") as f:
                torch.save(trees[0], f)
                f.flush()
                os.fsync(f.fileno())
        with _files.locked(dirpath):
            if not os.path.lexists(final):
                log.info("step %d: %s was removed while its export ran; not written", step, final)
                os.unlink(tmp)
                return
            os.replace(tmp, final)
            fsync_dir(dirpath)
            _files.record_export(dirpath, name, step)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    log.info("exported step %d as %s", step, final)
