"""Goodput under failures: the same small job under torchrun, kill -9 at a fixed rate.

    python benchmarks/goodput.py [--steps 400] [--mtbf 15] [--state-mb 16]
                                 [--json results/goodput.json]

The job: 2 processes (gloo), a fixed step time (``--step-seconds`` of sleep, default
50 ms, plus a tiny model's forward/backward and a gradient all-reduce), and a
per-rank training state of ``--state-mb`` (the tiny model plus a payload tensor
standing for the rest of a model's and optimizer's state; every step changes it). A
driver (this script) launches ``torchrun --max-restarts`` on ``_goodput_job.py`` and
kills a random rank with SIGKILL every ``--mtbf`` seconds of wall time (seeded; the
next kill waits until the job has recovered from the previous one, and none comes in
the job's last step). Side by side, run one after the other:

- ``none``: no checkpoint at all. It cannot finish under failures (every restart
  begins at step 1), so it only gives the floor: the restart time of the job.
- ``flashckpt``: ``flashckpt.torch.Checkpointer`` -- every step into shared memory,
  storage every ``--persist-every`` steps -- and ``elastic.start_agent``; a restart
  loads from memory.
- ``torch.save``: every rank ``torch.save`` + fsync + rename of its state every K
  steps, a barrier, then rank 0 commits ``latest``; K by Young's formula.
- ``dcp.async_save``: ``torch.distributed.checkpoint.async_save`` on a side gloo group
  every K steps (waiting for the previous one first); K by Young's formula.

Young's formula: the checkpoint interval is sqrt(2 * C * MTBF), C the blocking cost of
one save, measured by each job before it trains (3 saves, median, slowest rank).

Measured from the ranks' step records (wall clock, one machine):
- ideal step time: the median step interval of the ``none`` job before its first failure;
- goodput = steps x ideal step time / wall time from the first step to the last;
- lost time per failure = time from the last step completed before the kill to the next
  step that was never completed before, minus one ideal step: restart, restore and the
  re-done steps (rollback). For ``none`` the "next new step" is the restarted job's first
  step: that is the floor, the restart time alone. Its parts are printed too, and "own",
  the part a method adds to a bare restart: its own setup (imports, checkpointer, side
  group), the restore and the re-done steps. The rest (torchrun's relaunch, imports of
  torch, building the model) is the same for every method but varies by a second or
  more between restarts on a small shared machine, so "own" compares methods best.
The final states of the three checkpointing jobs must be equal (same data, same steps).

The table shows means; the JSON keeps every failure (``--reprint JSON`` prints it again).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
METHODS = ("none", "flashckpt", "torch.save", "dcp.async_save")
JOB = HERE / "_goodput_job.py"
RUN_LIMIT_SECONDS = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Records:
    """The ranks' JSON lines, read incrementally while the job runs."""

    def __init__(self, out: Path, world: int) -> None:
        self.paths = [out / f"rank{r}.jsonl" for r in range(world)]
        self.offsets = [0] * world
        self.by_rank: list[list[dict]] = [[] for _ in range(world)]

    def poll(self) -> None:
        for r, path in enumerate(self.paths):
            if not path.exists():
                continue
            with open(path) as f:
                f.seek(self.offsets[r])
                chunk = f.read()
            end = chunk.rfind("\n") + 1  # a line being written is read next time
            self.offsets[r] += len(chunk[:end].encode())
            self.by_rank[r] += [json.loads(line) for line in chunk[:end].splitlines() if line]

    def pid(self, rank: int, attempt: int) -> int | None:
        for rec in reversed(self.by_rank[rank]):
            if rec["a"] == attempt and rec["kind"] == "started":
                return rec["pid"]
        return None

    def steps(self) -> dict[tuple[int, int], float]:
        """(attempt, step) -> when the slowest rank finished it."""
        done: dict[tuple[int, int], float] = {}
        for recs in self.by_rank:
            for rec in recs:
                if rec["kind"] == "step":
                    key = (rec["a"], rec["s"])
                    done[key] = max(done.get(key, 0.0), rec["t"])
        return done

    def of(self, kind: str) -> list[dict]:
        return [r for recs in self.by_rank for r in recs if r["kind"] == kind]


