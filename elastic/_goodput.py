"""Metrics records (JSON lines in ``metrics_dir``) and goodput computed from them.

Each training process appends records to ``<metrics_dir>/rank<R>.jsonl``; a restarted
process of the same rank appends to the same file, so the file is the rank's whole
history across process restarts. Record types (all carry ``type``, ``time`` (wall
clock), ``rank``, ``pid``, and ``worker``, the agent's worker name):

- ``start``: an agent started (a new process or a re-started agent);
- ``steps``: an aggregate of consecutive steps ``first..last`` (step numbers), with
  ``t_begin`` (when the first of them started), ``t_end`` (when the last ended),
  ``busy_seconds`` (their summed duration), ``ckpt_seconds`` (checkpoint blocking time
  inside them), ``saves`` and ``samples``; written about once a second, not per step;
- ``load`` (a checkpoint restore: ``step``, ``source``, ``seconds``), ``failure``
  (``diagnosis``, ``step``), ``hang``, ``flush``, ``exit``, ``restart`` (in-process),
  ``heartbeats``, ``stop``, ``node_check``, ``stragglers``, and the user's own
  (``Agent.record``). Every record but ``steps`` is an *event*: with a coordinator the
  agent also publishes it to the coordinator's job-wide log (``elastic._publish``).

Goodput (DeepRec's Gazer idea) = time spent in steps whose result survived / wall time
of the job. A step re-done after a rollback counts once, at its last execution; the
earlier executions are *rollback* time. Restart downtime is the gap between the last
step of a process and the first step of the next one (start-up, restore).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
import threading
import time
from typing import Any, Callable, Iterable

from elastic._tensorboard import ScalarWriter

__all__ = ["MetricsLog", "read_records", "summarize"]

log = logging.getLogger(__name__)


class MetricsLog:
    """Appends JSON records to ``<metrics_dir>/rank<R>.jsonl`` (or keeps them in memory);
    ``on_event`` gets every record but ``steps`` (called with no lock held)."""

    def __init__(self, metrics_dir: str | None, *, rank: int, worker: str | None = None,
                 on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.rank = rank
        self.worker = worker
        self._on_event = on_event
        self.path = None if metrics_dir is None else os.path.join(metrics_dir, f"rank{rank}.jsonl")
        self._memory: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._file = None
        self._tb = None
        if self.path is not None:
            os.makedirs(metrics_dir, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
            if importlib.util.find_spec("tensorboard") is not None:
                try:  # written directly: importing TensorBoard would import TensorFlow
                    self._tb = ScalarWriter(os.path.join(metrics_dir, "tensorboard", f"rank{rank}"))
                except OSError as err:  # TensorBoard scalars are optional
                    log.info("TensorBoard scalars disabled: %s", err)

    def write(self, record_type: str, **fields: Any) -> dict[str, Any]:
        record = {"type": record_type, "time": time.time(), "rank": self.rank, "pid": os.getpid()}
        if self.worker is not None:
            record["worker"] = self.worker
        record.update(fields)
        line = json.dumps(record, sort_keys=True, default=str)
        with self._lock:
            self._memory.append(record)
            if self._file is not None:
                try:
                    self._file.write(line + "\n")
                    self._file.flush()
                except (OSError, ValueError) as err:
                    log.warning("cannot write metrics to %s: %s", self.path, err)
            if self._tb is not None and record_type == "steps" and fields.get("last") is not None:
                n = max(1, fields["last"] - fields["first"] + 1)
                try:
                    self._tb.add_scalars(fields["last"], {
                        "elastic/step_seconds": fields["busy_seconds"] / n,
                        "elastic/ckpt_blocking_seconds": fields["ckpt_seconds"]}, record["time"])
                except (OSError, ValueError) as err:
                    log.warning("cannot write TensorBoard scalars: %s", err)
        if self._on_event is not None and record_type != "steps":
            self._on_event(record)
        return record

    def records(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._memory)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
            if self._tb is not None:
                self._tb.close()
                self._tb = None


def read_records(metrics_dir: str) -> list[dict[str, Any]]:
    """Every record of every rank in ``metrics_dir``, sorted by time; bad lines skipped."""
    records = []
    for path in sorted(glob.glob(os.path.join(metrics_dir, "rank*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    log.warning("skipping a bad line in %s", path)
    records.sort(key=lambda r: r.get("time", 0.0))
    return records


def _rank_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    segments: list[list[float]] = []  # [first, last, busy] of surviving steps, in step order
    rollback_steps = 0
    rollback_seconds = 0.0
    ckpt_seconds = 0.0
    saves = samples = 0
    processes: list[dict[str, float]] = []  # per pid: first step begin, last step end
    failures = inprocess = hangs = 0
    kinds: dict[str, int] = {}
    for r in records:
        kind = r.get("type")
        if kind == "steps" and r.get("last") is not None:
            first, last = r["first"], r["last"]
            while segments and segments[-1][1] >= first:  # a rollback: those steps are re-done
                seg = segments[-1]
                n = seg[1] - seg[0] + 1
                cut = seg[1] - max(seg[0], first) + 1
                rollback_steps += cut
                rollback_seconds += seg[2] * cut / n
                if cut == n:
                    segments.pop()
                else:
                    seg[1] = first - 1
                    seg[2] -= seg[2] * cut / n
            segments.append([first, last, r["busy_seconds"]])
            ckpt_seconds += r.get("ckpt_seconds", 0.0)
            saves += r.get("saves", 0)
            samples += r.get("samples", 0) or 0
            if not processes or processes[-1]["pid"] != r["pid"]:
                processes.append({"pid": r["pid"], "begin": r["t_begin"], "end": r["t_end"]})
            processes[-1]["end"] = r["t_end"]
        elif kind == "restart":
            inprocess += 1
        elif kind in ("failure", "hang"):
            if kind == "hang":
                hangs += 1
            if kind == "failure" or r.get("action") == "exit":
                failures += 1
            diag = (r.get("diagnosis") or {}).get("kind", "hang" if kind == "hang" else "?")
            kinds[diag] = kinds.get(diag, 0) + 1
    start = min([r["time"] for r in records] + [p["begin"] for p in processes], default=0.0)
    end = max([r["time"] for r in records] + [p["end"] for p in processes], default=start)
    wall = max(0.0, end - start)
    useful = sum(s[2] for s in segments)
    downtime = sum(max(0.0, b["begin"] - a["end"]) for a, b in zip(processes, processes[1:]))
    restarts = max(0, len(processes) - 1) + inprocess
    steps = int(sum(s[1] - s[0] + 1 for s in segments))
    return {
        "wall_seconds": wall,
        "useful_seconds": useful,
        "goodput": useful / wall if wall > 0 else 0.0,
        "steps": steps,
        "last_step": int(segments[-1][1]) if segments else None,
        "mean_step_seconds": useful / steps if steps else None,
        "samples_per_second": samples / useful if useful and samples else None,
        "checkpoint_blocking_seconds": ckpt_seconds,
        "saves": saves,
        "restarts": restarts,
        "inprocess_restarts": inprocess,
        "failures": failures,
        "hangs": hangs,
        "failure_kinds": kinds,
        "restart_downtime_seconds": downtime,
        "rollback_steps": rollback_steps,
        "rollback_seconds": rollback_seconds,
        "lost_seconds_per_restart": (downtime + rollback_seconds) / restarts if restarts else None,
    }


def summarize(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Per-rank and job-wide goodput and metrics from records (any order, any ranks).

    The job's goodput is the mean of the ranks' (they share the wall clock and, in a
    synchronous job, the steps).
    """
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for r in sorted(records, key=lambda r: r.get("time", 0.0)):
        by_rank.setdefault(int(r.get("rank", 0)), []).append(r)
    ranks = {rank: _rank_summary(recs) for rank, recs in sorted(by_rank.items())}
    job: dict[str, Any] = {"ranks": len(ranks)}
    if ranks:
        vals = list(ranks.values())
        for key in ("goodput", "wall_seconds", "useful_seconds", "restart_downtime_seconds",
                    "rollback_seconds", "checkpoint_blocking_seconds"):
            job[key] = sum(v[key] for v in vals) / len(vals)
        job["restarts"] = max(v["restarts"] for v in vals)
        job["failures"] = sum(v["failures"] for v in vals)
        job["hangs"] = sum(v["hangs"] for v in vals)
        job["rollback_steps"] = max(v["rollback_steps"] for v in vals)
        job["last_step"] = max((v["last_step"] or 0) for v in vals)
        lost = [v["lost_seconds_per_restart"] for v in vals if v["lost_seconds_per_restart"] is not None]
        job["lost_seconds_per_restart"] = sum(lost) / len(lost) if lost else None
    return {"job": job, "ranks": ranks}
