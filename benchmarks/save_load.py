"""Save and load a training state: flashckpt side by side with the floor and its peers.

    python benchmarks/save_load.py [--size small|large|both] [--repeats 5]
                                   [--dir DIR] [--json results/save_load.json]
                                   [--methods floor,flashckpt,torch,dcp,dlrover,lmres,tckpt,mlf,dd]

(``--methods dlrover-memory``: DLRover's MEMORY saves and load only, no DISK runs and
no torchrun restarts -- its save stall at a fraction of the time.)

The state is GPT-2-shaped (see _state.py): "large" is GPT-2 small's AdamW training state
(124M fp32 parameters + two moments, 1.49 GB), "small" a 357 MB variant. Each repeat runs
every method once, in an order rotated per repeat, and the table shows medians over
repeats: disk figures here drift 2-3x from run to run, so methods are interleaved rather
than run one after the other.

What is timed, and the floor each ratio is taken against:
- floor: one ``copy_`` of every tensor into a preallocated, already-touched /dev/shm file
  (mmap + torch.frombuffer views); the load floor is the copy back out. "new process":
  a fresh process that opens and maps that file and copies out (what any load from
  memory after a restart must at least do).
- flashckpt: ``load`` of nothing first, as a training script starts (its slots are then
  prepared in the background while training runs: timed until they are ready), ``save``
  (first, steady, and with persist=False), ``save`` + ``wait`` (durable
  on storage), ``load`` in a NEW process finding the memory of this one (same directory
  and job id; only ``load`` is timed, the constructor separately), ``load`` from storage
  in a new process after ``close`` has freed shared memory.
- torch.save + fsync; torch.load + copy into the state's tensors.
- torch.distributed.checkpoint with no process group: save, load (in place), async_save
  (stall until staged, total until the future resolves) with its default per-call stager
  and with one reused stager (its staging buffers cached: first vs steady).
- DLRover 0.6.1 ``DdpCheckpointer`` in .bench-venv (subprocess, _dlrover_peer.py).
  (*) Its "persisted" is its tracker file naming the step: the shard itself is written
  by torch.save with no fsync, so that time (and dlrover_persist) is not durability.
- lm-resiliency 0.2 ``InMemoryCheckpointManager`` (GEMINI) in .bench-lmres (subprocess,
  _lmres_peer.py): ``save`` into its own process's CPU slots (the second save is the first
  into its other slot, shown apart), ``flush_to_disk`` + its write thread (torch.save +
  fsync: durable), ``load`` from memory in the same process; its memory dies with the
  process, so a new process loads from its node-local disk tier.
- torch-checkpointing 0.1 ``CheckpointManager`` (async saver) in .bench-tckpt (subprocess,
  _tckpt_peer.py) with ``use_direct_io=False`` (its default fails on ext4): stall until
  staged (``lock()`` free again), until its write future resolves (**) and after the
  driver fsyncs its files (durable); a new process loads from storage (no memory tier).
  (**) It never fsyncs: that time is not durability.
- ml-flashpoint 0.0.10 (Google) ``MemoryStorageWriter``/``Reader`` in .bench-mlf (subprocess,
  _mlf_peer.py; its C++ extensions built from the sdist): ``dcp.save`` into its tmpfs
  buffers + ``finalize_checkpoint`` (blocking: the stall), one gloo rank; a new process
  loads from that tmpfs (memory); it has no storage tier of its own.
- dd to the same directory, buffered + conv=fsync and oflag=direct: the persist floor.
- the read floor: flashckpt's committed files read cold with ``dd iflag=direct bs=16M``
  and with READ_THREADS threads of 16 MiB ``preadv`` (no checksums, into one reused
  buffer a thread), each after the whole page cache was dropped (as root; ``_cold.py``);
  the faster of the two is the floor of every load from storage
  (flashckpt's, torch.load's, DCP's, the peers': each reads about the same bytes).

A peer whose venv is missing is skipped with a note naming the setup command
(``benchmarks/setup_peer_venv.sh dlrover|lmres|tckpt|mlf``).

n in the table counts samples: a repeat takes several of some (floor copies, steady
saves), and the torchrun restarts of DLRover run in the first repeat only.

Every load is "until the caller's tensors hold the checkpoint" (a load that returns new
tensors is followed by the copy into the state), from a page cache emptied of the
checkpoint's files (posix_fadvise DONTNEED, checked with fincore) where it reads storage.
``benchmarks/cold_read.py`` measures the cold loads alone, at four sizes.
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO)]

from _cold import DD_BLOCK, READ_THREADS, make_cold, read_floor  # noqa: E402
from _peer_cli import RESULT_PREFIX  # noqa: E402
from _state import SPECS, ShmFloor, StateSpec, build_state, copy_into, fingerprint, nbytes, tensors  # noqa: E402

from flashckpt._names import job_prefix  # noqa: E402

PEER_PYTHON = REPO / ".bench-venv" / "bin" / "python"
PEER_SCRIPT = HERE / "_dlrover_peer.py"
DLROVER_SOCKETS = Path("/tmp/ckpt_sock")  # DLRover's fixed socket root, one folder a run id
SHM = Path("/dev/shm")
STEADY_SAVES = 3
FLOOR_COPIES = 3  # floor samples a repeat: every ratio divides by the floor's median
CHILD_TIMEOUT_SECONDS = 900


@dataclass(frozen=True, slots=True)
class Metric:
    key: str
    label: str
    floor: str | None  # the floor metric its ratio is taken against


METRICS: list[Metric] = [
    Metric("floor.save", "floor: copy_ into touched shm", "floor.save"),
    Metric("floor.load", "floor: copy_ out of shm", "floor.load"),
    Metric("floor.load_new_process", "floor: map + copy_ out, new process", "floor.load"),
    Metric("flashckpt.prepare", "flashckpt load() of nothing + slots ready (in the background)", None),
    Metric("flashckpt.stall_first", "flashckpt save stall, first (after load())", "floor.save"),
    Metric("flashckpt.stall_steady", "flashckpt save stall, steady", "floor.save"),
    Metric("flashckpt.stall_memory_only", "flashckpt save stall, persist=False", "floor.save"),
    Metric("flashckpt.durable_first", "flashckpt save+wait (durable), first", None),
    Metric("flashckpt.durable_steady", "flashckpt save+wait (durable), steady", None),
    Metric("flashckpt.open_new_process", "flashckpt Checkpointer(), new process", None),
    Metric("flashckpt.load_memory", "flashckpt load from memory, new process", "floor.load"),
    Metric("floor.read_dd", "read floor: dd iflag=direct bs=16M, cold", "floor.read"),
    Metric("floor.read_preads", f"read floor: {READ_THREADS} threads of 16M preadv, cold", "floor.read"),
    Metric("floor.read", "read floor: the faster of the two, per repeat", "floor.read"),
    Metric("flashckpt.load_storage", "flashckpt load from storage, new process", "floor.read"),
    Metric("torch.save_fsync", "torch.save + fsync", "floor.save"),
    Metric("torch.load", "torch.load + copy into state", "floor.read"),
    Metric("dcp.save", "DCP save", "floor.save"),
    Metric("dcp.load", "DCP load (in place)", "floor.read"),
    Metric("dcp.async_stall", "DCP async_save stall until staged", "floor.save"),
    Metric("dcp.async_total", "DCP async_save total", None),
    Metric("dcp.reused_stall_first", "DCP async_save stall, reused stager, first", "floor.save"),
    Metric("dcp.reused_stall_steady", "DCP async_save stall, reused stager, steady", "floor.save"),
    Metric("dcp.reused_total_steady", "DCP async_save total, reused stager, steady", None),
    Metric("dlrover.memory.stall_first", "DLRover MEMORY save stall, first", "floor.save"),
    Metric("dlrover.memory.stall_steady", "DLRover MEMORY save stall, steady", "floor.save"),
    Metric("dlrover.memory.load_same_process", "DLRover load + copy, same process", "floor.load"),
    Metric("dlrover.memory.load_new_process", "DLRover MEMORY load, new process", "floor.load"),
    Metric("dlrover.disk.stall_first", "DLRover DISK save stall, first", "floor.save"),
    Metric("dlrover.disk.stall_steady", "DLRover DISK save stall, steady", "floor.save"),
    Metric("dlrover.disk.durable_first", "DLRover DISK save until tracker names it*, first", None),
    Metric("dlrover.disk.durable_steady", "DLRover DISK save until tracker names it*, steady", None),
    Metric("dlrover.disk.load_new_process", "DLRover DISK load, new process", "floor.load"),
    Metric("dlrover.torchrun_kill.load", "DLRover load, torchrun restart after SIGKILL", "floor.load"),
    Metric("dlrover.torchrun_raise.load", "DLRover load, torchrun restart after exception", "floor.load"),
    Metric("lmres.stall_first", "lm-resiliency save stall, first", "floor.save"),
    Metric("lmres.stall_second", "lm-resiliency save stall, second (other slot, fresh)", "floor.save"),
    Metric("lmres.stall_steady", "lm-resiliency save stall, steady", "floor.save"),
    Metric("lmres.flush_stall", "lm-resiliency flush_to_disk call (clones the slot)", "floor.save"),
    Metric("lmres.durable_first", "lm-resiliency save+flush until written, first", None),
    Metric("lmres.durable_steady", "lm-resiliency save+flush until written, steady", None),
    Metric("lmres.load_same_process", "lm-resiliency load from memory + copy, same process", "floor.load"),
    Metric("lmres.load_new_process", "lm-resiliency load, new process", "floor.read"),
    Metric("tckpt.start", "torch-checkpointing manager until its writer is up", None),
    Metric("tckpt.call_steady", "torch-checkpointing save() returns, steady", "floor.save"),
    Metric("tckpt.stall_first", "torch-checkpointing save stall until staged, first", "floor.save"),
    Metric("tckpt.stall_steady", "torch-checkpointing save stall until staged, steady", "floor.save"),
    Metric("tckpt.written_first", "torch-checkpointing save until written**, first", None),
    Metric("tckpt.written_steady", "torch-checkpointing save until written**, steady", None),
    Metric("tckpt.durable_first", "torch-checkpointing written + our fsync, first", None),
    Metric("tckpt.durable_steady", "torch-checkpointing written + our fsync, steady", None),
    Metric("tckpt.load_new_process", "torch-checkpointing load, new process", "floor.read"),
    Metric("mlf.stall_first", "ml-flashpoint dcp.save + finalize, first", "floor.save"),
    Metric("mlf.stall_steady", "ml-flashpoint dcp.save + finalize, steady", "floor.save"),
    Metric("mlf.load_new_process", "ml-flashpoint load from tmpfs, new process", "floor.load"),
    Metric("dd.fsync", "dd bs=16M conv=fsync", None),
    Metric("dd.direct", "dd bs=16M oflag=direct", None),
]

# Issue 3's DEVELOPERS notes and issue 43: the peers' save stall over the floor, as measured there.
ISSUE_PEER_RATIOS: list[tuple[str, str, str]] = [
    ("DLRover save stall, steady", "1.31x", "dlrover.memory.stall_steady"),
    ("DLRover save stall, first", "3.7x", "dlrover.memory.stall_first"),
    ("DCP async_save stall until staged", "1.5-1.6x", "dcp.async_stall"),
    # Issue 43: small / large.
    ("lm-resiliency save stall, steady", "1.42x / 1.51x", "lmres.stall_steady"),
    ("lm-resiliency save stall, first", "3.5x / 3.7x", "lmres.stall_first"),
    ("torch-checkpointing staging (stall until staged, steady)", "1.97x / 1.7x", "tckpt.stall_steady"),
    ("ml-flashpoint dcp.save", "8.9x / 19x", "mlf.stall_steady"),
]


@dataclass(slots=True)
class Context:
    """One size's state, scratch space and everything measured on it."""

    spec: StateSpec
    state: dict[str, Any]
    expected: float
    nbytes: int
    workdir: Path
    repeat: int = 0
    samples: dict[str, list[float]] = field(default_factory=dict)
    sources: dict[str, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    load_average: list[float] = field(default_factory=list)

    def add(self, key: str, seconds: float) -> None:
        self.samples.setdefault(key, []).append(seconds)

    def source(self, key: str, where: str) -> None:
        self.sources.setdefault(key, []).append(where)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
            print(f"\n  note: {text}", flush=True)

    def check(self, what: str, got: float) -> None:
        if got != self.expected:
            self.note(f"{what}: loaded bytes differ from the saved state")

    def scratch(self, name: str) -> Path:
        path = self.workdir / f"{name}-{self.repeat}"
        path.mkdir(parents=True, exist_ok=True)
        return path


def timed(fn: Callable[[], Any]) -> float:
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def save_and_wait(save: Callable[[], Any], wait: Callable[[], Any]) -> tuple[float, float]:
    """(stall, total): the time until ``save`` returns, and until ``wait`` returns."""
    gc.collect()
    start = time.perf_counter()
    save()
    stall = time.perf_counter() - start
    wait()
    return stall, time.perf_counter() - start


def evict(path: Path) -> None:
    """Drop a checkpoint's files from the page cache, so a load reads storage; checked
    (``_cold.make_cold``: fincore), so any page left is reported rather than assumed away."""
    left = make_cold(path, everything=False)
    if left:
        print(f"note: {left} bytes of {path} stayed in the page cache", file=sys.stderr)


class ChildFailed(RuntimeError):
    """A benchmark subprocess ended without printing its result."""

    def __init__(self, cmd: list[str], returncode: int, output: str) -> None:
        self.output = output
        errors = [line for line in output.splitlines() if re.match(r"^[\w.]+(Error|Exception)\b", line)]
        lines = output.strip().splitlines()
        self.summary = errors[-1] if errors else (lines[-1] if lines else "no output")
        super().__init__(f"{' '.join(cmd[1:4])} ... exited {returncode}: {self.summary}")


def run_json(cmd: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run a command that prints one ``RESULT {json}`` line; return that JSON."""
    # Output goes to a file, not a pipe: a process the command leaves behind (DLRover's
    # orphaned saver) would hold a pipe open, and reading it to its end would never return.
    with tempfile.TemporaryFile(mode="w+") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=CHILD_TIMEOUT_SECONDS)
        out.seek(0)
        text = out.read()
    for line in reversed(text.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    raise ChildFailed(cmd, proc.returncode, text)


def run_child(ctx: Context, kind: str, *argv: str) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--size", ctx.spec.name]
    return run_json(cmd + list(argv))


# ---- the floor ---------------------------------------------------------------------------


def bench_floor(ctx: Context) -> None:
    ts = tensors(ctx.state)
    path = SHM / f"flashckpt-bench-floor-{os.getpid()}-{ctx.repeat}"
    floor = ShmFloor(path, ts, create=True)
    try:
        for _ in range(FLOOR_COPIES):
            ctx.add("floor.save", timed(lambda: floor.save(ts)))
            ctx.add("floor.load", timed(lambda: floor.load(ts)))
        result = run_child(ctx, "floor-load", "--path", str(path), "--expect", repr(ctx.expected))
        ctx.check("floor load in a new process", result["fingerprint"])
        ctx.add("floor.load_new_process", result["seconds"])
    finally:
        floor.close(unlink=True)


# ---- flashckpt ---------------------------------------------------------------------------


def bench_flashckpt(ctx: Context) -> None:
    try:
        from flashckpt.torch import Checkpointer
    except ImportError as exc:
        ctx.note(f"flashckpt skipped: {exc}")
        return
    directory = ctx.scratch("flashckpt")
    job_id = f"bench-{uuid.uuid4().hex[:12]}"
    ck = Checkpointer(str(directory), job_id=job_id)
    try:
        # as a training script starts: load() (nothing here), which prepares the slots in the
        # background while the first steps train (timed until the slots are ready)
        ctx.add("flashckpt.prepare", timed(lambda: (ck.load(ctx.state), ck.engine.slots.prepared())))
        stall, durable = save_and_wait(lambda: ck.save(1, ctx.state), ck.wait)
        ctx.add("flashckpt.stall_first", stall)
        ctx.add("flashckpt.durable_first", durable)
        for step in range(2, 2 + STEADY_SAVES):
            stall, durable = save_and_wait(lambda: ck.save(step, ctx.state), ck.wait)
            ctx.add("flashckpt.stall_steady", stall)
            ctx.add("flashckpt.durable_steady", durable)
        memory_step = 2 + STEADY_SAVES
        ctx.add("flashckpt.stall_memory_only", timed(lambda: ck.save(memory_step, ctx.state, persist=False)))
        ck.engine.storage.release_run()  # as a restart finds it: the saving process no longer holds the directory
        _flashckpt_child_load(ctx, directory, job_id, "flashckpt.load_memory", memory_step)
    finally:
        ck.close()
    evict(directory)
    _flashckpt_child_load(ctx, directory, job_id, "flashckpt.load_storage", memory_step)
    bench_read_floor(ctx, directory / f"step-{memory_step}")  # the step that load read
    shutil.rmtree(directory)


def _flashckpt_child_load(ctx: Context, directory: Path, job_id: str, key: str, memory_step: int) -> None:
    """A new process loads. Only memory holds ``memory_step`` (saved with persist=False)
    until a close() flushes it; once the job's segments are gone, only storage is left."""
    segments = sorted(os.path.basename(p) for p in glob.glob(glob.escape(job_prefix(job_id)) + ".rank*.slot*"))
    result = run_child(
        ctx, "flashckpt-load", "--dir", str(directory), "--job-id", job_id, "--expect", repr(ctx.expected)
    )
    ctx.check(key, result["fingerprint"])
    ctx.add(key, result["seconds"])
    if key == "flashckpt.load_memory":
        ctx.add("flashckpt.open_new_process", result["open"])
        ctx.source(key, "memory" if result["step"] == memory_step else f"storage, step {result['step']}")
    elif segments:
        ctx.note(f"flashckpt close() left shared memory behind: {', '.join(segments)}")
        ctx.source(key, f"memory or storage, step {result['step']}")
    else:
        ctx.source(key, f"storage, step {result['step']}")


def bench_read_floor(ctx: Context, directory: Path) -> None:
    """The read floor on the shards of one committed step (``_cold.read_floor``: the whole
    page cache dropped as root, checked with fincore, before each read)."""
    floor = read_floor(directory)
    ctx.add("floor.read_dd", floor["dd"])
    ctx.add("floor.read_preads", floor["preads"])
    ctx.add("floor.read", floor["floor"])


# ---- torch.save / torch.load and torch.distributed.checkpoint ----------------------------


def bench_torch(ctx: Context) -> None:
    path = ctx.scratch("torch") / "state.pt"

    def save() -> None:
        with open(path, "wb") as f:
            torch.save(ctx.state, f)
            f.flush()
            os.fsync(f.fileno())

    ctx.add("torch.save_fsync", timed(save))
    evict(path)
    ctx.add("torch.load", timed(lambda: copy_into(ctx.state, torch.load(path, weights_only=True))))
    shutil.rmtree(path.parent)


def bench_dcp(ctx: Context) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    directory = ctx.scratch("dcp")
    ctx.add("dcp.save", timed(lambda: dcp.save(ctx.state, checkpoint_id=directory / "sync")))
    evict(directory / "sync")
    ctx.add("dcp.load", timed(lambda: dcp.load(ctx.state, checkpoint_id=directory / "sync")))
    stall, total = _async_save(dcp, ctx.state, directory / "async", None)
    ctx.add("dcp.async_stall", stall)
    ctx.add("dcp.async_total", total)
    # A stager kept across saves caches its staging storages: the steady state of a training loop.
    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        for i in range(1 + STEADY_SAVES):
            stall, total = _async_save(dcp, ctx.state, directory / f"reused-{i}", stager)
            ctx.add("dcp.reused_stall_first" if i == 0 else "dcp.reused_stall_steady", stall)
            if i:
                ctx.add("dcp.reused_total_steady", total)
    finally:
        stager.close()
    shutil.rmtree(directory)


def _async_save(dcp: Any, state: dict[str, Any], path: Path, stager: Any) -> tuple[float, float]:
    """(stall until async_save returns, i.e. staged; total until its future resolves)."""
    gc.collect()
    start = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=path, async_stager=stager)
    stall = time.perf_counter() - start
    future.result()
    return stall, time.perf_counter() - start


# ---- DLRover (subprocesses in .bench-venv) -----------------------------------------------


@contextmanager
def dlrover_job(ctx: Context) -> Iterator[tuple[str, dict[str, str]]]:
    """A run id for DLRover: it names DLRover's shm segment and socket folder, and marks
    its processes (environment), so everything DLRover leaves behind can be removed."""
    run_id = f"flashckpt-bench-{uuid.uuid4().hex[:12]}"
    try:
        yield run_id, dict(os.environ, TORCHELASTIC_RUN_ID=run_id)
    finally:
        if _kill_marked(run_id):
            ctx.note("DLRover's saver outlived its trainer (orphaned daemon process); killed after the run")
        for segment in SHM.glob(f"{run_id}_*"):
            segment.unlink()
        shutil.rmtree(DLROVER_SOCKETS / run_id, ignore_errors=True)


def _kill_marked(run_id: str) -> int:
    """SIGKILL the processes this benchmark started under ``run_id``, by pid; return how many."""
    mark = f"TORCHELASTIC_RUN_ID={run_id}".encode()
    killed = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if mark in (proc / "environ").read_bytes().split(b"\0"):
                os.kill(int(proc.name), 9)
                killed += 1
        except (OSError, ProcessLookupError):
            continue
    return killed


def _peer(ctx: Context, env: dict[str, str], command: str, directory: Path, *argv: str) -> dict[str, Any]:
    cmd = [str(PEER_PYTHON), str(PEER_SCRIPT), command, "--size", ctx.spec.name, "--dir", str(directory)]
    return _run_dlrover(ctx, command, cmd + [*argv, "--saves", str(1 + STEADY_SAVES)], env)


def _run_dlrover(ctx: Context, what: str, cmd: list[str], env: dict[str, str]) -> dict[str, Any]:
    try:
        return run_json(cmd, env=env)
    except ChildFailed as exc:
        # DLRover's trainer and its saver meet over Unix sockets, and under load its
        # start-up races now and then (a lost first message, a request before the server
        # is ready). Note it, clear what the failed try left, and try once more.
        ctx.note(f"DLRover {what} failed in repeat {ctx.repeat + 1} ({exc.summary}); retried once")
    run_id = env["TORCHELASTIC_RUN_ID"]
    _kill_marked(run_id)
    shutil.rmtree(DLROVER_SOCKETS / run_id, ignore_errors=True)
    return run_json(cmd, env=env)


def bench_dlrover(ctx: Context, storages: tuple[str, ...] = ("memory", "disk"), restarts: bool = True) -> None:
    if not PEER_PYTHON.exists():
        ctx.note("DLRover skipped: no .bench-venv (run benchmarks/setup_peer_venv.sh dlrover)")
        return
    for storage in storages:
        prefix = f"dlrover.{storage}"
        directory = ctx.scratch(f"dlrover-{storage}")
        with dlrover_job(ctx) as (_, env):
            saved = _peer(ctx, env, "save", directory, "--storage", storage)
            ctx.check(f"{prefix} load in the same process", saved["fingerprint"])
            ctx.add(f"{prefix}.stall_first", saved["stall_first"])
            for stall in saved["stall_steady"]:
                ctx.add(f"{prefix}.stall_steady", stall)
            if storage == "memory":
                ctx.add(f"{prefix}.load_same_process", saved["load_same_process"])
            else:
                ctx.add(f"{prefix}.durable_first", saved["durable_first"])
                for durable in saved["durable_steady"]:
                    ctx.add(f"{prefix}.durable_steady", durable)
            evict(directory)
            _peer_load(ctx, f"{prefix}.load_new_process", _peer(ctx, env, "load", directory))
        shutil.rmtree(directory)
    if ctx.repeat or not restarts:
        return  # the restarts show where a restarted worker finds its bytes: once is enough
    for crash in ("kill", "raise"):
        directory = ctx.scratch(f"dlrover-torchrun-{crash}")
        with dlrover_job(ctx) as (run_id, env):
            cmd = [
                str(PEER_PYTHON), "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1",
                "--max-restarts=1", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0",
                f"--rdzv-id={run_id}", str(PEER_SCRIPT), "restart", "--crash", crash,
                "--size", ctx.spec.name, "--dir", str(directory),
            ]  # fmt: skip
            _peer_load(ctx, f"dlrover.torchrun_{crash}.load", _run_dlrover(ctx, f"torchrun {crash}", cmd, env))
        shutil.rmtree(directory)


def _peer_load(ctx: Context, key: str, result: dict[str, Any]) -> None:
    """Record a load; a load that found nothing has no time, only its source."""
    step = result.get("loaded_step")
    ctx.source(key, result["source"] + (f", step {step}" if step is not None else ""))
    if result["source"] != "none":
        ctx.check(key, result["fingerprint"])
        ctx.add(key, result["load"])


# ---- the 2026 peers: lm-resiliency, torch-checkpointing, ml-flashpoint (subprocesses in their venvs) --


@dataclass(frozen=True, slots=True, kw_only=True)
class Peer:
    """A peer checkpointer run by its driver (see _peer_cli.py) in a venv of its own."""

    name: str  # the --methods name, the metrics' prefix and setup_peer_venv.sh's argument
    label: str
    venv: str  # under the repository, made by benchmarks/setup_peer_venv.sh NAME
    saves: int  # saves a run: the first ones (fresh memory), then STEADY_SAVES steady ones
    in_memory: bool = False  # its directory is on /dev/shm (a tmpfs tier): never evicted, read from memory

    @property
    def python(self) -> Path:
        return REPO / self.venv / "bin" / "python"

    @property
    def script(self) -> Path:
        return HERE / f"_{self.name}_peer.py"


LMRES = Peer(name="lmres", label="lm-resiliency", venv=".bench-lmres", saves=2 + STEADY_SAVES)
TCKPT = Peer(name="tckpt", label="torch-checkpointing", venv=".bench-tckpt", saves=1 + STEADY_SAVES)
MLF = Peer(name="mlf", label="ml-flashpoint", venv=".bench-mlf", saves=1 + STEADY_SAVES, in_memory=True)
_NOT_METRICS = {"fingerprint", "last_step"}


def bench_peer(ctx: Context, peer: Peer) -> None:
    """Its saves in one process (every number it returns is a sample of ``NAME.KEY``),
    then a load in a new process from a page cache emptied of its files."""
    if not peer.python.exists():
        ctx.note(f"{peer.label} skipped: no {peer.venv} (run benchmarks/setup_peer_venv.sh {peer.name})")
        return
    directory = (SHM / f"flashckpt-bench-{peer.name}-{os.getpid()}-{ctx.repeat}" if peer.in_memory
                 else ctx.scratch(peer.name))
    cmd = [str(peer.python), str(peer.script)]
    where = ["--size", ctx.spec.name, "--dir", str(directory)]
    saved = run_json(cmd + ["save", *where, "--saves", str(peer.saves)])
    ctx.check(f"{peer.name} state after its saves", saved["fingerprint"])
    for key, value in saved.items():
        for seconds in value if isinstance(value, list) else [value]:
            if key not in _NOT_METRICS and seconds is not None:
                ctx.add(f"{peer.name}.{key}", seconds)
    if not peer.in_memory:
        evict(directory)
    _peer_load(ctx, f"{peer.name}.load_new_process", run_json(cmd + ["load", *where]))
    shutil.rmtree(directory)


# ---- dd ----------------------------------------------------------------------------------


def dd_bytes(nbytes: int) -> int:
    return math.ceil(nbytes / DD_BLOCK) * DD_BLOCK


def bench_dd(ctx: Context) -> None:
    target = ctx.scratch("dd") / "dd.bin"
    count = dd_bytes(ctx.nbytes) // DD_BLOCK
    for key, flag in (("dd.fsync", "conv=fsync"), ("dd.direct", "oflag=direct")):
        cmd = ["dd", "if=/dev/zero", f"of={target}", f"bs={DD_BLOCK}", f"count={count}", flag]
        ctx.add(key, timed(lambda: subprocess.run(cmd, check=True, capture_output=True)))
        target.unlink()
    shutil.rmtree(target.parent)


METHODS: list[tuple[str, Callable[[Context], None]]] = [
    ("floor", bench_floor),
    ("flashckpt", bench_flashckpt),
    ("torch", bench_torch),
    ("dcp", bench_dcp),
    ("dlrover", bench_dlrover),
    ("dlrover-memory", lambda ctx: bench_dlrover(ctx, ("memory",), restarts=False)),  # its save stall, quickly
    ("lmres", lambda ctx: bench_peer(ctx, LMRES)),
    ("tckpt", lambda ctx: bench_peer(ctx, TCKPT)),
    ("mlf", lambda ctx: bench_peer(ctx, MLF)),
    ("dd", bench_dd),
]


# ---- one size: run, summarise, print -----------------------------------------------------


def run_size(spec: StateSpec, repeats: int, root: Path, methods: list[str]) -> dict[str, Any]:
    print(f"== {spec.describe()}: building the state", flush=True)
    state = build_state(spec)
    ctx = Context(
        spec=spec, state=state, expected=fingerprint(state), nbytes=nbytes(state), workdir=root / spec.name
    )
    chosen = [(name, bench) for name, bench in METHODS if name in methods]
    for repeat in range(repeats):
        ctx.repeat = repeat
        shift = repeat % len(chosen)
        ctx.load_average.append(os.getloadavg()[0])
        print(f"  repeat {repeat + 1}/{repeats} (load average {ctx.load_average[-1]:.2f}):", end="", flush=True)
        for name, bench in chosen[shift:] + chosen[:shift]:
            print(f" {name}", end="", flush=True)
            try:
                bench(ctx)
            except Exception as exc:  # one method's failure must not hide the others' figures
                ctx.note(f"{name} failed in repeat {repeat + 1}: {type(exc).__name__}: {exc}")
        print(flush=True)
    shutil.rmtree(ctx.workdir, ignore_errors=True)
    return summarize(ctx, repeats)


def _median(values: list[float] | None) -> float | None:
    return statistics.median(values) if values else None


def _paired_rate(nbytes: int, totals: list[float] | None, stalls: list[float] | None) -> float | None:
    """Bytes per second written in the background: bytes / (durable time - save stall)."""
    if not totals or not stalls:
        return None
    return statistics.median(nbytes / (t - s) for t, s in zip(totals, stalls, strict=True))


def summarize(ctx: Context, repeats: int) -> dict[str, Any]:
    samples = ctx.samples
    medians = {key: statistics.median(values) for key, values in samples.items()}
    metrics: dict[str, Any] = {}
    for metric in METRICS:
        if metric.key not in samples and metric.key not in ctx.sources:
            continue
        median = medians.get(metric.key)
        floor = medians.get(metric.floor) if metric.floor else None
        metrics[metric.key] = {
            "label": metric.label,
            "median_s": median,
            "samples_s": samples.get(metric.key, []),
            "floor": metric.floor,
            "x_floor": median / floor if median is not None and floor else None,
            "sources": ctx.sources.get(metric.key),
        }
    dd_size = dd_bytes(ctx.nbytes)
    rates = {
        "flashckpt_persist": _paired_rate(
            ctx.nbytes, samples.get("flashckpt.durable_steady"), samples.get("flashckpt.stall_steady")
        ),
        "dlrover_persist": _paired_rate(
            ctx.nbytes, samples.get("dlrover.disk.durable_steady"), samples.get("dlrover.disk.stall_steady")
        ),
        "lmres_persist": _paired_rate(
            ctx.nbytes, samples.get("lmres.durable_steady"), samples.get("lmres.stall_steady")
        ),
        "tckpt_persist": _paired_rate(
            ctx.nbytes, samples.get("tckpt.durable_steady"), samples.get("tckpt.stall_steady")
        ),
        "torch_save_fsync": ctx.nbytes / medians["torch.save_fsync"] if "torch.save_fsync" in medians else None,
        "dcp_save": ctx.nbytes / medians["dcp.save"] if "dcp.save" in medians else None,
        "dd_fsync": dd_size / medians["dd.fsync"] if "dd.fsync" in medians else None,
        "dd_direct": dd_size / medians["dd.direct"] if "dd.direct" in medians else None,
    }
    return {
        "spec": {"name": ctx.spec.name, "description": ctx.spec.describe()},
        "bytes": ctx.nbytes,
        "repeats": repeats,
        "metrics": metrics,
        "throughput_gb_s": {k: v / 1e9 if v else None for k, v in rates.items()},
        "goals": _goals(metrics, rates),
        "issue_peer_ratios": [
            {"what": what, "issue": issue, "measured": metrics.get(key, {}).get("x_floor")}
            for what, issue, key in ISSUE_PEER_RATIOS
        ],
        "notes": ctx.notes,
        "load_average": ctx.load_average,
    }


def _goals(metrics: dict[str, Any], rates: dict[str, float | None]) -> list[dict[str, Any]]:
    def ratio(key: str) -> float | None:
        return metrics.get(key, {}).get("x_floor")

    persist, dd_fsync, dd_direct = rates["flashckpt_persist"], rates["dd_fsync"], rates["dd_direct"]
    dd = max((r for r in (dd_fsync, dd_direct) if r), default=None)
    versus_dd = persist / dd if persist and dd else None
    versus_fsync = persist / dd_fsync if persist and dd_fsync else None
    def speedup(slower: str, faster: str) -> float | None:
        a, b = metrics.get(slower, {}).get("median_s"), metrics.get(faster, {}).get("median_s")
        return a / b if a and b else None

    def paired(slower: str, faster: str) -> float | None:
        """The median over repeats of one repeat's ratio: the two measured back to back,
        so a disk or CPU disturbed for a while moves both (the medians above pair nothing)."""
        a, b = metrics.get(slower, {}).get("samples_s", []), metrics.get(faster, {}).get("samples_s", [])
        return statistics.median(x / y for x, y in zip(a, b)) if a and len(a) == len(b) else None

    goals: list[tuple[str, float | None, Callable[[float], bool] | None]] = [
        ("load from storage, new process: speed >= 0.8x the read floor", speedup("floor.read", "flashckpt.load_storage"),
         lambda v: v >= 0.8),
        ("the same, per repeat (load, then the floor on its files, back to back)",
         paired("floor.read", "flashckpt.load_storage"), None),
        ("load from storage faster than DCP load (x faster)", speedup("dcp.load", "flashckpt.load_storage"),
         lambda v: v > 1.0),
        ("load from storage faster than torch.load + copy (x faster)",
         speedup("torch.load", "flashckpt.load_storage"), lambda v: v > 1.0),
        ("save stall (steady) <= 1.2x floor", ratio("flashckpt.stall_steady"), lambda v: v <= 1.2),
        ("save stall, first <= 1.5x steady", speedup("flashckpt.stall_first", "flashckpt.stall_steady"),
         lambda v: v <= 1.5),
        ("load from memory, new process <= 2x floor", ratio("flashckpt.load_memory"), lambda v: v <= 2.0),
        ("load from memory, new process <= 1.15x the new-process floor",
         speedup("flashckpt.load_memory", "floor.load_new_process"), lambda v: v <= 1.15),
        ("persist throughput >= 0.8x dd (the faster dd)", versus_dd, lambda v: v >= 0.8),
        ("persist throughput / dd conv=fsync (also buffered + fsync)", versus_fsync, None),
    ]
    return [
        {"goal": goal, "value": value, "met": check(value) if check and value is not None else None}
        for goal, value, check in goals
    ]


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{result['spec']['description']} -- {result['bytes'] / 1e6:.0f} MB, medians of {result['repeats']}")
    print(f"{'method':<64} {'seconds':>8} {'x floor':>8} {'n':>3}")
    for metric in result["metrics"].values():
        sources = metric["sources"]
        where = f" [{'; '.join(sorted(set(sources)))}]" if sources else ""
        ratio = metric["x_floor"]
        x = "" if ratio is None else f"{ratio:.2f}x"
        n = len(metric["samples_s"])
        print(f"{metric['label'] + where:<64} {_fmt(metric['median_s'], '.3f'):>8} {x:>8} {n:>3}")
    print("throughput, GB/s: " + ", ".join(f"{k} {_fmt(v, '.2f')}" for k, v in result["throughput_gb_s"].items()))
    for goal in result["goals"]:
        verdict = {True: "MET", False: "MISSED", None: "(for reference)"}[goal["met"]]
        print(f"goal: {goal['goal']}: {_fmt(goal['value'], '.2f')} -> {verdict}")
    for peer in result["issue_peer_ratios"]:
        print(f"peer: {peer['what']}: issue notes {peer['issue']}, here {_fmt(peer['measured'], '.2f')}x")
    for note in result["notes"]:
        print(f"note: {note}")


# ---- child processes ---------------------------------------------------------------------


def child_main(argv: list[str]) -> None:
    """A new process that loads (the floor's shm file, or flashckpt), printing RESULT json."""
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["floor-load", "flashckpt-load"])
    parser.add_argument("--size", choices=sorted(SPECS), required=True)
    parser.add_argument("--expect", type=float, required=True)
    parser.add_argument("--path")
    parser.add_argument("--dir")
    parser.add_argument("--job-id")
    args = parser.parse_args(argv)
    state = build_state(SPECS[args.size], seed=1)
    result = _child_floor(state, Path(args.path)) if args.kind == "floor-load" else _child_flashckpt(state, args)
    result["fingerprint"] = fingerprint(state)
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def _child_floor(state: dict[str, Any], path: Path) -> dict[str, Any]:
    ts = tensors(state)
    gc.collect()
    start = time.perf_counter()
    floor = ShmFloor(path, ts, create=False)
    floor.load(ts)
    seconds = time.perf_counter() - start
    floor.close(unlink=False)
    return {"seconds": seconds}


