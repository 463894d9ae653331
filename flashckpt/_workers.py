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
    (the other items still run: ``fn`` decides whether to skip work after a failure)."""
    todo = collections.deque(items)
    if not todo:
        return
    left = [len(todo)]
    errors: list[BaseException] = []
    guard, finished = threading.Lock(), threading.Event()

    def drain() -> None:
        while True:
            try:
                item = todo.popleft()
            except IndexError:
                return
            try:
                fn(item)
            except BaseException as exc:  # raised by the caller, once every item ran
                with guard:
                    errors.append(exc)
            with guard:
                left[0] -= 1
                if left[0] == 0:
                    finished.set()

    helpers = min(threads, len(todo)) - 1
    _ensure_helpers(helpers)
    for _ in range(helpers):
        _work.put(drain)
    drain()
    finished.wait()
    if errors:
        raise errors[0]
