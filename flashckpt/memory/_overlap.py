"""An overlapped save's copy: the rest of a slot's image, copied on the copy threads.

``save(..., overlap=True)`` copies what may change before the next optimizer update
(buffers, anything the optimizer does not own) at once, and hands the optimizer-owned
tensors to :class:`OverlappedCopy`, which copies them on the long-lived copy threads
(:func:`flashckpt.memory._workers.submit`) and then marks the slot COMPLETE. Until then
the slot reads WRITING, so a crash mid-copy leaves the previous complete copy the newest,
as a crash during a blocking save does. The saver learns of the step only when someone
waits for the copy (:meth:`OverlappedCopy.wait`: the optimizer's step pre-hook, the next
save, ``wait``, ``load``, ``close``, a failure capture): never of a slot still being written.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Callable

from .._errors import CheckpointError, CheckpointTimeoutError
from ._copy import copy_threads, fewer_threads
from ._workers import submit

__all__ = ["OverlappedCopy"]


class OverlappedCopy:
    """``copy()`` then ``complete()`` of step ``step`` on a copy thread, from :meth:`start`
    on; :meth:`wait` runs ``announce()`` (tell the saver) on the waiting thread, once,
    after both. The copy uses one thread fewer than a blocking save's (at least one), so
    the training thread keeps a core."""

    def __init__(self, step: int, copy: Callable[[], None], complete: Callable[[], None],
                 announce: Callable[[], None]) -> None:
        self.step = step
        self._copy, self._complete = copy, complete
        self._announce: Callable[[], None] | None = announce
        self._announcing = threading.Lock()
        self._future: Future[None] = Future()

    def start(self) -> None:
        """Hand the copy to the copy threads: the last thing ``save`` does, since their
        Python work would hold the GIL against the rest of it."""
        def run() -> None:
            with fewer_threads():
                self._copy()
            self._complete()

        self._future = submit(run, copy_threads())

    def done(self) -> bool:
        """The copy ended (copied and complete, or failed); never blocks."""
        return self._future.done()

    def failed(self) -> bool:
        """The copy ended with an error (which :meth:`wait` raises); never blocks."""
        return self._future.done() and self._future.exception() is not None

    def wait(self, timeout: float) -> None:
        """Block until the copy ended, at most ``timeout`` seconds
        (:class:`~flashckpt.CheckpointTimeoutError`); then tell the saver (first call), or
        raise what failed as a :class:`~flashckpt.CheckpointError` (the slot stays WRITING:
        never loaded, never persisted)."""
        try:
            self._future.result(timeout)
        except FutureTimeout:
            raise CheckpointTimeoutError(f"the overlapped copy of step {self.step} did not end within "
                                         f"{timeout:g}s") from None
        except Exception as exc:
            raise CheckpointError(f"the overlapped copy of step {self.step} failed (the step is not saved; "
                                  f"the previous one is intact): {type(exc).__name__}: {exc}") from exc
        with self._announcing:  # a capture's thread and the main thread may both wait
            announce, self._announce = self._announce, None
            if announce is not None:
                announce()