def _child_flashckpt(state: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from flashckpt.torch import Checkpointer

    gc.collect()
    start = time.perf_counter()
    ck = Checkpointer(args.dir, job_id=args.job_id)
    opened = time.perf_counter()
    step = ck.load(state)
    loaded = time.perf_counter()
    ck.close()
    return {"open": opened - start, "seconds": loaded - opened, "step": step}


# ---- main --------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    shm = shutil.disk_usage(SHM)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    return {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "memory_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9,
        "dev_shm_free_gb": shm.free / 1e9,
        "commit": commit.stdout.strip(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["small", "large", "both"], default="both")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default="/tmp",
                        help="storage directory, made if missing (a temp folder is made inside)")
    parser.add_argument("--json", default=str(REPO / "results" / "save_load.json"))
    parser.add_argument("--methods", default=",".join(name for name, _ in METHODS if name != "dlrover-memory"),
                        help="comma-separated methods to run (default: all but dlrover-memory, a part of dlrover)")
    args = parser.parse_args(argv)
    args.methods = args.methods.split(",")
    unknown = sorted(set(args.methods) - {name for name, _ in METHODS})
    if unknown:
        parser.error(f"--methods: unknown {', '.join(unknown)}; known: {', '.join(name for name, _ in METHODS)}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    try:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        parser.error(f"--dir {args.dir}: cannot make the directory: {err.strerror or err}")
    return args


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        child_main(sys.argv[2:])
        return
    args = parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    names = ["small", "large"] if args.size == "both" else [args.size]
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="flashckpt-bench-", dir=args.dir))
    results: dict[str, Any] = {}
    try:
        for name in names:  # each size's table and JSON as soon as it is done
            results[name] = run_size(SPECS[name], args.repeats, root, args.methods)
            print_table(results[name])
            out.write_text(json.dumps({"machine": machine(), "sizes": results}, indent=2) + "\n")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\ntimings may be disturbed by other work on this machine: see load_average in the JSON")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
