"""Coordinator speed: operations per second and their latency, per backend, number of
worker processes and way of calling, next to the floor of the same machine.

    python benchmarks/coordinator.py [--seconds 2] [--workers 1,8,32] [--repeats 1]

Three ways of calling: ``pair`` = ``acquire`` then ``complete`` (two round trips / two
SQLite transactions per shard), ``combined`` = ``complete_and_acquire`` (one per shard),
``batch4`` = ``complete_and_acquire_many`` of 4 shards (one per 4 shards, as a reader
that leases ahead calls it; latencies are per call); all are two coordinator operations
(acquire, complete) per shard, and rates and CPU costs are per shard.
Floors: ``redis-benchmark`` PING round trips (C client, pipelining off, as many clients
as worker processes), the same PINGs from Python in as many processes (redis-py's
``Redis.ping()``, and a packed PING over one ``redis.connection.Connection``: the
transport the Redis store itself uses, so the best a Python client can do), each with
its p50/p99; an empty ``BEGIN IMMEDIATE; COMMIT`` on a WAL SQLite file. Ratios compare
operations per second (2 per shard) and round trips per second with each floor's calls
per second, and, robust to other load on a shared machine, the same from CPU cost: the
callers' CPU time plus the server's (from /proc) per call.
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
import resource
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sharding  # noqa: E402

DEFINITION = dict(size=50_000_000, shard_size=1, lease_timeout=600.0)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


#: round trips (or SQLite transactions) per shard
ROUND_TRIPS = {"pair": 2, "combined": 1, "batch4": 0.25}
#: shards one call of each mode moves on
SHARDS_PER_CALL = {"pair": 1, "combined": 1, "batch4": 4}
#: coordinator operations per shard (acquire and complete), however they are sent
OPERATIONS = 2


def _timed(step: Callable[[], Any], gate: "_Gate", seconds: float, out: Any) -> None:
    """Call ``step`` from the fleet's common start for ``seconds``; report each call's
    latency and this process's CPU time (user + system) over the window."""
    stop = gate.wait() + seconds
    latencies = []
    cpu = time.process_time()
    while (began := time.perf_counter()) and time.time() < stop:
        step()
        latencies.append(time.perf_counter() - began)
    out.put((latencies, time.process_time() - cpu))


def _ops(url: str, options: dict[str, Any], worker: str, mode: str, gate: "_Gate", seconds: float, out: Any) -> None:
    """One benchmark worker: shards until the clock runs out, one latency per shard."""
    ds = sharding.connect(url, **options).dataset("bench", **DEFINITION)
    if mode == "pair":
        _timed(lambda: ds.complete(ds.acquire(worker)), gate, seconds, out)
    elif mode == "batch4":
        batch = ds.complete_and_acquire_many([], worker, 4)[0]

        def many() -> None:
            nonlocal batch
            batch = ds.complete_and_acquire_many(batch, worker, 4)[0]

        _timed(many, gate, seconds, out)
    else:
        held = [ds.acquire(worker)]

        def step() -> None:
            held[0] = ds.complete_and_acquire(held[0])

        _timed(step, gate, seconds, out)


def _ping_floor(port: int, password: str, how: str, gate: "_Gate", seconds: float, out: Any) -> None:
    """PING round trips from Python: redis-py's client (``client``) or a packed command
    on one connection, as the Redis store sends its scripts (``packed``)."""
    import redis
    from redis.connection import Connection

    client = redis.Redis(host="127.0.0.1", port=port, password=password)
    connection = Connection(host="127.0.0.1", port=port, password=password)
    connection.connect()
    packed = [b"*1\r\n$4\r\nPING\r\n"]

    def ping() -> None:
        connection.send_packed_command(packed, check_health=False)
        connection.read_response()

    call = client.ping if how == "client" else ping
    call()
    _timed(call, gate, seconds, out)


