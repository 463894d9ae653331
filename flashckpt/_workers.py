"""Threads that stay: run a function over many items on a few long-lived threads.

A load reads its chunks on several threads. Starting a thread waits until the new thread
runs, which on a busy 2-core machine cost ~1.5 ms a thread: 13 ms of a 0.4 s resharded
FSDP load went to starting 8 readers. The helpers here start once per process (again in
a forked child, which has none of its parent's threads) and wait on one queue of work.
The calling thread works through the items too, so it never waits on a helper that is
busy for another caller, and a call made from a helper cannot deadlock.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = ["run_each"]

T = TypeVar("T")

_work: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
_started = 0
_starting = threading.Lock()


def _serve(work: "queue.SimpleQueue[Callable[[], None]]") -> None:
    while True:
        work.get()()


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


def run_each(items: Sequence[T], fn: Callable[[T], Any], threads: int) -> None:
    """``fn(item)`` for every item, taken in order by this thread and up to ``threads - 1``
    long-lived helpers. Returns once every call returned; then raises the first error
    (the other items still run: ``fn`` decides whether to skip work after a failure).
    Interrupted (Ctrl-C), it drops the items not yet started and waits for the running
    ones before it raises: no helper writes into the caller's buffers after it returns."""
    todo = collections.deque(items)
    errors: list[BaseException] = []
    running = [0]  # threads inside drain(): a helper that starts later finds nothing to do
    idle = threading.Condition()

    def drain() -> None:
        with idle:
            running[0] += 1
        try:
            while True:
                try:
                    item = todo.popleft()
                except IndexError:
                    return
                try:
                    fn(item)
                except BaseException as exc:  # raised by the caller, once every item ran
                    errors.append(exc)
                    if isinstance(exc, KeyboardInterrupt):  # the calling thread's Ctrl-C: stop early
                        raise
        finally:
            with idle:
                running[0] -= 1
                idle.notify_all()

    helpers = min(threads, len(todo)) - 1
    _ensure_helpers(helpers)
    for _ in range(helpers):
        _work.put(drain)
    interrupted: BaseException | None = None
    try:
        drain()
    except BaseException as exc:  # KeyboardInterrupt from a signal handler
        interrupted = exc
    todo.clear()
    with idle:
        while running[0]:
            try:
                idle.wait()
            except BaseException as exc:
                interrupted = interrupted or exc
    if interrupted is not None:
        raise interrupted
    if errors:
        raise errors[0]