def run_job(method: str, args: argparse.Namespace, work: Path, seed: int) -> dict[str, Any]:
    out = work / method
    out.mkdir(parents=True)
    ckpt = work / f"{method}-ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--max-restarts={args.max_failures + 2}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{_free_port()}", "--monitor-interval=0.1",
           str(JOB), "--method", method, "--out", str(out),
           "--ckpt", str(ckpt), "--steps", str(10**6 if method == "none" else args.steps),
           "--step-seconds", str(args.step_seconds),
           "--state-mb", str(args.state_mb), "--persist-every", str(args.persist_every),
           "--mtbf", str(args.mtbf)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    rng = random.Random(seed)
    recs = Records(out, 2)
    kills: list[dict[str, Any]] = []
    floor_failures = args.floor_failures
    with open(out / "torchrun.log", "wb") as logf:
        proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO,
                                start_new_session=True)
        began = time.monotonic()
        next_kill = None
        try:
            while proc.poll() is None:
                time.sleep(0.02)
                recs.poll()
                if time.monotonic() - began > RUN_LIMIT_SECONDS:
                    raise RuntimeError(f"{method}: the job ran past {RUN_LIMIT_SECONDS}s; see {out}/torchrun.log")
                steps = recs.steps()
                attempt = max((r["a"] for r in recs.of("started")), default=0)
                mine = sorted(s for a, s in steps if a == attempt)
                recovered = bool(mine) and (not kills or attempt > kills[-1]["attempt"] and (
                    method == "none" or mine[-1] > kills[-1]["last_step"]))
                if not recovered:
                    continue
                if next_kill is None:
                    next_kill = time.time() + args.mtbf
                done = method == "none" and len(kills) >= floor_failures
                if done and len(mine) >= 20:
                    (out / "stop").touch()
                if done or len(kills) >= args.max_failures or time.time() < next_kill:
                    continue
                if method != "none" and mine[-1] >= args.steps - 1:
                    continue  # the job is finishing: a kill now would only add a restart
                rank = rng.randrange(2)
                pid = recs.pid(rank, attempt)
                if pid is None:
                    continue
                t = time.time()
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                kills.append({"time": t, "rank": rank, "pid": pid, "attempt": attempt,
                              "last_step": mine[-1]})
                next_kill = t + args.mtbf
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    recs.poll()
    if proc.returncode != 0:
        raise RuntimeError(f"{method}: torchrun exited {proc.returncode}; see {out}/torchrun.log")
    return {"method": method, "kills": kills, "records": recs}


def analyse(job: dict[str, Any], ideal: float | None) -> dict[str, Any]:
    recs: Records = job["records"]
    steps = recs.steps()
    ready: dict[int, float] = {}
    started: dict[int, float] = {}
    for r in recs.of("ready"):
        ready[r["a"]] = max(ready.get(r["a"], 0.0), r["t"])
    for r in recs.of("started"):
        started[r["a"]] = max(started.get(r["a"], 0.0), r["t"])
    loads = {}
    for r in recs.of("ready"):
        loads.setdefault(r["a"], r)
    first_kill = job["kills"][0]["time"] if job["kills"] else math.inf
    intervals = [steps[(0, s + 1)] - t for (a, s), t in steps.items()
                 if a == 0 and (0, s + 1) in steps and steps[(0, s + 1)] < first_kill]
    failures = []
    for kill in job["kills"]:
        a = kill["attempt"]
        # what any rank had finished when the kill came (a rank may have finished a step
        # its killed peer had not): the next step never finished before is the target
        before = [(r["t"], r["s"]) for r in recs.of("step") if r["a"] == a and r["t"] <= kill["time"]]
        t_last, last = max(before)
        nxt = loads.get(a + 1)
        target = 1 if job["method"] == "none" else last + 1
        later = [t for (x, s), t in steps.items() if x > a and s == target]
        lost = (min(later) - t_last - (ideal or 0.0)) if later else None
        failures.append({
            "rank": kill["rank"], "at_step": last,
            "lost_seconds": lost,
            "restart_seconds": (ready[a + 1] - kill["time"]) if a + 1 in ready else None,
            # torchrun notices, stops the group, re-rendezvous, spawns; imports; init_process_group
            "relaunch_seconds": (started[a + 1] - kill["time"]) if a + 1 in started else None,
            "setup_seconds": nxt["setup_seconds"] if nxt else None,  # build state, checkpointer
            "setup_phases": nxt.get("phases") if nxt else None,
            "restored_step": nxt["loaded"] if nxt else None,
            "load_seconds": nxt["load_seconds"] if nxt else None,
            "rollback_steps": (last - nxt["loaded"]) if nxt and job["method"] != "none" else None,
        })
    saves = [r["save"] for r in recs.of("step") if "save" in r]
    result: dict[str, Any] = {
        "method": job["method"],
        "interval_steps": loads.get(0, {}).get("interval"),
        "failures": failures,
        "failure_count": len(failures),
        "median_step_seconds_before_failures": statistics.median(intervals) if intervals else None,
        "save_blocking_median_seconds": statistics.median(saves) if saves else None,
        "saves_per_rank": len(saves) // 2,
    }
    lost = [f["lost_seconds"] for f in failures if f["lost_seconds"] is not None]
    result["lost_seconds_per_failure"] = statistics.mean(lost) if lost else None
    done = recs.of("done")
    if job["method"] != "none" and done:
        final = max(s for (_, s) in steps)
        t0 = ready[0]
        t1 = min(t for (_, s), t in steps.items() if s == final)
        last = max(d["a"] for d in done)
        result.update(steps=final, wall_seconds=t1 - t0,
                      goodput=(final * ideal / (t1 - t0)) if ideal else None,
                      final_state=sorted((d["params"], d["payload"]) for d in done if d["a"] == last))
    return result


