"""DDP training from a ``ShardSampler``, for the capture test of several ranks.

    torchrun --nproc-per-node=2 --max-restarts=1 _train_shards_ddp.py CKPT OUT STEPS KILL_STEP

Two gloo ranks, a ``DdpCheckpointer`` saving to memory every 8 steps, a ``ShardSampler``
over SQLite (256 samples in shards of 6, so shards end inside batches of 4; one epoch),
a ``DataLoader`` of two prefetching workers through ``CountingLoader``, and the sampler's ``boundary_state()`` given to
``save_on_failure``. In attempt 0 rank 1 is SIGKILLed inside step KILL_STEP's backward, so
rank 0 captures the step before. Each rank appends ``<step> <indices>`` for every step it
trained to ``OUT/trained-a<A>-r<R>.txt``; after STEPS steps it draws, untrained, what the
sampler still gives it (``OUT/drained-a<A>-r<R>.txt``), so that what was trained up to the
loaded step, what was trained after it and what was left add up to the data set.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

SAMPLES = 256
BATCH = 4
SAVE_EVERY = 8


def main() -> None:
    import torch.distributed as dist

    from elastic import CountingLoader, ShardSampler
    from flashckpt.torch import DdpCheckpointer, init_process_group

    directory, out, steps, kill = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    init_process_group("gloo")
    rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    net = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sampler = ShardSampler(SAMPLES, coordinator=f"sqlite:///{out}/shards.db", name="train", shard_size=6,
                           shuffle=True, seed=3, num_epochs=1)
    loader = CountingLoader(DataLoader(TensorDataset(torch.arange(SAMPLES)), BATCH, sampler=sampler, num_workers=2))
    ckpt = DdpCheckpointer(directory, persist_every=1000)

    def state() -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "sampler": sampler.state_dict()}

    loaded = state()
    start = ckpt.load(loaded) or 0
    if start:
        opt.load_state_dict(loaded["optim"])
        sampler.load_state_dict(loaded["sampler"])
    else:
        sampler.reset()
    info = ckpt.engine.memory_info(start) if ckpt.last_load.source == "memory" else {}
    with open(os.path.join(out, f"attempt{attempt}-rank{rank}.json"), "w") as f:
        json.dump({"step": start, "source": ckpt.last_load.source, "captured": bool(info.get("captured"))}, f)
    ckpt.save_on_failure(state, optimizer=opt, boundary_state=lambda: {"sampler": sampler.boundary_state()})

    trained = open(os.path.join(out, f"trained-a{attempt}-r{rank}.txt"), "a")
    batches = iter(loader)
    for step in range(start + 1, steps + 1):
        (index,) = next(batches)
        trained.write(f"{step} {','.join(map(str, index.tolist()))}\n")
        trained.flush()
        if attempt == 0 and rank == 1 and step == kill:
            model.weight.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(index.float().unsqueeze(1) / SAMPLES), torch.ones(len(index), 1)).backward()
        opt.step()
        if step % SAVE_EVERY == 0:
            ckpt.save(step, state())
    with open(os.path.join(out, f"drained-a{attempt}-r{rank}.txt"), "w") as f:
        f.write(",".join(str(int(i)) for (batch,) in batches for i in batch))
    ckpt.close()
    sampler.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
