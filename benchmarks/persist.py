"""Persist throughput of the saver with 1, 2 and 4 local ranks, side by side with dd.

    python benchmarks/persist.py [--ranks 1,2,4] [--mib 256] [--saves 3] [--repeats 3]
                                 [--dir DIR] [--json results/persist.json]

N trainer processes of one job (hand-made placements: local rank i writes storage rank i
of N, so every step commits once all N shards are durable) each save a state of
``--mib`` MiB with a persist on every save. A timed step starts when every process has
passed a barrier; each process times ``save`` and then ``wait`` (its shard on storage);
the step's time is the slowest rank's (the last shard makes the commit). Throughput is
N * MiB over the median step time. First, untimed, a save without persist allocates a
slot; then ``persist`` + ``wait`` of that step, timed: the saver's first persist (its
start-up is paid in the constructor, before), shown next to a later persist (a timed
step's time after its save returned) to see whether the first pays anything more.

Modes, each with a job of its own (so a saver of its own):
- ``parallel``: ``FLASHCKPT_PERSIST_THREADS=4``, up to 4 ranks at once (the default is
  one thread per 4 cores, 1 to 4: see ``flashckpt.saver._settings.persist_threads``);
- ``serial``: ``FLASHCKPT_PERSIST_THREADS=1``, one slot at a time, as before;
- ``dd``: N ``dd if=/dev/zero bs=16M oflag=direct`` processes started together, each
  writing one rank's bytes into the same directory: the disk's floor for N writers.

Every repeat runs each N, and within it the modes in an order rotated per repeat; the
table shows medians over repeats with the load average (the machine may be shared), then
the medians of the per-repeat ratios (each repeat's modes ran back to back).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
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
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO)]

DD_BLOCK = 16 << 20
MODES = ("parallel", "serial", "dd")
THREADS = {"parallel": "4", "serial": "1"}


def _trainer(rank: int, world: int, directory: str, job_id: str, token: str, mib: int, saves: int, threads: str,
             barrier: Any, results: Any) -> None:
    """One local rank: an engine, one untimed save, then ``saves`` timed ones."""
    os.environ["FLASHCKPT_PERSIST_THREADS"] = threads
    import torch

    from flashckpt._engine import Engine, Options, Placement
    from flashckpt.torch import _tensors  # noqa: F401  (registers torch tensors as leaves)

    state = {"w": torch.ones(mib << 18)}  # fp32: 4 bytes an element
    placement = Placement(local_rank=rank, memory_rank=rank, writes_memory=True, storage_rank=rank,
                          storage_world=world, persists=True, token=token)
    engine = Engine(directory, Options(persist_every=1, keep_last=2, job_id=job_id), placement)
    engine.save(0, state, persist=False)  # allocates the slot
    barrier.wait()
    start = time.perf_counter()
    engine.persist(0)  # the first persist of this saver, nothing else running
    engine.wait()
    first = time.perf_counter() - start
    timings = []
    for step in range(1, saves + 1):
        barrier.wait()
        start = time.perf_counter()
        handle = engine.save(step, state)
        stall = time.perf_counter() - start
        handle.wait()
        timings.append((stall, time.perf_counter() - start))
    engine.close()
    results.put((rank, first, timings))


def run_flashckpt(world: int, directory: Path, mib: int, saves: int, mode: str) -> dict[str, Any]:
    """Step times of N trainers (see the module docstring)."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(world), ctx.Queue()
    job_id = "bp" + uuid.uuid4().hex[:10]
    token = f"{time.time_ns():016x}{uuid.uuid4().hex[:8]}"
    directory.mkdir(parents=True, exist_ok=True)
    procs = [ctx.Process(target=_trainer, args=(rank, world, str(directory), job_id, token, mib, saves,
                                                THREADS[mode], barrier, results)) for rank in range(world)]
    for proc in procs:
        proc.start()
    got, firsts = {}, []
    for _ in procs:
        rank, first, timings = results.get(timeout=900)
        got[rank] = timings
        firsts.append(first)
    for proc in procs:
        proc.join(60)
        if proc.exitcode != 0:
            raise RuntimeError(f"a {mode} trainer exited {proc.exitcode}")
    steps = [max(got[rank][i][1] for rank in got) for i in range(saves)]
    stalls = [max(got[rank][i][0] for rank in got) for i in range(saves)]
    shutil.rmtree(directory, ignore_errors=True)
    return {"first_persist": max(firsts), "steps": steps, "stalls": stalls}


