"""What the files DCP writes through ``flashckpt://`` become: one flashckpt save a rank.

DCP's ``FsspecWriter`` has every rank write its items into one file,
``<folder>/__<rank>_0.distcp``, and close it; then the coordinator (rank 0) writes the
pickled metadata to ``.metadata.tmp`` and renames it ``.metadata``. A rank other than 0
never hears of the checkpoint again after its close, so its file is handed over there: a
flashckpt save of the folder's step holding that file. Rank 0 holds its file until the
rename and saves it with ``.metadata``, as :class:`~flashckpt.dcp.FlashStorageWriter`
saves the coordinator's items in ``finish``; the saved trees are the writer's, so the
``dcp`` exporter writes the stock files of the folder once the step commits across ranks.

The step is the number the folder ends with (``step-100``), else the run's next (see
:meth:`flashckpt.dcp._run.Run.next_step`), taken when each rank opens its file. State is
kept per process, not per file system object: fsspec makes one object per thread, and
``dcp.async_save`` writes from another thread than the one that planned.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import torch

from .._errors import CheckpointError
from .._options import Options
from ._export import DISTCP
from ._fs_write import CapturedFile
from ._run import EXPORTER, Run, run_for, store_of

__all__ = ["DISTCP", "METADATA_TMP", "Saves"]

log = logging.getLogger(__name__)

METADATA = ".metadata"
METADATA_TMP = ".metadata.tmp"


class Saves:
    """The process's saves in flight through ``flashckpt://``, by checkpoint folder."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, CapturedFile] = {}
        self._coordinator: dict[str, tuple[Run, int, dict[str, Any]]] = {}
        self._metadata: dict[str, bytes] = {}

    def saving(self, folder: str) -> bool:
        """Whether a save of ``folder`` is in flight in this process."""
        with self._lock:
            return folder in self._coordinator or any(os.path.dirname(p) == folder for p in self._open)

    def open_distcp(self, path: str, options: Options | None) -> CapturedFile:
        """The rank's ``.distcp`` file of a save (all ranks open theirs: the run's first
        open, and the step of a folder without a number, are collectives)."""
        folder, name = os.path.split(path)
        rank, index = (int(g) for g in DISTCP.fullmatch(name).groups())  # type: ignore[union-attr]
        if index != 0:
            raise CheckpointError(f"{path}: flashckpt:// takes one file per rank (DCP's FsspecWriter with its "
                                  "defaults, thread_count=1 and single_file_per_rank=True)")
        run = run_for(store_of(folder, None), options)
        run.writing()
        if run.rank != rank:
            raise CheckpointError(f"{path} is rank {rank}'s file but this process is rank {run.rank} of the "
                                  "default process group: flashckpt:// saves with the default process group")
        step = run.next_step(folder)
        start = time.perf_counter()

        def closed(file: CapturedFile) -> None:
            self._forget(path)
            tree = file.tree(folder)
            if rank == 0:  # saved with the .metadata, at its rename
                with self._lock:
                    self._coordinator[folder] = (run, step, tree)
            else:
                _save(run, step, tree, start)

        return self._track(path, CapturedFile(path, closed))

    def open_metadata(self, path: str) -> CapturedFile:
        """The coordinator's ``.metadata.tmp``."""
        folder = os.path.dirname(path)

        def closed(file: CapturedFile) -> None:
            self._forget(path)
            with self._lock:
                self._metadata[folder] = file.getvalue()

        return self._track(path, CapturedFile(path, closed))

    def commit(self, tmp: str, final: str) -> bool:
        """DCP's rename of ``.metadata.tmp`` to ``.metadata``: the coordinator's save. False
        when ``tmp`` is no captured file of this process."""
        folder = os.path.dirname(tmp)
        if os.path.basename(tmp) != METADATA_TMP or final != os.path.join(folder, METADATA):
            return False
        with self._lock:
            metadata = self._metadata.pop(folder, None)
            pending = self._coordinator.pop(folder, None)
        if metadata is None:
            return False
        if pending is None:
            raise CheckpointError(f"{final}: the metadata of a save whose rank 0 file {folder}/__0_0.distcp was "
                                  "not written in this process")
        run, step, tree = pending
        tree["dcp"]["metadata"] = torch.frombuffer(bytearray(metadata), dtype=torch.uint8)
        _save(run, step, tree, time.perf_counter())
        return True

    def drop(self, path: str) -> bool:
        """DCP removes a file it failed to write, and an older ``.metadata`` before its
        rename: a file captured here is dropped. True if ``path`` was one, or is a
        ``.metadata`` that a save in flight replaces (with its whole folder)."""
        folder, name = os.path.split(path)
        found = DISTCP.fullmatch(name)
        with self._lock:
            file = self._open.pop(path, None)
            held = None
            if name == METADATA_TMP:
                held = self._metadata.pop(folder, None)
            elif found is not None and found.group(1) == "0":
                held = self._coordinator.pop(folder, None)
            replaced = name == METADATA and folder in self._coordinator
        if file is not None:
            file.discard()
        return file is not None or held is not None or replaced

    def _track(self, path: str, file: CapturedFile) -> CapturedFile:
        with self._lock:
            self._open[path] = file
        return file

    def _forget(self, path: str) -> None:
        with self._lock:
            self._open.pop(path, None)


def _save(run: Run, step: int, tree: dict[str, Any], start: float) -> None:
    folder = tree["dcp"]["checkpoint_id"]
    with run.lock:
        run.engine.save(step, tree, export={"name": EXPORTER, "params": {"checkpoint_id": folder}})
    log.debug("flashckpt:// save of %s as step %d: %d bytes of rank %d into memory in %.3fs", folder, step,
              tree["dcp"]["file_bytes"], run.rank, time.perf_counter() - start)
