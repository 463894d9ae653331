"""``FlashStorageReader``: DCP loads that read a flash save from shared memory first.

A file of the checkpoint (``__<rank>_0.distcp``) is read from its rank's image in this
node's shared memory when a local slot holds the save, else from the stock file on
storage. A save that committed but whose stock files were never written (its saver was
killed between the two) is exported first, here.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import time
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.futures import Future

from .._engine import LoadInfo
from .._errors import CheckpointNotFoundError
from .._options import Options
from ._export import METADATA, export, write_rank_file
from ._images import MemoryCopy, committed_step, memory_copies, memory_tree
from ._run import Run, RunMember, normalize_id, step_of
from ._writer import distcp_name

__all__ = ["FlashStorageReader"]

log = logging.getLogger(__name__)


def _rank_of(relative_path: str) -> int | None:
    for rank_text in (relative_path[2:].split("_", 1)[0],):
        if relative_path.startswith("__") and rank_text.isdigit() and relative_path == distcp_name(int(rank_text)):
            return int(rank_text)
    return None


class FlashStorageReader(RunMember, StorageReader):
    """A DCP ``StorageReader`` for checkpoints written by :class:`~flashckpt.dcp.FlashStorageWriter`:
    reads each rank's file from this node's shared memory when it is there (a restart on the
    same node), else the stock files in ``path`` (which it also reads when flashckpt never
    saved them: any DCP checkpoint). ``store``, ``options``: as the writer's."""

    def __init__(self, path: str | os.PathLike, *, store: str | os.PathLike | None = None,
                 options: Options | None = None, process_group: Any = None, **shorthands: Any) -> None:
        StorageReader.__init__(self)
        RunMember.__init__(self, path, store, options, process_group, shorthands)
        self._run()  # here, not inside DCP's calls: a refused store is a plain error (a collective at a store's first use)
        self._reset_state()

    def _reset_state(self) -> None:
        self.storage_data: dict[Any, _StorageInfo] = {}
        self._copies: dict[int, MemoryCopy] = {}
        self._step: int | None = None
        self._last_load: LoadInfo | None = None
        self._start = time.perf_counter()

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = normalize_id(checkpoint_id)
        self._reset_state()

    @property
    def last_load(self) -> LoadInfo | None:
        """Step, source ("memory" / "storage") and seconds of this reader's last load."""
        return self._last_load

    def read_metadata(self) -> Metadata:  # no **kwargs: DCP then never asks for per-rank metadata
        self._start = time.perf_counter()
        run = self._run()
        engine = run.engine
        self._copies = memory_copies(engine.job_id, engine.storage.root, self.path, engine.options.memory_slots)
        if 0 in self._copies:
            self._step = self._copies[0].step
            with memory_tree(self._copies[0]) as saved:
                metadata = pickle.loads(memoryview(saved["metadata"].numpy()))
        else:
            self._ensure_files(run)
            metadata = FileSystemReader(self.path).read_metadata()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        return metadata

    def _ensure_files(self, run: Run) -> None:
        """Make sure the stock files exist: export a committed save that was never exported."""
        if os.path.exists(os.path.join(self.path, METADATA)):
            if self._step is None:
                self._step = step_of(self.path)
            return
        step = committed_step(run.engine.storage, self.path, step_of(self.path))
        if step is None:
            raise CheckpointNotFoundError(
                f"no DCP checkpoint {self.path}: not in this node's memory, no {METADATA} there, and "
                f"nothing committed as it in {run.store}")
        log.warning("DCP checkpoint %s is committed as step %d of %s but its files were never written: "
                    "writing them now", self.path, step, run.store)
        export(run.store, step, {"checkpoint_id": self.path})
        self._step = step

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        from_files: list[ReadItem] = []
        for relative_path, items in per_file.items():
            rank = _rank_of(relative_path)
            copy = self._copies.get(rank) if rank is not None else None
            if copy is None:
                from_files += items
                continue
            with memory_tree(copy) as saved:
                self._read_from_memory(saved, items, planner)
        if from_files:
            run = self._run()
            self._ensure_files(run)
            files = FileSystemReader(self.path)
            files.storage_data = self.storage_data
            files.read_data(LoadPlan(from_files), planner).wait()
        source = "storage" if from_files else "memory"
        run = self._run()
        if self._step is not None:
            run.saw(self._step)
            run.engine.finish_load(self._step, source, self._start, checkpoint_id=self.path)
        self._last_load = LoadInfo(self._step, source, time.perf_counter() - self._start)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_from_memory(self, saved: dict[str, Any], items: list[ReadItem], planner: LoadPlanner) -> None:
        """Each item straight from its tensor in the slot (one copy) when the image keeps items
        apart, as the writer's do; else (a save through the ``flashckpt://`` protocol, whose image
        holds the file's bytes as ``torch.save`` wrote them) through the file's bytes rebuilt in memory."""
        places = _item_places(saved) if saved.get("items") else {}
        if not all(self.storage_data[item.storage_index].offset in places for item in items):
            self._read_from_file_bytes(saved, items, planner)
            return
        frames = memoryview(saved["frames"].numpy())
        data = saved["data"]
        for item in items:
            index, start, length = places[self.storage_data[item.storage_index].offset]
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(bytes(frames[start:start + length])))
                continue
            _fill(planner, item, data[index])

    def _read_from_file_bytes(self, saved: dict[str, Any], items: list[ReadItem], planner: LoadPlanner) -> None:
        """What ``FileSystemReader`` does with a file, over the file's bytes rebuilt from the image."""
        whole = io.BytesIO()
        write_rank_file(whole, saved)
        view = whole.getbuffer()
        try:
            for item in items:
                info = self.storage_data[item.storage_index]
                record = io.BytesIO(bytes(view[info.offset:info.offset + info.length]))
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, record)
                    continue
                _fill(planner, item, torch.load(record, map_location="cpu", weights_only=True))
        finally:
            del view


def _fill(planner: LoadPlanner, item: ReadItem, saved: torch.Tensor) -> None:
    """Copy the part of ``saved`` that ``item`` reads into the planner's tensor for it."""
    source = narrow_tensor_by_index(saved, item.storage_offsets, item.lengths)
    target = planner.resolve_tensor(item).detach()
    if target.size() != source.size():
        raise RuntimeError(f"{item.storage_index} has shape {tuple(source.size())} in memory, "
                           f"the load wants {tuple(target.size())}")
    target.copy_(source)
    planner.commit_tensor(item, target)


def _item_places(saved: dict[str, Any]) -> dict[int, tuple[int, int, int]]:
    """File offset of each item the recipe lays out -> (data index, frames start, frames length)."""
    data = saved["data"]
    recipe = saved["recipe"].tolist()
    places: dict[int, tuple[int, int, int]] = {}
    at = offset = 0
    for i in range(0, len(recipe), 3):
        before, index, after = recipe[i:i + 3]
        places[offset] = (index, at, before)
        at += before + after
        offset += before + after + (data[index].numel() * data[index].element_size() if index >= 0 else 0)
    return places
