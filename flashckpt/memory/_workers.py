"""Threads that stay: run a function over many items on a few long-lived threads.

A load reads its chunks on several threads, and a save's large copy runs in parts on
several threads (:mod:`flashckpt.memory._copy`): both on these helpers. Starting a thread waits
until the new thread runs, which on a busy 2-core machine cost ~1.5 ms a thread: 13 ms of
a 0.4 s resharded FSDP load went to starting 8 readers. The helpers here start once per
process (again in a forked child, which has none of its parent's threads) and wait on one
queue of work.
The calling thread works through the items too, so a call made from a helper cannot
deadlock; a helper takes one item at a time and then queues up again behind other
callers' work, so callers that run at once share the helpers.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["run_each", "submit"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_work: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
_started = 0
_starting = threading.Lock()


def _serve(work: "queue.SimpleQueue[Callable[[], None]]") -> None:
    while True:
        task = work.get()
        try:
            task()
        except BaseException:  # a task keeps its own errors: this only keeps the helper alive
            log.exception("a flashckpt worker task failed")


def _ensure_helpers(count: int) -> None:
    global _started
    with _starting:
        while _started < count:
            threading.Thread(target=_serve, args=(_work,), name=f"flashckpt-worker-{_started}", daemon=True).start()
            _started += 1


def _forget_helpers() -> None:
    global _work, _started, _starting
    _work, _started, _starting = queue.SimpleQueue(), 0, threading.Lock()


os.register_at_fork(after_in_child=_forget_helpers)


def submit(fn: Callable[[], T], helpers: int) -> "Future[T]":
    """``fn()`` on one of the helpers, whose result (or error) the returned future holds.
    Makes sure of ``helpers`` helpers besides it, so that a :func:`run_each` inside ``fn``
    still finds ``helpers - 1`` free ones (an overlapped save's copy runs so)."""
    future: Future[T] = Future()

    def task() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as exc:  # the caller's to raise, from future.result()
            future.set_exception(exc)

    _ensure_helpers(max(1, helpers) + 1)
    _work.put(task)
    return future


def run_each(items: Sequence[T], fn: Callable[[T], Any], threads: int) -> None:
    """``fn(item)`` for every item, taken in order by this thread and up to ``threads - 1``
    long-lived helpers. Returns once every call returned; then raises the first error
    (the other items still run: ``fn`` decides whether to skip work after a failure).
    Interrupted (Ctrl-C), it drops the items not yet started and waits for the running
    ones before it raises: no helper writes into the caller's buffers after it returns."""
    todo = collections.deque(items)
    errors: list[BaseException] = []
    running = [0]  # helpers inside an item of this call (signals reach only the caller)
    idle = threading.Condition(threading.Lock())

    def take() -> None:
        """A helper's turn: one item, then back in line behind other callers' work."""
        with idle:
            try:
                item = todo.popleft()
            except IndexError:
                return
            running[0] += 1  # with the pop, under the lock the caller waits with
        try:
            fn(item)
        except BaseException as exc:  # raised by the caller, once every item ran
            errors.append(exc)
        finally:
            with idle:
                running[0] -= 1
                idle.notify_all()
        if todo:
            _work.put(take)

    interrupted: BaseException | None = None
    try:
        helpers = min(threads, len(todo)) - 1
        _ensure_helpers(helpers)
        for _ in range(helpers):
            _work.put(take)
        while True:
            try:
                item = todo.popleft()
            except IndexError:
                break
            try:
                fn(item)
            except Exception as exc:
                errors.append(exc)
    except BaseException as exc:  # Ctrl-C: the items not yet started are dropped
        interrupted = exc

    def busy() -> bool:
        todo.clear()
        return running[0] > 0

    _wait_then_raise(idle, busy, interrupted, errors)


def _wait_then_raise(idle: threading.Condition, busy: Callable[[], bool], interrupted: BaseException | None,
                     errors: list[BaseException]) -> None:
    """Wait on ``idle`` (whose lock guards what ``busy`` reads) until ``busy()`` is false,
    also through Ctrl-C, for helpers that use the caller's memory; then raise
    ``interrupted`` (or a Ctrl-C that came while waiting), else the first of ``errors``."""
    while True:
        try:
            with idle:
                if interrupted is not None and busy():
                    log.info("waiting for running work before raising %s", type(interrupted).__name__)
                while busy():
                    idle.wait()
            break
        except BaseException as exc:
            interrupted = interrupted or exc
    if interrupted is not None:
        raise interrupted
    if errors:
        raise errors[0]
