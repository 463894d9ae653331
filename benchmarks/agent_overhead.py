"""Agent overhead at a 10 ms step: the cost the agent adds to the training thread.

Two measurements, side by side:
1. A/B: the same busy 10 ms step loop (a spin on the CPU clock, so the step time does
   not depend on scheduling) with and without the agent, interleaved in rounds; the
   difference of mean step times over the step time.
2. Direct: the cost of ``agent.step()`` itself (a tight loop of calls), and the CPU
   time the agent's threads used per step (from /proc/self/task/<tid>/stat), over the
   step time. On 2 shared cores the A/B number is noisy; the direct one is not.

The agent runs as in training: metrics records (and TensorBoard scalars where
TensorBoard is installed) in a metrics_dir, and a shard lease heartbeated every second
to a SQLite coordinator (as a ShardSampler with a 3 s lease timeout asks for).

Run: .venv/bin/python benchmarks/agent_overhead.py [--steps 500] [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

import elastic
import sharding

STEP = 0.010


def spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def loop(steps: int, agent: elastic.Agent | None) -> float:
    began = time.perf_counter()
    for _ in range(steps):
        spin(STEP)
        if agent is not None:
            agent.step()
    return (time.perf_counter() - began) / steps


def thread_cpu(tid: int) -> float:
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        agent = elastic.start_agent(metrics_dir=tmp, heartbeat_interval=5.0, handle_failures=False)
        ds = sharding.connect(f"sqlite:///{tmp}/shards.db").dataset(
            "bench", size=1000, shard_size=10, lease_timeout=3.0)
        ds.acquire("w0")
        agent.add_heartbeat(ds, "w0", interval_seconds=1.0)
        tids = [agent._thread.native_id, agent._io_thread.native_id]  # the watch and coordinator threads
        base, with_agent = [], []
        cpu0 = sum(map(thread_cpu, tids))
        agent_steps = 0
        for _ in range(args.rounds):
            base.append(loop(args.steps, None))
            with_agent.append(loop(args.steps, agent))
            agent_steps += args.steps
        cpu = sum(map(thread_cpu, tids)) - cpu0
        wall_agent = sum(with_agent) * args.steps
        n = 200_000
        t = time.perf_counter()
        for _ in range(n):
            agent.step()
        call = (time.perf_counter() - t) / n
        agent.stop()
        if ds.progress()["expired"]:
            raise SystemExit("the agent did not keep the shard lease alive")
    b, a = sum(base) / len(base), sum(with_agent) / len(with_agent)
    print(f"step time without agent : {b * 1e3:.3f} ms (mean of {args.rounds} x {args.steps})")
    print(f"step time with agent    : {a * 1e3:.3f} ms")
    print(f"A/B overhead            : {(a - b) / b * 100:+.3f}% (noisy: other processes share the cores)")
    print(f"agent.step() call       : {call * 1e6:.2f} us = {call / STEP * 100:.4f}% of a 10 ms step")
    print(f"agent threads CPU       : {cpu * 1e3:.1f} ms over {wall_agent:.1f} s of agent steps "
          f"= {cpu / wall_agent * 100:.3f}% of one core")
    print(f"direct overhead         : {(call / STEP + cpu / wall_agent) * 100:.3f}% (goal < 1%)")


if __name__ == "__main__":
    main()
