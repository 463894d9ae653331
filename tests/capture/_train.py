"""Deterministic training with failure capture, for the capture tests.

    python _train.py CKPT OUT STEPS ATTEMPT [FAULT ...]
    torchrun --nproc-per-node=2 --max-restarts=2 _train.py CKPT OUT STEPS - [FAULT ...]

Saves to memory every 20 steps (``save_on_failure`` registered after the load). Under
torchrun (``WORLD_SIZE`` set) the model is DDP over gloo and the attempt is the largest
restart count of the job's agents (on several nodes only the agent whose worker failed
counts the restart); else one process with a ``Checkpointer`` and ATTEMPT as given.
A FAULT is ``KIND:RANK:STEP:ATTEMPT``, done by that rank at that step of that attempt:

- ``kill9``: SIGKILL inside the step's backward; ``kill9-data`` before its batch is made,
  ``kill9-forward`` inside its forward, ``kill9-update`` inside its optimizer update;
- ``raise``: a RuntimeError in the step's forward;
- ``term``: SIGTERM to itself right after the step's optimizer update;
- ``term-update``: SIGTERM to itself inside the step's optimizer update;
- ``term-early``: SIGTERM before the first optimizer step (STEP ignored);
- ``term-blocked``: after the step's update, SIGTERM from another thread while the main
  thread waits inside a C++ call (a TCPStore wait) that does not return to Python;
- ``term-job``: SIGTERM to the parent (torchrun's agent, which forwards it to every worker and
  ends the job) inside the step's backward; ``term-job-data``, ``-forward``, ``-update`` as for kill9;
- ``rewrap``: a control, no failure: the DDP wrapper is made anew before the step, so the step
  runs as a restart's first step does (RANK ``*``: every rank, as it must be).

With ``CAPTURE_ACCUMULATE=N`` (default 1) the loop accumulates gradients over N micro-batches
(DDP's ``no_sync()`` on all but the last) and updates at every N-th: STEP (faults, saves, STEPS)
counts micro-batches, and ``save_on_failure`` gets ``steps_per_update=N``. With
``CAPTURE_BATCHNORM`` set the model normalizes its input with a BatchNorm1d first (``Normed``):
running statistics that every forward changes, outside the optimizer.

Each rank writes ``OUT/attempt<A>-rank<R>.json`` (what it loaded) after the load and
``OUT/final<R>.pt`` (the model's weights) at the end. ``CAPTURE_ATTEMPT_OFFSET`` is added to
the attempt (a second torchrun on the same checkpoints, where the first one's faults must not
fire again); ``CAPTURE_DDP`` is DDP's keyword arguments as JSON. With ``CAPTURE_RECORD`` set each
rank also writes ``OUT/attempt<A>-loaded<R>.pt`` (the weights and Adam state right after the
load, and the first step run), ``OUT/attempt<A>-steps<R>.pt`` (the same after every step, by
step) and ``OUT/attempt<A>-progress<R>`` (the last finished step, rewritten as each update ends).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Callable

import torch

SAVE_EVERY = int(os.environ.get("CAPTURE_SAVE_EVERY", "20"))  # benchmarks/capture_campaign.py sets 50
ACCUMULATE = int(os.environ.get("CAPTURE_ACCUMULATE", "1"))  # micro-batches per optimizer update
BATCHNORM = bool(os.environ.get("CAPTURE_BATCHNORM"))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)


class Normed(torch.nn.Linear):
    """``Linear(8, 1)`` over a ``BatchNorm1d(8)`` of its input (the same initial weights: the
    norm draws no random numbers)."""

    def __init__(self) -> None:
        super().__init__(8, 1)
        self.norm = torch.nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.norm(x))


def make(batchnorm: bool = BATCHNORM) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # every rank starts from the same weights, as DDP requires
    model = Normed() if batchnorm else torch.nn.Linear(8, 1)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _loss(net: torch.nn.Module, rank: int, step: int, accumulate: int) -> torch.Tensor:
    x, y = batch(rank, step)
    loss = torch.nn.functional.mse_loss(net(x), y)
    return loss / accumulate if accumulate > 1 else loss


def reference(world: int, steps: int, accumulate: int = 1, batchnorm: bool = False) -> list[dict[str, torch.Tensor]]:
    """Each rank's state dict at the end of an uninterrupted run of ``steps`` micro-batches,
    ``accumulate`` per update: each update's gradient is the mean of the ranks' accumulated
    gradients, as DDP's all-reduce makes it (``g/world`` summed: the same floats). Module
    buffers as DDP keeps them: rank 0's broadcast before an update's first forward (the
    others follow a ``no_sync`` forward, which broadcasts nothing), then each rank's own."""
    model, opt = make(batchnorm)
    ends = [dict(model.named_buffers())]
    for update in range(steps // accumulate):
        grads, ends = [], [{name: b.clone() for name, b in ends[0].items()} for _ in range(world)]
        for rank in range(world):
            model.zero_grad()
            for name, b in model.named_buffers():
                b.copy_(ends[rank][name])
            for step in range(update * accumulate + 1, (update + 1) * accumulate + 1):
                _loss(model, rank, step, accumulate).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            ends[rank] = {name: b.clone() for name, b in model.named_buffers()}
        for i, p in enumerate(model.parameters()):
            p.grad = sum(g[i] / world for g in grads)
        opt.step()
    return [{**{k: v.clone() for k, v in model.state_dict().items()}, **ends[rank]} for rank in range(world)]


def _blocked_in_cpp() -> None:
    """SIGTERM from another thread while this (main) thread sits in a C++ wait."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60))
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    store.wait(["never-set"])
    print("the C++ wait returned", file=sys.stderr)


def _once(act: Callable[[], None]) -> Callable[..., None]:
    """``act`` as a hook that acts the first time only (a signal to the agent is sent once)."""
    done: list[bool] = []

    def fire(*_: object) -> None:
        if not done:
            done.append(True)
            act()
    return fire


ACTIONS: dict[str, Callable[[], None]] = {
    "kill9": lambda: os.kill(os.getpid(), signal.SIGKILL),
    "term-job": lambda: os.kill(os.getppid(), signal.SIGTERM),
}


def _arm(fault: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Arm a ``kill9*`` or ``term-job*`` fault at its point of this step (``-data``: now)."""
    for name, act in ACTIONS.items():
        if fault != name and not fault.startswith(name + "-"):
            continue
        point, fire = fault[len(name) + 1:], _once(act)
        if point == "":
            model.weight.register_hook(lambda g: fire())
        elif point == "data":
            fire()
        elif point == "forward":
            model.register_forward_pre_hook(fire)
        elif point == "update":
            opt.register_step_pre_hook(fire)


def _faults(specs: list[str], rank: int, attempt: int) -> dict[int, str]:
    """This rank's faults of this attempt, by step."""
    faults = {}
    for spec in specs:
        kind, f_rank, f_step, f_attempt = spec.split(":")
        if f_rank in ("*", str(rank)) and int(f_attempt) == attempt:
            faults[int(f_step)] = kind
    return faults


def _attempt() -> int:
    """The job's attempt under torchrun (a collective): the largest restart count of any rank's
    agent, plus ``CAPTURE_ATTEMPT_OFFSET``. On one node every rank has the same count; on
    several, an agent whose workers the next rendezvous round stopped restarts them uncounted
    (``tests/nodes/test_nodes_restart.py``), so its ranks alone would run attempt 0 again."""
    import torch.distributed as dist

    count = torch.tensor([int(os.environ["TORCHELASTIC_RESTART_COUNT"])])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item()) + int(os.environ.get("CAPTURE_ATTEMPT_OFFSET", "0"))


