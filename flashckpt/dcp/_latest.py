"""The newest DCP checkpoint of a folder, from shared memory and the run's store.

Callers that keep one DCP checkpoint per step in a folder find the newest by listing it:
torchtitan takes the highest ``step-N`` that holds a ``.metadata`` file. After a crash
that listing misses flash saves: the newest may be only in shared memory (the saver
writes its stock files in the background, or, with ``persist_every`` above 1, not at
all), and a save of an abandoned line may still have its folder. :func:`latest_checkpoint`
answers from flashckpt's own record instead, with the one agreement every flashckpt
load uses (memory if every rank holds the newest save, else the newest committed step;
lines, not numbers).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .._errors import CheckpointError, CorruptCheckpointError
from .._options import Options
from ..restore._shard_read import open_shard
from ..restore._sources import Source
from ._images import _dcp_value, _saved_id
from ._run import Run, is_url, normalize_id, run_for, store_of
from ._url import CHAINED, PROTOCOL, folder_of

__all__ = ["Latest", "latest_checkpoint"]


@dataclass(frozen=True, slots=True)
class Latest:
    """The checkpoint to load: the same on every rank."""

    step: int
    """flashckpt's step of the save (the number its id ends with, ``step-100`` -> 100)."""
    checkpoint_id: str
    """The id it was saved as (an absolute path inside the folder)."""
    source: str
    """``"memory"`` (every rank holds it in this node's or a peer's memory) or ``"storage"``."""


def latest_checkpoint(folder: str | os.PathLike, *, step: int | None = None, store: str | os.PathLike | None = None,
                      options: Options | None = None, process_group: Any = None, **shorthands: Any) -> Latest | None:
    """The newest DCP checkpoint that :class:`~flashckpt.dcp.FlashStorageWriter` saved into
    ``folder`` (ids ``<folder>/<name>``) and every rank can load, or None when flashckpt holds
    none there (a fresh start, or a folder only stock DCP wrote: list it as before).
    ``step``: that step only (None when it is neither in every rank's memory nor committed).

    ``store``, ``options`` and shorthands: as the writer's (the run's store defaults to
    ``<folder>/.flashckpt``). A collective: all ranks must call this, and all get the same
    answer. Load it with ``FlashStorageReader(latest.checkpoint_id)``, or, for a folder of
    the ``flashckpt://`` protocol (``flashckpt:///abs/dir``, ``flashckpt::s3://bucket/run``;
    its id is in that form), with ``dcp.load(state, checkpoint_id=latest.checkpoint_id)``.
    """
    given = os.fspath(folder)
    if not given.startswith(f"{PROTOCOL}:"):
        return _latest(folder, step, store, options, process_group, shorthands)
    found = _latest(folder_of(given), step, store, options, process_group, shorthands)
    if found is None:
        return None
    prefix = CHAINED if is_url(found.checkpoint_id) else f"{PROTOCOL}://"
    return Latest(found.step, prefix + found.checkpoint_id, found.source)


def _latest(folder: str | os.PathLike, step: int | None, store: str | os.PathLike | None, options: Options | None,
            process_group: Any, shorthands: dict[str, Any]) -> Latest | None:
    folder = normalize_id(folder)
    run = run_for(store_of(os.path.join(folder, "_"), store), options, process_group, **shorthands)  # the store of every id in folder
    agreement = run.engine.agree(step)
    if agreement.step is None:
        return None
    found = agreement.step
    where = "memory" if agreement.source == Source.MEMORY else "storage"
    if where == "storage" and found not in run.engine.storage.committed_steps():
        return None  # an asked-for step that nothing holds
    ids = run.engine.on_all_ranks(lambda: _saved_as(run, found, where), f"reading the id of step {found} of {run.store}")
    if len(set(ids)) != 1:
        raise CheckpointError(f"step {found} of {run.store} was saved under different ids by different ranks: "
                              f"{sorted(set(map(str, ids)))}")
    checkpoint_id = ids[0]
    if not isinstance(checkpoint_id, str) or os.path.dirname(checkpoint_id) != folder:
        raise CheckpointError(f"step {found} of {run.store} is not a DCP checkpoint in {folder} "
                              f"(saved as {checkpoint_id!r}); give each folder its own store")
    return Latest(found, checkpoint_id, where)


def _saved_as(run: Run, step: int, where: str) -> Any:
    """The checkpoint id this rank's copy of ``step`` (memory), or rank 0's committed shard, names."""
    if where == "memory":
        return _saved_id(run.engine.memory_info(step))
    try:
        with open_shard(run.engine.storage, step, 0) as reader:
            return _dcp_value(reader.image.meta.get("tree"), "checkpoint_id")
    except (CorruptCheckpointError, OSError) as exc:
        raise CheckpointError(f"step {step} of {run.store}: cannot read which checkpoint it is: {exc}") from exc