def _sqlite_floor(path: str, gate: "_Gate", seconds: float, out: Any) -> None:
    db = sqlite3.connect(path, timeout=30, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")

    def empty() -> None:
        db.execute("BEGIN IMMEDIATE")
        db.execute("COMMIT")

    _timed(empty, gate, seconds, out)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Gate:
    """Starts every process of a fleet at one moment, once all have connected."""

    def __init__(self, ctx: Any) -> None:
        self.ready, self.go, self.at = ctx.Semaphore(0), ctx.Event(), ctx.Value("d", 0.0)

    def wait(self) -> float:
        """In a fleet process, once connected: block until the common start; return it."""
        self.ready.release()
        self.go.wait()
        while time.time() < self.at.value:
            time.sleep(0.0005)
        return float(self.at.value)

    def open(self, count: int) -> None:
        for _ in range(count):
            if not self.ready.acquire(timeout=120):
                raise RuntimeError("a benchmark process did not get ready")
        self.at.value = time.time() + 0.2
        self.go.set()


def _fleet(target: Any, args: list[tuple[Any, ...]], seconds: float, server: int | None = None) -> dict[str, float]:
    """Run ``target(*a, gate, seconds, queue)`` in one spawned process per ``a``; also
    the CPU the fleet and the ``server`` process (a pid) spent per call in the window."""
    ctx = mp.get_context("spawn")
    out, gate = ctx.Queue(), _Gate(ctx)
    procs = [ctx.Process(target=target, args=(*a, gate, seconds, out)) for a in args]
    for p in procs:
        p.start()
    gate.open(len(procs))
    server_cpu = 0.0
    if server is not None:
        time.sleep(max(0.0, gate.at.value - time.time()))
        server_cpu = -_cpu_seconds(server)
        time.sleep(max(0.0, gate.at.value + seconds - time.time()))
        server_cpu += _cpu_seconds(server)
    results = [out.get(timeout=120 + seconds) for _ in procs]
    for p in procs:
        p.join()
    latencies = [x for lat, _ in results for x in lat]
    calls = max(1, len(latencies))
    return {
        "ops_per_s": len(latencies) / seconds,
        "p50_ms": _percentile(latencies, 0.50) * 1e3,
        "p99_ms": _percentile(latencies, 0.99) * 1e3,
        "client_cpu_us": sum(cpu for _, cpu in results) / calls * 1e6,
        "server_cpu_us": server_cpu / calls * 1e6,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _redis_benchmark(port: int, password: str, clients: int, server: int) -> dict[str, float]:
    """The C client's PING_MBULK rate, latency and CPU per call with ``clients`` connections."""
    requests = max(50_000, 5_000 * clients)
    client_cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    server_cpu = _cpu_seconds(server)
    out = subprocess.run(
        ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-a", password, "-t", "ping_mbulk",
         "-n", str(requests), "-c", str(clients), "--csv"],
        capture_output=True, text=True, check=True,
    ).stdout
    server_cpu = _cpu_seconds(server) - server_cpu
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = [row.replace('"', "").split(",") for row in out.splitlines()]
    header, values = lines[0], [row for row in lines if row[0] == "PING_MBULK"][0]
    named = dict(zip(header, values))
    return {"ops_per_s": float(named["rps"]), "p50_ms": float(named["p50_latency_ms"]),
            "p99_ms": float(named["p99_latency_ms"]),
            "client_cpu_us": (after.ru_utime + after.ru_stime - client_cpu.ru_utime - client_cpu.ru_stime) / requests * 1e6,
            "server_cpu_us": server_cpu / requests * 1e6}


def _simulate(url: str, options: dict[str, Any], port: int, password: str, workers: int) -> dict[str, Any]:
    """10,000 workers each holding a lease: server microseconds per script (acquire,
    heartbeat, complete_and_acquire, complete), then capacity against the load such a job
    makes (one complete_and_acquire per shard every ``shard_seconds`` per worker,
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
    held = [ds.complete_and_acquire(shard) for shard in held]  # how a worker moves on
    for shard in held:
        ds.complete(shard)
    client_seconds = time.perf_counter() - began
    stats = admin.info("commandstats")
    scripts = stats.get("cmdstat_evalsha", {})
    usec = float(scripts.get("usec_per_call", 0.0))
    calls = int(scripts.get("calls", 0))
    shard_seconds, heartbeat_seconds = 10.0, 20.0
    demand = workers * (1 / shard_seconds + 1 / heartbeat_seconds)  # scripts per second (combined calls)
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


def _cpu(entry: dict[str, float]) -> float:
    """Machine CPU microseconds per call: the callers' plus the server's."""
    return entry["client_cpu_us"] + entry["server_cpu_us"]


def _ratios(row: dict[str, Any], floors: dict[str, dict[str, float]]) -> dict[str, float]:
    """``row`` against each floor. ``vs_*``: acquire and complete operations per second
    (2 per shard in both modes; the issue's measure) over the floor's round trips per
    second; ``rt_vs_*``: round trips over round trips; ``cpu_vs_*``: ``vs_*`` from CPU
    cost alone (what a machine where CPU is the only limit, e.g. a quiet one, would show;
    robust to other load on a shared machine)."""
    out = {}
    for name, floor in floors.items():
        out[f"vs_{name}"] = OPERATIONS * row["ops_per_s"] / floor["ops_per_s"]
        out[f"rt_vs_{name}"] = ROUND_TRIPS[row["mode"]] * row["ops_per_s"] / floor["ops_per_s"]
        out[f"cpu_vs_{name}"] = OPERATIONS * _cpu(floor) / _cpu(row)
    return out


def _per_shard(stats: dict[str, float], mode: str) -> dict[str, float]:
    """A fleet's per-call figures as per-shard rates and costs (latencies stay per call)."""
    k = SHARDS_PER_CALL[mode]
    return {**stats, "ops_per_s": stats["ops_per_s"] * k, "client_cpu_us": stats["client_cpu_us"] / k,
            "server_cpu_us": stats["server_cpu_us"] / k}


def _measure_sqlite(tmp: Path, n: int, seconds: float, run: int) -> list[dict[str, Any]]:
    floor = _fleet(_sqlite_floor, [(str(tmp / f"floor-{n}-{run}.db"),) for _ in range(n)], seconds)
    floors = {"sqlite_empty_txn": floor}
    rows = []
    for mode in ROUND_TRIPS:
        url = f"sqlite://{tmp / f'bench-{n}-{mode}-{run}.db'}"
        row = {"backend": "sqlite", "mode": mode, "workers": n, "run": run,
               **_per_shard(_fleet(_ops, [(url, {}, f"w{i}", mode) for i in range(n)], seconds), mode)}
        rows.append({**row, **_ratios(row, floors), "floors": floors})
    return rows


def _measure_redis(url: str, port: int, password: str, server: int, n: int, seconds: float, run: int) -> list[dict[str, Any]]:
    floors = {
        "c": _redis_benchmark(port, password, n, server),
        "py_packed": _fleet(_ping_floor, [(port, password, "packed") for _ in range(n)], seconds, server),
        "py_client": _fleet(_ping_floor, [(port, password, "client") for _ in range(n)], seconds, server),
    }
    rows = []
    for mode in ROUND_TRIPS:
        options = {"key_prefix": f"bench{n}-{mode}-{run}:"}
        row = {"backend": "redis", "mode": mode, "workers": n, "run": run,
               **_per_shard(_fleet(_ops, [(url, options, f"w{i}", mode) for i in range(n)], seconds, server), mode)}
        rows.append({**row, **_ratios(row, floors), "floors": floors})
    return rows


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _verdicts(rows: list[dict[str, Any]], workers: int) -> dict[str, Any]:
    """The issue's goals at ``workers`` processes, on medians over runs."""
    out: dict[str, Any] = {}
    for mode in ROUND_TRIPS:
        mine = [r for r in rows if r["backend"] == "redis" and r["mode"] == mode and r["workers"] == workers]
        if not mine:
            continue
        floors = [r["floors"] for r in mine]
        out[f"redis_{mode}"] = {
            "workers": workers,
            "ops_per_s": _median([r["ops_per_s"] for r in mine]),
            "operations_vs_c_floor": _median([r["vs_c"] for r in mine]),
            "round_trips_vs_c_floor": _median([r["rt_vs_c"] for r in mine]),
            "operations_vs_python_floor": _median([r["vs_py_packed"] for r in mine]),
            "p99_ms": _median([r["p99_ms"] for r in mine]),
            "python_floor_vs_c_floor": _median([f["py_packed"]["ops_per_s"] / f["c"]["ops_per_s"] for f in floors]),
            "python_floor_p99_ms": _median([f["py_packed"]["p99_ms"] for f in floors]),
            "redis_py_floor_p99_ms": _median([f["py_client"]["p99_ms"] for f in floors]),
            "c_floor_p99_ms": _median([f["c"]["p99_ms"] for f in floors]),
            "cpu_us_per_op": _median([_cpu(r) for r in mine]),
            "client_cpu_us_per_op": _median([r["client_cpu_us"] for r in mine]),
            "server_cpu_us_per_op": _median([r["server_cpu_us"] for r in mine]),
            "c_floor_cpu_us": _median([_cpu(f["c"]) for f in floors]),
            "python_floor_cpu_us": _median([_cpu(f["py_packed"]) for f in floors]),
            "cpu_bound_vs_c_floor": _median([r["cpu_vs_c"] for r in mine]),
            "python_floor_cpu_bound_vs_c_floor": _median([_cpu(f["c"]) / _cpu(f["py_packed"]) for f in floors]),
        }
        v = out[f"redis_{mode}"]
        # both ways: a C floor starved by other load flatters the rate ratio
        v["goal_half_of_c_floor"] = min(v["operations_vs_c_floor"], v["cpu_bound_vs_c_floor"]) >= 0.5
        v["goal_p99_under_5ms"] = v["p99_ms"] < 5.0
    sqlite = [r for r in rows if r["backend"] == "sqlite" and r["mode"] == "pair" and r["workers"] == 8]
    if sqlite:
        out["sqlite_pair_8"] = {"ops_per_s": _median([r["ops_per_s"] for r in sqlite])}
        out["sqlite_pair_8"]["goal_2000_per_s"] = out["sqlite_pair_8"]["ops_per_s"] >= 2000
    return out


def _print(rows: list[dict[str, Any]], verdicts: dict[str, Any], simulation: dict[str, Any] | None) -> None:
    print(f"\ncoordinator ({os.cpu_count()} cores, Python {platform.python_version()}); pair = acquire+complete "
          "(2 round trips), combined = complete_and_acquire (1), batch4 = complete_and_acquire_many of 4 shards (1 per 4); "
          "ops/s = shards/s; p50/p99 per call; cpu = machine CPU us per shard (callers + server); op/floor = 2 operations per shard x shards/s / floor calls/s; cpu-bound = the same "
          "from CPU cost alone")
    print(f"{'backend':7} {'mode':9} {'procs':>5} {'run':>3} {'ops/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'cpu':>6} | "
          f"{'floor':16} {'floor/s':>8} {'fl p50':>7} {'fl p99':>7} {'fl cpu':>6} {'op/floor':>8} {'cpu-bound':>9}")
    for r in rows:
        first = True
        lead = (f"{r['backend']:7} {r['mode']:9} {r['workers']:>5} {r['run']:>3} {r['ops_per_s']:>8.0f} "
                f"{r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f} {_cpu(r) if 'client_cpu_us' in r else float('nan'):>6.1f}")
        for name, floor in r.get("floors", {}).items():
            print(f"{lead if first else ' ' * len(lead)} | {name:16} {floor['ops_per_s']:>8.0f} "
                  f"{floor['p50_ms']:>7.2f} {floor['p99_ms']:>7.2f} {_cpu(floor):>6.1f} {r[f'vs_{name}']:>8.2f} "
                  f"{r[f'cpu_vs_{name}']:>9.2f}")
            first = False
        if first:
            print(f"{lead} |")
    print("\ngoals (medians over runs):")
    for name, v in verdicts.items():
        if name.startswith("redis_"):
            print(f"  {name} at {v['workers']} procs: {v['ops_per_s']:.0f} shards/s; acquire+complete operations = "
                  f"{v['operations_vs_c_floor']:.0%} of the C round-trip rate, {v['cpu_bound_vs_c_floor']:.0%} from CPU cost "
                  f"(goal 50%: {'met' if v['goal_half_of_c_floor'] else 'MISSED'}; counted in round trips "
                  f"{v['round_trips_vs_c_floor']:.0%}); {v['operations_vs_python_floor']:.0%} of the Python-client floor, "
                  f"which itself is {v['python_floor_vs_c_floor']:.0%} of the C rate")
            print(f"    p99 {v['p99_ms']:.2f} ms (goal <5 ms: {'met' if v['goal_p99_under_5ms'] else 'MISSED'}); PING p99 "
                  f"from as many processes: bare Python {v['python_floor_p99_ms']:.2f} ms, redis-py "
                  f"{v['redis_py_floor_p99_ms']:.2f} ms; C (one process) {v['c_floor_p99_ms']:.2f} ms")
            print(f"    CPU per shard {v['cpu_us_per_op']:.1f} us (callers {v['client_cpu_us_per_op']:.1f} + server "
                  f"{v['server_cpu_us_per_op']:.1f}); per PING round trip: C {v['c_floor_cpu_us']:.1f} us, Python "
                  f"{v['python_floor_cpu_us']:.1f} us. Where CPU is the only limit: operations = "
                  f"{v['cpu_bound_vs_c_floor']:.0%} of the C rate; Python PINGs alone "
                  f"{v['python_floor_cpu_bound_vs_c_floor']:.0%}")
        else:
            print(f"  {name}: {v['ops_per_s']:.0f} pairs/s (goal 2,000: {'met' if v['goal_2000_per_s'] else 'MISSED'})")
    if simulation:
        s = simulation
        print(f"\nsimulation: {s['workers']} workers on redis: {s['server_usec_per_script']:.1f} us of server time per "
              f"script -> capacity {s['server_capacity_scripts_per_s']:.0f} scripts/s; a job with "
              f"{s['assumed_shard_seconds']:.0f} s shards and {s['assumed_heartbeat_seconds']:.0f} s heartbeats needs "
              f"{s['demand_scripts_per_s']:.0f}/s (utilisation {s['server_utilisation']:.0%}): bottleneck = {s['bottleneck']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--workers", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every measurement, interleaved")
    parser.add_argument("--backends", default="memory,sqlite,redis")
    parser.add_argument("--simulated-workers", type=int, default=10_000, help="0: no simulation")
    parser.add_argument("--out", default=str(ROOT / "results" / "coordinator.json"))
    args = parser.parse_args()
    counts = [int(n) for n in args.workers.split(",")]
    backends = set(args.backends.split(","))
    if shutil.which("redis-server") is None:
        sys.exit("redis-server is not installed (make redis-server)")
    import redis.utils

    tmp = Path(tempfile.mkdtemp(prefix="coordinator-bench-"))
    password, port = "bench-pw", _free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp), "--save", "",
         "--appendonly", "no", "--requirepass", password, "--logfile", str(tmp / "redis.log")]
    )
    rows: list[dict[str, Any]] = []
    simulation = None
    load_before = os.getloadavg()
    try:
        for _ in range(200):
            if subprocess.run(["redis-cli", "-p", str(port), "-a", password, "--no-auth-warning", "ping"],
                              capture_output=True).returncode == 0:
                break
            time.sleep(0.05)
        redis_url = f"redis://:{password}@127.0.0.1:{port}/0"
        if "memory" in backends:
            ds = sharding.connect("memory://bench").dataset("bench", **DEFINITION)
            latencies, stop = [], time.time() + args.seconds
            while (began := time.perf_counter()) and time.time() < stop:
                ds.complete(ds.acquire("w"))
                latencies.append(time.perf_counter() - began)
            rows.append({"backend": "memory", "mode": "pair", "workers": 1, "run": 0,
                         "ops_per_s": len(latencies) / args.seconds,
                         "p50_ms": _percentile(latencies, 0.5) * 1e3, "p99_ms": _percentile(latencies, 0.99) * 1e3})
        for run in range(args.repeats):
            for n in counts:
                if "sqlite" in backends:
                    rows += _measure_sqlite(tmp, n, args.seconds, run)
                if "redis" in backends:
                    rows += _measure_redis(redis_url, port, password, server.pid, n, args.seconds, run)
        if "redis" in backends and args.simulated_workers:
            simulation = _simulate(redis_url, {"key_prefix": "sim:"}, port, password, args.simulated_workers)
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(tmp, ignore_errors=True)

    verdicts = _verdicts(rows, max(counts))
    _print(rows, verdicts, simulation)
    load = {"before": load_before, "after": os.getloadavg()}
    print(f"load average before {load_before[0]:.2f}, after {load['after'][0]:.2f}; hiredis: {redis.utils.HIREDIS_AVAILABLE}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "goals": verdicts, "simulation": simulation, "seconds": args.seconds,
                               "repeats": args.repeats, "load_average": load, "hiredis": redis.utils.HIREDIS_AVAILABLE,
                               "cores": os.cpu_count(), "python": platform.python_version()}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
