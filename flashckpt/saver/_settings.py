"""The saver's settings from the environment: the bound on every wait on it, and how many
local ranks it persists at once."""

from __future__ import annotations

import os

from .._options import env_count

__all__ = ["TIMEOUT_ENV", "persist_threads", "saver_timeout"]

TIMEOUT_ENV = "FLASHCKPT_SAVER_TIMEOUT"
_THREADS_ENV = "FLASHCKPT_PERSIST_THREADS"
_THREADS_MAX_DEFAULT = 4
_CORES_PER_THREAD = 4


def saver_timeout() -> float:
    """The default bound, in seconds, on any wait on the saver (``FLASHCKPT_SAVER_TIMEOUT``)."""
    raw = os.environ.get(TIMEOUT_ENV, "600")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{TIMEOUT_ENV} must be positive, got {raw!r}")
    return value


def persist_threads() -> int:
    """How many local ranks the saver persists at once (``FLASHCKPT_PERSIST_THREADS``;
    1 writes one slot at a time). The saver takes it from the environment of the
    trainer that started it. Default: one per 4 CPU cores, 1 to 4: a persist keeps about a
    core busy (checksums, feeding the device), taken from the trainers on a small machine.
    On a loaded 2-core machine whose disk one O_DIRECT stream nearly fills, 4 threads over
    1 with 4 ranks measured 0.73x-1.52x (median 1.13x, 11 repeats; ``benchmarks/persist.py``),
    no clear gain; parallel and network file systems want several streams."""
    return env_count(_THREADS_ENV, min(_THREADS_MAX_DEFAULT, max(1, (os.cpu_count() or 1) // _CORES_PER_THREAD)))
