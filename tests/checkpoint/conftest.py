import glob
import os
import signal
import subprocess
from contextlib import contextmanager

import pytest
from flashckpt._names import job_prefix


def shm_objects(job: str) -> list[str]:
    return sorted(glob.glob(job_prefix(job) + ".*"))


@contextmanager
def small_tmpfs(where, size: str):
    """A tmpfs of ``size`` (e.g. "4m") mounted at the new directory ``where`` (root only), for full-disk tests."""
    if os.geteuid() != 0:
        pytest.fail("mounting a small tmpfs needs root (CI runs as root)")
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture
def ctrl_c():
    """SIGINT raises KeyboardInterrupt during the test, as in a terminal, even where the
    suite was started with SIGINT ignored (a shell's background job)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)
