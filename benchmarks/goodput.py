"""Goodput under failures: the same small job under torchrun, kill -9 at a fixed rate.

    python benchmarks/goodput.py [--steps 1200] [--mtbf 12] [--state-mb 256] [--repeats 3]
                                 [--max-failures 6] [--json results/goodput.json]

The job: 2 processes (gloo), a fixed step time (``--step-seconds`` of sleep, default
50 ms, plus a tiny model's forward/backward and a gradient all-reduce), and a
per-rank training state of ``--state-mb`` (default 256 MiB, the same for every method:
the tiny model plus a payload tensor standing for the rest of a model's and optimizer's
state; every step changes it). A driver (this script) launches ``torchrun
--max-restarts`` on ``_goodput_job.py`` and kills a random rank with SIGKILL after every
``--mtbf`` seconds of training (seeded; the clock starts when the job has recovered from
the previous kill; none comes in the job's last step; at most ``--max-failures``).
Methods, each run ``--repeats`` times, the order rotated from one repeat to the next
(interleaved, so a busy spell of the machine does not fall on one method):

- ``none``: no checkpoint at all. It cannot finish under failures (every restart
  begins at step 1), so it only gives the floor: the restart time of the job.
- ``flashckpt``: ``flashckpt.torch.Checkpointer`` -- into shared memory every K steps,
  storage every ``--persist-every`` memory saves -- and ``elastic.start_agent``; a
  restart loads from memory. K by Young's formula from its own (small) save cost, like
  the others (``--flash-every N`` forces N: every step costs a 256 MiB copy per step).
- ``torch.save``: every rank ``torch.save`` + fsync + rename of its state every K
  steps, a barrier, then rank 0 commits ``latest``; K by Young's formula.
- ``dcp.async_save``: ``torch.distributed.checkpoint.async_save`` on a side gloo group
  every K steps (waiting for the previous one first); K by Young's formula.
- ``flashckpt.ddp``, ``flashckpt.ddp+capture``, ``flashckpt.ddp.every-step`` (issue 42;
  not in the default ``--methods``): ``DdpCheckpointer`` (one copy per node of the
  replicated state) into memory every ``--ddp-every`` steps (default 50), the second with
  ``save_on_failure`` (a survivor saves the last finished step at the failure), the third
  every step. Every method's state changes only inside ``optimizer.step()`` (a post-hook
  updates the payload), as failure capture requires.

Young's formula: the checkpoint interval is sqrt(2 * C * MTBF), C the blocking cost of
one save, measured by each job before it trains (one untimed save, then the median of 3,
slowest rank), MTBF = ``--mtbf``.

Measured from the ranks' step records (wall clock, one machine):
- ideal step time: the median step interval of the repeat's ``none`` job before its
  first failure;
- goodput = steps x ideal step time / wall time from the first step to the last;
- lost time per failure = time from the last step completed before the kill to the next
  step that was never completed before, minus one ideal step: restart, restore and the
  re-done steps (rollback). For ``none`` the "next new step" is the restarted job's first
  step: that is the floor, the restart time alone. Its parts are printed too: relaunch
  (kill to ``init_process_group`` done: torchrun stops the group -- a flashckpt
  survivor first flushes the newest step to storage, "flush" --, spawns, imports),
  setup, load, redo; and "own", what a method adds to a bare restart (its own setup,
  the restore and the re-done steps);
- where the wall time goes: useful (steps x ideal step), save stalls (blocking saves),
  failures (their lost time), slower steps (the rest: background writes, the saver,
  DCP's thread, contention on a small machine).
The final states of the checkpointing jobs must be equal (same data, same steps).

Tables show mean and spread (goodput over runs, lost time over failures); the JSON
keeps every run and failure (``--reprint JSON`` prints the tables again).
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
    limit = 180 + 3 * args.steps * args.step_seconds + args.max_failures * (args.mtbf + 40)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--max-restarts={args.max_failures + 2}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{_free_port()}", "--monitor-interval=0.1",
           str(JOB), "--method", method, "--out", str(out),
           "--ckpt", str(ckpt), "--steps", str(10**6 if method == "none" else args.steps),
           "--step-seconds", str(args.step_seconds),
           "--state-mb", str(args.state_mb), "--persist-every", str(args.persist_every),
           "--mtbf", str(args.mtbf), "--flash-every", str(args.flash_every), "--ddp-every", str(args.ddp_every)]
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
                if time.monotonic() - began > limit:
                    raise RuntimeError(f"{method}: the job ran past {limit:.0f}s; see {out}/torchrun.log")
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
                next_kill = None  # the next clock starts once the job has recovered
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    recs.poll()
    (out / "kills.json").write_text(json.dumps(kills))  # for a look afterwards (--keep)
    if proc.returncode != 0:
        raise RuntimeError(f"{method}: torchrun exited {proc.returncode}; see {out}/torchrun.log")
    return {"method": method, "kills": kills, "records": recs, "out": out}


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
        # (a failure capture may hold a step whose record was not written yet: its restart
        # begins after ``target``)
        later = [t for (x, s), t in steps.items() if x > a and s >= target]
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
            "rollback_steps": max(0, last - nxt["loaded"]) if nxt and job["method"] != "none" else None,
        })
    saves = [r["save"] for r in recs.of("step") if "save" in r]
    result: dict[str, Any] = {
        "method": job["method"],
        "interval_steps": loads.get(0, {}).get("interval"),
        "save_cost_calibrated_seconds": loads.get(0, {}).get("save_cost"),
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
        wall = t1 - t0
        result.update(steps=final, wall_seconds=wall,
                      goodput=(final * ideal / wall) if ideal else None,
                      final_state=sorted((d["params"], d["payload"]) for d in done if d["a"] == last))
        if ideal:  # wall = useful + save stalls + lost in failures + the rest (slower steps)
            stall = sum(saves) / 2  # per rank, the ranks save alike
            result["wall_parts_seconds"] = {
                "useful": final * ideal, "save_stalls": stall, "failures": sum(lost),
                "slower_steps": wall - final * ideal - stall - sum(lost)}
    flushes = [r["seconds"] for r in _agent_records(job["out"]) if r.get("type") == "flush"]
    if flushes:  # a survivor's flush at SIGTERM delays the group's exit, so the relaunch
        result["agent_flush_seconds"] = statistics.mean(flushes)
    return result


def _agent_records(out: Path) -> list[dict[str, Any]]:
    if not (out / "metrics").is_dir():
        return []
    sys.path[:0] = [str(REPO)]
    from elastic._goodput import read_records

    return read_records(str(out / "metrics"))



def agent_goodput(out: Path) -> dict[str, Any] | None:
    """The flashckpt agent's own view of the run (its metrics_dir)."""
    from elastic._goodput import summarize

    records = _agent_records(out)
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


