"""FSDP2 checkpoints: flashckpt's FsdpCheckpointer side by side with
torch.distributed.checkpoint (DCP) on the same model, 2 gloo ranks on CPU.

    python benchmarks/fsdp.py [--params-m 48] [--repeats 3] [--dir DIR] [--json results/fsdp.json]
                              [--device cuda] [--source-world 4] [--methods reshard,floor]

``--device cuda``: the model lives on the one GPU of a 1-rank job (NCCL for FSDP's
collectives); the floor copies into page-locked host memory, and the resharded loads
are left out (they need 2 ranks, and they read storage on any device). ``--methods``:
only the methods whose names contain one of the given words (all by default).

The model is a stack of square Linear layers (hidden 2048, one ``fully_shard`` each)
with AdamW state after one step: parameters + two moments, fp32. A job of
``--source-world`` ranks (4) first saves the same state with both libraries; those
checkpoints are the sources of the resharded loads (4 -> 2 ranks). Then, on 2 ranks, each repeat runs every method once
(in a rotated order) and the table shows medians over repeats of the slowest rank:

- floor: one ``copy_`` of every local tensor into an already-touched /dev/shm file
  (the least any save to memory must do); its reverse is the load floor. Floor and
  steady flashckpt saves alternate, 5 pairs back to back per repeat (as in a training
  loop), so the medians are over 5 x repeats samples.
- flashckpt save (blocking, persist=False, steady state), save + wait (durable), load
  from memory (in place), load from storage (a new job: nothing in memory; checksums
  verified), resharded load (4 -> 2 ranks, ranged reads, the blocks read verified).
- DCP save, async_save (time until it returns, i.e. the training stall, and until
  its future resolves), load (``dcp.load`` in place into the live DTensors; the
  ``set_state_dict`` a user would call after it is not timed, which favours DCP),
  resharded load (4 -> 2 ranks).

Storage loads start from a page cache emptied of the checkpoint's files
(posix_fadvise DONTNEED), for both libraries. The sources of the resharded loads are
read once before the first repeat: this machine's virtual disk serves a file just written
with ``O_DIRECT`` (as flashckpt's saver writes) slower on its first read than on later
ones (264 MB with 8 threads: 0.24-0.35 s, then 0.15 s), while a file written through the
page cache (as DCP writes) reads fast at once; the warm-up keeps the writer from deciding
the reads.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO)]

from tests._fork import run_ranks  # noqa: E402

HIDDEN = 2048
STEADY_SAVES = 5
"""Saves (and floor copies) per repeat: a repeat's other methods write gigabytes to disk,
whose writeback a lone save right after them would also measure."""


def build(layers: int, device: str = "cpu"):
    import torch
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(layers)]).to(device)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(4, HIDDEN, device=device)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def sharded_state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=False))
    return {"model": msd, "optim": osd}


def local_tensors(state: dict) -> list:
    out = []

    def walk(x):
        if hasattr(x, "to_local"):
            out.append(x.to_local())
        elif hasattr(x, "shape"):
            out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
    walk(state)
    return out


def drop_cache(*roots: str) -> None:
    for root in roots:
        for path in Path(root).rglob("*"):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def read_once(*roots: str) -> None:
    """Read every file under ``roots`` once (see the module docstring), then drop it from the page cache."""
    for root in roots:
        for path in Path(root).rglob("*"):
            if path.is_file():
                with open(path, "rb", buffering=0) as f:
                    while f.read(16 << 20):
                        pass
    drop_cache(*roots)


def save_sources(rank: int, world: int, root: str, layers: int) -> None:
    """The checkpoints the 2-rank job reshards from (saved by ``world`` ranks)."""
    import torch.distributed.checkpoint as dcp
    from flashckpt.torch import FsdpCheckpointer
    model, opt = build(layers)
    with FsdpCheckpointer(os.path.join(root, "flash-src"), job_id=f"bw{hashlib.sha1(root.encode()).hexdigest()[:8]}") as ck:
        ck.save(1, model, opt, persist=True)
    dcp.save(sharded_state(model, opt), checkpoint_id=os.path.join(root, "dcp-src"))


def measure(rank: int, world: int, root: str, layers: int, repeats: int, device: str,
            only: list[str] | None = None) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from _state import PinnedFloor, ShmFloor
    from flashckpt.torch import FsdpCheckpointer

    model, opt = build(layers, device)
    local = local_tensors(sharded_state(model, opt))
    state_bytes = sum(t.numel() * t.element_size() for t in local)
    job = f"bf{hashlib.sha1(root.encode()).hexdigest()[:8]}"  # the same on every rank
    async_group = dist.new_group(backend="gloo")  # async_save's collectives run off the training thread
    if device == "cuda":
        floor = PinnedFloor(local)
    else:
        floor = ShmFloor(Path(f"/dev/shm/flashckpt-bench-floor.{job}.{rank}"), local, create=True)
    ck = FsdpCheckpointer(os.path.join(root, "flash-w2"), job_id=job, persist_every=1000)
    step = 1
    ck.save(step, model, opt, persist=False)  # warm-up: slots allocated and touched
    ck.save(step + 1, model, opt, persist=False)
    step += 1
    samples: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[[], Any], before: Callable[[], Any] | None = None) -> None:
        if before is not None:
            before()
        dist.barrier()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
        everyone = [None] * world
        dist.all_gather_object(everyone, seconds)
        samples.setdefault(name, []).append(max(everyone))  # a job waits for its slowest rank

    def flash_save() -> None:
        nonlocal step
        step += 1
        ck.save(step, model, opt, persist=False)

    def flash_durable() -> None:
        nonlocal step
        step += 1
        ck.save(step, model, opt, persist=True)
        ck.wait()

    others: list[Any] = []  # a new job's checkpointer, built before the timed load, closed after

    def open_other(directory: str, suffix: str) -> None:
        drop_cache(directory)
        others.append(FsdpCheckpointer(directory, job_id=job + suffix))

    def flash_storage() -> None:
        other = others.pop()
        assert other.load(model, opt) is not None and other.last_load.source == "storage"
        closing.append(other)

    def flash_reshard() -> None:
        other = others.pop()
        assert other.load(model, opt) == 1 and other.last_load.source == "storage"
        closing.append(other)

    closing: list[Any] = []

    dcp_dir = os.path.join(root, "dcp-w2")

    def dcp_save() -> None:
        dcp.save(sharded_state(model, opt), checkpoint_id=dcp_dir)

    pending: list[Any] = []

    def dcp_async() -> None:
        pending.append(dcp.async_save(sharded_state(model, opt), checkpoint_id=dcp_dir + "-async",
                                      process_group=async_group))

    def dcp_async_done() -> None:
        pending.pop().result()

    def dcp_load() -> None:
        dcp.load(sharded_state(model, opt), checkpoint_id=dcp_dir)

    def dcp_reshard() -> None:
        dcp.load(sharded_state(model, opt), checkpoint_id=os.path.join(root, "dcp-src"))

    methods = [
        ("steady saves", None, None),  # STEADY_SAVES pairs of the two below, back to back
        ("floor load", lambda: floor.load(local), None),
        ("flashckpt save + wait (durable)", flash_durable, None),
        ("flashckpt load from memory", lambda: ck.load(model, opt), None),
        ("flashckpt load from storage", flash_storage, lambda: open_other(os.path.join(root, "flash-w2"), "s")),
        ("flashckpt resharded load", flash_reshard, lambda: open_other(os.path.join(root, "flash-src"), "r")),
        ("dcp save", dcp_save, None),
        ("dcp async_save (blocking)", dcp_async, None),
        ("dcp async_save (until done)", dcp_async_done, None),
        ("dcp load", dcp_load, lambda: drop_cache(dcp_dir)),
        ("dcp resharded load", dcp_reshard, lambda: drop_cache(os.path.join(root, "dcp-src"))),
    ]
    if world == 1:
        methods = [m for m in methods if "resharded" not in m[0]]
    if only:
        methods = [m for m in methods if any(word in m[0] for word in only)]
    flash_durable()  # every load below has something committed to read
    dcp_save()
    for r in range(repeats):
        # async_save's two halves stay in order; everything else rotates per repeat
        rotated = methods[r % len(methods):] + methods[:r % len(methods)]
        order = [m for m in rotated if m[0] != "dcp async_save (until done)"]
        for i, m in enumerate(order):
            if m[0] == "dcp async_save (blocking)":
                order[i + 1:i + 1] = [m for m in methods if m[0] == "dcp async_save (until done)"]
                break
        for name, fn, before in order:
            if name.startswith("flashckpt load from memory"):
                flash_save()  # the newest step is in memory
            if name == "steady saves":  # as in a training loop: save after save, alternating with the floor
                for _ in range(STEADY_SAVES):
                    timed("floor save", lambda: floor.save(local))
                    timed("flashckpt save (blocking)", flash_save)
                name = "flashckpt save (blocking)"
            else:
                timed(name, fn, before)
            if rank == 0:
                print(f"[fsdp bench] repeat {r}: {name} {samples[name][-1]:.3f}s", file=sys.stderr, flush=True)
            while closing:
                closing.pop().close()
    ck.close()
    if device != "cuda":
        floor.close(unlink=True)
    total = [None] * world
    dist.all_gather_object(total, state_bytes)
    return {"samples": samples, "state_bytes_per_rank": total, "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params-m", type=float, default=48.0, help="model parameters, millions")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir under /tmp)")
    parser.add_argument("--json", default=str(REPO / "results" / "fsdp.json"))
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--source-world", type=int, default=4, help="ranks that save the resharded loads' source")
    parser.add_argument("--methods", default="", help="comma-separated words: run only the methods named with one")
    args = parser.parse_args()
    only = [w for w in args.methods.split(",") if w]
    layers = max(1, round(args.params_m * 1e6 / (HIDDEN * HIDDEN + HIDDEN)))
    root = tempfile.mkdtemp(prefix="flashckpt-fsdp-bench-", dir=args.dir)
    world, backend = (1, "cpu:gloo,cuda:nccl") if args.device == "cuda" else (2, "gloo")
    try:
        if world > 1:
            run_ranks(save_sources, args.source_world, root, layers, timeout=3600)
            read_once(os.path.join(root, "flash-src"), os.path.join(root, "dcp-src"))
        result = run_ranks(measure, world, root, layers, args.repeats, args.device, only, timeout=3600,
                           backend=backend)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {name: statistics.median(v) for name, v in result["samples"].items()}
    pairs = [
        ("flashckpt save / floor save", "flashckpt save (blocking)", "floor save"),
        ("dcp async_save blocking / flashckpt save", "dcp async_save (blocking)", "flashckpt save (blocking)"),
        ("dcp save / flashckpt save", "dcp save", "flashckpt save (blocking)"),
        ("flashckpt load from memory / floor load", "flashckpt load from memory", "floor load"),
        ("dcp load / flashckpt load from memory", "dcp load", "flashckpt load from memory"),
        ("dcp load / flashckpt load from storage", "dcp load", "flashckpt load from storage"),
        (f"dcp resharded load / flashckpt resharded load ({args.source_world}->2)", "dcp resharded load",
         "flashckpt resharded load"),
    ]
    ratios = {name: med[a] / med[b] for name, a, b in pairs if a in med and b in med}
    total_bytes = sum(result["state_bytes_per_rank"])
    where = f"1 rank on {args.device}" if world == 1 else "2 gloo ranks on CPU"
    print(f"FSDP2, {where}, {layers} x Linear({HIDDEN}, {HIDDEN}) + AdamW: "
          f"{total_bytes / 2**20:.0f} MiB of state ({result['state_bytes_per_rank'][0] / 2**20:.0f} MiB a rank); "
          f"median of {args.repeats} repeats (steady saves: {STEADY_SAVES} a repeat), slowest rank")
    width = max(len(n) for n in med)
    for name, seconds in med.items():
        samples = ", ".join(f"{s:.3f}" for s in result["samples"][name])
        print(f"  {name:<{width}}  {seconds * 1000:9.1f} ms   [{samples}] s")
    print("ratios:")
    for name, value in ratios.items():
        print(f"  {name:<52} {value:6.2f}x")
    out = {"benchmark": "fsdp", "world_size": world, "device": args.device, "layers": layers, "hidden": HIDDEN,
           "state_bytes": total_bytes, "repeats": args.repeats, "median_seconds": med,
           "samples_seconds": result["samples"], "ratios": ratios, "torch": result["torch"],
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "loadavg_at_end": os.getloadavg()},
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
