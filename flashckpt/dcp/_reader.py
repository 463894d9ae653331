"""``FlashStorageReader``: DCP loads that read a flash save from shared memory first.

A file of the checkpoint (``__<rank>_0.distcp``) is read from its rank's image in this
node's shared memory when a local slot holds the save, else from storage: for a local id
the stock file (DCP's ``FileSystemReader``); for an object-store id the rank's committed
flash shard in the run's store, verified block by block as every load from storage is, or,
once the store retired the step (``keep_last``), the stock files (DCP's ``FsspecReader``).
A save that committed but whose stock files were never written (its saver was killed
between the two) is exported first, here.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.futures import Future

from .._engine import LoadInfo
from .._errors import CheckpointError, CheckpointNotFoundError
from .._options import Options
from ..memory._slot import Slot
from ..restore._shard_read import open_shard
from ..storage._object import object_backend
from ..storage._protocol import Storage
from ..torch._image_views import read_shard, unpickler
from ..torch._tensors import TorchKind
from ._export import METADATA, export, write_rank_file
from ._images import MemoryCopy, committed_save, committed_step, memory_copies, memory_tree, unmap_later
from ._run import Run, RunMember, is_url, normalize_id, step_of
from ._writer import SAVE_ID_PREFIX, distcp_name

__all__ = ["FlashStorageReader"]

log = logging.getLogger(__name__)

_TORCH = TorchKind()
_REFUSE = unpickler(False, "a DCP step holds no pickled entries")
_BATCH_BYTES = 256 << 20
_ENTRY_BYTES = 512
"""Bound on what an item adds to a slot's image beyond its bytes in the file (header entry, alignment, recipe)."""
_HEADER_BYTES = 64 << 10
"""Bound on the rest of an image's header (the saved tree's skeleton)."""


def _rank_of(relative_path: str) -> int | None:
    for rank_text in (relative_path[2:].split("_", 1)[0],):
        if relative_path.startswith("__") and rank_text.isdigit() and relative_path == distcp_name(int(rank_text)):
            return int(rank_text)
    return None


