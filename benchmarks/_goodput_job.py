"""The job that ``benchmarks/goodput.py`` runs under torchrun, once per checkpoint method.

Each rank appends JSON lines to ``<out>/rank<R>.jsonl``: ``started`` (after
``init_process_group``), ``ready`` (after setup and restore), ``step`` (every step done,
with the blocking seconds of a save in it) and ``done`` (a digest of the final state).
See the driver's docstring for the job and the methods.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

CALIBRATION_SAVES = 3  # timed, after one untimed save (first-save costs: allocation, page cache)


def run(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    from flashckpt.torch import init_process_group  # a store prefix per torchrun attempt

    init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    out = Path(args.out)
    log = open(out / f"rank{rank}.jsonl", "a", buffering=1)

    def record(**fields: Any) -> None:
        log.write(json.dumps({"a": attempt, "t": time.time(), **fields}) + "\n")

    record(kind="started", pid=os.getpid())
    setup = time.monotonic()
    torch.manual_seed(0)  # every rank the same model, as DDP keeps it (replicated state)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    payload = torch.zeros(max(1, (args.state_mb << 20) // 4 - 64 * 65))
    state: dict[str, Any] = {"model": model.state_dict(), "payload": payload, "step": 0}
    doing = {"step": 0}

    def rest_of_the_update(*_: Any) -> None:
        """The rest of the state changes with the parameters, inside ``optimizer.step()``
        (the boundary failure capture relies on)."""
        payload[doing["step"] % payload.numel()] += 1.0
        state["step"] = doing["step"]

    opt.register_step_post_hook(rest_of_the_update)
    method = Method.create(args, rank, world, state, opt)
    if attempt == 0:
        method.calibrate()
    began = time.monotonic()
    start = method.load()
    record(kind="ready", pid=os.getpid(), loaded=start, load_seconds=time.monotonic() - began,
           setup_seconds=began - setup, phases=method.phases, interval=method.interval,
           save_cost=method.cost)
    stop = torch.zeros(1)
    for step in range(start + 1, args.steps + 1):
        g = torch.Generator().manual_seed(step * world + rank)
        loss = model(torch.randn(8, 64, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        doing["step"] = step
        opt.step()
        time.sleep(args.step_seconds)
        blocking = method.after_step(step)
        record(kind="step", s=step, **({"save": blocking} if blocking is not None else {}))
        if args.method == "none":  # the driver ends the floor job with a file
            stop[0] = float(os.path.exists(out / "stop"))
            dist.all_reduce(stop)
            if stop[0]:
                break
    method.finish()
    digest = float(sum(p.detach().double().sum() for p in model.parameters()))
    record(kind="done", step=state["step"], params=digest, payload=float(payload.double().sum()))
    dist.destroy_process_group()


class Method:
    """One way of checkpointing; ``interval`` is K (saves every K steps) or None."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int, state: dict, optimizer: Any) -> None:
        self.args, self.rank, self.world, self.state, self.optimizer = args, rank, world, state, optimizer
        self.dir = Path(args.ckpt)
        self.interval: int | None = None
        self.cost: float | None = None  # the calibrated blocking seconds of one save
        self.phases: dict[str, float] = {}  # seconds of the setup's parts, for the record

    @staticmethod
    def create(args: argparse.Namespace, rank: int, world: int, state: dict, optimizer: Any) -> "Method":
        cls = {"none": Method, "flashckpt": Flash, "torch.save": TorchSave, "dcp.async_save": DcpAsync,
               **{m.name: m for m in (FlashDdp, FlashDdpCapture, FlashDdpEveryStep)}}[args.method]
        return cls(args, rank, world, state, optimizer)

    def calibrate(self) -> None:
        """Measure the blocking cost of a save (attempt 0); pick K by Young's formula."""

    def load(self) -> int:
        return 0

    def after_step(self, step: int) -> float | None:
        """Save if due; the blocking seconds of the save, or None."""
        return None

    def finish(self) -> None:
        pass

    # helpers for the Young methods
    def _young(self, samples: list[float]) -> None:
        import torch
        import torch.distributed as dist

        cost = torch.tensor([statistics.median(samples)])
        dist.all_reduce(cost, op=dist.ReduceOp.MAX)
        seconds = math.sqrt(2.0 * float(cost) * self.args.mtbf)
        k = max(1, round(seconds / self.args.step_seconds))
        if self.rank == 0:
            _atomic_write(self._young_path(), json.dumps(
                {"cost_seconds": float(cost), "interval_seconds": seconds, "k": k}))
        dist.barrier()

    def _young_path(self) -> Path:
        return self.dir.parent / f"{self.dir.name}.young.json"

    def _k(self) -> int:
        young = json.loads(self._young_path().read_text())
        self.cost = young["cost_seconds"]
        return young["k"]


