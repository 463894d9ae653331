"""One torchrun worker of the multi-node elastic-data test: a sample-count "model", a
``ShardSampler`` and a ``DdpCheckpointer`` that saves both.

    torchrun ... _data_worker.py --dir SHARED_DIR --coordinator URL --samples N
                                 [--pause WORLD:STEP:SECONDS ...]

The model is a vector of how many times each sample was trained, all-reduced every step,
so the restored model says exactly which samples it holds; the sampler's state (the
coordinator's) is saved with it every ``EVERY`` steps. The ranks of a round agree on a
round id (rank 0's, broadcast). Each process appends JSON lines to
``SHARED_DIR/events-<host>-<pid>.jsonl``: ``launch``, ``start`` (rank, world, round,
restored step), ``trained`` (round, step, the sample ids this rank trained in it), ``pause``
and ``done`` (rank 0: the model, the coordinator's progress). ``--pause W:S:P``: the first
time a round of world size W reaches step S (a marker file per rank in SHARED_DIR), each rank
of this torchrun sleeps P seconds there, so the test can kill or add a node at a known step
between checkpoints.
"""

import argparse
import datetime
import json
import os
import secrets
import socket
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from elastic import ShardSampler
from flashckpt.torch import DdpCheckpointer, init_process_group
from tests.elastic_data._workers import IndexDataset
from tests.nodes._worker import _first_time
from tests._exit import exit_now

BATCH, EVERY, SHARD, SEED = 2, 3, 4, 7


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--coordinator", required=True)
    p.add_argument("--samples", type=int, required=True)
    p.add_argument("--pause", action="append", default=[], help="WORLD:STEP:SECONDS")
    p.add_argument("--pg-timeout", type=float, default=30.0)
    args = p.parse_args()
    host = socket.gethostname()
    log = os.path.join(args.dir, f"events-{host}-{os.getpid()}.jsonl")

    def emit(**event) -> None:
        with open(log, "a") as f:
            f.write(json.dumps({**event, "time": time.time()}) + "\n")

    emit(event="launch", host=host, restart_count=int(os.environ["TORCHELASTIC_RESTART_COUNT"]))
    init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    token = [secrets.token_hex(4) if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    round_id = token[0]
    pauses = {(int(w), int(s)): float(sec) for w, s, sec in (x.split(":") for x in args.pause)}

    n = args.samples
    sampler = ShardSampler(n, coordinator=args.coordinator, name="train", shard_size=SHARD, shuffle=True, seed=SEED)
    model = torch.zeros(n, dtype=torch.int64)
    ckpt = DdpCheckpointer(os.path.join(args.dir, "ckpt"), persist_every=1)
    state = {"model": model, "sampler": "", "step": 0}
    step = ckpt.load(state) or 0
    if step:
        sampler.load_state_dict(json.loads(state["sampler"]))
    emit(event="start", host=host, rank=rank, world=world, round=round_id, restored=step,
         source=ckpt.last_load.source if step else None,
         restart_count=int(os.environ["TORCHELASTIC_RESTART_COUNT"]))

    batches = iter(DataLoader(IndexDataset(n), batch_size=BATCH, sampler=sampler))
    while True:
        batch = next(batches, None)  # ranks run out of shards at different steps
        counts = torch.zeros(n + 1, dtype=torch.int64)  # this step's samples; last: ranks with data
        if batch is not None:
            counts.index_add_(0, batch, torch.ones_like(batch))
            counts[n] = 1
        dist.all_reduce(counts)
        if counts[n] == 0:
            break
        step += 1
        # logged before the step's checkpoint, whose sampler state is a collective: a
        # committed step N means every rank has logged step N
        emit(event="trained", rank=rank, round=round_id, step=step, ids=[] if batch is None else batch.tolist())
        model += counts[:n]
        if step % EVERY == 0:
            ckpt.save(step, {"model": model, "sampler": json.dumps(sampler.state_dict()), "step": step})
        pause = pauses.get((world, step))
        if pause and _first_time(os.path.join(args.dir, f"paused-{world}-{step}-{rank}")):
            emit(event="pause", rank=rank, world=world, step=step)
            time.sleep(pause)
    ckpt.close()
    if rank == 0:
        emit(event="done", round=round_id, step=step, model=model.tolist(), progress=sampler.progress())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now()  # gloo groups still referenced can abort interpreter teardown
