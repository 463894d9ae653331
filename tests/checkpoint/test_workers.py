"""Long-lived worker threads: every item runs once, errors surface after all ran, threads
are started once per process (and again in a forked child), callers at once share them,
a nested call cannot hang, Ctrl-C waits for the running items."""

import os
import signal
import threading
import time

import pytest

from flashckpt.memory import _workers
from flashckpt.restore._shard_read import run_chunks


def on_distinct_threads(count: int):
    """An item function whose first ``count`` items meet at a barrier: they must be on
    ``count`` threads at once. Returns it and the threads that ran items."""
    meet = threading.Barrier(count, timeout=30)
    seen, guard = [], threading.Lock()

    def work(i):
        if i < count:
            meet.wait()
        with guard:
            seen.append((i, threading.current_thread()))

    return work, seen


def test_every_item_runs_once_on_the_threads():
    work, seen = on_distinct_threads(4)
    _workers.run_each(range(40), work, 4)
    assert sorted(i for i, _ in seen) == list(range(40))
    threads = {t for _, t in seen}
    assert threading.current_thread() in threads and len(threads) == 4


class _Chunk:
    """Stands in for a planned read: records the thread that reads it; the first two
    chunks meet, so two threads read."""

    reader, touched = None, []

    def __init__(self, seen: set, meet: threading.Barrier | None) -> None:
        self.seen, self.meet = seen, meet

    def read(self, gaps) -> None:
        if self.meet is not None:
            self.meet.wait()
        self.seen.add(threading.current_thread())


def chunks(seen: set, count: int) -> list[_Chunk]:
    meet = threading.Barrier(2, timeout=30)
    return [_Chunk(seen, meet if i < 2 else None) for i in range(count)]


def test_a_load_reads_on_threads_that_were_there_before_it():
    run_chunks(chunks(set(), 16), threads=4)  # the first load starts them
    before = set(threading.enumerate())
    seen: set = set()
    run_chunks(chunks(seen, 16), threads=4)
    assert len(seen) > 1 and seen <= before  # no thread started for this load
    assert all(t.is_alive() for t in seen)


def test_callers_at_once_share_the_helpers():
    # a long call holds the helpers; a second caller still gets one (each helper takes an
    # item at a time and queues up again), so its first two items can meet
    release = threading.Event()
    long_call = threading.Thread(target=_workers.run_each, args=(range(6), lambda i: release.wait(30), 3))
    long_call.start()
    try:
        work, seen = on_distinct_threads(2)
        _workers.run_each(range(4), work, 2)
        assert len({t for _, t in seen}) == 2
    finally:
        release.set()
        long_call.join(30)


def test_the_first_error_is_raised_after_every_item_ran():
    ran = []

    def work(i):
        ran.append(i)
        if i == 3:
            raise ValueError("item 3")

    with pytest.raises(ValueError, match="item 3"):
        _workers.run_each(range(10), work, 3)
    assert sorted(ran) == list(range(10))


def test_a_helper_survives_whatever_an_item_raises():
    def work(i):
        if threading.current_thread() is not threading.main_thread():
            raise SystemExit("from a helper")

    for _ in range(3):  # raised to the caller, never out of the helper
        with pytest.raises(SystemExit):
            _workers.run_each(range(30), lambda i: (time.sleep(0.001), work(i)), 3)
    work, seen = on_distinct_threads(3)
    _workers.run_each(range(6), work, 3)
    assert len({t for _, t in seen}) == 3


def test_a_call_from_a_worker_does_not_hang():
    results = []

    def outer(i):
        _workers.run_each(range(8), results.append, 8)  # every helper may be busy with outer items

    done = threading.Event()
    threading.Thread(target=lambda: (_workers.run_each(range(8), outer, 8), done.set()), daemon=True).start()
    assert done.wait(30)
    assert sorted(results) == sorted(list(range(8)) * 8)


def test_a_forked_child_runs_with_threads_of_its_own():
    _workers.run_each(range(8), lambda i: time.sleep(0.01), 4)  # the parent's helpers exist now
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            work, seen = on_distinct_threads(2)
            _workers.run_each(range(8), work, 2)
            code = 0 if len({t for _, t in seen}) == 2 else 1
        finally:
            os._exit(code)
    for _ in range(600):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    assert os.waitstatus_to_exitcode(status) == 0


def test_ctrl_c_drops_the_items_not_started_and_waits_for_the_running_ones(ctrl_c):
    ran, helper_started, helper_finished = [], [], []

    def work(i):
        ran.append(i)
        if threading.current_thread() is threading.main_thread():
            time.sleep(0.05)
            return
        helper_started.append(i)
        if len(helper_started) == 1:  # the interrupt comes while this helper item runs
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        time.sleep(0.3)
        helper_finished.append(i)

    try:
        with pytest.raises(KeyboardInterrupt):
            _workers.run_each(range(200), work, 3)
    except KeyboardInterrupt:
        pytest.fail("the interrupt escaped run_each's wait")
    assert helper_started and sorted(helper_finished) == sorted(helper_started)  # waited for them
    started = len(ran)
    time.sleep(0.5)
    assert len(ran) == started < 200  # the rest was dropped: nothing runs after it raised
