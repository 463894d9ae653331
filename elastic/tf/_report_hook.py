"""The estimator hook that commits the records each training step consumed.

It only reads the positions it is given (or finds registered with the graph), so it
imports :class:`~elastic.tf.ShardPositions` for type hints only and
``ShardPositions.report_hook`` can build one without an import loop.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from flashckpt.tf._data import graph_positions

if TYPE_CHECKING:
    from ._positions import ShardPositions

__all__ = ["ShardReportHook", "positions_of_graph"]


def positions_of_graph(graph: Any = None) -> ShardPositions | None:
    """The positions an elastic ``input_fn`` registered with ``graph`` (default: current)."""
    return graph_positions(graph)


class ShardReportHook(tf.estimator.SessionRunHook):
    """Counts the records each training step consumed and commits them to the coordinator.

    ``positions``: default, those an elastic ``input_fn`` registered with the training
    graph. ``batch_size``: default, the ``input_fn``'s. Commits after every step, unless
    a ``FlashCheckpointHook`` owns the positions (then at each checkpoint). Use one per
    ``train`` call; a ``FlashCheckpointHook`` runs one itself when none is given.
    """

    def __init__(self, positions: ShardPositions | None = None, *, batch_size: int | None = None) -> None:
        self._given = positions
        self._batch_size = batch_size
        self.positions: ShardPositions | None = None
        self._counting = False

    def begin(self) -> None:
        self.positions = self._given or positions_of_graph()
        if self.positions is None:
            raise ValueError("ShardReportHook: no elastic input_fn in this graph; pass positions=")
        if self._batch_size is not None:
            self.positions.batch_size = self._batch_size
        counter = getattr(self.positions, "_counter", None)
        self._counting = counter is None or counter() in (None, self)
        if self._counting:
            self.positions._counter = weakref.ref(self)  # type: ignore[attr-defined]

    def after_run(self, run_context: Any, run_values: Any) -> None:
        if self._counting and self.positions is not None:
            self.positions.consumed_steps(1)

    def end(self, session: Any) -> None:
        if self._counting and self.positions is not None:
            if not self.positions.deferred:
                self.positions.commit()
            self.positions._counter = None  # type: ignore[attr-defined]
            self._counting = False
