"""Failure capture under random kills: steps lost per kill, and exact restores.

    python benchmarks/capture_campaign.py [--kills 50] [--worlds 2,4] [--mode kill|term-job] [--steps 120]
                                          [--save-every 50] [--seed 1] [--phases ...] [--ddp JSON]
                                          [--nodes 1|2] [--json results/capture_campaign.json]

Each kill is one ``torchrun --standalone --nproc-per-node=W`` job of ``tests/capture/_train.py``
(DDP over gloo, ``DdpCheckpointer`` with memory saves every ``--save-every`` steps and
``save_on_failure``) that fails at a random step, at a random point of it (before its batch, in
forward, in backward's all-reduce, inside the optimizer update):

- ``--mode kill``: a random rank is SIGKILLed (or, with ``--phases raise``, its forward raises)
  and torchrun (``--max-restarts=1``) restarts the job;
- ``--mode term-job``: a random rank sends SIGTERM to torchrun's agent, its parent, which
  forwards it to every worker and ends the job; a second torchrun on the same checkpoints
  resumes (``CAPTURE_ATTEMPT_OFFSET=1``: the first run's fault does not fire again).

``--nodes 2`` (root; ``--mode kill``): each job runs on two namespace nodes of
``tests/nodes/_netns.py`` (a network and mount namespace each, a private ``/dev/shm``, ``/tmp``
shared, so the checkpoint directory is one shared directory), one torchrun per node with W/2
workers and a c10d rendezvous on node0 (``tests/nodes/_torchrun.py``); the uninterrupted run
too. ``DdpCheckpointer`` then keeps one copy per node, and its peer-memory replicas (on by
default on two nodes) copy each node's newest step into the other node's memory: a capture on
the node that survived reaches the killed rank's node only that way. Each kill's record also
says where every rank loaded from and what the restart logged about replicas and captures.

The restart loads and trains to the end. Per kill:

- the steps lost: the newest step any rank finished (each rank records its progress) minus the
  step loaded; without capture it would be the steps since the newest save;
- exact at load: every rank's weights and Adam state right after the load equal the
  uninterrupted run's after that step, bit for bit, and its first step is the one after it
  (the data order is a function of the step);
- final exact: every rank's final weights equal the uninterrupted run's, bit for bit (it runs
  first, once per world size: gloo's all-reduce order makes the floats a function of the world
  size). Where they do not, the final weights are compared with a control run without failure
  whose DDP wrapper is made anew before the step after the loaded one (``rewrap``): a
  restart's fresh DDP reduces its first iterations in its initial bucket order, not the rebuilt
  one, which on 4 gloo ranks rounds differently; identical to the control means the restart
  itself was exact. A bucket per parameter (``--ddp '{"find_unused_parameters": true,
  "bucket_cap_mb": 1e-6}'``) makes both orders the same: then restarts end bit for bit.

Prints one line per kill and a summary per world size; writes every kill to JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests.nodes, for --nodes
TRAIN = REPO / "tests" / "capture" / "_train.py"
PHASES = {
    "kill": ["kill9-data", "kill9-forward", "kill9", "kill9-update"],  # kill9: in backward's all-reduce
    "term-job": ["term-job-data", "term-job-forward", "term-job", "term-job-update"],
}
"""The default faults per mode; ``raise`` (a RuntimeError in the step's forward) may be chosen too (``--phases``)."""
JOB_SECONDS = 600
NOTES = ("fetched step", "was captured at a failure", "peer replicas failed", "falling back")
"""What the restart's logs say about replicas and captures, kept with each kill (``notes``)."""


def run_job(work: Path, world: int, steps: int, save_every: int, *faults: str, restarts: int = 1, offset: int = 0,
            ddp: str = "{}", nodes: int = 1) -> subprocess.CompletedProcess:
    """One torchrun of the training in ``work`` (checkpoints in ``work/ckpt``, its files in ``work/out``);
    on ``nodes`` namespace nodes, one torchrun per node (:func:`on_nodes`)."""
    out = work / "out"
    out.mkdir(exist_ok=True)
    script = [str(TRAIN), str(work / "ckpt"), str(out), str(steps), "-", *faults]
    env = {**os.environ, "CAPTURE_SAVE_EVERY": str(save_every), "CAPTURE_RECORD": "1",
           "CAPTURE_ATTEMPT_OFFSET": str(offset), "CAPTURE_DDP": ddp}
    if nodes > 1:
        return on_nodes(work, nodes, world // nodes, restarts, script, env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           f"--max-restarts={restarts}", "--monitor-interval=0.1", *script]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_SECONDS, env=env)


def on_nodes(work: Path, count: int, nproc: int, restarts: int, script: list[str],
             env: dict[str, str]) -> subprocess.CompletedProcess:
    """``script`` under torchrun on ``count`` new namespace nodes of ``nproc`` workers each
    (``tests/nodes``: c10d rendezvous on node0), until every agent exits; the nodes and every
    process left in them are removed when it returns. The return code is the first nonzero
    agent's (124 past ``JOB_SECONDS``); stderr holds every node's log, node by node."""
    from tests.nodes._netns import Nodes
    from tests.nodes._torchrun import agent_argv

    env = {**env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    logs = [work / f"torchrun-node{i}.log" for i in range(count)]
    with Nodes(count) as nodes:
        argv = agent_argv(nodes, script, nproc=nproc, max_restarts=restarts, options=("--monitor-interval=0.1",))
        agents = []
        for i, log in enumerate(logs):
            with open(log, "w") as f:
                agents.append(nodes.spawn(i, argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT))
        end = time.monotonic() + JOB_SECONDS
        codes = []
        for agent in agents:
            try:
                codes.append(agent.wait(timeout=max(1.0, end - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(124)
    text = "".join(f"--- node{i}'s torchrun ---\n{log.read_text(errors='replace')}" for i, log in enumerate(logs))
    return subprocess.CompletedProcess(argv, next((c for c in codes if c), 0), "", text)


def equal(a: Any, b: Any) -> bool:
    """Bit-for-bit equality of nested dicts of tensors."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def finals(out: Path, world: int) -> list[dict]:
    return [torch.load(out / f"final{r}.pt") for r in range(world)]


def uninterrupted(world: int, steps: int, save_every: int, *faults: str, ddp: str = "{}", nodes: int = 1) -> dict:
    """Every rank's final weights of the job run without a failure (``faults``: a control
    such as ``rewrap``), and its weights and Adam state after every step."""
    with tempfile.TemporaryDirectory(prefix="flashckpt-capture-") as work:
        out = Path(work) / "out"
        proc = run_job(Path(work), world, steps, save_every, *faults, ddp=ddp, nodes=nodes)
        if proc.returncode != 0:
            raise RuntimeError(f"the uninterrupted run failed: {proc.stderr[-3000:]}")
        return {"final": finals(out, world), "steps": [torch.load(out / f"attempt0-steps{r}.pt") for r in range(world)]}


class Reference:
    """The uninterrupted run of a world size, and fresh-DDP controls (``rewrap`` before a step) on demand."""

    def __init__(self, world: int, steps: int, save_every: int, ddp: str, nodes: int = 1) -> None:
        self.world, self.steps, self.save_every, self.ddp, self.nodes = world, steps, save_every, ddp, nodes
        self.run = uninterrupted(world, steps, save_every, ddp=ddp, nodes=nodes)
        self.controls: dict[int, list[dict]] = {}

    def control(self, step: int) -> list[dict]:
        """The final weights of the uninterrupted run whose DDP wrapper is made anew before ``step``."""
        if step not in self.controls:
            self.controls[step] = uninterrupted(self.world, self.steps, self.save_every, f"rewrap:*:{step}:0",
                                                ddp=self.ddp, nodes=self.nodes)["final"]
        return self.controls[step]


def launch(work: Path, ref: Reference, mode: str, fault: str) -> tuple[subprocess.CompletedProcess, str]:
    """The failed job and its restart: torchrun's own restart (kill), or a second torchrun on the
    same checkpoints after SIGTERM ended the first (term-job). Returns the restart's run and the
    first run's stderr."""
    args = (work, ref.world, ref.steps, ref.save_every, fault)
    if mode == "kill":
        proc = run_job(*args, ddp=ref.ddp, nodes=ref.nodes)
        return proc, proc.stderr
    first = run_job(*args, restarts=0, ddp=ref.ddp)
    return run_job(*args, restarts=0, offset=1, ddp=ref.ddp), first.stderr


def judge(out: Path, ref: Reference, result: dict) -> None:
    """The restart's load and final weights against the uninterrupted run, into ``result``."""
    world = ref.world
    loaded = [json.loads((out / f"attempt1-rank{r}.json").read_text()) for r in range(world)]
    step = result["loaded"] = loaded[0]["step"] or 0
    # any rank's: before the fix in flashckpt.memory._rank_slots.writer a copy fetched from a peer's replica lost the mark
    result["captured"] = any(l["captured"] for l in loaded)
    result["captured_on"] = [r for r, l in enumerate(loaded) if l["captured"]]
    result["same_on_every_rank"] = len({(l["step"], l["source"]) for l in loaded}) == 1
    result["sources"] = [l["source"] for l in loaded]
    result["fetched_replica"] = any("fetched step" in n for n in result["notes"])
    result["lost"] = result["last_finished"] - step
    at_load = [torch.load(out / f"attempt1-loaded{r}.pt") for r in range(world)]
    result["exact_at_load"] = all(equal(s["model"], ref.run["steps"][r][step]["model"]) for r, s in enumerate(at_load))
    result["optim_exact_at_load"] = all(equal(s["optim"], ref.run["steps"][r][step]["optim"])
                                        for r, s in enumerate(at_load))
    result["data_order"] = all(s["first_step"] == step + 1 for s in at_load)
    final = finals(out, world)
    result["exact"] = all(equal(f, g) for f, g in zip(final, ref.run["final"]))
    if not result["exact"]:
        result["as_fresh_ddp"] = all(equal(f, g) for f, g in zip(final, ref.control(step + 1)))


def one_kill(ref: Reference, mode: str, rank: int, step: int, phase: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="flashckpt-capture-") as work:
        out = Path(work) / "out"
        began = time.monotonic()
        proc, first_err = launch(Path(work), ref, mode, f"{phase}:{rank}:{step}:0")
        result = {"world": ref.world, "nodes": ref.nodes, "mode": mode, "rank": rank, "step": step, "phase": phase,
                  "seconds": time.monotonic() - began, "returncode": proc.returncode,
                  "notes": [l for l in proc.stderr.splitlines() if any(n in l for n in NOTES)]}
        progress = [out / f"attempt0-progress{r}" for r in range(ref.world)]
        finished = max(int(p.read_text() or 0) if p.exists() else 0 for p in progress)
        result.update(last_finished=finished, lost_without_capture=finished % ref.save_every,
                      in_update=(mode == "kill" and phase.endswith("-update"))
                      or "inside an optimizer update" in first_err)
        if proc.returncode != 0:
            result["error"] = proc.stderr[-3000:]
            return result
        try:
            judge(out, ref, result)
        except OSError as exc:  # a rank wrote no record of its restart: one kill's failure, not the campaign's
            result["error"] = f"{exc}\n{proc.stderr[-3000:]}"
        return result


def exact_at_load(r: dict) -> bool:
    """Weights, Adam state and data order right after the restart's load are the uninterrupted run's."""
    return r["exact_at_load"] and r["optim_exact_at_load"] and r["data_order"]


def line(r: dict) -> str:
    if "error" in r:  # rc 0: the restart ran, but its records are missing (the error's first line says which)
        return f"FAILED rc {r['returncode']}" + (f": {r['error'].splitlines()[0]}" if r["returncode"] == 0 else "")
    fresh = {True: " (identical to a fresh-DDP control: the restart is exact)",
             False: " (differs from the fresh-DDP control too)"}.get(r.get("as_fresh_ddp"), "")
    sources = "/".join(dict.fromkeys(r["sources"])) + (" (a node fetched it from its peer's replica)"
                                                       if r["fetched_replica"] else "")
    return (f"finished {r['last_finished']}, loaded {r['loaded']}{' (captured)' if r['captured'] else ''} "
            f"from {sources}, "
            f"lost {r['lost']} (without capture {r['lost_without_capture']}), exact at load "
            f"{exact_at_load(r)}, final exact {r['exact']}{fresh}, "
            f"{r['seconds']:.0f}s")


def summary(done: list[dict], n: int) -> str:
    """One setting's numbers: steps lost, and exactness at the load and at the end."""
    if not done:
        return f"0/{n} restarts finished"
    lost = [r["lost"] for r in done]
    outside = [r["lost"] for r in done if not r["in_update"]]
    inexact = [r for r in done if not r["exact"]]
    return (f"{len(done)}/{n} restarts finished; steps lost per kill: mean {statistics.mean(lost):.2f}, max "
            f"{max(lost)} (outside an update: {len(outside)} kills, max {max(outside, default=None)}); without "
            f"capture mean {statistics.mean(r['lost_without_capture'] for r in done):.1f}; exact at load "
            f"(weights, Adam state, data order) {sum(map(exact_at_load, done))}/{len(done)}; "
            f"final exact {len(done) - len(inexact)}/{len(done)}; of the inexact, identical to the fresh-DDP control "
            f"{sum(r['as_fresh_ddp'] for r in inexact)}/{len(inexact)}" + (
                f"; a node fetched the loaded step from its peer's replica in "
                f"{sum(r['fetched_replica'] for r in done)}/{len(done)}" if done[0]["nodes"] > 1 else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=50, help="kills per world size")
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--mode", choices=sorted(PHASES), default="kill")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--phases", help="faults to draw from (tests/capture/_train.py's kinds: kill9-data, kill9-forward, "
                   "kill9, kill9-update, raise; term-job-data, ...); default: the mode's four")
    p.add_argument("--ddp", default="{}", help="DDP's keyword arguments, as JSON")
    p.add_argument("--nodes", type=int, default=1, help="namespace nodes per job (root; --mode kill); each world "
                   "size is spread evenly over them")
    p.add_argument("--json", help="default: results/capture_campaign.json (one node), "
                   "results/capture_campaign-nodes<N>.json")
    a = p.parse_args()
    worlds = [int(w) for w in a.worlds.split(",")]
    if a.nodes > 1:
        from tests.nodes._netns import missing_requirements
        if why := missing_requirements():
            p.error(f"--nodes {a.nodes}: {why}")
        if a.mode != "kill":
            p.error("--nodes runs --mode kill only: term-job's second torchrun would start on new nodes, whose "
                    "/dev/shm holds nothing")
        if any(w % a.nodes for w in worlds):
            p.error(f"every world size must be a multiple of --nodes {a.nodes}")
    rng = random.Random(a.seed)
    phases = a.phases.split(",") if a.phases else PHASES[a.mode]
    out = Path(a.json or REPO / "results" / ("capture_campaign.json" if a.nodes == 1
                                             else f"capture_campaign-nodes{a.nodes}.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    where = "" if a.nodes == 1 else f" on {a.nodes} nodes"
    for world in worlds:
        ref = Reference(world, a.steps, a.save_every, a.ddp, a.nodes)
        for i in range(a.kills):
            r = one_kill(ref, a.mode, rng.randrange(world), rng.randint(2, a.steps - 1), rng.choice(phases))
            results.append(r)
            node = "" if a.nodes == 1 else f" (node{r['rank'] // (world // a.nodes)})"
            print(f"world {world}{where} {a.mode} {i + 1}/{a.kills}: rank {r['rank']}{node} step {r['step']} "
                  f"{r['phase']}: {line(r)}", flush=True)
            out.write_text(json.dumps(results, indent=2) + "\n")
        done = [r for r in results if r["world"] == world and "error" not in r]
        print(f"== world {world}{where}, {a.mode}: {summary(done, a.kills)}", flush=True)
    print(f"wrote {out}")

if __name__ == "__main__":
    main()