def _spread(values: list[float]) -> dict[str, Any] | None:
    if not values:
        return None
    return {"mean": statistics.mean(values), "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One method's repeats: spreads over runs (goodput) and over all failures (lost time)."""
    fails = [f for r in runs for f in r["failures"]]
    parts = [r["wall_parts_seconds"] for r in runs if "wall_parts_seconds" in r]
    out: dict[str, Any] = {
        "runs": len(runs),
        "failures": len(fails),
        "interval_steps": sorted({r["interval_steps"] for r in runs if r["interval_steps"] is not None}),
        "save_cost_calibrated_seconds": _spread([r["save_cost_calibrated_seconds"] for r in runs
                                                 if r.get("save_cost_calibrated_seconds") is not None]),
        "save_blocking_median_seconds": _spread([r["save_blocking_median_seconds"] for r in runs
                                                 if r["save_blocking_median_seconds"] is not None]),
        "saves_per_rank": _spread([r["saves_per_rank"] for r in runs]),
        "goodput": _spread([r["goodput"] for r in runs if r.get("goodput") is not None]),
        "lost_seconds_per_failure": _spread([f["lost_seconds"] for f in fails if f["lost_seconds"] is not None]),
        "rollback_steps": _spread([f["rollback_steps"] for f in fails if f["rollback_steps"] is not None]),
        "agent_flush_seconds": _spread([r["agent_flush_seconds"] for r in runs if "agent_flush_seconds" in r]),
    }
    timed = [f for f in fails if _own_seconds(f) is not None]
    if timed:
        out["per_failure_seconds"] = {k: statistics.mean(f[k] for f in timed)
                                      for k in ("relaunch_seconds", "setup_seconds", "load_seconds", "lost_seconds")}
        out["per_failure_seconds"]["own"] = statistics.mean(_own_seconds(f) for f in timed)
    if parts:  # fractions of the wall time, mean over runs
        walls = [sum(p.values()) for p in parts]
        out["wall_fractions"] = {k: statistics.mean(p[k] / w for p, w in zip(parts, walls)) for k in parts[0]}
    return out


def render(report: dict[str, Any]) -> str:
    """The tables of a report (the JSON this script writes)."""
    c, agg = report["config"], report["summary"]
    floor = (agg.get("none", {}).get("lost_seconds_per_failure") or {}).get("mean")
    ideal = _spread(report["ideal_step_seconds"])

    def f(v: Any, fmt: str, unit: str = "") -> str:
        return "-" if v is None else format(v, fmt) + unit

    def pm(s: dict[str, Any] | None, scale: float, fmt: str) -> str:
        return "-" if not s else f"{format(s['mean'] * scale, fmt)}±{format(s['stdev'] * scale, fmt)}"

    def span(s: dict[str, Any] | None) -> str:
        return "-" if not s else f"{s['min'] * 100:.1f}-{s['max'] * 100:.1f}"

    lines = [f"goodput under kill -9 of a random rank every {c['mtbf']:.0f} s of training: 2 ranks (gloo), "
             f"{c['steps']} steps of {c['step_seconds'] * 1e3:.0f} ms sleep (ideal step "
             f"{ideal['mean'] * 1e3:.1f} ms, {ideal['min'] * 1e3:.1f}-{ideal['max'] * 1e3:.1f} over repeats), "
             f"state {c['state_mb']} MiB/rank, {c['repeats']} repeats interleaved; flashckpt: memory every "
             f"{'K (Young)' if not c.get('flash_every') else c['flash_every']} steps, storage every "
             f"{c['persist_every']} memory saves; mean±stdev (goodput over runs, lost time over failures)",
             f"{'method':<26}{'K':>9}{'cost/save':>11}{'saves':>7}{'fails':>7}{'lost/failure':>15}"
             f"{'- floor':>9}{'rollback':>10}{'goodput':>14}{'min-max':>13}"]
    for name, r in agg.items():
        lost, g = r["lost_seconds_per_failure"], r["goodput"]
        ks = r["interval_steps"]
        lines.append(
            f"{name:<26}{'-' if not ks else '/'.join(map(str, ks)):>9}"
            f"{f(r['save_cost_calibrated_seconds'] and r['save_cost_calibrated_seconds']['mean'] * 1e3, '.0f', ' ms'):>11}"
            f"{f(r['saves_per_rank'] and r['saves_per_rank']['mean'], '.0f'):>7}{r['failures']:>7}"
            f"{pm(lost, 1, '.2f') + ' s':>15}"
            f"{f(lost['mean'] - floor if lost and floor is not None and name != 'none' else None, '+.2f'):>9}"
            f"{f(r['rollback_steps'] and r['rollback_steps']['mean'], '.1f'):>10}"
            f"{pm(g, 100, '.1f') + '%' if g else '-':>14}"
            f"{span(g):>13}")
    lines += ["", "where the wall time goes (mean fraction of the wall time): useful = steps x ideal step; "
              "stalls = blocking saves; failures = lost time of the failures; slower = the rest "
              "(steps slowed by background writes, the saver, DCP's thread, contention)",
              f"{'method':<26}{'useful':>8}{'stalls':>8}{'failures':>10}{'slower':>8}"]
    for name, r in agg.items():
        w = r.get("wall_fractions")
        if w:
            lines.append(f"{name:<26}{w['useful'] * 100:>7.1f}%{w['save_stalls'] * 100:>7.1f}%"
                         f"{w['failures'] * 100:>9.1f}%{w['slower_steps'] * 100:>7.1f}%")
    lines += ["", "where a failure's lost time goes (mean per failure, seconds): relaunch = kill to "
              "init_process_group done (torchrun stops the group -- a flashckpt survivor flushes first --, "
              "spawns, imports); setup = state and checkpointer; load = restore; redo = re-done steps "
              "and the step in flight; own = what the method adds to a bare restart (its own setup + "
              "load + redo)",
              f"{'method':<26}{'relaunch':>10}{'setup':>8}{'load':>8}{'redo':>8}{'lost':>8}{'own':>8}{'flush':>8}"]
    for name, r in agg.items():
        m = r.get("per_failure_seconds")
        if not m:
            continue
        redo = m["lost_seconds"] - m["relaunch_seconds"] - m["setup_seconds"] - m["load_seconds"]
        fl = r.get("agent_flush_seconds")
        lines.append(f"{name:<26}{m['relaunch_seconds']:>10.2f}{m['setup_seconds']:>8.2f}"
                     f"{m['load_seconds']:>8.2f}{redo:>8.2f}{m['lost_seconds']:>8.2f}{m['own']:>8.2f}"
                     f"{f(fl and fl['mean'], '.2f'):>8}")
    lines.append(f"floor (no checkpoint, restart only): {f(floor, '.2f', ' s')} per failure; final "
                 f"states of the checkpointing jobs equal: {report['final_states_equal']}")
    agents = [a for a in report.get("flashckpt_agent", []) if a]
    if agents:
        lines.append("flashckpt agent's own goodput (useful step time / wall, its metrics_dir): "
                     + ", ".join(f"{a['goodput'] * 100:.1f}%" for a in agents))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1200, help="steps of each checkpointing job")
    p.add_argument("--step-seconds", type=float, default=0.05, help="sleep in every step")
    p.add_argument("--state-mb", type=int, default=256, help="training state per rank, MiB")
    p.add_argument("--persist-every", type=int, default=10,
                   help="flashckpt: storage every N memory saves")
    p.add_argument("--flash-every", type=int, default=0,
                   help="flashckpt: memory every N steps (0: K by Young's formula, like the others)")
    p.add_argument("--ddp-every", type=int, default=50,
                   help="flashckpt.ddp and flashckpt.ddp+capture: memory every N steps")
    p.add_argument("--mtbf", type=float, default=12.0, help="seconds of training between kills (the "
                   "failure rate); keep it well above the restart time")
    p.add_argument("--max-failures", type=int, default=6, help="at most this many kills a job")
    p.add_argument("--floor-failures", type=int, default=2, help="kills of the no-checkpoint job")
    p.add_argument("--repeats", type=int, default=3, help="runs of every method, interleaved")
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
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    ideals: list[float] = []
    agents: list[dict[str, Any] | None] = []
    load: list[list[float]] = []
    try:
        for rep in range(args.repeats):
            order = methods[rep % len(methods):] + methods[:rep % len(methods)]  # interleaved
            jobs = {}
            for i, method in enumerate(order):
                t = time.monotonic()
                jobs[method] = run_job(method, args, work / f"r{rep}", args.seed + 100 * rep + methods.index(method))
                load.append(list(os.getloadavg()))
                print(f"repeat {rep} {method}: {time.monotonic() - t:.0f}s, {len(jobs[method]['kills'])} "
                      f"failures, load {load[-1][0]:.2f}", file=sys.stderr)
            ideal = analyse(jobs["none"], None)["median_step_seconds_before_failures"]
            ideals.append(ideal)
            for method in methods:
                runs[method].append(analyse(jobs[method], ideal))
            if "flashckpt" in jobs:
                agents.append(agent_goodput(jobs["flashckpt"]["out"]))
    finally:
        if args.keep:
            print(f"work directory kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    finals = {json.dumps(r["final_state"]) for m, rs in runs.items() if m != "none"
              for r in rs if "final_state" in r}
    report = {
        "config": {k: getattr(args, k) for k in ("steps", "step_seconds", "state_mb", "persist_every", "flash_every", "ddp_every",
                                                   "mtbf", "max_failures", "floor_failures", "repeats", "seed")},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_after_each_job": load},
        "ideal_step_seconds": ideals,
        "final_states_equal": len(finals) <= 1,
        "flashckpt_agent": agents,
        "summary": {m: aggregate(rs) for m, rs in runs.items()},
        "runs": {m: [{k: v for k, v in r.items() if k != "final_state"} for r in rs] for m, rs in runs.items()},
    }
    print(render(report))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
