"""Training script for the torchrun kill -9 test (run by torchrun, not by pytest).

The "model" is a vector of how many times each sample was trained, all-reduced every
step, so the restored model state says exactly which samples it has trained. Rank
``KILL_RANK`` kills itself with SIGKILL at step ``KILL_STEP`` of the first attempt,
between checkpoints. After torchrun restarts the group, every rank loads the newest
flash checkpoint (model + sampler) and trains to the end of the epoch; rank 0 writes
the final vector. Ranks may run out of samples at different steps (ShardSampler), so
each step all-reduces "has data" and a rank without data contributes nothing.

usage: _torchrun_train.py MODE N CKPT_DIR OUT [SQLITE_URL]   (MODE: static | shard)
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from elastic import ElasticDistributedSampler, ShardSampler
from flashckpt.torch import Checkpointer, init_process_group
from tests.elastic_data._workers import SEED, IndexDataset
from tests._exit import exit_now

BATCH, EVERY, KILL_RANK, KILL_STEP = 4, 5, 1, 13


def main() -> None:
    mode, n, ckpt_dir, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    init_process_group()
    rank = dist.get_rank()
    ds = IndexDataset(n)
    if mode == "static":
        sampler = ElasticDistributedSampler(ds, shuffle=True, seed=SEED)
    else:
        sampler = ShardSampler(n, coordinator=sys.argv[5], name="train", shard_size=6, shuffle=True, seed=SEED)
    model = torch.zeros(n, dtype=torch.int64)
    ckpt = Checkpointer(ckpt_dir)
    state = {"model": model, "sampler": "", "step": 0}
    step = ckpt.load(state) or 0
    if step:
        sampler.load_state_dict(json.loads(state["sampler"]))
        print(f"rank {rank} attempt {attempt}: restored step {step}", flush=True)
    sampler.set_epoch(0)
    batches = iter(DataLoader(ds, batch_size=BATCH, sampler=sampler))
    while True:
        batch = next(batches, None)
        has = torch.tensor([0 if batch is None else 1])
        dist.all_reduce(has)
        if has.item() == 0:
            break
        update = torch.zeros(n, dtype=torch.int64)
        if batch is not None:
            update.index_add_(0, batch, torch.ones_like(batch))
        dist.all_reduce(update)
        model += update
        step += 1
        if step % EVERY == 0:
            ckpt.save(step, {"model": model, "sampler": json.dumps(sampler.state_dict()), "step": step})
        if attempt == 0 and rank == KILL_RANK and step == KILL_STEP:
            os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"model": model.tolist(), "attempt": attempt, "steps": step,
                       "padding": getattr(sampler, "padding", 0)}, f)
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now()  # gloo groups still referenced can abort interpreter teardown
