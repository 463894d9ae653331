"""A cold page cache, checked, and the read floor of a set of files.

``make_cold(paths)`` empties the page cache of ``paths`` for real: as root it writes dirty
pages back (``sync``) and drops the whole page cache (``/proc/sys/vm/drop_caches``);
otherwise (or with ``everything=False``) it asks the kernel to drop each file's pages (``posix_fadvise`` DONTNEED), which
keeps pages another process has mapped. Either way it then counts the files' pages still
resident with ``fincore`` (util-linux, mincore(2)) and returns that count in bytes, so a
benchmark reports how cold its "cold" read was instead of assuming it.

``read_floor(files)``: the faster of one ``dd iflag=direct`` stream and READ_THREADS threads
of buffered 16 MiB preads, each from a cold cache: what any loader of those bytes must at
least spend reading them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = ["DD_BLOCK", "READ_THREADS", "files_of", "make_cold", "parallel_read", "read_floor", "resident_bytes"]

DD_BLOCK = 16 * 1024 * 1024
READ_THREADS = 8
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def files_of(path: Path) -> list[Path]:
    """``path`` itself, or every file under it."""
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


def resident_bytes(files: list[Path]) -> int | None:
    """Bytes of ``files`` in the page cache now (``fincore``); None where fincore is missing."""
    if not files or shutil.which("fincore") is None:
        return None if files else 0
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *map(str, files)],
                         check=True, capture_output=True, text=True).stdout
    return sum(int(line) for line in out.split())


def make_cold(path: Path, *, everything: bool = True) -> int | None:
    """Empty the page cache of ``path`` (a file or a directory); returns the bytes of it
    still resident afterwards (0 when cold; None when fincore cannot tell). ``everything``
    False: only ``path``'s pages, for a process that must keep its own code cached (a
    library's pages dropped under a timed load would be read again inside it)."""
    files = files_of(path)
    os.sync()
    if everything and os.geteuid() == 0 and os.access(DROP_CACHES, os.W_OK):
        DROP_CACHES.write_text("1\n")
    else:
        for file in files:
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return resident_bytes(files)


def parallel_read(files: list[Path], threads: int = READ_THREADS) -> int:
    """Read ``files`` whole with ``threads`` threads of DD_BLOCK preads; returns the bytes read."""
    jobs = []
    for path in files:
        size = path.stat().st_size
        jobs += [(path, at, min(DD_BLOCK, size - at)) for at in range(0, size, DD_BLOCK)]
    fds = {path: os.open(path, os.O_RDONLY) for path in files}
    local = threading.local()

    def read(job: tuple[Path, int, int]) -> int:
        path, at, n = job
        if getattr(local, "buf", None) is None:
            local.buf = bytearray(DD_BLOCK)
        return os.preadv(fds[path], [memoryview(local.buf)[:n]], at)

    try:
        with ThreadPoolExecutor(threads) as pool:
            return sum(pool.map(read, jobs))
    finally:
        for fd in fds.values():
            os.close(fd)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def read_floor(path: Path) -> dict[str, float | int | None]:
    """Both read floors of ``path``'s files from a cold cache: ``dd`` (one O_DIRECT stream),
    ``preads`` (READ_THREADS buffered threads), ``floor`` (the faster), and the bytes each
    found resident before it started (``dd_resident``, ``preads_resident``)."""
    files = files_of(path)
    result: dict[str, float | int | None] = {"dd_resident": make_cold(path)}
    result["dd"] = _timed(lambda: [subprocess.run(["dd", f"if={f}", "of=/dev/null", f"bs={DD_BLOCK}", "iflag=direct"],
                                                  check=True, capture_output=True) for f in files])
    result["preads_resident"] = make_cold(path)
    result["preads"] = _timed(lambda: parallel_read(files))
    result["floor"] = min(result["dd"], result["preads"])
    return result
