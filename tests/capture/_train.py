"""Deterministic training with failure capture, for the capture tests.

    python _train.py CKPT OUT STEPS ATTEMPT [FAULT ...]
    torchrun --nproc-per-node=2 --max-restarts=2 _train.py CKPT OUT STEPS - [FAULT ...]

Saves to memory every 20 steps (``save_on_failure`` registered after the load). Under
torchrun (``WORLD_SIZE`` set) the model is DDP over gloo and the attempt is torchrun's
restart count; else one process with a ``Checkpointer`` and ATTEMPT as given.
A FAULT is ``KIND:RANK:STEP:ATTEMPT``, done by that rank at that step of that attempt:

- ``kill9``: SIGKILL inside the step's backward; ``kill9-data`` before its batch is made,
  ``kill9-forward`` inside its forward, ``kill9-update`` inside its optimizer update;
- ``raise``: a RuntimeError in the step's forward;
- ``term``: SIGTERM to itself right after the step's optimizer update;
- ``term-update``: SIGTERM to itself inside the step's optimizer update;
- ``term-early``: SIGTERM before the first optimizer step (STEP ignored);
- ``term-blocked``: after the step's update, SIGTERM from another thread while the main
  thread waits inside a C++ call (a TCPStore wait) that does not return to Python.

Each rank writes ``OUT/attempt<A>-rank<R>.json`` (what it loaded) after the load and
``OUT/final<R>.pt`` (the model's weights) at the end.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch

SAVE_EVERY = int(os.environ.get("CAPTURE_SAVE_EVERY", "20"))  # benchmarks/capture_campaign.py sets 50


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # every rank starts from the same weights, as DDP requires
    model = torch.nn.Linear(8, 1)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def reference(world: int, steps: int) -> dict[str, torch.Tensor]:
    """The weights of an uninterrupted run: each step's gradient is the mean of the
    ranks' gradients, as DDP's all-reduce makes it (``g/world`` summed: the same floats)."""
    model, opt = make()
    for step in range(1, steps + 1):
        grads = []
        for rank in range(world):
            model.zero_grad()
            x, y = batch(rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = sum(g[i] / world for g in grads)
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _blocked_in_cpp() -> None:
    """SIGTERM from another thread while this (main) thread sits in a C++ wait."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60))
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    store.wait(["never-set"])
    print("the C++ wait returned", file=sys.stderr)


def main() -> None:
    import torch.distributed as dist
    from flashckpt.torch import Checkpointer, DdpCheckpointer, init_process_group

    logging.basicConfig(level=logging.INFO, format="%(process)d %(name)s %(levelname)s %(message)s")
    directory, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        init_process_group("gloo")
        rank = dist.get_rank()
    else:
        attempt, rank = int(sys.argv[4]), 0
    faults = {}
    for spec in sys.argv[5:]:
        kind, f_rank, f_step, f_attempt = spec.split(":")
        if int(f_rank) == rank and int(f_attempt) == attempt:
            faults[int(f_step)] = kind

    model, opt = make()
    net = torch.nn.parallel.DistributedDataParallel(model) if distributed else model
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

    ckpt.save_on_failure(lambda: {"model": model.state_dict(), "optim": opt.state_dict()}, optimizer=opt)
    now = {"step": 0}
    if "term-early" in faults.values():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    for step in range(start + 1, steps + 1):
        now["step"] = step
        fault = faults.get(step)
        if fault == "kill9":
            model.weight.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
        if fault == "kill9-data":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "kill9-forward":
            model.register_forward_pre_hook(lambda *_: os.kill(os.getpid(), signal.SIGKILL))
        if fault == "kill9-update":
            opt.register_step_pre_hook(lambda *_: os.kill(os.getpid(), signal.SIGKILL))
        if fault == "term-update":
            opt.register_step_pre_hook(lambda *_: os.kill(os.getpid(), signal.SIGTERM))
        if fault == "raise":
            raise RuntimeError(f"injected failure at step {step}")
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        if fault == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        if fault == "term-blocked":
            _blocked_in_cpp()
        if step % SAVE_EVERY == 0:
            ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
    ckpt.close()
    torch.save(model.state_dict(), os.path.join(out, f"final{rank}.pt"))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no finalization, where torch's gloo teardown can abort (see tests/_exit.py)
