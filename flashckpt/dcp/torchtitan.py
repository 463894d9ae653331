"""torchtitan's checkpoint manager with flash checkpoints.

:class:`FlashCheckpointManager` is torchtitan's own ``CheckpointManager`` (0.3) with the
DCP calls given flashckpt's writer and reader; a trainer picks it in its config::

    checkpoint=FlashCheckpointManager.Config(enable=True, folder="checkpoint", interval=100)

What changes, and why:

- **Saves** go through :class:`~flashckpt.dcp.FlashStorageWriter`: ``save`` blocks only
  for one copy of the rank's state into shared memory; the node's saver writes the stock
  ``step-N`` folder (``.metadata`` + ``__<rank>_0.distcp``) in the background. torchtitan's
  ``async_mode`` has nothing left to do (its staging would be a second copy), so every
  mode saves this way; on CPU it also spares ``async_with_pinned_mem``'s stager, which
  needs an accelerator.
- **Loads** go through :class:`~flashckpt.dcp.FlashStorageReader` (memory first).
- **The first save** of a fresh start (or after torchtitan's own load of an
  ``initial_load_path``) is readied at ``load`` (:func:`~flashckpt.dcp.prepare`): it blocks
  only for its copy, as the later ones do; a flash load readies it itself.
- **The newest step** comes from :func:`~flashckpt.dcp.latest_checkpoint`, not from
  listing ``step-N`` folders that hold a ``.metadata``: after a crash the newest save may
  be in memory only. torchtitan then checks that ``step-N`` is a folder before loading, so
  an empty one stands for a save still only in memory; the saver's export replaces it.
- **Purging** (``keep_latest_k``) deletes ``step-N`` folders only, never an export's
  staging folder (``step-N.tmp-flashckpt``, which torchtitan's ``step-(\\d+)`` search
  also matches).

HF safetensors saves and loads (``last_save_in_hf``, ``initial_load_in_hf``) and
``initial_load_path`` (a checkpoint outside the folder) stay torchtitan's own. flashckpt
keeps its run in ``<folder>/.flashckpt`` (its copy of each persisted step, ``keep_last``
of them); the ``step-N`` folders are stock DCP checkpoints that torchtitan without
flashckpt loads.

The folder is local (a shared file system is fine), or an object store's, chained:
``flashckpt::s3://bucket/run`` (``s3://bucket/run`` is taken as that). Its run is then the
writer's for ``s3://bucket/run/step-N`` ids (store ``s3://bucket/run/.flashckpt``), and
torchtitan's own look at the folder (its fsspec calls: does it exist, is ``step-N`` a
folder, the purge's listing and removal) goes through the ``flashckpt://`` file system,
which sees the saves in memory first: through s3fs a save not yet in the bucket is not there.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import posixpath
import re
from typing import Any

import torch.distributed.checkpoint as dcp
from torchtitan.components.checkpoint import MODEL, CheckpointManager
from torchtitan.tools import filesystem
from torchtitan.tools.utils import GarbageCollection

from .._engine import LoadInfo
from .._options import Options
from ._latest import Latest, latest_checkpoint
from ._prepare import prepare
from ._reader import FlashStorageReader
from ._run import close_all, is_url, normalize_id
from ._url import CHAINED, PROTOCOL, folder_of, strip
from ._writer import FlashStorageWriter

__all__ = ["FlashCheckpointManager"]

log = logging.getLogger(__name__)

_STEP_FOLDER = re.compile(r"step-(\d+)")

_DEFAULTS = Options()
"""The config's flashckpt fields default as ``Options`` does, so that a writer, reader or
:func:`~flashckpt.dcp.latest_checkpoint` given no options opens the same run."""


class FlashCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` saving and loading through flashckpt (see the
    module docstring). Built like it, from its config: ``Config(...).build(dataloader=...,
    model_parts=..., optimizers=..., lr_schedulers=..., states=..., sd_adapter=...)``."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        persist_every: int = _DEFAULTS.persist_every
        """Every this many saves also reach storage (a ``step-N`` folder); the others stay
        in shared memory only, and a restart on the same node still loads them."""

        keep_last: int = _DEFAULTS.keep_last
        """Persisted steps flashckpt keeps in its own store, ``<folder>/.flashckpt``
        (0: all); torchtitan's ``keep_latest_k`` purges the ``step-N`` folders."""

        store: str | None = None
        """flashckpt's folder for the run, absolute (default: ``.flashckpt`` in the
        checkpoint folder)."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            Options(persist_every=self.persist_every, keep_last=self.keep_last)  # its checks
            if self.store is not None and not os.path.isabs(self.store):
                raise ValueError(f"checkpoint.store must be an absolute path, got {self.store!r}")

    def __init__(self, config: Config, **components: Any) -> None:
        if config.enable and config.async_mode != "disabled":
            log.info("flash checkpoints: async_mode=%s is not needed (a save blocks only for one copy into "
                     "shared memory and persists in the background); saving without DCP's staging",
                     config.async_mode)
            config = dataclasses.replace(config, async_mode="disabled")
        super().__init__(config, **components)
        if not self.enable:
            return
        self._flash_folder = _flash_folder(self.folder)
        self.folder = f"{CHAINED}{self._flash_folder}" if is_url(self._flash_folder) else self._flash_folder
        self._options = Options(persist_every=config.persist_every, keep_last=config.keep_last)
        self._store = config.store
        self._latest: Latest | None = None
        self._last_load: LoadInfo | None = None

    @property
    def last_load(self) -> LoadInfo | None:
        """Step, source (``"memory"`` / ``"storage"``) and seconds of the last flash load."""
        return self._last_load

    # -- the DCP calls -------------------------------------------------------------

    def _ours(self, checkpoint_id: str) -> bool:
        if is_url(self._flash_folder):
            return posixpath.dirname(checkpoint_id) == self.folder
        return os.path.dirname(os.path.abspath(checkpoint_id)) == self.folder

    def _flash_id(self, checkpoint_id: str) -> str:
        """The writer's and reader's id of a checkpoint id in the folder (``s3://...`` for a chain's)."""
        return strip(checkpoint_id) if is_url(self._flash_folder) else checkpoint_id

    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: Any,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> None:
        """A flash save of ``state_dict`` as ``checkpoint_id``; HF saves are torchtitan's."""
        if to_hf or not self._ours(checkpoint_id):
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        dcp.save(state_dict, storage_writer=FlashStorageWriter(self._flash_id(checkpoint_id), store=self._store,
                                                               options=self._options))
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return None

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        """A flash load of ``checkpoint_id`` (memory first); HF loads and checkpoints
        outside the folder (``initial_load_path``) are torchtitan's."""
        if from_hf or not self._ours(checkpoint_id):
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        reader = FlashStorageReader(self._flash_id(checkpoint_id), store=self._store, options=self._options)
        dcp.load(state_dict, storage_reader=reader)
        if MODEL in self.states:  # as torchtitan: the model's states are flattened into state_dict
            self.states[MODEL].load_state_dict(state_dict)
        self._last_load = reader.last_load
        return None

    # -- which step ------------------------------------------------------------------

    def _load(self, step: int = -1) -> bool:
        """torchtitan's load, told the newest step by flashckpt (all ranks call it)."""
        self._latest = latest_checkpoint(self._flash_folder, step=None if step == -1 else step, store=self._store,
                                         options=self._options)
        if self._latest is not None:
            if self._latest.checkpoint_id != self._flash_id(self._create_checkpoint_id(self._latest.step)):
                log.warning("the newest flash save in %s is %s, not a torchtitan step folder: not loading it",
                            self.folder, self._latest.checkpoint_id)
                self._latest = None
            elif not is_url(self._flash_folder):
                # torchtitan checks it is a folder; a save only in memory has none yet (through
                # flashckpt::s3://, torchtitan sees the folders of memory's saves)
                os.makedirs(self._latest.checkpoint_id, exist_ok=True)
        before = self._last_load
        loaded = super()._load(step)
        if self._last_load is before and not self.load_only:  # a fresh start, or torchtitan's own load
            prepare(self._flattened_model_states_sd(), self._flash_folder, store=self._store, options=self._options)
        return loaded

    def _find_load_step(self, folder: str = "") -> int:
        if self._latest is not None and folder in ("", self.folder):
            return self._latest.step
        return super()._find_load_step(folder)

    def _purge_stale_checkpoints(self) -> None:
        """torchtitan's purge (``keep_latest_k``), over ``step-N`` folders only."""
        if not self._should_purge():
            return
        steps = sorted((int(m.group(1)), name) for name in filesystem.listdir(self.folder)
                       if (m := _STEP_FOLDER.fullmatch(name)))
        for _, name in steps[:-self.keep_latest_k]:
            self.purge_queue.put(filesystem.join(self.folder, name))

    def _close(self) -> None:
        """torchtitan's close, then flashckpt's (:func:`flashckpt.dcp.close`): every flash run of
        the process persists its newest save and frees its memory."""
        super()._close()
        close_all()

    def __del__(self) -> None:
        """Garbage collected: torchtitan's threads only; the process's flash runs stay open
        (another manager may use them) until :meth:`close` or exit."""
        if getattr(self, "enable", False):
            super()._close()


def _flash_folder(folder: str) -> str:
    """The folder flashckpt's writer and reader take: an absolute local path, or the
    object-store URL of ``flashckpt::s3://...`` (or ``s3://...``); a clear error for other
    remote folders."""
    if folder.startswith(f"{PROTOCOL}:"):
        return folder_of(folder)
    if filesystem.is_remote(folder):
        return normalize_id(folder)  # an object store's URL, else a CheckpointError naming the scheme
    return os.path.abspath(folder)
