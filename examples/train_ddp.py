"""DDP training with flash checkpoints and elastic data; survives kill -9 under torchrun.

    torchrun --standalone --nproc_per_node=2 --max-restarts=3 examples/train_ddp.py --workdir /tmp/run1

Every step is checkpointed into shared memory (the loop blocks only for that copy);
every 20th also goes to storage in the background. Data comes in small shards from a
SQLite coordinator, so a restart resumes the data exactly where the restored model
left it. Each rank prints JSON lines (``start``, ``restored``, ``step``, ``done``).
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from elastic import ShardSampler
from flashckpt.torch import DdpCheckpointer, init_process_group


def make_data(n: int = 8192, dim: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=g)
    y = torch.sin(x @ torch.randn(dim, 1, generator=g)) + 0.05 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def emit(**event) -> None:
    os.write(1, (json.dumps(event) + "\n").encode())  # one write: lines of two ranks never interleave


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workdir", required=True)
    p.add_argument("--step-seconds", type=float, default=0.05, help="extra time per step, to watch it")
    args = p.parse_args()
    init_process_group()
    rank = dist.get_rank()
    emit(event="start", rank=rank, pid=os.getpid(), attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(32, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 1)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_data()
    sampler = ShardSampler(len(data), coordinator=f"sqlite:///{args.workdir}/shards.db", name="train",
                           shard_size=256, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler)

    ckpt = DdpCheckpointer(os.path.join(args.workdir, "ckpt"), persist_every=20)
    state = {"model": model.module.state_dict(), "optim": optim.state_dict(), "step": 0, "sampler": {}}
    step = ckpt.load(state) or 0
    if step:
        optim.load_state_dict(state["optim"])
        sampler.load_state_dict(state["sampler"])
        info = ckpt.last_load
        emit(event="restored", rank=rank, step=step, source=info.source, seconds=info.seconds,
             shards_redone=len(state["sampler"]["coordinator"]["queue"]))
    else:
        sampler.reset()  # no checkpoint: shards a failed attempt completed are trained again

    start = time.perf_counter()
    batches = iter(loader)
    while True:
        batch = next(batches, None)
        has_data = torch.tensor([batch is not None], dtype=torch.int32)
        dist.all_reduce(has_data, op=dist.ReduceOp.MIN)  # ranks get uneven shards: stop together
        if not has_data.item():
            break
        x, y = batch
        loss = torch.nn.functional.mse_loss(model(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
        step += 1
        time.sleep(args.step_seconds)
        ckpt.save(step, {"model": model.module.state_dict(), "optim": optim.state_dict(), "step": step,
                         "sampler": sampler.state_dict()})
        emit(event="step", rank=rank, step=step, loss=round(loss.item(), 5))
    ckpt.close()
    emit(event="done", rank=rank, step=step, loss=round(loss.item(), 5), seconds=time.perf_counter() - start)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