class FlashStorageReader(RunMember, StorageReader):
    """A DCP ``StorageReader`` for checkpoints written by :class:`~flashckpt.dcp.FlashStorageWriter`:
    reads each rank's file from this node's shared memory when it is there (a restart on the
    same node), else storage (see the module doc; the stock files of ``path`` also when
    flashckpt never saved them: any DCP checkpoint). ``path``, ``store``, ``options``: as the writer's."""

    def __init__(self, path: str | os.PathLike, *, store: str | os.PathLike | None = None,
                 options: Options | None = None, process_group: Any = None, **shorthands: Any) -> None:
        StorageReader.__init__(self)
        RunMember.__init__(self, path, store, options, process_group, shorthands)
        self._run()  # here, not inside DCP's calls: a refused store is a plain error (a collective at a store's first use)
        self._reset_state()

    def _reset_state(self) -> None:
        self.storage_data: dict[Any, _StorageInfo] = {}
        self._copies: dict[int, MemoryCopy] = {}
        self._read: list[Slot] = []
        """Slots this load read from, still mapped: see :meth:`_prepare_next_saves`."""
        self._step: int | None = None
        self._files_ensured = False
        self._stored_image = 0
        """Bytes of this rank's image read from the store (its committed shard), if it was."""
        self._last_load: LoadInfo | None = None
        self._start = time.perf_counter()
        self._rank = 0
        self._coordinator = True

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
            with memory_tree(self._copies[0], self._read, keys=("metadata",)) as saved:
                metadata = pickle.loads(memoryview(saved["metadata"].numpy()))
        else:
            self._ensure_files(run)
            metadata = self._stock_files().read_metadata()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        return metadata

    def _ensure_files(self, run: Run) -> None:
        """Make sure the stock files are those of the save committed as this id: export a
        committed save that was never exported, or whose files are another save's of the
        id (an abandoned line's, its saver dead between the commit and the export). Once a load."""
        if self._files_ensured:
            return
        self._files_ensured = True
        committed = committed_save(run.engine.storage, self.path, step_of(self.path))
        files = self._has_metadata()
        if files and not (committed is not None and self._files_of_another_save(committed[1])):
            if self._step is None:
                self._step = step_of(self.path)
            return
        if committed is None:
            raise CheckpointNotFoundError(
                f"no DCP checkpoint {self.path}: not in this node's memory, no {METADATA} there, and "
                f"nothing committed as it in {run.store}")
        step = committed[0]
        log.warning("DCP checkpoint %s is committed as step %d of %s but its files %s: writing them now",
                    self.path, step, run.store, "are another save's" if files else "were never written")
        export(run.store, step, {"checkpoint_id": self.path})
        self._step = step

    def _files_of_another_save(self, committed_id: Any) -> bool:
        """The stock files are of another flashckpt save of this id than ``committed_id``
        (files a stock writer saved, whose ``save_id`` flashckpt did not make, are left)."""
        if committed_id is None:
            return False
        found = getattr(self._stock_files().read_metadata().storage_meta, "save_id", None)
        return isinstance(found, str) and found.startswith(SAVE_ID_PREFIX) and found != committed_id

    def _has_metadata(self) -> bool:
        if not is_url(self.path):
            return os.path.exists(os.path.join(self.path, METADATA))
        try:
            object_backend(self.path).size(METADATA)
        except CheckpointNotFoundError:
            return False
        return True

    def _stock_files(self) -> FileSystemReader:
        """DCP's own reader of the stock files: ``FsspecReader`` for a URL."""
        if is_url(self.path):
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            return FsspecReader(self.path)
        return FileSystemReader(self.path)

    def _read_from_storage(self, run: Run, items: list[ReadItem], planner: LoadPlanner) -> None:
        """Items from storage (see the module doc)."""
        self._ensure_files(run)
        if is_url(self.path):
            step = committed_step(run.engine.storage, self.path, step_of(self.path))
            if step is not None:
                self._step = step
                self._read_from_shards(run.engine.storage, step, items, planner)
                return
        files = self._stock_files()
        files.storage_data = self.storage_data
        files.read_data(LoadPlan(items), planner).wait()

    def _read_from_shards(self, storage: Storage, step: int, items: list[ReadItem], planner: LoadPlanner) -> None:
        """Items from the committed shards of ``step``, a rank's file from its shard, each shard
        read whole and verified before any item is taken from it."""
        per_rank: dict[int, list[ReadItem]] = {}
        for item in items:
            relative_path = self.storage_data[item.storage_index].relative_path
            rank = _rank_of(relative_path)
            if rank is None:
                raise CheckpointError(f"{self.path}: the .metadata names {relative_path!r}, not a file of the "
                                      f"flash writer (__<rank>_0.distcp)")
            per_rank.setdefault(rank, []).append(item)
        for rank, wanted in sorted(per_rank.items()):
            with open_shard(storage, step, rank, whole=True) as reader:
                tree, whole = read_shard(reader, _REFUSE)
            if rank == self._rank:
                self._stored_image = len(whole)
            try:
                saved = tree["dcp"]
                if saved["checkpoint_id"] != self.path:
                    raise CheckpointError(f"step {step} of {storage.root} holds {saved['checkpoint_id']}, "
                                          f"not {self.path}")
                self._read_from_memory(saved, wanted, planner)
            finally:
                tree = saved = whole = None  # the views go with the bytes

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        self._coordinator = is_coordinator
        self._rank = kwargs.get("rank", dist.get_rank() if dist.is_available() and dist.is_initialized() else 0)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            self._read_items(plan, planner)
        finally:
            if self._read:  # not handed on: a load that failed
                unmap_later(self._read)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_items(self, plan: LoadPlan, planner: LoadPlanner) -> None:
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
            with memory_tree(copy, self._read) as saved:
                self._read_from_memory(saved, items, planner)
        if from_files:
            self._read_from_storage(self._run(), from_files, planner)
        source = "storage" if from_files else "memory"
        run = self._run()
        if self._step is not None:
            run.saw(self._step)
            run.engine.finish_load(self._step, source, self._start, checkpoint_id=self.path)
        self._last_load = LoadInfo(self._step, source, time.perf_counter() - self._start)
        self._prepare_next_saves(run)

    def _prepare_next_saves(self, run: Run) -> None:
        """Size the run's slots for the saves that follow this load, in the background, so that
        the first of them copies into ready memory (a resume loads before it saves): as large as
        this rank's save that was loaded, its image in memory or its file on storage (DCP's plan
        gives a rank the same items again at the same world size). The thread that does it first
        unmaps the slots this load read: started after the unmapping, it would wait for it."""
        copy = self._copies.get(self._rank)
        if copy is not None:
            size = copy.image_len
        elif self._stored_image or is_url(self.path):
            size = self._stored_image
        else:
            size = _image_bound(self.path, distcp_name(self._rank), self._coordinator,
                                sum(info.relative_path == distcp_name(self._rank) for info in self.storage_data.values()))
        run.engine.prepare_image(size, self._read)
        self._read.clear()

    def _read_from_memory(self, saved: dict[str, Any], items: list[ReadItem], planner: LoadPlanner) -> None:
        """(``saved``: a rank's ``dcp`` tree, viewing a slot or a shard read from the store.) Each item straight from its tensor in the slot (one copy) when the image keeps items
        apart, as the writer's do; else (a save through the ``flashckpt://`` protocol, whose image
        holds the file's bytes as ``torch.save`` wrote them) through the file's bytes rebuilt in memory."""
        places = _item_places(saved) if saved.get("items") else {}
        if not all(self.storage_data[item.storage_index].offset in places for item in items):
            self._read_from_file_bytes(saved, items, planner)
            return
        frames = memoryview(saved["frames"].numpy())
        data = saved["data"]
        batch = _Batch(planner)
        for item in items:
            index, start, length = places[self.storage_data[item.storage_index].offset]
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(bytes(frames[start:start + length])))
                continue
            batch.add(item, data[index])
        batch.flush()

    def _read_from_file_bytes(self, saved: dict[str, Any], items: list[ReadItem], planner: LoadPlanner) -> None:
        """What ``FileSystemReader`` does with a file, over the file's bytes rebuilt from the image."""
        whole = io.BytesIO()
        write_rank_file(whole, saved)
        view = whole.getbuffer()
        batch = _Batch(planner)
        try:
            for item in items:
                info = self.storage_data[item.storage_index]
                record = io.BytesIO(bytes(view[info.offset:info.offset + info.length]))
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, record)
                    continue
                batch.add(item, torch.load(record, map_location="cpu", weights_only=True))
            batch.flush()
        finally:
            del view


