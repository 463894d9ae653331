"""A training stand-in for crash tests, run as a subprocess.

Every tensor of the state saved at step ``s`` is filled with ``s``, so a load can
prove it got one whole step and not a mix. Prints ``saved <s>`` after each save.

    python _trainer.py DIR JOB STEPS PERSIST_EVERY [MB] [--sleep S] [--close] [--linger S]
"""

import argparse
import sys
import time

import torch

from flashckpt.torch import Checkpointer


def make_state(mb: float, step: int = 0) -> dict:
    n = max(1, int(mb * 2**20 / 4 / 8))
    return {"model": {f"w{i}": torch.full((n,), float(step)) for i in range(8)},
            "half": torch.full((1000,), float(step), dtype=torch.bfloat16),
            "step": step, "meta": {"note": "x"}}


def fill(state: dict, step: int) -> None:
    for t in state["model"].values():
        t.fill_(step)
    state["half"].fill_(step)
    state["step"] = step


def check(state: dict) -> int:
    """The one step the whole state holds (raises if it holds a mix)."""
    step = state["step"]
    for name, t in list(state["model"].items()) + [("half", state["half"])]:
        if not bool((t == step).all()):
            raise AssertionError(f"{name} holds {t.unique()[:5].tolist()}, expected all {step}")
    return step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("job")
    p.add_argument("steps", type=int)
    p.add_argument("persist_every", type=int)
    p.add_argument("mb", type=float, nargs="?", default=4.0)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--close", action="store_true")
    p.add_argument("--linger", type=float, default=0.0, help="seconds to stay alive after the last save")
    p.add_argument("--start", type=int, default=1)
    p.add_argument("--memory-slots", type=int, default=2)
    a = p.parse_args()
    state = make_state(a.mb)
    ck = Checkpointer(a.dir, job_id=a.job, persist_every=a.persist_every, keep_last=2, memory_slots=a.memory_slots)
    for step in range(a.start, a.start + a.steps):
        fill(state, step)
        ck.save(step, state)
        print(f"saved {step}", flush=True)
        time.sleep(a.sleep)
    if a.close:
        ck.close()
    print("done", flush=True)
    time.sleep(a.linger)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