def _wrap(model: torch.nn.Module) -> torch.nn.Module:
    return torch.nn.parallel.DistributedDataParallel(model, **json.loads(os.environ.get("CAPTURE_DDP", "{}")))


class Recorder:
    """What ``CAPTURE_RECORD`` asks for: the state at the load, after every step, the progress."""

    def __init__(self, out: str, attempt: int, rank: int) -> None:
        self.prefix = os.path.join(out, f"attempt{attempt}-")
        self.rank = rank
        self.on = bool(os.environ.get("CAPTURE_RECORD"))
        self.steps: dict[int, dict] = {}
        self.fd = os.open(f"{self.prefix}progress{rank}", os.O_CREAT | os.O_WRONLY) if self.on else -1

    @staticmethod
    def state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
        return copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()["state"]})

    def loaded(self, start: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        if self.on:
            self.steps[start] = self.state(model, opt)
            torch.save({**self.steps[start], "first_step": start + 1}, f"{self.prefix}loaded{self.rank}.pt")

    def watch(self, opt: torch.optim.Optimizer, now: dict[str, int]) -> None:
        """Write the progress as the update ends (a hook before failure capture's, so a SIGTERM
        right after the update finds it written)."""
        if self.on:
            opt.register_step_post_hook(lambda *_: os.pwrite(self.fd, f"{now['step']:<12d}".encode(), 0))

    def step(self, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        if self.on:
            self.steps[step] = self.state(model, opt)

    def close(self) -> None:
        if self.on:
            torch.save(self.steps, f"{self.prefix}steps{self.rank}.pt")
            os.close(self.fd)


def main() -> None:
    import torch.distributed as dist
    from flashckpt.torch import Checkpointer, DdpCheckpointer, init_process_group

    logging.basicConfig(level=logging.INFO, format="%(process)d %(name)s %(levelname)s %(message)s")
    directory, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        init_process_group("gloo")
        attempt, rank = _attempt(), dist.get_rank()
    else:
        attempt, rank = int(sys.argv[4]), 0
    faults = _faults(sys.argv[5:], rank, attempt)

    model, opt = make()
    net = _wrap(model) if distributed else model
    ckpt = (DdpCheckpointer if distributed else Checkpointer)(directory, persist_every=1000)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    start = ckpt.load(state) or 0
    opt.load_state_dict(state["optim"])
    loaded = ckpt.last_load
    report = {"step": loaded.step, "source": loaded.source, "captured": False}
    if loaded.source == "memory":
        report["captured"] = bool(ckpt.engine.memory_info(loaded.step).get("captured"))
    with open(os.path.join(out, f"attempt{attempt}-rank{rank}.json"), "w") as f:
        json.dump(report, f)
    record = Recorder(out, attempt, rank)
    record.loaded(start, model, opt)
    now = {"step": 0}
    record.watch(opt, now)

    per_update = {"steps_per_update": ACCUMULATE} if ACCUMULATE > 1 else {}  # the default as the contract has it
    ckpt.save_on_failure(lambda: {"model": model.state_dict(), "optim": opt.state_dict()}, optimizer=opt, **per_update)
    if "term-early" in faults.values():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    for step in range(start + 1, steps + 1):
        now["step"] = step
        fault = faults.get(step, "")
        _arm(fault, model, opt)
        if fault == "term-update":
            opt.register_step_pre_hook(lambda *_: os.kill(os.getpid(), signal.SIGTERM))
        if fault == "raise":
            raise RuntimeError(f"injected failure at step {step}")
        if fault == "rewrap":
            net = _wrap(model)
        if (step - 1) % ACCUMULATE == 0:
            opt.zero_grad()
        updates = step % ACCUMULATE == 0
        with net.no_sync() if distributed and not updates else contextlib.nullcontext():
            _loss(net, rank, step, ACCUMULATE).backward()
        if updates:
            opt.step()
        record.step(step, model, opt)
        if fault == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        if fault == "term-blocked":
            _blocked_in_cpp()
        if step % SAVE_EVERY == 0:
            ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
    ckpt.close()
    record.close()
    torch.save(model.state_dict(), os.path.join(out, f"final{rank}.pt"))
    if distributed:
        dist.destroy_process_group()

if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no finalization, where torch's gloo teardown can abort (see tests/_exit.py)
