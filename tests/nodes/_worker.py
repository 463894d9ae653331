"""One torchrun worker of the multi-node tests: a few DDP steps, a flash checkpoint every step.

    torchrun ... _worker.py --dir SHARED_DIR --steps N [--kill-rank R --kill-step S --kill-pause P]
                            [--replicas auto|0|1] [--per-rank] [--close-at-kill]

The process group comes from ``flashckpt.torch.init_process_group``. At step S every rank
writes a ``step`` event; the first time each rank gets there (a marker file per rank in
SHARED_DIR), rank R SIGKILLs itself and the other ranks spend P seconds on that step (R = -1:
every rank pauses, for a test that kills a whole node; with replicas on, a node's local rank 0
first waits until its node holds its ring predecessor's replica of step S). With ``--close-at-kill``
the ranks wait at step S instead until the test writes ``SHARED_DIR/go`` (after it killed a
node), then save step S + 1 and time ``close()``. Each process appends JSON lines to
``SHARED_DIR/events-<host>-<pid>.jsonl``: ``launch`` (before the process group), ``start``
(host, restart count, rank, seconds to form the group), ``restored`` (step, source, the addresses of the peers that sent
this rank a replica), ``step``, ``closed`` (seconds, the error or None, the warnings logged) and ``done``
(the model's bias, to check that every step counted exactly once).
"""

import argparse
import datetime
import faulthandler
import json
import logging
import os
import signal
import socket
import time

import torch
import torch.distributed as dist

from flashckpt import CheckpointError
from flashckpt.replicas._store import replica_index
from flashckpt.torch import Checkpointer, DdpCheckpointer, init_process_group
from tests._exit import exit_now


STACK_SECONDS = 45.0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--kill-pause", type=float, default=0.0,
                   help="the other ranks' step time at the kill step: longer than their agents take to "
                        "see the restart, so they are stopped by it rather than fail on the dead peer")
    p.add_argument("--pg-timeout", type=float, default=60.0)
    p.add_argument("--replicas", default="auto", help="the checkpointer's replicas: auto (None), 0 or 1")
    p.add_argument("--per-rank", action="store_true",
                   help="Checkpointer (every rank saves its own copy) instead of DdpCheckpointer")
    p.add_argument("--close-at-kill", action="store_true",
                   help="at the kill step wait for SHARED_DIR/go, save one more step and time close()")
    args = p.parse_args()
    log = os.path.join(args.dir, f"events-{socket.gethostname()}-{os.getpid()}.jsonl")

    def emit(**event) -> None:
        with open(log, "a") as f:
            f.write(json.dumps({**event, "time": time.time()}) + "\n")

    emit(event="launch", host=socket.gethostname(), restart_count=int(os.environ["TORCHELASTIC_RESTART_COUNT"]))
    # a worker still running after STACK_SECONDS (a round takes about 15 s) leaves its stacks where the
    # test's failure shows them
    stacks = open(os.path.join(args.dir, f"stacks-{socket.gethostname()}-{os.getpid()}.txt"), "w")
    faulthandler.dump_traceback_later(STACK_SECONDS, file=stacks)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # the test asks when it stalls
    began = time.monotonic()
    init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank = dist.get_rank()
    emit(event="start", host=socket.gethostname(), rank=rank, world=dist.get_world_size(),
         restart_count=int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
         master=f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
         agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE"), pg_seconds=time.monotonic() - began)

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    initial = model.bias.sum().item()
    replicas = None if args.replicas == "auto" else int(args.replicas)
    logged = _Logged()
    ckpt = (Checkpointer if args.per_rank else DdpCheckpointer)(os.path.join(args.dir, "ckpt"), persist_every=5,
                                                                replicas=replicas)
    state = {"model": model.state_dict(), "step": 0}
    step = ckpt.load(state) or 0
    if step:
        emit(event="restored", rank=rank, step=step, source=ckpt.last_load.source, peers=logged.fetched)
    while step < args.steps:
        step += 1
        grad = torch.full((16,), float(step))
        dist.all_reduce(grad)
        with torch.no_grad():
            model.bias -= 1e-3 * grad
        ckpt.save(step, {"model": model.state_dict(), "step": step})
        if step == args.kill_step:
            if ckpt.engine.replicas.endpoints and ckpt.engine.placement.local_rank == 0:
                _wait_replicated(ckpt.job_id, step)
            emit(event="step", rank=rank, step=step)
            if args.close_at_kill:
                _close_after_go(args.dir, ckpt, step + 1, {"model": model.state_dict(), "step": step + 1}, logged,
                                lambda **e: emit(rank=rank, **e))
                return
            if _first_time(os.path.join(args.dir, f"reached-{rank}")):  # once per rank and job
                if rank == args.kill_rank:
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(args.kill_pause)
        time.sleep(0.1)
    ckpt.close()
    emit(event="done", rank=rank, step=step, bias=model.bias.sum().item(), initial=initial)
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


class _Logged(logging.Handler):
    """What the library logs: the peers replicas were fetched from, and warnings."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.fetched: list[str] = []
        self.warnings: list[str] = []
        logging.getLogger("flashckpt").addHandler(self)
        logging.getLogger("flashckpt").setLevel(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("fetched step %d of rank %d from the replica on"):
            self.fetched.append(record.args[2])
        elif record.levelno >= logging.WARNING:
            self.warnings.append(record.getMessage())


def _close_after_go(shared: str, ckpt, step: int, state: dict, logged: _Logged, emit, timeout: float = 60.0) -> None:
    """Once the test wrote ``shared/go`` (it killed a node), save ``step`` and time ``close()``."""
    go = os.path.join(shared, "go")
    deadline = time.monotonic() + timeout
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.05)
    ckpt.save(step, state)
    began, error = time.monotonic(), None
    try:
        ckpt.close()
    except CheckpointError as exc:
        error = f"{type(exc).__name__}: {exc}"
    emit(event="closed", step=step, seconds=time.monotonic() - began, error=error, warnings=logged.warnings)


def _wait_replicated(job_id: str, step: int, timeout: float = 20.0) -> None:
    """Until this node holds its ring predecessor's replica of ``step`` (the test kills after it)."""
    deadline = time.monotonic() + timeout
    while not any(h.step == step for _, h in replica_index(job_id)) and time.monotonic() < deadline:
        time.sleep(0.02)


def _first_time(marker: str) -> bool:
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


if __name__ == "__main__":
    main()
    exit_now()  # gloo groups still referenced can abort interpreter teardown