class Flash(Method):
    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        t0 = time.monotonic()
        import elastic
        import flashckpt.torch  # noqa: F401

        t1 = time.monotonic()
        self.ckpt = self.checkpointer(self.dir, persist_every=self.args.persist_every, keep_last=2)
        t2 = time.monotonic()
        self.agent = elastic.start_agent(checkpointer=self.ckpt,
                                         metrics_dir=str(Path(self.args.out) / "metrics"))
        self.phases = {"import": t1 - t0, "checkpointer": t2 - t1, "agent": time.monotonic() - t2}

    @staticmethod
    def checkpointer(*args: Any, **kwargs: Any) -> Any:
        from flashckpt.torch import Checkpointer

        return Checkpointer(*args, **kwargs)

    def calibrate(self) -> None:
        """Memory saves of the initial state (step 0, as if not trained yet), not persisted."""
        samples = []
        for i in range(CALIBRATION_SAVES + 1):
            began = time.perf_counter()
            self.ckpt.save(0, self.state, persist=False)
            samples.append(time.perf_counter() - began)
        self._young(samples[1:])

    def load(self) -> int:
        self.interval = self._interval(self._k())
        return self.ckpt.load(self.state) or 0

    def _interval(self, k: int) -> int:
        """Memory saves every this many steps (``k``: Young's)."""
        return self.args.flash_every or k

    def after_step(self, step: int) -> float | None:
        if step % self.interval:
            return None
        began = time.perf_counter()
        self.ckpt.save(step, self.state)
        return time.perf_counter() - began

    def finish(self) -> None:
        self.ckpt.close()
        self.agent.stop()


class FlashDdp(Flash):
    """``DdpCheckpointer`` (one copy of the replicated state per node) into memory every
    ``--ddp-every`` steps (default 50), no failure capture."""
    name = "flashckpt.ddp"
    capture = False

    @staticmethod
    def checkpointer(*args: Any, **kwargs: Any) -> Any:
        from flashckpt.torch import DdpCheckpointer

        return DdpCheckpointer(*args, **kwargs)

    def _interval(self, k: int) -> int:
        return self.args.ddp_every

    def load(self) -> int:
        start = super().load()
        if self.capture:
            self.ckpt.save_on_failure(lambda: self.state, optimizer=self.optimizer)
        return start


class FlashDdpCapture(FlashDdp):
    """:class:`FlashDdp` with ``save_on_failure``: a failure saves the last finished step."""
    name = "flashckpt.ddp+capture"
    capture = True


class FlashDdpEveryStep(FlashDdp):
    """:class:`FlashDdp` saving every step (loses no step, pays a copy per step)."""
    name = "flashckpt.ddp.every-step"

    def _interval(self, k: int) -> int:
        return 1


