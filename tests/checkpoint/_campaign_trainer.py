"""One rank of the crash campaign's stand-in job, a process of its own (the driver forks it
from a server that imported torch already, ``tests._fork``; ``python -m`` runs it alike).

    python -m tests.checkpoint._campaign_trainer train DIR JOB --rank R --world W --store PATH ...
    python -m tests.checkpoint._campaign_trainer load  DIR JOB --rank R --world W --store PATH ...

``train`` saves steps 1, 2, 3, ... of a state whose every tensor holds the step number
(``tests.checkpoint._trainer.make_state``), printing ``saving N`` before and ``saved N``
after each ``save`` returned; with ``--close`` it stops after ``--steps`` saves and prints
``closing`` / ``closed`` around ``close()``. With ``--capture E`` the state changes only inside an optimizer's ``step()`` (one update a
step, ``--sleep`` seconds after the step began, printing ``updated N`` after it), every E-th step is saved, and ``save_on_failure``
is armed: a SIGTERM captures the last finished step. ``load`` prints ``loading``, loads, checks that
the state holds one whole step, and prints one JSON line ``{"step": ..., "source": ...,
"torn": ...}``; it then exits without ``close()`` (as a crashed restart would).

With ``--world 2`` the ranks form a gloo group through a FileStore at ``--store``, so the
checkpointer agrees on steps across ranks as in a real job. SIGUSR1 dumps every thread's
stack to stderr (the driver asks for it before killing a process it thinks hangs).
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import signal
import sys
import time

import torch

from tests.checkpoint._trainer import check, fill, make_state


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class _Fill(torch.optim.Optimizer):
    """An update that fills the state with the next step number inside ``step()``, as a real
    optimizer changes the parameters there only (the state's tensors are its parameters)."""

    def __init__(self, state: dict) -> None:
        self.tree = state
        super().__init__(list(state["model"].values()) + [state["half"]], {})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        fill(self.tree, self.tree["step"] + 1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["train", "load"])
    p.add_argument("dir")
    p.add_argument("job")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--store", default="")
    p.add_argument("--persist-every", type=int, default=1)
    p.add_argument("--memory-slots", type=int, default=2)
    p.add_argument("--mb", type=float, default=4.0)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds of each step before its update (--capture)")
    p.add_argument("--close", action="store_true")
    p.add_argument("--capture", type=int, default=0, help="save every N-th update, failure capture armed")
    a = p.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(1)
    if a.world > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"file://{a.store}", rank=a.rank, world_size=a.world,
                                timeout=datetime.timedelta(seconds=90))
    from flashckpt.torch import Checkpointer
    state = make_state(a.mb)
    ck = Checkpointer(a.dir, job_id=a.job, persist_every=a.persist_every, keep_last=3,
                      memory_slots=a.memory_slots)
    _say("ready")
    if a.role == "load":
        _say("loading")
        step = ck.load(state)
        torn = None
        if step is not None:
            try:
                if check(state) != step:
                    torn = f"load returned {step} but the state's step is {state['step']}"
            except AssertionError as exc:
                torn = str(exc)
        info = ck.last_load
        _say(json.dumps({"step": step, "source": getattr(info, "source", None), "torn": torn}))
        os._exit(0)  # no close(): the memory stays as a crashed restart leaves it
    update = None
    if a.capture:
        update = _Fill(state)
        ck.save_on_failure(lambda: state, optimizer=update)
    for step in range(1, a.steps + 1):
        if a.world > 1:  # ranks step together, as data-parallel training does (its gradient all-reduce)
            dist.barrier()
        if update is None:
            fill(state, step)
        else:
            time.sleep(a.sleep)  # forward and backward
            update.step()
            _say(f"updated {step}")
            if step % a.capture:
                continue
        _say(f"saving {step}")
        ck.save(step, state)
        _say(f"saved {step}")
    if a.close:
        _say("closing")
        from flashckpt import CheckpointError
        try:
            ck.close()
        except CheckpointError as exc:  # allowed (a named error), not a hang or a raw OSError
            _say(f"close raised {type(exc).__name__}: {exc}")
        _say("closed")
    _say("done")
    time.sleep(600)  # the driver kills us


if __name__ == "__main__":
    main()
