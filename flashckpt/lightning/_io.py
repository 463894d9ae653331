"""``FlashCheckpointIO``: Lightning's checkpoint saves at the cost of one memory copy.

For Lightning's non-sharded strategies (single device, DDP, DP), which hand the
Trainer's whole checkpoint dict to the strategy's ``CheckpointIO`` on global rank 0.
``save_checkpoint`` copies that dict into shared memory through a
:class:`~flashckpt.torch.DdpCheckpointer` (step: ``checkpoint["global_step"]``) and
returns; the node's saver persists it to ``<dirpath>/.flashckpt`` and then writes
Lightning's own ``.ckpt`` file at the path (``flashckpt.lightning._export``), so stock
Lightning reads the files without flashckpt. ``load_checkpoint`` (every rank) reads the
step from memory when every rank's node holds it, else from flashckpt's storage, else the
stock file. The IO is itself asynchronous: Lightning's ``AsyncCheckpointIO`` works on top
of it, but only adds a clone of every tensor on the training thread.

The checkpointer is built on every rank together (a collective), in the IO's Lightning
``setup`` hook: pass the IO to the Trainer's ``callbacks`` (it installs itself as the
strategy's checkpoint IO there, or keeps an ``AsyncCheckpointIO`` wrapping it from
``plugins``). Without a process group it also opens on first use.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch import Callback
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO

from .._engine import SaveHandle
from .._errors import CheckpointError, CheckpointNotFoundError
from .._options import Options, resolve_options
from ..torch import DdpCheckpointer
from . import _files

__all__ = ["EXPORTER", "FlashCheckpointIO"]

log = logging.getLogger("flashckpt.lightning")

_STOCK, _MISSING = "stock", "missing"

EXPORTER = "lightning"
"""The exporter's name in the ``flashckpt.exporters`` entry-point group."""


