"""``FlashStorageWriter``: DCP's planned write items into the rank's shared memory in one copy.

Each rank's items become the bytes of one stock DCP file, ``__<rank>_0.distcp``: a
tensor item is ``torch.save``'s framing around its raw bytes (see
:mod:`flashckpt.dcp._framing`), a bytes item its bytes. The save copies them into the
rank's slot as one flashckpt step (the framing and bytes items as one ``uint8`` tensor, the
tensors as themselves, and a recipe of how they interleave); the coordinator's step also
holds the pickled ``.metadata``. The node's saver persists and commits the step across
ranks like any flashckpt save, then the ``dcp`` exporter writes the stock files into the
checkpoint id's folder (see :mod:`flashckpt.dcp._export`).
"""

from __future__ import annotations

import logging
import os
import pickle
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .._errors import CheckpointError
from .._options import Options
from ._framing import framing
from ._run import EXPORTER, Run, RunMember, check_store_free, normalize_id

__all__ = ["FlashStorageWriter", "SAVE_ID_PREFIX", "distcp_name", "rank_tree"]

log = logging.getLogger(__name__)

SAVE_ID_PREFIX = "flashckpt-"
"""How a save's ``save_id`` begins (a stock writer's is a bare uuid): which save's files a
folder holds, compared by the reader with the committed save's."""


def distcp_name(rank: int) -> str:
    """The stock DCP file of ``rank``'s items."""
    return f"__{rank}_0.distcp"


def rank_tree(checkpoint_id: str, rank: int, plan: SavePlan, planner: SavePlanner
              ) -> tuple[dict[str, Any], list[WriteResult]]:
    """The tree a save of ``rank``'s planned items holds (see the module doc; without the
    coordinator's ``.metadata``), and DCP's write result of each item. Tensors are the
    planner's, not copied."""
    name = distcp_name(rank)
    frames = bytearray()
    data: list[torch.Tensor] = []
    recipe: list[int] = []
    results: list[WriteResult] = []
    offset = 0
    for item in plan.items:
        resolved = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            raw = resolved.getbuffer()
            frames += raw
            recipe += (len(raw), -1, 0)
            length = len(raw)
        else:
            tensor = resolved.detach()
            prefix, suffix = framing(tensor.dtype, tuple(tensor.shape))
            frames += prefix
            frames += suffix
            recipe += (len(prefix), len(data), len(suffix))
            data.append(tensor)
            length = len(prefix) + tensor.numel() * tensor.element_size() + len(suffix)
        results.append(WriteResult(index=item.index, size_in_bytes=length,
                                   storage_data=_StorageInfo(name, offset, length)))
        offset += length
    tree = {"dcp": {"checkpoint_id": checkpoint_id, "file": name, "file_bytes": offset, "items": True,
                    "frames": torch.frombuffer(frames, dtype=torch.uint8) if frames else torch.empty(0, dtype=torch.uint8),
                    "recipe": torch.tensor(recipe, dtype=torch.int64), "data": data}}
    return tree, results


class FlashStorageWriter(RunMember, StorageWriter):
    """A DCP ``StorageWriter`` with flash semantics: ``dcp.save`` (or ``async_save``) blocks
    only for one copy of this rank's items into shared memory; flashckpt's saver writes
    the stock DCP files (``.metadata``, ``__<rank>_0.distcp``) into ``path`` in the
    background, and a restarted process reads them from memory
    (:class:`~flashckpt.dcp.FlashStorageReader`).

    ``path`` is the checkpoint id (a folder; ``dcp.save(checkpoint_id=...)`` may change it):
    a local path, or an object-store URL (``s3://bucket/run/step-100``: the stock files are
    objects under it, ``.metadata`` written last).
    ``store``: flashckpt's own directory for the run (default: ``.flashckpt`` beside
    ``path``, in the bucket for a URL); one run per store. ``options`` / keyword shorthands: :class:`flashckpt.Options`
    (``persist_every``, ``keep_last`` of the store, ...). The step a save takes is the
    number its id ends with (``step-100``), else one past the newest.
    """

    def __init__(self, path: str | os.PathLike, *, store: str | os.PathLike | None = None,
                 options: Options | None = None, process_group: Any = None, **shorthands: Any) -> None:
        StorageWriter.__init__(self)
        RunMember.__init__(self, path, store, options, process_group, shorthands)
        # the run opens at the first write, in the process that writes (async_save's process
        # executor saves from a child); a store another run holds is refused here, outside DCP's wrapping
        check_store_free(self._store())
        self._coordinator = True
        self._rank = 0
        self._pending: tuple[Run, int, dict[str, Any]] | None = None

    # -- DCP's calls -----------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = normalize_id(checkpoint_id)
        self._pending = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise CheckpointError(f"{self.path}: FlashStorageWriter saves with DCP's collectives (its coordinator "
                                  "writes the metadata of every rank's items); use_collectives=False is not supported")
        self._coordinator = is_coordinator
        self._rank = kwargs.get("rank", dist.get_rank() if dist.is_available() and dist.is_initialized() else 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        start = time.perf_counter()
        run = self._run()
        run.writing()
        step = run.next_step(self.path)
        tree, results = rank_tree(self.path, self._rank, plan, planner)
        if self._coordinator:  # saved with the .metadata once every rank wrote (finish)
            self._pending = (run, step, tree)
        else:
            self._save(run, step, tree, start)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        start = time.perf_counter()
        if self._pending is None:
            raise RuntimeError("finish() without write_data() on the coordinator")
        run, step, tree = self._pending
        self._pending = None
        metadata.storage_data = {r.index: r.storage_data for rank_results in results for r in rank_results}
        save_id = SAVE_ID_PREFIX + uuid.uuid4().hex  # in the exported .metadata and the commit
        metadata.storage_meta = StorageMeta(checkpoint_id=self.path, save_id=save_id)
        tree["dcp"]["metadata"] = torch.frombuffer(bytearray(pickle.dumps(metadata)), dtype=torch.uint8)
        tree["dcp"]["save_id"] = save_id
        self._save(run, step, tree, start)

    # -- flashckpt -----------------------------------------------------------------

    def _save(self, run: Run, step: int, tree: dict[str, Any], start: float) -> None:
        export = {"name": EXPORTER, "params": {"checkpoint_id": self.path}}
        with run.lock:
            run.engine.save(step, tree, export=export)
        log.debug("dcp save of %s as step %d: %d bytes of rank %d into memory in %.3fs", self.path, step,
                  tree["dcp"]["file_bytes"], self._rank, time.perf_counter() - start)

    def __getstate__(self) -> dict[str, Any]:
        state = RunMember.__getstate__(self)
        state["_pending"] = None
        return state
