"""A small training job for the agent's tests, run as a script (plain python or torchrun).

Fault injection by (rank, step), on the first attempt only unless --every-attempt:
  --fault hang        a time.sleep in the training loop (in inject_hang)
  --fault gil_hang    a C sleep with the GIL held (ctypes.PyDLL: the GIL is not released)
  --fault memory      a real MemoryError (allocating a petabyte)
  --fault gloo        the faulty rank skips a collective; the others hit the gloo timeout
  --fault data        the data set raises while the DataLoader fetches a batch
  --fault transient   ConnectionResetError once (for in-process restart)
  --fault sigterm     the process sends itself SIGTERM (as a scheduler would)
  --fault kill9       the process SIGKILLs itself (its peers fail in the next collective)
Prints nothing; writes "<out>/rank<R>.attempt<A>.json" with the final step and state sum.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import logging
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import elastic
from tests._exit import exit_now


def inject_hang(seconds: float) -> None:
    time.sleep(seconds)


def hang_with_gil(seconds: float) -> None:
    """Block in C for ``seconds`` with the GIL held, deaf to signals.

    PyDLL calls do not release the GIL; pthread_mutex_timedlock on a mutex this thread
    already holds waits out its deadline and, unlike sleep(), is not cut short by signals.
    """
    libc = ctypes.PyDLL(None)
    mutex = ctypes.create_string_buffer(64)  # zeroed == PTHREAD_MUTEX_INITIALIZER (glibc)
    libc.pthread_mutex_lock(mutex)
    deadline = time.time() + seconds
    ts = (ctypes.c_long * 2)(int(deadline), int((deadline % 1) * 1e9))
    libc.pthread_mutex_timedlock(mutex, ts)


class Data(torch.utils.data.Dataset):
    def __init__(self, bad_index: int | None) -> None:
        self.bad_index = bad_index

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad_index:
            raise ValueError(f"corrupt record {i}")
        g = torch.Generator().manual_seed(i)
        return torch.randn(4, generator=g)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--step-seconds", type=float, default=0.05)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--fault", default=None)
    p.add_argument("--fault-rank", type=int, default=0)
    p.add_argument("--fault-step", type=int, default=5)
    p.add_argument("--fault-seconds", type=float, default=30.0)
    p.add_argument("--every-attempt", action="store_true")
    p.add_argument("--on-hang", default="dump")
    p.add_argument("--hang-timeout", default="auto")
    p.add_argument("--restarts", type=int, default=0)
    p.add_argument("--pg-timeout", type=float, default=30.0)
    p.add_argument("--job-id", default=None)
    p.add_argument("--wait-for-storage", default="auto")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{os.environ.get('RANK', 0)} "
                        "%(name)s %(levelname)s %(message)s")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # a store prefix per torchrun attempt, so a restarted group can form
        from flashckpt.torch import init_process_group

        init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank = dist.get_rank() if world > 1 else 0
    ckpt = None
    if args.ckpt:
        from flashckpt.torch import Checkpointer
        ckpt = Checkpointer(args.ckpt, persist_every=1000, keep_last=3, job_id=args.job_id)
    hang_timeout = args.hang_timeout if args.hang_timeout == "auto" else float(args.hang_timeout)
    agent = elastic.start_agent(
        checkpointer=ckpt, hang_timeout=hang_timeout, heartbeat_interval=0.2, on_hang=args.on_hang,
        metrics_dir=os.path.join(args.out, "metrics"), max_inprocess_restarts=args.restarts,
        hang_floor_seconds=1.0, hang_multiplier=5.0, warmup_steps=2, warmup_timeout_seconds=20.0,
        backstop_grace_seconds=1.0, job_id=args.job_id if ckpt is None else None,
        wait_for_storage=args.wait_for_storage)
    faulty = rank == args.fault_rank and (attempt == 0 or args.every_attempt)
    fired = {"done": False}

    def train() -> int:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        start = 0
        if ckpt is not None:
            start = ckpt.load(state) or 0
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
        bad = (args.fault_step - 1) * 8 if faulty and args.fault == "data" else None
        loader = torch.utils.data.DataLoader(Data(bad), batch_size=8, shuffle=False)
        it = iter(loader)
        for _ in range(start):
            next(it)
        for step in range(start + 1, args.steps + 1):
            x = next(it)
            if faulty and step == args.fault_step and not fired["done"]:
                fired["done"] = True
                inject(args)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            if world > 1:
                for prm in model.parameters():
                    dist.all_reduce(prm.grad)
            opt.step()
            time.sleep(args.step_seconds)
            if ckpt is not None:
                ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
            else:
                agent.step()
        total = float(sum(p.detach().sum() for p in model.parameters()))
        with open(os.path.join(args.out, f"rank{rank}.attempt{attempt}.json"), "w") as f:
            json.dump({"step": args.steps, "sum": total, "params": [p.detach().tolist() for p in
                                                                    model.parameters()]}, f)
        return args.steps

    agent.run(train)
    if ckpt is not None:
        ckpt.wait()
        ckpt.close()
    agent.stop()
    if world > 1:
        dist.destroy_process_group()
    return 0


def inject(args: argparse.Namespace) -> None:
    fault = args.fault
    if fault == "hang":
        inject_hang(args.fault_seconds)
    elif fault == "gil_hang":
        hang_with_gil(args.fault_seconds)
    elif fault == "memory":
        bytearray(1 << 50)
    elif fault == "gloo":
        time.sleep(args.fault_seconds)  # the others' all_reduce times out
    elif fault == "transient":
        raise ConnectionResetError("injected transient network failure")
    elif fault == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    elif fault == "kill9":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault not in (None, "data"):
        raise SystemExit(f"unknown fault {fault}")


if __name__ == "__main__":
    exit_now(main())
