"""The streaming-store copy: every byte of the range lands, nothing outside it changes."""

import os
import platform
import subprocess
import sys

import numpy as np
import pytest

from flashckpt.memory import _stream_copy

_X86_LINUX = (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")
              and os.environ.get("FLASHCKPT_STREAMING_COPY", "1").strip() != "0")  # where the loop must load


def test_the_streaming_loop_loads_where_it_can_run():
    assert _stream_copy.streaming() is _X86_LINUX  # else every test below only tests memmove


@pytest.mark.parametrize("min_bytes", [0, _stream_copy.STREAM_MIN_BYTES])
def test_copies_exactly_the_range_at_any_alignment_and_size(monkeypatch, min_bytes):
    monkeypatch.setattr(_stream_copy, "STREAM_MIN_BYTES", min_bytes)  # 0: the loop takes even tiny copies
    rng = np.random.default_rng(0)
    sizes = [0, 1, 15, 16, 63, 64, 65, 79, 80, 127, 128, 129, 4096, 100_003, (1 << 20) + 17, 3 << 20]
    for size in sizes:
        for src_off, dst_off in [(0, 0), (1, 0), (0, 1), (4, 12), (13, 3), (31, 47)]:
            src = rng.integers(0, 256, size + 128, dtype=np.uint8)
            dst = rng.integers(0, 256, size + 128, dtype=np.uint8)
            want = dst.copy()
            want[dst_off:dst_off + size] = src[src_off:src_off + size]
            _stream_copy.stream_copy(dst.ctypes.data + dst_off, src.ctypes.data + src_off, size)
            assert np.array_equal(dst, want), (size, src_off, dst_off)


def test_overlapping_ranges_copy_as_memmove_does(monkeypatch):
    monkeypatch.setattr(_stream_copy, "STREAM_MIN_BYTES", 0)
    buf = np.arange(1 << 16, dtype=np.uint8)
    want = buf.copy()
    want[100:100 + 60_000] = buf[0:60_000].copy()
    _stream_copy.stream_copy(buf.ctypes.data + 100, buf.ctypes.data, 60_000)
    assert np.array_equal(buf, want)


def test_the_setting_turns_streaming_off():
    code = "from flashckpt.memory import _stream_copy; print(_stream_copy.streaming())"
    env = {**os.environ, "FLASHCKPT_STREAMING_COPY": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_loop_stores_around_the_caches_and_fences_before_it_returns():
    code = _stream_copy._CODE
    assert code.count(bytes.fromhex("660fe7")) == 4  # movntdq: the four stores stream
    assert code.endswith(bytes.fromhex("0faef8c3"))  # sfence; ret: visible to other processes on return


def test_large_copies_of_every_kind_go_through_the_loop(monkeypatch):
    import torch

    from flashckpt.memory import _copy
    from flashckpt.torch._tensors import TorchKind

    assert _stream_copy.streaming() is _X86_LINUX
    if not _X86_LINUX:
        return
    calls = []
    real = _stream_copy._stream_body()
    monkeypatch.setattr(_stream_copy, "_stream_body", lambda: lambda d, s, n: (calls.append(n), real(d, s, n)))
    size = _stream_copy.STREAM_MIN_BYTES * 4
    src, dst = np.ones(size, np.uint8), np.zeros(size, np.uint8)
    _copy.copy_spans([(dst.ctypes.data, src.ctypes.data, size)])
    assert calls and dst.all()
    calls.clear()
    dst[:] = 0
    _copy.copy_arrays([dst], [src])
    assert calls and dst.all()
    calls.clear()
    t_src, t_dst = torch.ones(size // 4), torch.zeros(size // 4)
    TorchKind().copy([t_dst], [t_src])
    assert calls and bool(t_dst.all())
