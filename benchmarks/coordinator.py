"""Coordinator speed: acquire+complete pairs per second and their latency, per backend and
number of worker processes, next to the floor of the same machine.

    python benchmarks/coordinator.py [--seconds 2] [--workers 1,8,32]

Floors: ``redis-benchmark`` PING round trips (C client, pipelining off) and the same
round trips from redis-py in as many Python processes; an empty ``BEGIN IMMEDIATE;
COMMIT`` on a WAL SQLite file. One acquire+complete pair is two round trips (two Lua
scripts) or two SQLite transactions, so ratios compare ``2 x pairs/s`` with the floor.
A simulation of 10,000 workers against the Redis backend measures the server's cost per
script and says whether the coordinator or the workers bound the job.
Prints a table and writes ``results/coordinator.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sharding  # noqa: E402

DEFINITION = dict(size=50_000_000, shard_size=1, lease_timeout=600.0)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _pairs(url: str, options: dict[str, Any], worker: str, start_at: float, seconds: float, out: Any) -> None:
    """One benchmark worker: acquire+complete pairs until the clock runs out."""
    ds = sharding.connect(url, **options).dataset("bench", **DEFINITION)
    latencies = []
    while time.time() < start_at:
        time.sleep(0.001)
    stop = start_at + seconds
    while (began := time.perf_counter()) and time.time() < stop:
        ds.complete(ds.acquire(worker))
        latencies.append(time.perf_counter() - began)
    out.put(latencies)


def _ping_floor(port: int, password: str, start_at: float, seconds: float, out: Any) -> None:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, password=password)
    client.ping()
    while time.time() < start_at:
        time.sleep(0.001)
    count, stop = 0, start_at + seconds
    while time.time() < stop:
        client.ping()
        count += 1
    out.put([0.0] * count)


def _sqlite_floor(path: str, start_at: float, seconds: float, out: Any) -> None:
    db = sqlite3.connect(path, timeout=30, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    while time.time() < start_at:
        time.sleep(0.001)
    count, stop = 0, start_at + seconds
    while time.time() < stop:
        db.execute("BEGIN IMMEDIATE")
        db.execute("COMMIT")
        count += 1
    out.put([0.0] * count)


def _fleet(target: Any, args: list[tuple[Any, ...]], seconds: float) -> dict[str, float]:
    """Run ``target(*a, start_at, seconds, queue)`` in one spawned process per ``a``."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + 1.5 + 0.1 * len(args)  # every process imported and connected
    procs = [ctx.Process(target=target, args=(*a, start_at, seconds, out)) for a in args]
    for p in procs:
        p.start()
    latencies = [x for _ in procs for x in out.get(timeout=120 + seconds)]
    for p in procs:
        p.join()
    return {
        "ops_per_s": len(latencies) / seconds,
        "p50_ms": _percentile(latencies, 0.50) * 1e3,
        "p99_ms": _percentile(latencies, 0.99) * 1e3,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _redis_benchmark(port: int, password: str, clients: int) -> float:
    out = subprocess.run(
        ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-a", password, "-t", "ping_mbulk",
         "-n", str(max(20_000, 5_000 * clients)), "-c", str(clients), "--csv"],
        capture_output=True, text=True, check=True,
    ).stdout
    line = [row for row in out.splitlines() if row.startswith('"PING_MBULK"')][0]
    return float(line.split(",")[1].strip('"'))


