"""``python -m elastic.report METRICS_DIR [--png PATH] [--coordinator URL]``: goodput
summary and a timeline.

Reads every ``rank*.jsonl`` the agents wrote into ``METRICS_DIR`` (across process
restarts), prints the job's goodput, restart downtime, rollback, checkpoint blocking
time and failures by kind, and draws ``METRICS_DIR/timeline.png``: one row per rank,
time left to right; green where steps ran (brightness: step number), a red line at each
failure or hang, a blue line at each restore (checkpoint load). The PNG is written with
numpy and zlib only (no plotting library needed), so it carries no text labels; the
printed summary carries the numbers. With ``--coordinator URL`` (the ``sharding`` URL
the agents were given) it also lists the job-wide events of every rank from the
coordinator's log -- the failures and hangs of ranks whose ``metrics_dir`` is elsewhere.

Exit codes: 0 done, 1 no records found, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import os
import struct
import sys
import zlib
from typing import Any

from elastic._goodput import read_records, summarize

__all__ = ["format_events", "format_summary", "main", "timeline_png"]

log = logging.getLogger(__name__)

_GREEN = (40, 170, 60)
_RED = (220, 30, 30)
_BLUE = (30, 90, 230)
_ORANGE = (240, 150, 20)


def format_summary(summary: dict[str, Any]) -> str:
    """The summary of :func:`elastic._goodput.summarize` as plain text."""
    job = summary["job"]
    if not job.get("ranks"):
        return "no records"

    def f(value: Any, unit: str = "s") -> str:
        return "-" if value is None else f"{value:.3f}{unit}" if isinstance(value, float) else str(value)

    lines = [
        f"ranks: {job['ranks']}   last step: {job['last_step']}",
        f"goodput: {job['goodput'] * 100:.1f}%  (useful {f(job['useful_seconds'])} of wall "
        f"{f(job['wall_seconds'])}, mean over ranks)",
        f"restarts: {job['restarts']}   failures: {job['failures']}   hangs: {job['hangs']}",
        f"restart downtime: {f(job['restart_downtime_seconds'])}   rollback: "
        f"{job['rollback_steps']} steps / {f(job['rollback_seconds'])}   lost per restart: "
        f"{f(job['lost_seconds_per_restart'])}",
        f"checkpoint blocking: {f(job['checkpoint_blocking_seconds'])}",
        "",
        "rank  goodput  steps  mean_step   ckpt_block  restarts  downtime  rollback  failures",
    ]
    for rank, r in summary["ranks"].items():
        kinds = ",".join(f"{k}:{v}" for k, v in sorted(r["failure_kinds"].items())) or "-"
        lines.append(f"{rank:>4}  {r['goodput'] * 100:6.1f}%  {r['steps']:>5}  "
                     f"{f(r['mean_step_seconds']):>9}  {f(r['checkpoint_blocking_seconds']):>10}  "
                     f"{r['restarts']:>8}  {f(r['restart_downtime_seconds']):>8}  "
                     f"{r['rollback_steps']:>8}  {kinds}")
    return "\n".join(lines)


def _detail(event: dict[str, Any]) -> str:
    diag = event.get("diagnosis") or {}
    if diag:
        return f"{diag.get('kind')} -> {diag.get('action')}: {diag.get('reason', '')}"[:160]
    keys = ("step", "source", "seconds", "ok", "handoff", "code", "stalled_seconds", "paused")
    return " ".join(f"{k}={event[k]}" for k in keys if event.get(k) is not None)


def format_events(events: list[dict[str, Any]]) -> str:
    """Events (``Agent.events()`` records) as one line each: time, seq, worker, type, detail."""
    import time

    lines = []
    for e in events:
        at = e.get("time") or 0.0
        stamp = time.strftime("%H:%M:%S", time.gmtime(at)) + f".{int(at % 1 * 1000):03d}"
        lines.append(f"{stamp}  {e.get('seq', '-'):>5}  {e.get('worker', '?'):<24} "
                     f"{e.get('type', '?'):<11} {_detail(e)}")
    return "\n".join(lines)


def _coordinator_events(url: str) -> list[dict[str, Any]]:
    import sharding

    from elastic._publish import as_record

    return [as_record(e) for e in sharding.connect(url).events()]


def _png(pixels: Any) -> bytes:
    height, width, _ = pixels.shape
    raw = b"".join(b"\x00" + pixels[y].tobytes() for y in range(height))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def timeline_png(records: list[dict[str, Any]], *, width: int = 1000, row: int = 40) -> bytes:
    """A PNG timeline of the records (see the module docstring for the colours)."""
    import numpy as np

    ranks = sorted({int(r.get("rank", 0)) for r in records}) or [0]
    t0 = min((r.get("t_begin", r["time"]) for r in records), default=0.0)
    t1 = max((r.get("t_end", r["time"]) for r in records), default=t0 + 1.0)
    span = max(t1 - t0, 1e-6)
    last_step = max((r.get("last") or 0 for r in records if r.get("type") == "steps"), default=1) or 1
    pad = 6
    img = np.full((pad + len(ranks) * row, width, 3), 255, dtype=np.uint8)

    def x(t: float) -> int:
        return min(width - 1, max(0, int((t - t0) / span * (width - 1))))

    for i, rank in enumerate(ranks):
        top = pad + i * row
        img[top + row - 2, :] = 220  # row separator
        for r in records:
            if int(r.get("rank", 0)) != rank:
                continue
            kind = r.get("type")
            if kind == "steps" and r.get("last") is not None:
                shade = 0.4 + 0.6 * (r["last"] / last_step)
                color = [int(255 - (255 - c) * shade) for c in _GREEN]
                img[top + 4:top + row - 6, x(r["t_begin"]):x(r["t_end"]) + 1] = color
            elif kind in ("failure", "hang", "load", "restart", "exit"):
                color = {"load": _BLUE, "hang": _ORANGE}.get(kind, _RED)
                xs = x(r["time"])
                img[top:top + row - 2, max(0, xs - 1):xs + 2] = color
    return _png(img)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic.report",
                                     description="Goodput summary and PNG timeline of an agent's metrics_dir.")
    parser.add_argument("metrics_dir")
    parser.add_argument("--png", help="where to write the timeline (default METRICS_DIR/timeline.png)")
    parser.add_argument("--coordinator", metavar="URL", help="also list every rank's events from "
                        "this sharding coordinator's job-wide log")
    args = parser.parse_args(argv)
    if args.coordinator:
        try:
            events = _coordinator_events(args.coordinator)
        except Exception as err:
            sys.stderr.write(f"cannot read the events of {args.coordinator}: {err}\n")
            return 2
        sys.stdout.write(f"events in the coordinator's log: {len(events)}\n")
        if events:
            sys.stdout.write(format_events(events) + "\n\n")
    records = read_records(args.metrics_dir) if os.path.isdir(args.metrics_dir) else []
    if not records:
        sys.stderr.write(f"no agent records (rank*.jsonl) in {args.metrics_dir}\n")
        return 1
    sys.stdout.write(format_summary(summarize(records)) + "\n")
    png = args.png or os.path.join(args.metrics_dir, "timeline.png")
    with open(png, "wb") as f:
        f.write(timeline_png(records))
    sys.stdout.write(f"timeline: {png}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
