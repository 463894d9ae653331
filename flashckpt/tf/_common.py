"""What the TF checkpointer, the estimator hook and the Keras callback share: the
engine for one worker, the shape of the saved state, and the data positions."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from .._engine import Engine, Placement, SingleProcess, new_token
from .._errors import CheckpointError
from .._options import Options, resolve_options
from ._data import DataPositions

__all__ = ["FORMAT", "data_state", "new_engine", "positions_of", "restore_data"]

log = logging.getLogger("flashckpt.tf")

FORMAT = "flashckpt.tf/1"


def new_engine(directory: str | os.PathLike, options: Options | None = None, **shorthands: Any) -> Engine:
    """An engine for one TF worker: its own directory, memory slots and shard ``rank-0``;
    ``options`` with its keyword shorthands laid over it (see :func:`resolve_options`)."""
    options = resolve_options(options, **shorthands)
    placement = Placement(local_rank=0, memory_rank=0, writes_memory=True, storage_rank=0, storage_world=1,
                          persists=True, token=new_token())
    return Engine(os.fspath(directory), options, placement, SingleProcess())


def positions_of(data: Any) -> DataPositions | None:
    """The positions of a data set (its ``.positions``, e.g. an ``elastic.tf.ShardDataset``),
    the positions themselves (:class:`DataPositions`), or None."""
    if data is None:
        return None
    positions = getattr(data, "positions", data)
    if not isinstance(positions, DataPositions):
        raise TypeError(f"data must be an elastic.tf.ShardDataset or ShardPositions (flashckpt.tf.DataPositions), "
                        f"got {type(data).__name__}")
    positions.deferred = True  # the coordinator learns positions at our saves
    return positions


def data_state(positions: DataPositions | None, rollback: Any) -> str | None:
    """The positions as a JSON string leaf (None without data)."""
    return None if positions is None else json.dumps(positions.state(rollback), separators=(",", ":"))


def restore_data(positions: DataPositions | None, saved: Any, step: int) -> None:
    """Put the data positions back where checkpoint ``step`` left them."""
    if positions is None:
        return
    if saved is None:
        log.warning("step %d holds no data positions; %s resumes from the coordinator as it is", step, positions)
        return
    try:
        state = json.loads(saved)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"step {step}: the data positions are not JSON: {exc}") from exc
    positions.restore(state)
