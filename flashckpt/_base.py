"""What every framework's checkpointer shares: the engine's storage-side calls."""

from __future__ import annotations

from typing import Any

from ._engine import Engine, LoadInfo

__all__ = ["EngineCheckpointer"]


class EngineCheckpointer:
    """Base of the framework checkpointers: subclasses set ``self._engine`` and add
    their own ``save``/``load``."""

    _engine: Engine

    @property
    def engine(self) -> Engine:
        """The engine underneath, for adapters built on this checkpointer."""
        return self._engine

    @property
    def directory(self) -> str:
        return self._engine.storage.root

    @property
    def job_id(self) -> str:
        """Names this job's shared memory on the node (see ``flashckpt gc``)."""
        return self._engine.job_id

    @property
    def last_load(self) -> LoadInfo | None:
        """Step, source ("memory" / "storage" / None) and seconds of the last load."""
        return self._engine.last_load

    def wait(self, timeout: float | None = None) -> None:
        """Block until every persist asked for so far is durable (raises what failed)."""
        self._engine.wait(timeout)

    def flush(self, timeout: float | None = None) -> None:
        """Persist the newest in-memory step now if it is not on storage yet, and wait."""
        self._engine.flush(timeout)

    def latest_step(self) -> int | None:
        """The newest step committed on storage."""
        return self._engine.latest_step()

    def close(self) -> None:
        """Persist the newest step if needed, wait for storage, free shared memory."""
        self._engine.close()

    def __enter__(self) -> "EngineCheckpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
