"""Worker bodies for the multi-process tests (importable by spawned interpreters)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils.data import DataLoader, Dataset

from elastic import CountingLoader, ElasticDistributedSampler

SEED = 11


class IndexDataset(Dataset):
    """Sample ``i`` is the integer ``i``: what a loop receives names the samples."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


def train_elastic(
    rank: int,
    world: int,
    n: int,
    batch: int,
    steps: Optional[int],
    state: Optional[dict],
    gather: bool = False,
    num_workers: int = 0,
) -> dict[str, Any]:
    """Train epoch 0 for ``steps`` batches (None: to its end) from ``state``; return the
    samples this rank received and the sampler state afterwards."""
    ds = IndexDataset(n)
    sampler = ElasticDistributedSampler(ds, shuffle=True, seed=SEED)
    if state is not None:
        sampler.load_state_dict(state)
    sampler.set_epoch(0)
    loader: Any = DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=num_workers)
    if num_workers:
        loader = CountingLoader(loader)
    seen: list[int] = []
    limit = range(steps) if steps is not None else iter(int, 1)  # endless without steps
    for _, b in zip(limit, loader):  # zip pulls the limit first: no batch pulled past it
        seen += b.tolist()
    return {
        "seen": seen,
        "state": sampler.state_dict(gather=gather),
        "padding": sampler.padding,
        "world": sampler.num_replicas,
    }


def train_shards(
    rank: int,
    world: int,
    url: str,
    n: int,
    shard_size: int,
    steps: Optional[int],
    state: Optional[dict],
    sleep_per_sample: Optional[list] = None,
    after_checkpoint: int = 0,
) -> dict[str, Any]:
    """Iterate a ShardSampler for ``steps`` samples (None: to the end of the epoch), then
    checkpoint (collective), then take ``after_checkpoint`` more samples (trained after
    the checkpoint: a rollback must replay them)."""
    import time

    from elastic import ShardSampler

    sampler = ShardSampler(
        n, coordinator=url, name="train", shard_size=shard_size, shuffle=True, seed=SEED, num_epochs=1
    )
    if state is not None:
        sampler.load_state_dict(state)
    delay = sleep_per_sample[rank] if sleep_per_sample else 0.0
    it = iter(sampler)
    seen: list[int] = []
    for i in (range(steps) if steps is not None else iter(int, 1)):
        try:
            seen.append(next(it))
        except StopIteration:
            break
        if delay:
            time.sleep(delay)
    ckpt = sampler.state_dict() if steps is not None else None
    later = [i for _, i in zip(range(after_checkpoint), it)]
    return {"seen": seen, "state": ckpt, "later": later, "worker": sampler.worker}


def lockstep_shards(rank: int, world: int, url: str, n: int, shard_size: int) -> list[int]:
    """A DDP-style loop over a ShardSampler: one sample per rank per step, and an
    all-reduce of "has data" so ranks that run out keep stepping with the others."""
    import torch.distributed as dist

    from elastic import ShardSampler

    sampler = ShardSampler(n, coordinator=url, name="lockstep", shard_size=shard_size)
    it = iter(sampler)
    seen: list[int] = []
    while True:
        i = next(it, None)
        has = torch.tensor([0 if i is None else 1])
        dist.all_reduce(has)
        if has.item() == 0:
            return seen
        if i is not None:
            seen.append(i)


def boundary_ranks(rank: int, world: int, url: str) -> dict:
    """Two lockstep ranks draw a step of 4 samples each (shards of 6), take their step
    boundary, and draw the next step: each finishes receiving its first shard and leases
    the next. Then each reads ``state_dict()`` as a failure capture's other thread does,
    and once more as a capture on the training thread inside a call into the store would."""
    import threading
    import time

    import torch.distributed as dist

    import sharding
    from elastic import ShardSampler, _capture_read

    sampler = ShardSampler(48, coordinator=url, name="boundary", shard_size=6, num_epochs=1)
    it = iter(sampler)
    trained = [next(it) for _ in range(4)]
    alone = 0.0
    if rank == 1:  # a capture before any boundary, on one rank: no barrier (its peer may be dead)
        began = time.monotonic()
        captured_state(sampler)
        alone = time.monotonic() - began
    else:
        time.sleep(3)  # a barrier on rank 1 would wait for this rank's next one
    dist.barrier()
    sampler.boundary_state()
    dist.barrier()
    later = [next(it) for _ in range(4)]
    dist.barrier()
    got: list[dict] = []
    thread = threading.Thread(target=lambda: got.append(sampler.state_dict()))
    thread.start()
    thread.join()
    # a capture on the training thread while that thread is inside a call into the store (a
    # signal handled there): the store's lock is held, the capture's read must give up
    _capture_read.CAPTURE_READ_SECONDS = 0.5
    try:
        with sampler._ds._store._lock:
            captured_state(sampler)
        refused = ""
    except sharding.CoordinatorError as exc:
        refused = str(exc)
    dist.barrier()
    return {"trained": trained, "later": later, "state": got[0], "refused": refused, "alone": alone}