class _Batch:
    """Tensor reads resolved by the planner, copied together and then committed, in item order:
    one multi-threaded byte copy of the contiguous host ones (``flashckpt.torch``'s copy, as a
    load of the core's), where DCP's readers copy item by item on one thread. At most about
    ``_BATCH_BYTES`` are resolved and not yet committed at once (a planner may resolve into
    temporary tensors that its ``commit_tensor`` copies on)."""

    def __init__(self, planner: LoadPlanner) -> None:
        self._planner = planner
        self._reads: list[tuple[ReadItem, torch.Tensor, torch.Tensor]] = []
        self._bytes = 0

    def add(self, item: ReadItem, saved: torch.Tensor) -> None:
        """Read the part of ``saved`` that ``item`` names (copied at the latest by :meth:`flush`)."""
        source = narrow_tensor_by_index(saved, item.storage_offsets, item.lengths)
        target = self._planner.resolve_tensor(item).detach()
        if target.size() != source.size():
            raise RuntimeError(f"{item.storage_index} has shape {tuple(source.size())} in memory, "
                               f"the load wants {tuple(target.size())}")
        self._reads.append((item, target, source))
        self._bytes += target.nbytes
        if self._bytes >= _BATCH_BYTES:
            self.flush()

    def flush(self) -> None:
        """Copy the reads added so far, then commit them to the planner."""
        reads, self._reads, self._bytes = self._reads, [], 0
        if not reads:
            return
        _TORCH.copy([target for _, target, _ in reads], [source for _, _, source in reads])
        for item, target, _ in reads:
            self._planner.commit_tensor(item, target)


def _image_bound(folder: str, name: str, coordinator: bool, items: int) -> int:
    """About the bytes (never fewer) of the image a save of the items in file ``name`` of
    ``folder`` takes (with the ``.metadata`` on the coordinator); 0 without such a file."""
    try:
        size = os.path.getsize(os.path.join(folder, name))
        if coordinator:
            size += os.path.getsize(os.path.join(folder, METADATA))
    except OSError:
        return 0
    return size + items * _ENTRY_BYTES + _HEADER_BYTES


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
