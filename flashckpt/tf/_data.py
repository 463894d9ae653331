"""The data positions a TF adapter checkpoints with the model: a small protocol.

flashckpt never imports a data library. ``Checkpointer``, ``FlashCheckpointHook`` and
``FlashCheckpointCallback`` take any object that satisfies :class:`DataPositions`
(``elastic.tf.ShardPositions`` does), or a data set that carries one as ``.positions``
(``elastic.tf.ShardDataset``). An estimator ``input_fn`` registers its positions with
the graph it builds (:func:`register_graph_positions`), so the hook finds them without
being told.

Call protocol: the adapter sets ``deferred`` (it commits at its saves), takes
``state(rollback)`` into every checkpoint and ``mark()`` right before the save's copy,
then ``commit(mark)`` once the copy is done; on load, ``restore(state)``. Training steps
are counted by ``consumed_steps`` (Keras) or by the ``report_hook()`` the estimator
hook runs; a failed input pipeline becomes ``fail(error)``, the error to raise.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol, runtime_checkable

__all__ = ["DataPositions", "graph_positions", "register_graph_positions"]


@runtime_checkable
class DataPositions(Protocol):
    """What the TF adapters call on the data positions they checkpoint."""

    #: True while a checkpointer commits the positions at its saves
    deferred: bool
    #: records per training step, when known
    batch_size: int | None

    def state(self, rollback: Any = None) -> dict[str, Any]:
        """The positions as a small JSON-able dict; ``rollback`` (None: the default)
        says what a restore rolls back."""

    def restore(self, state: dict[str, Any]) -> None:
        """Go back to ``state`` (from :meth:`state`)."""

    def mark(self) -> Any:
        """The consumed positions now, for a later :meth:`commit` of exactly these."""

    def commit(self, mark: Any = None) -> None:
        """Tell the data source the consumed positions (now, or those of ``mark``)."""

    def consumed_steps(self, steps: int) -> None:
        """``steps`` more training steps of ``batch_size`` records were trained."""

    def fail(self, error: BaseException) -> BaseException:
        """Reading stopped with ``error``: the error to raise instead."""

    def report_hook(self) -> Any:
        """A ``tf.estimator.SessionRunHook`` that counts each step's records."""


_GRAPHS: "weakref.WeakKeyDictionary[Any, DataPositions]" = weakref.WeakKeyDictionary()


def register_graph_positions(positions: DataPositions, graph: Any = None) -> None:
    """Make ``positions`` those of ``graph`` (default: the current default graph)."""
    _GRAPHS[_graph(graph)] = positions


def graph_positions(graph: Any = None) -> DataPositions | None:
    """The positions registered with ``graph`` (default: the current default graph)."""
    return _GRAPHS.get(_graph(graph))


def _graph(graph: Any) -> Any:
    if graph is not None:
        return graph
    import tensorflow as tf

    return tf.compat.v1.get_default_graph()
