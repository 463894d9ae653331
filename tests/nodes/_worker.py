"""One torchrun worker of the multi-node tests: a few DDP steps, a flash checkpoint every step.

    torchrun ... _worker.py --dir SHARED_DIR --steps N [--kill-rank R --kill-step S --kill-pause P]
                            [--replicas auto|0|1] [--per-rank | --fsdp | --deepspeed [--zero-stage 1|2|3]]
                            [--close-at-kill]

The process group comes from ``flashckpt.torch.init_process_group``. At step S every rank
writes a ``step`` event; the first time each rank gets there (a marker file per rank in
SHARED_DIR), rank R SIGKILLs itself and the other ranks spend P seconds on that step (R = -1:
every rank pauses, for a test that kills a whole node; with replicas on, a node's local rank 0
first waits until its node holds its ring predecessor's replica of step S). With ``--close-at-kill``
the ranks wait at step S instead until the test writes ``SHARED_DIR/go`` (after it killed a
node), then save step S + 1 and time ``close()``. Each process appends JSON lines to
``SHARED_DIR/events-<host>-<pid>.jsonl``: ``launch`` (before the process group), ``start``
(host, restart count, rank, seconds to form the group), ``restored`` (step, source, the addresses of the peers that sent
this rank a replica, a digest of its training state), ``step`` (with that digest at the kill step),
``closed`` (seconds, the error or None, the warnings logged) and ``done`` (the model's bias, to check
that every step counted exactly once, the state's digest and the warnings logged).

``--fsdp``: the model sharded with FSDP2 and saved by ``FsdpCheckpointer`` (sharded state:
every rank's shard is needed), stepped by SGD with the same update to the bias. ``--deepspeed``:
ZeRO (stage ``--zero-stage``, default 1) and ``DeepSpeedCheckpointer``, the same update to the bias
(``_frameworks.py``).
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
from tests.nodes._frameworks import DeepSpeedTraining, digest


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
    p.add_argument("--fsdp", action="store_true", help="FSDP2 and FsdpCheckpointer (sharded state)")
    p.add_argument("--deepspeed", action="store_true", help="ZeRO and DeepSpeedCheckpointer")
    p.add_argument("--zero-stage", type=int, choices=(1, 2, 3), default=1, help="--deepspeed's ZeRO stage")
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
    replicas = None if args.replicas == "auto" else int(args.replicas)
    logged = _Logged()
    directory = os.path.join(args.dir, "ckpt")
    if args.fsdp:
        train = _FsdpTraining(model, directory, replicas)
    elif args.deepspeed:
        train = DeepSpeedTraining(directory, replicas, args.zero_stage)
    else:
        train = _Training(model, (Checkpointer if args.per_rank else DdpCheckpointer)(
            directory, persist_every=5, replicas=replicas))
    initial = train.bias_sum()
    flash = train.flash
    step = train.load() or 0
    if step:
        emit(event="restored", rank=rank, step=step, source=flash.last_load.source, peers=logged.fetched,
             digest=train.digest())
    while step < args.steps:
        step += 1
        train.step(step)
        train.save(step)
        if step == args.kill_step:
            if flash.replicas.endpoints and flash.placement.local_rank == 0:
                _wait_replicated(flash.job_id, step)
            emit(event="step", rank=rank, step=step, digest=train.digest())
            if args.close_at_kill:
                _close_after_go(args.dir, train, step + 1, logged, lambda **e: emit(rank=rank, **e))
                return
            if _first_time(os.path.join(args.dir, f"reached-{rank}")):  # once per rank and job
                if rank == args.kill_rank:
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(args.kill_pause)
        time.sleep(0.1)
    train.close()
    emit(event="done", rank=rank, step=step, bias=train.bias_sum(), initial=initial, digest=train.digest(),
         warnings=logged.warnings)
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


class _Training:
    """A step subtracts ``1e-3 * world * step`` from every bias entry (a gradient of ``step``
    on every rank, all-reduced); the state is saved every step."""

    def __init__(self, model: torch.nn.Module, ckpt) -> None:
        self.model, self.ckpt = model, ckpt

    @property
    def flash(self):
        """The flash engine under the checkpointer."""
        return self.ckpt.engine

    def state(self, step: int) -> dict:
        return {"model": self.model.state_dict(), "step": step}

    def load(self) -> int | None:
        return self.ckpt.load(self.state(0))

    def step(self, step: int) -> None:
        grad = torch.full((16,), float(step))
        dist.all_reduce(grad)
        with torch.no_grad():
            self.model.bias -= 1e-3 * grad

    def save(self, step: int) -> None:
        self.ckpt.save(step, self.state(step))

    def bias_sum(self) -> float:
        return self.model.bias.sum().item()

    def digest(self) -> str:
        return digest(self.model.state_dict())

    def close(self) -> None:
        self.ckpt.close()


class _FsdpTraining(_Training):
    """The same update through FSDP2: the loss's gradient on the bias is ``world * step`` on
    every rank, FSDP averages it, SGD applies it."""

    def __init__(self, model: torch.nn.Module, directory: str, replicas: int | None) -> None:
        from torch.distributed.fsdp import fully_shard
        from flashckpt.torch import FsdpCheckpointer

        fully_shard(model)
        self.optim = torch.optim.SGD(model.parameters(), lr=1e-3)
        super().__init__(model, FsdpCheckpointer(directory, persist_every=5, replicas=replicas))

    def load(self) -> int | None:
        return self.ckpt.load(self.model, self.optim)

    def step(self, step: int) -> None:
        self.optim.zero_grad()
        loss = self.model(torch.zeros(1, 16)).sum() * dist.get_world_size() * step  # input 0: only the bias learns
        loss.backward()
        self.optim.step()

    def save(self, step: int) -> None:
        self.ckpt.save(step, self.model, self.optim)

    def bias_sum(self) -> float:
        return self.model.bias.full_tensor().sum().item()

    def digest(self) -> str:
        return digest({k: v.to_local() for k, v in self.model.state_dict().items()})


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


def _close_after_go(shared: str, train: _Training, step: int, logged: _Logged, emit, timeout: float = 60.0) -> None:
    """Once the test wrote ``shared/go`` (it killed a node), save ``step`` and time ``close()``."""
    go = os.path.join(shared, "go")
    deadline = time.monotonic() + timeout
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.05)
    train.save(step)
    began, error = time.monotonic(), None
    try:
        train.close()
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
