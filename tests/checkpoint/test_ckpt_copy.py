"""Large numpy copies split across threads: every byte lands once, in order, errors surface."""

import os
import signal
import threading
import time

import numpy as np
import pytest

from flashckpt.memory import _copy


def covered(groups) -> dict[int, list[tuple[int, int]]]:
    """Byte ranges of each destination buffer that the groups write, by buffer address."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for group in groups:
        for dst, _ in group:
            base = dst.base if dst.base is not None else dst
            start = dst.__array_interface__["data"][0] - base.__array_interface__["data"][0]
            spans.setdefault(id(base), []).append((start, start + dst.nbytes))
    return spans


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
def test_split_covers_every_byte_once_in_balanced_parts(parts):
    sizes = [5, 1 << 20, 3, 0, 777_777, 64, 1]
    dsts = [np.empty(n, dtype=np.float32) for n in sizes]
    srcs = [np.empty(n, dtype=np.float32) for n in sizes]
    groups = _copy.split_ranges(dsts, srcs, parts)
    assert 1 <= len(groups) <= parts
    for dst, spans in zip(dsts, (covered(groups).get(id(d), []) for d in dsts)):
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == dst.nbytes
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), spans  # no gap, no overlap
    total = sum(d.nbytes for d in dsts)
    sizes_of = [sum(d.nbytes for d, _ in g) for g in groups]
    assert sum(sizes_of) == total
    assert max(sizes_of) <= -(-total // parts) + 4  # equal shares, give or take one element


def test_split_keeps_strided_and_broadcast_pairs_whole():
    base = np.arange(100, dtype=np.int64).reshape(10, 10)
    dsts = [np.empty((5, 10), dtype=np.int64), np.empty((10, 10), dtype=np.int64)]
    srcs = [base[::2], np.int64(3)]
    groups = _copy.split_ranges(dsts, srcs, 4)
    pairs = [pair for group in groups for pair in group]
    assert [d.shape for d, _ in pairs] == [(5, 10), (10, 10)]


@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_copy_arrays_copies_exactly(monkeypatch, threads):
    monkeypatch.setenv("FLASHCKPT_COPY_THREADS", threads)
    rng = np.random.default_rng(0)
    srcs = [rng.standard_normal(n).astype(np.float32) for n in (9_000_000, 7, 1_000_001)]
    srcs += [rng.integers(0, 255, (1000, 999), dtype=np.uint8), np.arange(40, dtype=np.int16).reshape(8, 5)[::2]]
    dsts = [np.zeros(s.shape, s.dtype) for s in srcs]
    assert sum(d.nbytes for d in dsts) >= _copy.PARALLEL_MIN_BYTES
    _copy.copy_arrays(dsts, srcs)
    for d, s in zip(dsts, srcs):
        assert np.array_equal(d, s)


def spy_threads(monkeypatch, parts: int) -> set[str]:
    """Names of the threads that run a part of a threaded copy (filled as they run).
    Each part waits (10 s at most) until ``parts`` of them run at once: a copy whose parts
    can only run one after another on one thread fails instead of passing by timing."""
    seen: set[str] = set()
    together = threading.Barrier(parts, timeout=10)

    def spying(real):
        def spy(group):
            seen.add(threading.current_thread().name)
            together.wait()
            real(group)
        return spy

    for part in ("_copy_group", "_copy_span_group"):  # array pairs, address spans
        monkeypatch.setattr(_copy, part, spying(getattr(_copy, part)))
    return seen


def test_copy_arrays_uses_the_threads(monkeypatch):
    monkeypatch.setenv("FLASHCKPT_COPY_THREADS", "3")
    seen = spy_threads(monkeypatch, 3)
    src = np.ones(_copy.PARALLEL_MIN_BYTES, dtype=np.uint8)
    dst = np.zeros_like(src)
    _copy.copy_arrays([dst], [src])
    assert dst.all()
    assert len(seen) == 3 and threading.current_thread().name in seen  # each part on its own thread


def test_a_failing_part_raises_after_every_part_finished(monkeypatch):
    monkeypatch.setenv("FLASHCKPT_COPY_THREADS", "2")
    src = np.ones(_copy.PARALLEL_MIN_BYTES, dtype=np.uint8)
    dst = np.zeros_like(src)
    read_only = np.zeros_like(src)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        _copy.copy_arrays([dst, read_only], [src, src])
    assert dst.all()  # the other part ran to its end


def test_bad_thread_setting_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("FLASHCKPT_COPY_THREADS", "many")
    with pytest.raises(ValueError, match="FLASHCKPT_COPY_THREADS"):
        _copy.copy_arrays([np.zeros(1)], [np.ones(1)])


def test_a_forked_child_copies_with_its_own_threads(monkeypatch):
    monkeypatch.setenv("FLASHCKPT_COPY_THREADS", "2")
    src = np.arange(_copy.PARALLEL_MIN_BYTES // 8, dtype=np.int64)
    _copy.copy_arrays([np.empty_like(src)], [src])  # the parent's pool exists now
    pid = os.fork()
    if pid == 0:  # the parent's pool threads are gone here: copying must not wait for them
        dst = np.empty_like(src)
        _copy.copy_arrays([dst], [src])
        os._exit(0 if np.array_equal(dst, src) else 1)
    for _ in range(200):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        threading.Event().wait(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung copying")
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
def test_split_spans_covers_every_byte_once_in_balanced_parts(parts):
    sizes = [5, 1 << 20, 3, 0, 777_777, 64, 1]
    spans = [((i + 1) << 40, (i + 1) << 32, n) for i, n in enumerate(sizes)]
    groups = _copy.split_spans(spans, parts)
    assert 1 <= len(groups) <= parts
    pieces = [piece for group in groups for piece in group]
    for dst, src, size in spans:
        mine = sorted(p for p in pieces if dst <= p[0] < dst + max(size, 1))
        assert sum(p[2] for p in mine) == size
        at = dst
        for p_dst, p_src, p_size in mine:  # in order, no gap, no overlap, source moved with destination
            assert p_dst == at and p_src - src == p_dst - dst
            at += p_size
    total = sum(sizes)
    sizes_of = [sum(p[2] for p in g) for g in groups]
    assert sum(sizes_of) == total and max(sizes_of) <= -(-total // parts)


@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_copy_spans_copies_exactly(monkeypatch, threads):
    monkeypatch.setenv("FLASHCKPT_COPY_THREADS", threads)
    rng = np.random.default_rng(1)
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in (9_000_001, 7, 1_000_003, 0, 8_000_000)]
    dsts = [np.zeros_like(s) for s in srcs]
    assert sum(d.nbytes for d in dsts) >= _copy.PARALLEL_MIN_BYTES
    _copy.copy_spans([(d.ctypes.data, s.ctypes.data, s.nbytes) for d, s in zip(dsts, srcs)])
    for d, s in zip(dsts, srcs):
        assert np.array_equal(d, s)


def test_ctrl_c_during_a_copy_waits_for_the_helpers(monkeypatch, ctrl_c):
    monkeypatch.setenv("FLASHCKPT_COPY_THREADS", "2")
    finished, caller_copied, helper_took = [], threading.Event(), threading.Event()
    real = _copy._copy_span_group

    def slow_helper(group):
        if threading.current_thread() is not threading.main_thread():
            helper_took.set()
            assert caller_copied.wait(30)  # the caller then waits for this part
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # while this part copies
            time.sleep(0.3)
            real(group)
            finished.append(True)
        else:
            real(group)
            assert helper_took.wait(30)  # on a loaded machine the caller would take both parts
            caller_copied.set()

    monkeypatch.setattr(_copy, "_copy_span_group", slow_helper)
    src = np.ones(_copy.PARALLEL_MIN_BYTES, dtype=np.uint8)
    dst = np.zeros_like(src)
    try:
        with pytest.raises(KeyboardInterrupt):
            _copy.copy_spans([(dst.ctypes.data, src.ctypes.data, src.nbytes)])
    except KeyboardInterrupt:
        pytest.fail("the interrupt escaped the copy's wait")
    assert finished == [True] and dst.all()  # the caller's memory was in use until the helper ended
