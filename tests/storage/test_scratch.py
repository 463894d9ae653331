"""Scratch directories of a URL location (``flashckpt.storage._scratch``): a crashed
process's ``flashckpt-deepspeed-*`` goes at the next one's start or by ``flashckpt gc``;
a live process's stays."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

import pytest

from flashckpt.storage._scratch import make_scratch, remove_dead_scratch

_HOLD = """
from flashckpt.storage._scratch import make_scratch
print(make_scratch("deepspeed").path, flush=True)
input()
"""


@pytest.fixture
def tmp_dir(tmp_path, monkeypatch):
    """A temporary directory of its own, here and in subprocesses."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _holder() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def test_a_dead_processs_scratch_goes_a_live_ones_stays(tmp_dir):
    dead, dead_path = _holder()
    live, live_path = _holder()
    try:
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait(60)
        assert os.path.isdir(dead_path) and os.path.dirname(dead_path) == str(tmp_dir)
        (tmp_dir / "flashckpt-export-abc").mkdir()  # not a scratch kind: never touched
        assert remove_dead_scratch(dry_run=True) == ([dead_path], [live_path])
        out = subprocess.run([sys.executable, "-m", "flashckpt.cli", "gc", "--dry-run"], capture_output=True,
                             text=True, timeout=120)
        assert f"would remove {dead_path}" in out.stdout and live_path not in out.stdout, out.stdout + out.stderr
        mine = make_scratch("deepspeed")  # the next run's scratch clears the dead one's
        assert not os.path.exists(dead_path) and os.path.isdir(live_path) and os.path.isdir(mine.path)
        assert remove_dead_scratch() == ([], sorted([live_path, mine.path]))
        mine.close()
        assert not os.path.exists(mine.path) and (tmp_dir / "flashckpt-export-abc").is_dir()
    finally:
        live.stdin.close()
        live.wait(60)
    assert remove_dead_scratch() == ([live_path], [])  # its process exited without closing it


def test_gc_removes_a_dead_processs_scratch(tmp_dir):
    dead, path = _holder()
    dead.kill()
    dead.wait(60)
    out = subprocess.run([sys.executable, "-m", "flashckpt.cli", "gc"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and f"removing {path}" in out.stdout, out.stdout + out.stderr
    assert not os.path.exists(path)