def run_dd(world: int, directory: Path, mib: int) -> float:
    """Seconds for ``world`` parallel dd writers of ``mib`` MiB each (O_DIRECT)."""
    directory.mkdir(parents=True, exist_ok=True)
    count = max(1, (mib << 20) // DD_BLOCK)
    start = time.perf_counter()
    procs = [subprocess.Popen(["dd", "if=/dev/zero", f"of={directory / f'dd-{i}'}", f"bs={DD_BLOCK}",
                               f"count={count}", "oflag=direct"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for i in range(world)]
    for proc in procs:
        _, err = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"dd failed: {err.decode().strip()}")
    seconds = time.perf_counter() - start
    shutil.rmtree(directory, ignore_errors=True)
    return seconds


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    samples: dict[str, dict[str, list[float]]] = {}
    load_average: list[float] = []
    for repeat in range(args.repeats):
        load_average.append(os.getloadavg()[0])
        print(f"repeat {repeat + 1}/{args.repeats} (load average {load_average[-1]:.2f})", flush=True)
        for world in args.ranks:
            order = MODES[repeat % len(MODES):] + MODES[:repeat % len(MODES)]
            for mode in order:
                where = root / f"{mode}-{world}-{repeat}"
                got = samples.setdefault(f"{world}", {})
                if mode == "dd":
                    got.setdefault("dd", []).append(run_dd(world, where, args.mib))
                else:
                    result = run_flashckpt(world, where, args.mib, args.saves, mode)
                    got.setdefault(mode, []).append(statistics.median(result["steps"]))
                    got.setdefault(f"{mode}.stall", []).append(statistics.median(result["stalls"]))
                    got.setdefault(f"{mode}.first_persist", []).append(result["first_persist"])
                print(f"  {world} rank(s) {mode}: {got[mode][-1]:.3f}s", flush=True)
    table = {}
    for world in args.ranks:
        got = samples[f"{world}"]
        mib = world * args.mib
        med = {key: statistics.median(values) for key, values in got.items()}
        table[f"{world}"] = {
            "mib": mib,
            "seconds": med,
            "mib_per_s": {mode: mib / med[mode] for mode in MODES},
            "ratios": {"parallel_vs_dd": med["dd"] / med["parallel"], "serial_vs_dd": med["dd"] / med["serial"],
                       "parallel_vs_serial": med["serial"] / med["parallel"]},
            "paired_ratios": {"parallel_vs_dd": _paired(got["dd"], got["parallel"]),
                              "serial_vs_dd": _paired(got["dd"], got["serial"]),
                              "parallel_vs_serial": _paired(got["serial"], got["parallel"])},
            "first_persist_s": {mode: med[f"{mode}.first_persist"] for mode in THREADS},
            "steady_persist_s": {mode: med[mode] - med[f"{mode}.stall"] for mode in THREADS},
        }
    return {"samples": samples, "table": table, "load_average": load_average}


def _paired(numerators: list[float], denominators: list[float]) -> float:
    """The median of the per-repeat ratios: modes of one repeat ran back to back, so
    their ratio sheds most of the drift of a shared machine's load between repeats."""
    return statistics.median(n / d for n, d in zip(numerators, denominators))


def print_table(result: dict[str, Any], mib: int) -> None:
    print(f"\npersist throughput, {mib} MiB a rank, medians (MiB/s; ratio = throughput / dd's)")
    print(f"{'ranks':>5} {'dd direct':>10} {'parallel':>10} {'serial':>10} {'par/dd':>7} {'ser/dd':>7} "
          f"{'par/ser':>8} {'1st persist':>12} {'later':>7}")
    for world, row in result["table"].items():
        rate, ratio = row["mib_per_s"], row["ratios"]
        print(f"{world:>5} {rate['dd']:>10.0f} {rate['parallel']:>10.0f} {rate['serial']:>10.0f} "
              f"{ratio['parallel_vs_dd']:>7.2f} {ratio['serial_vs_dd']:>7.2f} {ratio['parallel_vs_serial']:>8.2f} "
              f"{row['first_persist_s']['parallel']:>11.3f}s {row['steady_persist_s']['parallel']:>6.3f}s")
    print("the same ratios per repeat (modes run back to back), median over repeats:")
    for world, row in result["table"].items():
        paired = row["paired_ratios"]
        print(f"{world:>5} ranks: par/dd {paired['parallel_vs_dd']:.2f}  ser/dd {paired['serial_vs_dd']:.2f}  "
              f"par/ser {paired['parallel_vs_serial']:.2f}")
    print(f"load average per repeat: {', '.join(f'{x:.2f}' for x in result['load_average'])}")


def machine() -> dict[str, Any]:
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    return {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "platform": platform.platform(),
            "python": platform.python_version(), "cpus": os.cpu_count(), "commit": commit.stdout.strip()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2,4", help="local rank counts, comma-separated")
    parser.add_argument("--mib", type=int, default=256, help="state size of each rank")
    parser.add_argument("--saves", type=int, default=3, help="timed saves per run (after one untimed)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/tmp", help="storage directory (a temp folder is made inside)")
    parser.add_argument("--json", default=str(REPO / "results" / "persist.json"))
    args = parser.parse_args(argv)
    args.ranks = [int(x) for x in args.ranks.split(",")]
    if min(args.ranks) < 1 or args.mib < 16 or args.saves < 1 or args.repeats < 1:
        parser.error("ranks >= 1, --mib >= 16, --saves >= 1, --repeats >= 1")
    return args


def main() -> None:
    args = parse_args()
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="flashckpt-persist-", dir=args.dir))
    try:
        result = run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_table(result, args.mib)
    out.write_text(json.dumps({"machine": machine(), "args": {k: v for k, v in vars(args).items() if k != "json"},
                               **result}, indent=2) + "\n")
    print("timings may be disturbed by other work on this machine: see load_average in the JSON")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