def agent_goodput(work: Path) -> dict[str, Any] | None:
    sys.path[:0] = [str(REPO)]
    from elastic._goodput import read_records, summarize

    records = read_records(str(work / "flashckpt" / "metrics"))
    if not records:
        return None
    job = summarize(records)["job"]
    return {k: job.get(k) for k in ("goodput", "restarts", "rollback_steps", "restart_downtime_seconds",
                                    "lost_seconds_per_restart", "checkpoint_blocking_seconds")}


def _own_seconds(f: dict[str, Any]) -> float | None:
    """The part of a failure's lost time that the checkpoint method adds to a bare restart:
    its own setup (imports, checkpointer, side group), the restore and the re-done steps."""
    if f["lost_seconds"] is None or f["relaunch_seconds"] is None or f["setup_seconds"] is None:
        return None
    own_setup = sum((f.get("setup_phases") or {}).values())
    return f["lost_seconds"] - f["relaunch_seconds"] - (f["setup_seconds"] - own_setup)


def render(report: dict[str, Any]) -> str:
    """The tables of a report (the JSON this script writes)."""
    c, results, floor = report["config"], report["methods"], report["floor_lost_seconds_per_failure"]
    flash = results.get("flashckpt", {}).get("goodput")

    def f(v: Any, fmt: str, unit: str = "") -> str:
        return "-" if v is None else format(v, fmt) + unit

    lines = [f"goodput under kill -9 of a random rank every {c['mtbf']:.0f} s: 2 ranks (gloo), "
             f"{c['steps']} steps, ideal step {report['ideal_step_seconds'] * 1e3:.1f} ms, state "
             f"{c['state_mb']} MiB/rank, flashckpt storage every {c['persist_every']} steps",
             f"{'method':<16}{'K':>5}{'saves':>7}{'block/save':>12}{'failures':>10}{'lost/failure':>14}"
             f"{'- floor':>9}{'rollback':>10}{'goodput':>9}{'vs flashckpt':>14}"]
    for name, r in results.items():
        lost = r.get("lost_seconds_per_failure")
        rollback = [x["rollback_steps"] for x in r["failures"] if x["rollback_steps"] is not None]
        goodput, block = r.get("goodput"), r["save_blocking_median_seconds"]
        lines.append(
            f"{name:<16}{f(r['interval_steps'], 'd'):>5}{r['saves_per_rank']:>7}"
            f"{f(block and block * 1e3, '.1f', ' ms'):>12}"
            f"{r['failure_count']:>10}{f(lost, '.2f', ' s'):>14}"
            f"{f(lost - floor if lost is not None and floor is not None and name != 'none' else None, '+.2f'):>9}"
            f"{f(statistics.mean(rollback) if rollback else None, '.1f'):>10}"
            f"{f(goodput and goodput * 100, '.1f', '%'):>9}"
            f"{f(goodput / flash if goodput and flash else None, '.2f', 'x'):>14}")
    lines += ["", "where the lost time goes (mean per failure, seconds): relaunch = kill to "
              "init_process_group done (torchrun, spawn, imports); setup = state and checkpointer; "
              "load = restore; redo = re-done steps and the step in flight; own = what the method "
              "adds to a bare restart (its own setup + load + redo); the rest is the same for all "
              "and varies by a second or more from one restart to the next here",
              f"{'method':<16}{'relaunch':>10}{'setup':>8}{'load':>8}{'redo':>8}{'lost':>8}{'own':>8}"]
    for name, r in results.items():
        fs = [x for x in r["failures"] if _own_seconds(x) is not None]
        if not fs:
            continue
        mean = {k: statistics.mean(x[k] for x in fs) for k in ("relaunch_seconds", "setup_seconds",
                                                                "load_seconds", "lost_seconds")}
        redo = mean["lost_seconds"] - mean["relaunch_seconds"] - mean["setup_seconds"] - mean["load_seconds"]
        lines.append(f"{name:<16}{mean['relaunch_seconds']:>10.2f}{mean['setup_seconds']:>8.2f}"
                     f"{mean['load_seconds']:>8.2f}{redo:>8.2f}{mean['lost_seconds']:>8.2f}"
                     f"{statistics.mean(_own_seconds(x) for x in fs):>8.2f}")
    lines.append(f"floor (no checkpoint, restart only): {f(floor, '.2f', ' s')} per failure; final "
                 f"states of the checkpointing jobs equal: {report['final_states_equal']}")
    agent = report.get("flashckpt_agent")
    if agent:
        lines.append(f"flashckpt agent's own goodput (useful step time / wall, its metrics_dir): "
                     f"{agent['goodput'] * 100:.1f}%, {agent['restarts']} restarts, "
                     f"rollback {agent['rollback_steps']} steps")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400, help="steps of each checkpointing job")
    p.add_argument("--step-seconds", type=float, default=0.05, help="sleep in every step")
    p.add_argument("--state-mb", type=int, default=16, help="training state per rank, MiB")
    p.add_argument("--persist-every", type=int, default=50, help="flashckpt: storage every N steps")
    p.add_argument("--mtbf", type=float, default=15.0, help="seconds between kills (the failure "
                   "rate); keep it well above the restart time")
    p.add_argument("--max-failures", type=int, default=3, help="at most this many kills a job")
    p.add_argument("--floor-failures", type=int, default=2, help="kills of the no-checkpoint job")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, records)")
    p.add_argument("--json", default=str(REPO / "results" / "goodput.json"))
    p.add_argument("--reprint", metavar="JSON", help="print the tables of an earlier run's JSON")
    args = p.parse_args()
    if args.reprint:
        print(render(json.loads(Path(args.reprint).read_text())))
        return
    methods = [m for m in args.methods.split(",") if m]
    if "none" not in methods:
        methods.insert(0, "none")  # the ideal step time and the floor come from it
    work = Path(tempfile.mkdtemp(prefix="goodput-", dir=args.dir))
    results: dict[str, dict[str, Any]] = {}
    ideal = floor = None
    try:
        for i, method in enumerate(methods):
            t = time.monotonic()
            job = run_job(method, args, work, args.seed + i)
            if method == "none":
                pre = analyse(job, None)
                ideal = pre["median_step_seconds_before_failures"]
            results[method] = analyse(job, ideal)
            if method == "none":
                floor = results[method]["lost_seconds_per_failure"]
            print(f"{method}: {time.monotonic() - t:.0f}s, {results[method]['failure_count']} failures",
                  file=sys.stderr)
        finals = {json.dumps(r["final_state"]) for m, r in results.items() if m != "none" and "final_state" in r}
        same = len(finals) <= 1
        agent = agent_goodput(work) if "flashckpt" in results else None
    finally:
        if args.keep:
            print(f"work directory kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    report = {
        "config": {k: getattr(args, k) for k in ("steps", "step_seconds", "state_mb", "persist_every",
                                                   "mtbf", "max_failures", "floor_failures", "seed")},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "ideal_step_seconds": ideal, "floor_lost_seconds_per_failure": floor,
        "final_states_equal": same, "flashckpt_agent": agent,
        "methods": {m: {k: v for k, v in r.items() if k != "final_state"} for m, r in results.items()},
    }
    print(render(report))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
