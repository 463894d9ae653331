"""Long-lived worker threads: every item runs once, errors surface after all ran, threads
are started once per process (and again in a forked child), a nested call cannot hang."""

import os
import signal
import threading
import time

import pytest

from flashckpt import _workers
from flashckpt._shard_read import run_chunks


def test_every_item_runs_once_on_the_threads():
    seen, guard = [], threading.Lock()

    def work(i):
        time.sleep(0.01)
        with guard:
            seen.append((i, threading.current_thread()))

    _workers.run_each(range(40), work, 4)
    assert sorted(i for i, _ in seen) == list(range(40))
    threads = {t for _, t in seen}
    assert threading.current_thread() in threads and len(threads) == 4


class _Chunk:
    """Stands in for a planned read: records the thread that reads it."""

    reader, touched = None, []

    def __init__(self, seen: set) -> None:
        self.seen = seen

    def read(self, gaps) -> None:
        time.sleep(0.01)
        self.seen.add(threading.current_thread())


def test_a_load_reads_on_threads_that_were_there_before_it():
    run_chunks([_Chunk(set()) for _ in range(16)], threads=4)  # the first load starts them
    before = set(threading.enumerate())
    seen: set = set()
    run_chunks([_Chunk(seen) for _ in range(16)], threads=4)
    assert len(seen) > 1 and seen <= before  # no thread started for this load
    assert all(t.is_alive() for t in seen)


def test_the_first_error_is_raised_after_every_item_ran():
    ran = []

    def work(i):
        ran.append(i)
        if i == 3:
            raise ValueError("item 3")

    with pytest.raises(ValueError, match="item 3"):
        _workers.run_each(range(10), work, 3)
    assert sorted(ran) == list(range(10))


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
        ran = []
        _workers.run_each(range(8), lambda i: (time.sleep(0.01), ran.append(i)), 4)
        os._exit(0 if sorted(ran) == list(range(8)) else 1)
    for _ in range(200):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    assert os.waitstatus_to_exitcode(status) == 0


def test_ctrl_c_drops_the_items_not_started_and_waits_for_the_running_ones():
    ran, helper_started, helper_finished = [], [], []

    def work(i):
        ran.append(i)
        if threading.current_thread() is threading.main_thread():
            time.sleep(0.05)
            return
        helper_started.append(i)
        time.sleep(0.5)
        helper_finished.append(i)

    interrupt = threading.Timer(0.2, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    interrupt.start()
    with pytest.raises(KeyboardInterrupt):
        _workers.run_each(range(100), work, 3)
    assert helper_started and sorted(helper_finished) == sorted(helper_started)  # waited for them
    interrupt.join()
    started = len(ran)
    time.sleep(0.6)
    assert len(ran) == started < 100  # the rest was dropped: nothing runs after it raised