def epoch_without_a_final_boundary(rank: int, world: int, url: str) -> tuple[int, int]:
    """Two epochs of 20 samples in shards of 6 and batches of 4; a boundary after every batch
    but the last of each epoch. The samples each epoch drew."""
    from elastic import ShardSampler

    sampler = ShardSampler(20, coordinator=url, name="no-final-boundary", shard_size=6, num_epochs=2)
    loader = DataLoader(IndexDataset(20), batch_size=4, sampler=sampler)
    drawn = []
    for _ in range(2):
        n = 0
        for i, batch in enumerate(loader):
            n += len(batch)
            if i < 4:  # five batches an epoch: no boundary after the last
                sampler.boundary_state()
        drawn.append(n)
    return drawn[0], drawn[1]


def peer_a_step_ahead(rank: int, world: int, url: str, then: str = "draws") -> dict:
    """Two lockstep ranks, batches of 4 from shards of 6, a boundary after step 1. Rank 0 is
    then caught before its update of step 2 (a failure capture writes step 1); rank 1 went on
    through its boundary of step 2 (finishing its first shard) and then (``then``) drew step 3
    (finishing its second shard, leasing a third), or went into a save's ``state_dict()`` (its
    part before the barrier that rank 0 never reaches) and drew step 3, or began a new
    iteration (which completes its first shard at once) and drew what it could. Rank 0's
    capture then reads the state."""
    import torch.distributed as dist

    from elastic import ShardSampler

    sampler = ShardSampler(48, coordinator=url, name="ahead", shard_size=6, num_epochs=1)
    it = iter(sampler)
    step1 = [next(it) for _ in range(4)]
    sampler.boundary_state()
    later = [next(it) for _ in range(4)]
    dist.barrier()  # both drew step 2 (a new iteration would otherwise take every shard first)
    if rank == 1:
        sampler.boundary_state()
        if then == "saves":
            sampler.state_dict(sync=False)
        later += list(sampler) if then == "begins an iteration" else [next(it) for _ in range(6)]
    dist.barrier()
    state = captured_state(sampler) if rank == 0 else None
    dist.barrier()
    return {"step1": step1, "later": later, "state": state}


def peer_dead_inside_its_update(rank: int, world: int, url: str, dies_at: int = 2) -> dict:
    """Two lockstep ranks under failure capture (a real ``FailureCapture`` on an SGD
    optimizer, the sampler in ``boundary_state``), batches of 4 from shards of 6, steps 1 to
    ``dies_at``: rank 1 begins its update of step ``dies_at`` and dies there (it never reaches
    its boundary), rank 0 finishes that step and its capture then reads the state of it."""
    import torch.distributed as dist

    import flashckpt._capture as capture
    from elastic import ShardSampler

    sampler = ShardSampler(48, coordinator=url, name="behind", shard_size=6, num_epochs=1)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    failure = capture.FailureCapture(lambda: {}, optimizer, save=lambda step, state: None, last_load=lambda: None,
                                     boundary_state=lambda: {"sampler": sampler.boundary_state()})
    it = iter(sampler)
    trained = []
    for step in range(1, dies_at + 1):
        batch = [next(it) for _ in range(4)]
        trained += batch
        model(torch.ones(1, 1)).sum().backward()
        if step == dies_at and rank == 1:
            failure.update_begins()  # killed inside this update: no boundary of this step
        else:
            optimizer.step()
    dist.barrier()
    state = captured_state(sampler) if rank == 0 else None
    dist.barrier()
    return {"trained": trained, "state": state}


def captured_state(sampler: Any) -> dict:
    """``sampler.state_dict()`` as a failure capture's call of ``state_fn`` makes it."""
    import flashckpt._capture as capture

    capture._this_thread.capturing = True
    try:
        return sampler.state_dict()
    finally:
        capture._this_thread.capturing = False
