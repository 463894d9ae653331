"""What a save returns: the step, whether it goes to storage, and calls to learn when its
copy is in memory (an overlapped save's may end after ``save`` returned) and when it is on
storage."""

from __future__ import annotations

from typing import Any, Callable

from ._errors import CheckpointError
from .memory._overlap import OverlappedCopy
from .saver._client import SaverClient

__all__ = ["SaveHandle"]


class SaveHandle:
    """What :meth:`flashckpt._engine.Engine.save` returns: the step, whether it goes to storage, and calls
    to learn when it is there (the counterpart of the Future of DCP's ``async_save``)."""

    def __init__(self, step: int, persisting: bool, key: tuple[str | None, int], token: str, *,
                 saver: SaverClient, storage: Any, wait: Callable[[float | None], None],
                 raise_errors: Callable[[], None], copy: OverlappedCopy | None = None,
                 finish_copy: Callable[[float | None, OverlappedCopy], None] | None = None) -> None:
        self.step = step
        self.persisting = persisting
        """True when this save was due for storage (``persist_every``, or ``persist=True``)."""
        self._key = key
        """(slot path, generation) of the copy the saver persists."""
        self._saver, self._storage, self._wait, self._raise_errors = saver, storage, wait, raise_errors
        self._token = token
        """The line this save belongs to: a step of another line with the same number is not this save."""
        self._copy, self._finish_copy = copy, finish_copy
        """An overlapped save's copy still running when save returned (None: the save copied all)."""

    def copied(self) -> bool:
        """The copy into shared memory ended (an overlapped save's may still run after
        ``save`` returned; :meth:`wait_copy` raises what failed); never blocks."""
        return self._copy is None or self._copy.done()

    def wait_copy(self, timeout: float | None = None) -> None:
        """Block until the copy into shared memory ended and the saver knows the step
        (an overlapped save), raising what failed; ``timeout`` as :meth:`flashckpt._engine.Engine.wait`."""
        if self._copy is not None and self._finish_copy is not None:
            self._finish_copy(timeout, self._copy)

    def done(self) -> bool:
        """The saver finished with this save (persisted, failed, or nothing to persist);
        never blocks. An overlapped save's copy that ended is announced to the saver here."""
        if self._copy is not None:
            if not self._copy.done():
                return False
            if self._copy.failed():
                return True  # nothing to persist; the next wait for it raises why
            self.wait_copy()  # ended: tells the saver, without waiting
        if not self.persisting:
            return True
        self._saver.drain()
        return self._key not in self._saver.pending

    def durable(self) -> bool:
        """This save's (line, step) is committed on storage (every rank's shard and the
        metadata); the same step number of another line (one abandoned by a rollback, or
        the line that replaced this one) is not."""
        try:
            return self._storage.metadata(self.step).get("token") == self._token
        except CheckpointError:  # not committed (or unreadable, so not durable either)
            return False

    def wait(self, timeout: float | None = None) -> None:
        """Block until this save (and every persist asked before it) is done, raising what
        failed, also a failure :meth:`done` or another call heard of first and nothing
        raised yet; ``timeout`` as :meth:`flashckpt._engine.Engine.wait`."""
        self.wait_copy(timeout)
        if self.done():
            self._raise_errors()
        else:
            self._wait(timeout)

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}, persisting={self.persisting}, copied={self.copied()}, done={self.done()})"
