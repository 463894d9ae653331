"""Whether the machine ran short of memory while a multi-node test ran.

A machine out of memory with no swap (here: tmpfs ``/dev/shm`` full of other runs' segments)
squeezes the page cache to nothing: every process stalls in page faults on its own code
for minutes, the rendezvous store's server thread included, until the kernel's OOM killer
ends some process; a two-node job then looks hung in rendezvous, gloo's setup or a
collective (one such stall here: the kernel logged ``pt_tcpstore_uv invoked oom-killer``
the second every waiting rank timed out). :class:`MemoryWatch` refuses to start a job
on a machine without room, notes the kernel's memory-stall counter (PSI) when a job
starts, says while it runs once the machine is starved (the test fails then, not at its
deadline), and :meth:`MemoryWatch.report` tells, at a failure, how long every task stalled
on memory since then, which processes the OOM killer ended, and what memory is left.
"""

from __future__ import annotations

import re
import subprocess

import pytest

__all__ = ["MemoryWatch"]

ROOM_MB = 3000
"""Memory a two-node job needs available to start (four workers, two agents, the saver)."""
STALL_LIMIT = 15.0
"""Seconds during which every task stalled on memory, since the job started, that make the
machine starved: nothing the job does can go on."""


def _psi_full_seconds() -> float | None:
    """Seconds during which every non-idle task stalled on memory, since boot (None: no PSI)."""
    try:
        with open("/proc/pressure/memory") as f:
            for line in f:
                if line.startswith("full"):
                    return int(line.rsplit("total=", 1)[1]) / 1e6
    except (OSError, ValueError, IndexError):
        pass
    return None


def _uptime() -> float:
    with open("/proc/uptime") as f:
        return float(f.read().split()[0])


def _meminfo_mb(*keys: str) -> dict[str, int]:
    values = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in keys:
                    values[name] = int(rest.split()[0]) // 1024
    except (OSError, ValueError):
        pass
    return values


def _oom_kills_since(uptime: float) -> list[str]:
    """The kernel's "Out of memory: Killed process" lines logged after ``uptime`` (root only)."""
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    kills = []
    for line in out.splitlines():
        m = re.match(r"\[\s*([0-9.]+)\]\s*(.*)", line)
        if m and float(m.group(1)) >= uptime and ("invoked oom-killer" in m.group(2)
                                                   or "Out of memory: Killed process" in m.group(2)):
            kills.append(f"+{float(m.group(1)) - uptime:.0f} s: {m.group(2)[:200]}")
    return kills


class MemoryWatch:
    """Started with a job; :meth:`report` at its failure."""

    def __init__(self) -> None:
        mem = _meminfo_mb("MemAvailable", "Shmem")
        if mem.get("MemAvailable", ROOM_MB) < ROOM_MB:
            pytest.fail(f"only {mem['MemAvailable']} MB of memory available ({mem.get('Shmem', '?')} MB of it "
                        f"held by shared memory, such as /dev/shm segments of earlier runs: `flashckpt gc`, or "
                        f"remove them): a multi-node job needs {ROOM_MB} MB and would stall")
        self.uptime = _uptime()
        self.stalled = _psi_full_seconds()

    def starved(self) -> str | None:
        """Why the machine is out of memory since the start (None: it is not, or no PSI)."""
        now = _psi_full_seconds()
        if now is None or self.stalled is None or now - self.stalled <= STALL_LIMIT:
            return None
        return (f"the machine is out of memory: every task stalled on memory for {now - self.stalled:.0f} s "
                f"since the job started (PSI full, limit {STALL_LIMIT:g} s)")

    def report(self) -> str:
        """One paragraph: memory stalls and OOM kills since the start, memory left now."""
        now = _psi_full_seconds()
        stalled = None if now is None or self.stalled is None else now - self.stalled
        kills = _oom_kills_since(self.uptime)
        mem = _meminfo_mb("MemTotal", "MemAvailable", "Shmem", "SwapTotal")
        lines = [f"memory since the job started ({_uptime() - self.uptime:.0f} s ago): every task stalled on memory "
                 f"for {'?' if stalled is None else f'{stalled:.1f}'} s (PSI full); now "
                 + ", ".join(f"{k} {v} MB" for k, v in mem.items())]
        if kills:
            lines.append("the kernel's OOM killer ran (the machine ran out of memory: a stall here is the machine's, "
                         "not the job's):")
            lines += kills
        return "\n".join(lines)