class TorchSave(Method):
    """Per-rank files, committed by rank 0 after a barrier (``latest``, atomically)."""

    def calibrate(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        samples = []
        for i in range(CALIBRATION_SAVES + 1):
            began = time.perf_counter()
            self._save(f"calibrate-{i}", commit=False)
            samples.append(time.perf_counter() - began)
        self._young(samples[1:])
        if self.rank == 0:
            for i in range(CALIBRATION_SAVES + 1):
                shutil.rmtree(self.dir / f"calibrate-{i}", ignore_errors=True)

    def load(self) -> int:
        import torch

        self.interval = self._k()
        latest = self.dir / "latest"
        if not latest.exists():
            return 0
        name = latest.read_text().strip()
        saved = torch.load(self.dir / name / f"rank{self.rank}.pt", weights_only=True)
        for key, value in saved["model"].items():
            self.state["model"][key].copy_(value)
        self.state["payload"].copy_(saved["payload"])
        self.state["step"] = saved["step"]
        return saved["step"]

    def after_step(self, step: int) -> float | None:
        if step % self.interval:
            return None
        began = time.perf_counter()
        self._save(f"step-{step}")
        return time.perf_counter() - began

    def _save(self, name: str, commit: bool = True) -> None:
        import torch
        import torch.distributed as dist

        folder = self.dir / name
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}.pt"
        with open(f"{path}.tmp", "wb") as f:
            torch.save(self.state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(f"{path}.tmp", path)
        dist.barrier()  # every rank's file is durable: commit
        if self.rank == 0 and commit:
            old = (self.dir / "latest").read_text().strip() if (self.dir / "latest").exists() else None
            _atomic_write(self.dir / "latest", name)
            if old and old != name:
                shutil.rmtree(self.dir / old, ignore_errors=True)


class DcpAsync(Method):
    """``dcp.async_save`` of ``{"rank<R>": state}`` on a side gloo group; committed when
    DCP's ``.metadata`` exists; all ranks load the newest step every rank sees."""

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        t0 = time.monotonic()
        import torch.distributed as dist
        import torch.distributed.checkpoint  # noqa: F401

        t1 = time.monotonic()
        self.group = dist.new_group(backend="gloo")  # async saves must not share the training group
        self.phases = {"import": t1 - t0, "group": time.monotonic() - t1}
        self.future: Any = None

    def _tree(self) -> dict:
        return {f"rank{self.rank}": self.state}

    def calibrate(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        samples = []
        for i in range(CALIBRATION_SAVES + 1):
            began = time.perf_counter()
            self.future = self._async(self.dir / f"calibrate-{i}")
            samples.append(time.perf_counter() - began)
            self.future.result()
        self.future = None
        self._young(samples[1:])
        if self.rank == 0:
            for i in range(CALIBRATION_SAVES + 1):
                shutil.rmtree(self.dir / f"calibrate-{i}", ignore_errors=True)

    def _async(self, path: Path) -> Any:
        import torch.distributed.checkpoint as dcp

        return dcp.async_save(self._tree(), checkpoint_id=str(path), process_group=self.group)

    def load(self) -> int:
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        self.interval = self._k()
        steps = [int(p.name[5:]) for p in self.dir.glob("step-*") if (p / ".metadata").exists()]
        newest = torch.tensor([max(steps, default=0)])
        dist.all_reduce(newest, op=dist.ReduceOp.MIN)
        step = int(newest)
        if step == 0:
            return 0
        tree = self._tree()
        dcp.load(tree, checkpoint_id=str(self.dir / f"step-{step}"), process_group=self.group)
        self.state["step"] = step
        return step

    def after_step(self, step: int) -> float | None:
        if step % self.interval:
            return None
        began = time.perf_counter()
        if self.future is not None:
            self.future.result()  # one save in flight at a time
            self._prune()
        self.future = self._async(self.dir / f"step-{step}")
        return time.perf_counter() - began

    def _prune(self) -> None:
        """Keep the two newest committed steps (DCP deletes nothing: ~14 GB per run otherwise)."""
        if self.rank != 0:
            return
        committed = sorted((int(p.name[5:]) for p in self.dir.glob("step-*") if (p / ".metadata").exists()))
        for step in committed[:-2]:
            shutil.rmtree(self.dir / f"step-{step}", ignore_errors=True)

    def finish(self) -> None:
        if self.future is not None:
            self.future.result()


def _atomic_write(path: Path, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser(description="one goodput job (run by benchmarks/goodput.py)")
    p.add_argument("--method", required=True,
                   choices=("none", "flashckpt", "torch.save", "dcp.async_save", FlashDdp.name, FlashDdpCapture.name,
                            FlashDdpEveryStep.name))
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--step-seconds", type=float, required=True)
    p.add_argument("--state-mb", type=int, required=True)
    p.add_argument("--persist-every", type=int, required=True)
    p.add_argument("--mtbf", type=float, required=True)
    p.add_argument("--flash-every", type=int, default=0, help="flashckpt: memory every N steps "
                   "(0: K by Young's formula, like the others)")
    p.add_argument("--ddp-every", type=int, default=50, help="flashckpt.ddp(+capture): memory every N steps")
    run(p.parse_args())


if __name__ == "__main__":
    main()
