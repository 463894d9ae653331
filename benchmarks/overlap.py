"""Overlapped saves: what a save every step costs the training loop, blocking against overlapped.

    python benchmarks/overlap.py [--ranks 2] [--rounds 5] [--steps 8] [--width 1024] [--layers 4]
                                 [--batch N] [--json results/overlap.json]

DDP on ``--ranks`` gloo ranks (one process each, one torch thread each: the copy threads
share the cores with compute, as issue 42 asks), an MLP of ``--layers`` square layers of
``--width`` under AdamW; the saved state is ``{"model": ..., "optim": ...}`` (12 bytes a
parameter). ``DdpCheckpointer``: local rank 0 holds the node's copy, so rank 0 copies and
rank 1 waits for it in the next all-reduce, as in a real job. Saves stay in memory
(``persist_every`` far away): the copy is what is measured, not the disk.

The batch is chosen (unless ``--batch``) so that a step's forward and backward take at least
3x the memcpy floor of the state on rank 0. Then, in ``--rounds`` rounds, each a rotation of
the three loops (``--steps`` steps each):
- none: no saves;
- blocking: ``save(step, state)`` after every optimizer step;
- overlap: ``save(step, state, overlap=True, optimizer=opt)`` after every step.
Reported (rank 0's clock; every rank runs the same loops; (b) and (c) are medians over rounds of
each round's difference or ratio against that round's loop without saves):
(a) the memcpy floor: one ``copy_`` of every tensor into a touched /dev/shm file;
(b) the loop's added time per save, (loop - none) / steps, over the floor (goal for overlap:
    <= 0.1x);
(c) steps/s with a save every step over steps/s without saves (goal for overlap: >= 90%).

Found on the 2-core development machine, shared with other jobs (load average 6-20 while it
ran, so single rounds vary 2x; 48 MiB state, 7 rounds x 8 steps):
- 2 ranks (two runs): blocking +0.04x / -0.01x the floor a save (99% / 100% of the steps/s),
  overlap +0.23x / +0.69x (96% / 91%).
  With ``DdpCheckpointer`` only rank 0 copies: during a blocking copy rank 1 waits in the
  all-reduce, which leaves its core to rank 0's copy threads, so the blocking save is already
  overlapped with idle time; the overlapped copy instead competes with both ranks' compute.
- 1 rank (``--ranks 1``, 9 rounds): blocking +0.23x (95%), overlap +0.71x (86%).
  The optimizer's wait for the copy is ~0.2 ms (the copy ends within forward+backward), and
  the overlapped save returns in ~1 ms when the machine is idle; what costs is the copy's CPU
  time taken from forward and backward on cores that have none to spare. The goals (<= 0.1x,
  >= 90%) want a core the training threads leave idle; not met here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO)]

from _state import ShmFloor, tensors  # noqa: E402

MODES = ("none", "blocking", "overlap")
FLOOR_COPIES = 5
COMPUTE_OVER_COPY = 3.0


def _model(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks)


def _floor(ts: list[torch.Tensor]) -> float:
    """Median seconds of one copy_ of ``ts`` into a touched /dev/shm file."""
    floor = ShmFloor(Path("/dev/shm") / f"overlap-floor-{uuid.uuid4().hex[:8]}", ts, create=True)
    try:
        samples = []
        for _ in range(FLOOR_COPIES):
            began = time.perf_counter()
            floor.save(ts)
            samples.append(time.perf_counter() - began)
        return statistics.median(samples)
    finally:
        floor.close(unlink=True)


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, directory: str, out: Any) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from flashckpt.torch import DdpCheckpointer

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _model(args.width, args.layers)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(batch: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        ddp(batch).square().mean().backward()
        opt.step()

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    step(torch.randn(8, args.width))  # the moments exist
    nbytes = sum(t.nbytes for t in tensors(state()))
    floor = _floor(tensors(state()))
    batch_size = args.batch
    if batch_size is None:  # forward + backward of a probe batch, scaled to 3x the floor (rank 0 decides)
        probe = torch.randn(64, args.width)
        began = time.perf_counter()
        for _ in range(3):
            ddp(probe).square().mean().backward()
        fwd_bwd = (time.perf_counter() - began) / 3
        batch_size = max(64, int(64 * COMPUTE_OVER_COPY * floor / fwd_bwd * 1.2))
    chosen = [batch_size]
    dist.broadcast_object_list(chosen, src=0)
    batch = torch.randn(chosen[0], args.width)
    began = time.perf_counter()
    for _ in range(3):
        ddp(batch).square().mean().backward()
    fwd_bwd = (time.perf_counter() - began) / 3
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    with DdpCheckpointer(directory, job_id=f"bench-overlap-{port}", persist_every=10**9) as ckpt:
        ckpt.prepare(state())
        n = 0
        for mode in MODES:  # warm-up: slots mapped, hooks registered, caches filled
            step(batch)
            n += 1
            if mode != "none":
                ckpt.save(n, state(), overlap=mode == "overlap", optimizer=opt)
        for r in range(args.rounds):
            for mode in MODES[r % 3:] + MODES[:r % 3]:
                dist.barrier()
                began = time.perf_counter()
                for _ in range(args.steps):
                    step(batch)
                    n += 1
                    if mode != "none":
                        ckpt.save(n, state(), overlap=mode == "overlap")
                ckpt.engine.finish_copy()  # the last overlapped copy is part of the loop's cost
                times[mode].append((time.perf_counter() - began) / args.steps)
    dist.destroy_process_group()
    if rank == 0:
        out.put({"bytes": nbytes, "floor": floor, "batch": chosen[0], "fwd_bwd": fwd_bwd, "times": times})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--json", default=str(REPO / "results" / "overlap.json"))
    args = p.parse_args()

    import torch.multiprocessing as mp

    sys.path.insert(0, str(REPO / "tests"))
    from _net import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-overlap-") as directory:
        procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args, directory, out)) for r in range(args.ranks)]
        for proc in procs:
            proc.start()
        result = out.get(timeout=1800)
        for proc in procs:
            proc.join(60)
    floor = result["floor"]
    times = result["times"]
    med = {mode: statistics.median(ts) for mode, ts in times.items()}
    # paired by round (the loops of one round ran back to back), so that drift of the machine's
    # load between rounds cancels
    added = {mode: statistics.median(t - n for t, n in zip(times[mode], times["none"])) for mode in ("blocking", "overlap")}
    rate = {mode: statistics.median(n / t for t, n in zip(times[mode], times["none"])) for mode in ("blocking", "overlap")}
    lines = [
        f"DDP, {args.ranks} gloo ranks, 1 torch thread each, {os.cpu_count()} CPUs; MLP {args.layers}x{args.width}, "
        f"AdamW; state {result['bytes'] / 2**20:.1f} MiB; batch {result['batch']}",
        f"(a) memcpy floor of the state (rank 0)  : {floor * 1e3:8.2f} ms",
        f"    forward+backward                     : {result['fwd_bwd'] * 1e3:8.2f} ms "
        f"= {result['fwd_bwd'] / floor:.1f}x the floor (asked: >= {COMPUTE_OVER_COPY:g}x)",
        f"    step, no saves                       : {med['none'] * 1e3:8.2f} ms",
    ]
    for mode in ("blocking", "overlap"):
        lines.append(f"(b) added loop time per save, {mode:8s} : {added[mode] * 1e3:8.2f} ms = "
                     f"{added[mode] / floor:6.3f}x the floor" + ("  (goal <= 0.1x)" if mode == "overlap" else ""))
    for mode in ("blocking", "overlap"):
        lines.append(f"(c) steps/s, a save every step, {mode:8s}: {rate[mode] * 100:6.1f}% of no saves"
                     + ("  (goal >= 90%)" if mode == "overlap" else ""))
    lines.append(f"{args.rounds} rounds x {args.steps} steps, loops interleaved; per-round step ms: "
                 + "; ".join(f"{m} " + " ".join(f"{t * 1e3:.1f}" for t in ts) for m, ts in result["times"].items()))
    for line in lines:
        print(line)
    report = {"args": vars(args), "machine": platform.platform(), "cpus": os.cpu_count(), **result,
              "median_step_seconds": med, "added_per_save_over_floor": {m: added[m] / floor for m in added},
              "steps_per_second_over_none": rate}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