def _simulate(url: str, options: dict[str, Any], port: int, password: str, workers: int) -> dict[str, Any]:
    """10,000 workers each holding a lease: server microseconds per script, then capacity
    against the load such a job makes (a shard every ``shard_seconds`` per worker,
    heartbeats every ``lease_timeout / 3``)."""
    import redis

    admin = redis.Redis(host="127.0.0.1", port=port, password=password)
    ds = sharding.connect(url, **options).dataset("sim", size=10 * workers * 4, shard_size=10, lease_timeout=60.0)
    names = [f"node{i // 8}-rank{i % 8}" for i in range(workers)]
    admin.config_resetstat()
    began = time.perf_counter()
    held = [ds.acquire(n) for n in names]  # 10,000 leases out at once
    for n in names:
        ds.heartbeat(n)
    for shard in held:
        ds.complete(shard)
    client_seconds = time.perf_counter() - began
    stats = admin.info("commandstats")
    scripts = stats.get("cmdstat_evalsha", {})
    usec = float(scripts.get("usec_per_call", 0.0))
    calls = int(scripts.get("calls", 0))
    shard_seconds, heartbeat_seconds = 10.0, 20.0
    demand = workers * (2 / shard_seconds + 1 / heartbeat_seconds)  # scripts per second
    capacity = 1e6 / usec if usec else float("inf")  # one server thread
    return {
        "workers": workers,
        "scripts": calls,
        "server_usec_per_script": usec,
        "server_capacity_scripts_per_s": capacity,
        "assumed_shard_seconds": shard_seconds,
        "assumed_heartbeat_seconds": heartbeat_seconds,
        "demand_scripts_per_s": demand,
        "server_utilisation": demand / capacity,
        "bottleneck": "coordinator" if demand > capacity else "workers",
        "one_client_scripts_per_s": calls / client_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--workers", default="1,8,32")
    parser.add_argument("--simulated-workers", type=int, default=10_000)
    parser.add_argument("--out", default=str(ROOT / "results" / "coordinator.json"))
    args = parser.parse_args()
    counts = [int(n) for n in args.workers.split(",")]
    if shutil.which("redis-server") is None:
        sys.exit("redis-server is not installed (make redis-server)")
    tmp = Path(tempfile.mkdtemp(prefix="coordinator-bench-"))
    password, port = "bench-pw", _free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp), "--save", "",
         "--appendonly", "no", "--requirepass", password, "--logfile", str(tmp / "redis.log")]
    )
    rows: list[dict[str, Any]] = []
    try:
        for _ in range(200):
            if subprocess.run(["redis-cli", "-p", str(port), "-a", password, "--no-auth-warning", "ping"],
                              capture_output=True).returncode == 0:
                break
            time.sleep(0.05)
        redis_url = f"redis://:{password}@127.0.0.1:{port}/0"
        ds = sharding.connect("memory://bench").dataset("bench", **DEFINITION)
        latencies, stop = [], time.time() + args.seconds
        while (began := time.perf_counter()) and time.time() < stop:
            ds.complete(ds.acquire("w"))
            latencies.append(time.perf_counter() - began)
        rows.append({"backend": "memory", "workers": 1, "ops_per_s": len(latencies) / args.seconds,
                     "p50_ms": _percentile(latencies, 0.5) * 1e3, "p99_ms": _percentile(latencies, 0.99) * 1e3})
        for n in counts:
            db = tmp / f"bench-{n}.db"
            row = _fleet(_pairs, [(f"sqlite://{db}", {}, f"w{i}") for i in range(n)], args.seconds)
            floor = _fleet(_sqlite_floor, [(str(tmp / f"floor-{n}.db"),) for _ in range(n)], args.seconds)
            rows.append({"backend": "sqlite", "workers": n, **row, "floor": "empty BEGIN IMMEDIATE;COMMIT (python)",
                         "floor_per_s": floor["ops_per_s"], "ratio": 2 * row["ops_per_s"] / floor["ops_per_s"]})
        for n in counts:
            options = {"key_prefix": f"bench{n}:"}
            row = _fleet(_pairs, [(redis_url, options, f"w{i}") for i in range(n)], args.seconds)
            c_floor = _redis_benchmark(port, password, n)
            py_floor = _fleet(_ping_floor, [(port, password) for _ in range(n)], args.seconds)["ops_per_s"]
            rows.append({"backend": "redis", "workers": n, **row, "floor": "redis-benchmark PING (C)",
                         "floor_per_s": c_floor, "ratio": 2 * row["ops_per_s"] / c_floor,
                         "python_floor_per_s": py_floor, "python_ratio": 2 * row["ops_per_s"] / py_floor})
        simulation = _simulate(redis_url, {"key_prefix": "sim:"}, port, password, args.simulated_workers)
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\ncoordinator: acquire+complete pairs ({os.cpu_count()} cores, {platform.python_version()})")
    print(f"{'backend':8} {'procs':>5} {'pairs/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'floor/s':>9} {'2*pairs/floor':>13} {'vs py floor':>11}")
    for r in rows:
        print(f"{r['backend']:8} {r['workers']:>5} {r['ops_per_s']:>9.0f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
              f"{r.get('floor_per_s', float('nan')):>9.0f} {r.get('ratio', float('nan')):>13.2f} "
              f"{r.get('python_ratio', float('nan')):>11.2f}")
    s = simulation
    print(f"\nsimulation: {s['workers']} workers on redis: {s['server_usec_per_script']:.1f} us of server time per script "
          f"-> capacity {s['server_capacity_scripts_per_s']:.0f} scripts/s; a job with {s['assumed_shard_seconds']:.0f} s shards "
          f"and {s['assumed_heartbeat_seconds']:.0f} s heartbeats needs {s['demand_scripts_per_s']:.0f}/s "
          f"(utilisation {s['server_utilisation']:.0%}): bottleneck = {s['bottleneck']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "simulation": simulation, "seconds": args.seconds,
                               "cores": os.cpu_count(), "python": platform.python_version()}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
