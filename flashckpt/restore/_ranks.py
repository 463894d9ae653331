"""Collective steps that never hang a rank: every rank gets every rank's result or the same
exception naming each rank that failed (DCP's rule for collective steps)."""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable

from .. import _errors
from .._errors import CheckpointError
from .._placement import Collective

__all__ = ["Errors", "flush_on_every_rank", "gather", "on_all_ranks", "raise_errors"]

log = logging.getLogger("flashckpt")

Errors = list[tuple[str, str]]
"""(error class name, "rank R: message") of each rank that failed."""


def gather(collective: Collective, fn: Callable[[], Any]) -> tuple[list[Any], Errors]:
    """Every rank's result of ``fn`` (None where it failed) and every failed rank's error.
    All ranks must call this."""
    try:
        mine: tuple[Any, tuple[str, str] | None] = (fn(), None)
    except Exception as exc:  # any rank's failure must reach all ranks, never hang them
        mine = (None, (type(exc).__name__, f"rank {collective.rank}: {exc}"))
    views = collective.all_gather(mine)
    return [result for result, _ in views], [error for _, error in views if error]


def raise_errors(errors: Errors, prefix: str) -> None:
    """One exception on every rank, of the ranks' common flashckpt class if they share one."""
    names = {name for name, _ in errors}
    cls = getattr(_errors, names.pop(), CheckpointError) if len(names) == 1 else CheckpointError
    if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
        cls = CheckpointError
    raise cls(f"{prefix}: " + "; ".join(message for _, message in errors))


def on_all_ranks(collective: Collective, fn: Callable[[], Any], what: str) -> list[Any]:
    """Run ``fn`` on every rank; every rank gets every rank's result, or the same exception
    naming each rank that failed. All ranks must call this."""
    results, errors = gather(collective, fn)
    if errors:
        raise_errors(errors, f"{what} failed")
    return results


def flush_on_every_rank(collective: Collective, flush: Callable[[], None],
                        lost: Callable[[], list[str]] = list) -> None:
    """``flush()`` at close; when every rank closes (not while an exception unwinds this one,
    whose peers may still be training), also wait for every rank's, so that every rank sees
    the same newest committed step after ``close`` and learns of any rank's failure. Without
    a process group any more, or with nodes ``lost()`` names (a collective would wait for the
    process group's timeout), this rank's flush only."""
    mine: tuple[str, str] | None = None
    failed: CheckpointError | None = None
    try:
        flush()
    except CheckpointError as exc:
        mine, failed = (type(exc).__name__, f"rank {collective.rank}: {exc}"), exc
    if collective.world_size > 1 and sys.exc_info()[0] is None:
        if gone := lost():
            log.warning("close: node(s) %s do not answer (lost?): not waiting for the other ranks' flushes",
                        ", ".join(gone))
        else:
            try:
                views = collective.all_gather(mine)
            except Exception as exc:  # the process group was destroyed before close
                log.debug("close: no agreement with the other ranks (%s)", exc)
                views = []
            others = [view for rank, view in enumerate(views) if view is not None and rank != collective.rank]
            if failed is None and others:
                raise_errors(others, "persisting the newest step failed on other ranks")
    if failed is not None:
        raise failed
