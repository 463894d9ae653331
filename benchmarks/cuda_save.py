"""A GPU training state: flashckpt's save and load side by side with the floor and
with torch.distributed.checkpoint's async_save, on one CUDA device.

    python benchmarks/cuda_save.py [--size large|small] [--repeats 5] [--json results/cuda_save.json]

The state is the GPT-2-shaped AdamW state of _state.py ("large": 1.49 GB) on cuda:0.
Each repeat runs every method once, in an order rotated per repeat; the table shows
medians over repeats. What is timed:

- floor save: every tensor copied into one page-locked host buffer (non-blocking
  copies, one stream sync): the least any GPU -> host save must do. floor load: back.
- pageable save: the same copies into an already-touched /dev/shm mapping that is not
  page-locked (what a checkpointer pays that copies into plain shared memory).
- flashckpt save (blocking part; persist=False, steady state), flashckpt's first save
  (a new job: slot created, touched and page-locked), the first save of a new job whose
  ``load()`` found nothing a second before (slots prepared in the background: the
  usual loop), and the steady save with page-locking turned off (what locking buys).
- flashckpt load from memory in a new process (a restarted trainer whose state is on
  the GPU; only ``load`` is timed), with and without page-locking.
- DCP ``async_save`` (no process group), time until it returns (the training stall):
  with its default stager, and with ``FileSystemWriter(cache_staged_state_dict=True)``
  (page-locked staging buffers reused across saves: DCP's fastest setting), steady.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO)]

import torch  # noqa: E402

from _state import SPECS, PinnedFloor, ShmFloor, build_state, fingerprint, nbytes, tensors  # noqa: E402


def to_cuda(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.cuda()
    if isinstance(tree, dict):
        return {k: to_cuda(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [to_cuda(v) for v in tree]
    return tree


def str_keys(tree: Any) -> Any:
    """The same tensors under string keys (DCP's planner wants them)."""
    if isinstance(tree, dict):
        return {str(k): str_keys(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return {str(i): str_keys(v) for i, v in enumerate(tree)}
    return tree


def gpu_state(size: str) -> dict[str, Any]:
    state = to_cuda(build_state(SPECS[size]))
    torch.cuda.synchronize()
    return state


class PageableFloor(ShmFloor):
    def save(self, ts: list[torch.Tensor]) -> None:
        super().save(ts)
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


from flashckpt.torch._tensors import TorchKind  # noqa: E402

_PAGE_LOCKER = TorchKind.page_locker


def page_locking(enabled: bool) -> None:
    """Turn flashckpt's page-locking of slots for GPU copies on or off (for comparison)."""
    TorchKind.page_locker = _PAGE_LOCKER if enabled else (lambda self, objs: None)


def child_write(argv: list[str]) -> None:
    """A trainer that saves the GPU state to memory and dies (a crash: its slots stay)."""
    size, directory, job = argv
    from flashckpt.torch import Checkpointer
    ck = Checkpointer(directory, job_id=job, persist_every=10**9)
    ck.save(1, gpu_state(size), persist=False)
    ck.wait()
    os._exit(0)


def child_load(argv: list[str]) -> None:
    """A restarted trainer: build the GPU state, load it from the dead process's memory."""
    size, directory, job, lock, expect = argv[0], argv[1], argv[2], argv[3] == "1", float(argv[4])
    page_locking(lock)
    from flashckpt.torch import Checkpointer
    state = gpu_state(size)
    for t in tensors(state):
        t.zero_()
    ck = Checkpointer(directory, job_id=job)
    seconds = timed(lambda: ck.load(state))
    source = ck.last_load.source
    ok = abs(fingerprint(state) - expect) <= 1e-6 * max(1.0, abs(expect))
    ck.close()  # frees the slots
    print(json.dumps({"seconds": seconds, "source": source, "ok": ok}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SPECS), default="large")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=str(REPO / "results" / "cuda_save.json"))
    args = parser.parse_args()
    import torch.distributed.checkpoint as dcp
    from flashckpt.torch import Checkpointer

    state = gpu_state(args.size)
    ts = tensors(state)
    size = nbytes(state)
    expect = fingerprint(state)
    root = Path(tempfile.mkdtemp(prefix="flashckpt-cuda-bench-"))
    job = "bc" + uuid.uuid4().hex[:8]
    pinned = PinnedFloor(ts)
    pageable = PageableFloor(Path(f"/dev/shm/flashckpt-bench-floor.{job}"), ts, create=True)
    ck = Checkpointer(root / "flash", job_id=job, persist_every=10**9)
    unlocked = Checkpointer(root / "flash-unlocked", job_id=job + "u", persist_every=10**9)
    step = 0
    samples: dict[str, list[float]] = {}

    def flash_save() -> None:
        nonlocal step
        step += 1
        ck.save(step, state, persist=False)

    def flash_unlocked() -> None:
        page_locking(False)
        try:
            unlocked.save(step, state, persist=False)
        finally:
            page_locking(True)

    firsts: list[Any] = []

    def flash_first() -> None:
        firsts.append(Checkpointer(root / "flash-first", job_id=job + f"f{len(firsts)}", persist_every=10**9))
        firsts[-1].save(1, state, persist=False)

    def fresh_start() -> None:
        """A new job's load() finds nothing and prepares (and page-locks) the slots in the
        background while the first steps train (a second here)."""
        fresh = job + f"n{uuid.uuid4().hex[:6]}"  # close() commits the newest step: a new directory each time
        firsts.append(Checkpointer(root / fresh, job_id=fresh, persist_every=10**9))
        assert firsts[-1].load(state) is None
        time.sleep(1.0)

    def flash_first_after_load() -> None:
        firsts[-1].save(1, state, persist=False)

    def child(lock: bool) -> Callable[[], float]:
        def run() -> float:
            # one process saves and dies, a new one loads (a run's directory has one live
            # process per rank: the parent's own checkpointers cannot be loaded from)
            restarted = job + f"r{uuid.uuid4().hex[:6]}"
            for argv in (["--write", args.size, str(root / restarted), restarted],
                         ["--child", args.size, str(root / restarted), restarted, "1" if lock else "0", repr(expect)]):
                out = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True)
                if out.returncode != 0:
                    raise RuntimeError(f"{argv[0]} failed ({out.returncode}): {out.stderr[-3000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            assert result["source"] == "memory" and result["ok"], result
            return result["seconds"]
        return run

    cached = dcp.FileSystemWriter(str(root / "dcp-cached"), cache_staged_state_dict=True)
    pending: list[Any] = []

    def dcp_async(writer: Any) -> Callable[[], None]:
        def run() -> None:
            target = writer if writer is not None else dcp.FileSystemWriter(str(root / "dcp-default"))
            pending.append(dcp.async_save(str_keys(state), storage_writer=target, no_dist=True))
        return run

    methods: list[tuple[str, Callable[[], Any]]] = [
        ("floor save (page-locked)", lambda: pinned.save(ts)),
        ("floor load (page-locked)", lambda: pinned.load(ts)),
        ("pageable save (plain /dev/shm)", lambda: pageable.save(ts)),
        ("flashckpt save (blocking)", flash_save),
        ("flashckpt save, no page-locking", flash_unlocked),
        ("flashckpt first save", flash_first),
        ("flashckpt first save after load() found nothing", flash_first_after_load),
        ("flashckpt load from memory, new process", child(True)),
        ("flashckpt load from memory, new process, no page-locking", child(False)),
        ("dcp async_save (blocking), default stager", dcp_async(None)),
        ("dcp async_save (blocking), cached pinned staging", dcp_async(cached)),
    ]
    for warm in (flash_save, flash_save, flash_unlocked, flash_unlocked, dcp_async(cached)):
        warm()  # slots allocated and locked; DCP's cached buffers allocated
    while pending:
        pending.pop().result()
    for r in range(args.repeats):
        order = methods[r % len(methods):] + methods[:r % len(methods)]
        for name, fn in order:
            if name.startswith("flashckpt load"):
                value = fn()  # the child reports its own load time
            elif name.startswith("flashckpt first save after load"):
                fresh_start()
                value = timed(fn)
            else:
                value = timed(fn)
            samples.setdefault(name, []).append(value)
            while pending:
                pending.pop().result()
            while firsts:
                firsts.pop().close()
            print(f"[cuda bench] repeat {r}: {name} {value * 1000:.1f} ms", file=sys.stderr, flush=True)
    ck.close()
    unlocked.close()
    pageable.close(unlink=True)
    shutil.rmtree(root, ignore_errors=True)

    med = {name: statistics.median(v) for name, v in samples.items()}
    floor_save, floor_load = med["floor save (page-locked)"], med["floor load (page-locked)"]
    ratios = {
        "flashckpt save / floor save": med["flashckpt save (blocking)"] / floor_save,
        "flashckpt first save / floor save": med["flashckpt first save"] / floor_save,
        "flashckpt first save after load() / floor save":
            med["flashckpt first save after load() found nothing"] / floor_save,
        "flashckpt save without page-locking / floor save": med["flashckpt save, no page-locking"] / floor_save,
        "dcp async_save blocking (default) / flashckpt save":
            med["dcp async_save (blocking), default stager"] / med["flashckpt save (blocking)"],
        "dcp async_save blocking (cached pinned) / flashckpt save":
            med["dcp async_save (blocking), cached pinned staging"] / med["flashckpt save (blocking)"],
        "flashckpt load from memory (new process) / floor load":
            med["flashckpt load from memory, new process"] / floor_load,
        "flashckpt load without page-locking / floor load":
            med["flashckpt load from memory, new process, no page-locking"] / floor_load,
    }
    device = torch.cuda.get_device_name()
    print(f"{SPECS[args.size].describe()}: {size / 1e9:.2f} GB of AdamW state on {device}; "
          f"median of {args.repeats} (GB/s = state bytes / time)")
    width = max(len(n) for n in med)
    for name, seconds in med.items():
        print(f"  {name:<{width}}  {seconds * 1000:8.1f} ms  {size / seconds / 1e9:6.1f} GB/s")
    print("ratios:")
    for name, value in ratios.items():
        print(f"  {name:<58} {value:6.2f}x")
    out = {"benchmark": "cuda_save", "size": args.size, "state_bytes": size, "device": device,
           "repeats": args.repeats, "median_seconds": med, "samples_seconds": samples, "ratios": ratios,
           "torch": torch.__version__, "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"]:
        child_write(sys.argv[2:])
    elif sys.argv[1:2] == ["--child"]:
        child_load(sys.argv[2:])
    else:
        main()