class FlashCheckpointIO(CheckpointIO, Callback):
    """Flash checkpoints for a Lightning ``Trainer`` whose checkpoints go to ``dirpath``
    (the ``ModelCheckpoint``'s ``dirpath``).

    ``options`` (a :class:`flashckpt.Options`) and its fields as keywords, as every
    checkpointer takes them; ``persist_every`` counts Lightning's saves (a save not
    persisted leaves only a placeholder at its path, which this IO loads while the step
    is in memory). ``last_save`` is the :class:`~flashckpt.SaveHandle` of the newest
    save, ``checkpointer`` the :class:`~flashckpt.torch.DdpCheckpointer` underneath
    (``checkpointer.last_load.source``: "memory" or "storage").
    """

    def __init__(self, dirpath: str | os.PathLike, *, options: Options | None = None, **shorthands: Any) -> None:
        super().__init__()
        self.dirpath = os.path.abspath(os.fspath(dirpath))
        self.options = resolve_options(options, **shorthands)
        self.checkpointer: DdpCheckpointer | None = None
        self.last_save: SaveHandle | None = None
        self._stock = TorchCheckpointIO()

    # -- Lightning's Callback side: open on every rank together --------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Install this IO as the strategy's and open the checkpointer (every rank, once
        the process group exists)."""
        self._install(trainer.strategy)
        self._open(collective=True)

    def _install(self, strategy: Any) -> None:
        current = strategy._checkpoint_io  # None: the strategy would make a TorchCheckpointIO
        if current is self or (isinstance(current, _WrappingCheckpointIO) and current.checkpoint_io is self):
            return
        if isinstance(current, _WrappingCheckpointIO) and current.checkpoint_io is None:
            current.checkpoint_io = self
            return
        if current is not None and not isinstance(current, TorchCheckpointIO):
            raise CheckpointError(f"the strategy already has the checkpoint IO {type(current).__name__}; "
                                  "FlashCheckpointIO replaces the stock TorchCheckpointIO only")
        strategy.checkpoint_io = self

    def _open(self, *, collective: bool) -> DdpCheckpointer:
        if self.checkpointer is None:
            if not collective and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                raise CheckpointError("FlashCheckpointIO opens on every rank together: pass it to the Trainer's "
                                      "callbacks (Trainer(callbacks=[io, ...])), not only to its plugins")
            os.makedirs(self.dirpath, exist_ok=True)
            self.checkpointer = DdpCheckpointer(_files.flash_dir(self.dirpath), options=self.options)
            self.checkpointer.engine.expect_export(EXPORTER)
        return self.checkpointer

    # -- CheckpointIO ----------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        """Copy ``checkpoint`` into shared memory as step ``checkpoint["global_step"]`` and
        return; ``path`` gets a placeholder now, the stock file once the step is persisted.
        Called on global rank 0."""
        if storage_options is not None:
            raise TypeError("FlashCheckpointIO.save_checkpoint takes no storage_options, got "
                            f"{storage_options!r}")
        if not isinstance(checkpoint, dict):
            raise TypeError(f"a Lightning checkpoint is a dict, got {type(checkpoint).__name__}")
        step = checkpoint.get("global_step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"checkpoint['global_step'] must be an int >= 0 (the flashckpt step), got {step!r}")
        name = self._name(path)
        checkpointer = self._open(collective=False)
        target = os.path.join(self.dirpath, name)
        created = _files.write_placeholder(target, step)
        export = {"name": EXPORTER, "params": {"dirpath": self.dirpath, "file": name}}
        try:
            self.last_save = checkpointer.engine.save(step, checkpoint, export=export)
        except BaseException:
            if created:
                _files.remove(self.dirpath, name)
            raise
        log.debug("saved step %d for %s to memory", step, target)

    def load_checkpoint(self, path: str | os.PathLike, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint at ``path`` (every rank): a ``last*.ckpt`` name is the newest step;
        another name the step it was saved as. From memory when every rank holds it, else
        flashckpt's storage, else the stock file. Tensors are CPU tensors (as the stock IO
        loads them); a path outside the IO's directory is read by the stock IO."""
        full = os.path.abspath(os.fspath(path))
        if os.path.dirname(full) != self.dirpath:
            return self._stock.load_checkpoint(full, map_location=map_location, weights_only=weights_only)
        name = _files.check_name(os.path.basename(full), self.dirpath)
        checkpointer = self._open(collective=False)
        wanted = checkpointer.engine.collective.all_gather(self._step_of(name, full))[0]  # rank 0's view
        if wanted == _MISSING:
            raise FileNotFoundError(f"{full}: no such checkpoint")
        if wanted != _STOCK:
            state: dict[str, Any] = {}
            try:
                if checkpointer.load(state, step=wanted) is not None:
                    return state
            except CheckpointNotFoundError:
                pass
            if not os.path.isfile(full) or _files.placeholder_step(full) is not None:
                raise FileNotFoundError(f"{full}: no such checkpoint (not in memory, not in "
                                        f"{checkpointer.directory})")
            log.info("%s: its step is not in memory or in %s; reading the file", full, checkpointer.directory)
        return self._stock.load_checkpoint(full, map_location=map_location, weights_only=weights_only)

    def _step_of(self, name: str, full: str) -> int | str | None:
        """The step the file ``name`` stands for: None (the newest) for a ``last*.ckpt``
        name, :data:`_STOCK` for a file flashckpt did not write, :data:`_MISSING`."""
        if _files.is_last(name):
            return None
        step = _files.placeholder_step(full)
        if step is None:
            step = _files.exported_steps(self.dirpath).get(name)
        if step is not None:
            return step
        return _STOCK if os.path.isfile(full) else _MISSING

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        """Remove the file at ``path`` (global rank 0), and its export still to come; the
        flashckpt steps stay, retired by ``keep_last`` alone."""
        _files.remove(self.dirpath, self._name(path))

    def teardown(self, *_hook_args: Any, **_hook_kwargs: Any) -> None:
        """Flush the newest step to storage, wait, free shared memory (every rank; the
        next ``fit``/``test`` opens again). Both Lightning's ``teardown`` calls land here:
        the callback's (``trainer, pl_module, stage``), then the strategy's (none)."""
        if self.checkpointer is not None:
            checkpointer, self.checkpointer = self.checkpointer, None
            checkpointer.close()

    def _name(self, path: str | os.PathLike) -> str:
        full = os.path.abspath(os.fspath(path))
        if os.path.dirname(full) != self.dirpath:
            raise CheckpointError(f"{full} is not in this FlashCheckpointIO's directory {self.dirpath} (give the IO "
                                  "the ModelCheckpoint's dirpath)")
        return _files.check_name(os.path.basename(full), self.dirpath)
