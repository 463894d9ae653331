"""Failure capture under random kills: steps lost per kill, and exact restores.

    python benchmarks/capture_campaign.py [--kills 50] [--worlds 2,4] [--steps 120] [--save-every 50]
                                          [--seed 1] [--phases ...] [--json results/capture_campaign.json]

Each kill is one ``torchrun --standalone --nproc-per-node=W --max-restarts=1`` job of
``tests/capture/_train.py`` (DDP over gloo, ``DdpCheckpointer`` with memory saves every
``--save-every`` steps and ``save_on_failure``): a random rank is SIGKILLed at a random step, at
a random point of it (before its batch, in forward, in backward's all-reduce, inside the
optimizer update; or, with ``--phases raise``, its forward raises). torchrun restarts the job,
which loads and trains to the end. Per kill:

- the step loaded after the restart, and the steps lost: the newest step any rank finished
  (the killed step itself when the kill came inside an update, which the other ranks finish)
  minus the step loaded; without capture it would be the steps since the newest save;
- whether every rank's final weights equal those of an uninterrupted run of the same job
  (run first, once per world size: gloo's all-reduce order makes the floats a function of the
  world size), bit for bit: the data order is a function of the step, so this holds only if the
  restart resumed exactly at the loaded step.

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

import torch

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "tests" / "capture" / "_train.py"
PHASES = ["kill9-data", "kill9-forward", "kill9", "kill9-update"]  # kill9: in backward's all-reduce
"""The default faults; ``raise`` (a RuntimeError in the step's forward) may be chosen too (``--phases``)."""


def run_job(world: int, steps: int, save_every: int, work: Path, *faults: str) -> subprocess.CompletedProcess:
    out = work / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "--max-restarts=1", "--monitor-interval=0.1", str(TRAIN), str(work / "ckpt"), str(out), str(steps), "-",
           *faults]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "CAPTURE_SAVE_EVERY": str(save_every)})


def uninterrupted(world: int, steps: int, save_every: int) -> list[dict]:
    """Every rank's final weights of the job run without a fault."""
    with tempfile.TemporaryDirectory(prefix="flashckpt-capture-") as work:
        proc = run_job(world, steps, save_every, Path(work))
        if proc.returncode != 0:
            raise RuntimeError(f"the uninterrupted run failed: {proc.stderr[-3000:]}")
        return [torch.load(Path(work) / "out" / f"final{r}.pt") for r in range(world)]


def one_kill(world: int, steps: int, save_every: int, rank: int, step: int, phase: str, ref: list[dict]) -> dict:
    with tempfile.TemporaryDirectory(prefix="flashckpt-capture-") as work:
        out = Path(work) / "out"
        began = time.monotonic()
        proc = run_job(world, steps, save_every, Path(work), f"{phase}:{rank}:{step}:0")
        seconds = time.monotonic() - began
        finished = step if phase == "kill9-update" else step - 1
        result = {"world": world, "rank": rank, "step": step, "phase": phase, "seconds": seconds,
                  "returncode": proc.returncode, "last_finished": finished,
                  "lost_without_capture": finished - finished // save_every * save_every}
        if proc.returncode != 0:
            result["error"] = proc.stderr[-3000:]
            return result
        loaded = [json.loads((out / f"attempt1-rank{r}.json").read_text()) for r in range(world)]
        result["loaded"] = loaded[0]["step"] or 0
        result["captured"] = loaded[0]["captured"]
        result["same_on_every_rank"] = all(l == loaded[0] for l in loaded)
        result["lost"] = finished - result["loaded"]
        result["exact"] = all(all(torch.equal(torch.load(out / f"final{r}.pt")[k], v) for k, v in ref[r].items())
                              for r in range(world))
        return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=50, help="kills per world size")
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--phases", default=",".join(PHASES), help="faults to draw from (tests/capture/_train.py's "
                   "kinds: kill9-data, kill9-forward, kill9, kill9-update, raise)")
    p.add_argument("--json", default=str(REPO / "results" / "capture_campaign.json"))
    a = p.parse_args()
    rng = random.Random(a.seed)
    phases = a.phases.split(",")
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    for world in map(int, a.worlds.split(",")):
        ref = uninterrupted(world, a.steps, a.save_every)
        for i in range(a.kills):
            r = one_kill(world, a.steps, a.save_every, rng.randrange(world), rng.randint(2, a.steps - 1),
                         rng.choice(phases), ref)
            results.append(r)
            print(f"world {world} kill {i + 1}/{a.kills}: rank {r['rank']} step {r['step']} {r['phase']}: "
                  + (f"loaded {r['loaded']}{' (captured)' if r['captured'] else ''}, lost {r['lost']} "
                     f"(without capture {r['lost_without_capture']}), exact {r['exact']}, {r['seconds']:.0f}s"
                     if "error" not in r else f"FAILED rc {r['returncode']}"), flush=True)
            out.write_text(json.dumps(results, indent=2) + "\n")
        done = [r for r in results if r["world"] == world and "error" not in r]
        outside = [r["lost"] for r in done if r["phase"] != "kill9-update"]
        print(f"== world {world}: {len(done)}/{a.kills} restarts finished; steps lost per kill: mean "
              f"{statistics.mean([r['lost'] for r in done]) if done else float('nan'):.2f}, max "
              f"{max((r['lost'] for r in done), default=None)} (outside an update: max {max(outside, default=None)}); "
              f"without capture mean {statistics.mean([r['lost_without_capture'] for r in done]) if done else 0:.1f}; "
              f"exact restores {sum(r['exact'] for r in done)}/{len(done)}", flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
