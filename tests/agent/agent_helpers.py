"""Shared helpers of the agent tests: run the training script, read what the agents wrote."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import uuid

from tests._net import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "agent", "agent_script.py")
VENV_BIN = os.path.dirname(sys.executable)


def job_id() -> str:
    return "t" + uuid.uuid4().hex[:12]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, e.get("PYTHONPATH")) if p)
    e["OMP_NUM_THREADS"] = "1"
    return e


def run(out: str, *args: str, nproc: int = 1, max_restarts: int = 0, timeout: float = 120,
        torchrun: bool | None = None) -> subprocess.CompletedProcess:
    """Run the training script (under torchrun when nproc > 1 or asked) and wait."""
    torchrun = nproc > 1 if torchrun is None else torchrun
    if torchrun:
        cmd = [os.path.join(VENV_BIN, "torchrun"), f"--nproc_per_node={nproc}",
               f"--max-restarts={max_restarts}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--monitor-interval=0.5", SCRIPT]
    else:
        cmd = [sys.executable, SCRIPT]
    cmd += ["--out", out, *args]
    return subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def start(out: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, SCRIPT, "--out", out, *args], env=env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def records(out: str, rank: int | None = None) -> list[dict]:
    pattern = f"rank{rank}.jsonl" if rank is not None else "rank*.jsonl"
    found = []
    for path in sorted(glob.glob(os.path.join(out, "metrics", pattern))):
        with open(path) as f:
            found += [json.loads(line) for line in f if line.strip()]
    return sorted(found, key=lambda r: r["time"])


def of_type(recs: list[dict], kind: str) -> list[dict]:
    return [r for r in recs if r["type"] == kind]


def stacks(out: str, rank: int) -> str:
    path = os.path.join(out, "metrics", f"stacks.rank{rank}.txt")
    return open(path).read() if os.path.exists(path) else ""


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"rc={proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"


def node_check_worker(rank: int, world: int) -> dict:
    """Under a gloo group (tests._fork.run_ranks): two node checks, rank 1 made slow."""
    import dataclasses

    import elastic

    first = elastic.check_node(timeout=60, size=512, repeats=2 if rank == 0 else 40)
    second = elastic.check_node(timeout=60, size=64, repeats=1)
    return {"first": [dataclasses.asdict(r) for r in first],
            "second": [dataclasses.asdict(r) for r in second]}
