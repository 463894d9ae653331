"""Side by side: resuming mid-epoch with another world size.

Scenario (the one tests/elastic_data checks over real gloo groups): a data set of
N = 1001 samples, 2 ranks train 30 batches of 8 each (480 samples), checkpoint, then the
job resumes with 3 ranks (and, separately, with 1) and trains to the end of the epoch.
Exact is: every sample trained once, plus the padding the new world size needs.

Each approach runs rank by rank in this process: a sampler's layout is a pure function
of (num_replicas, rank), so simulating the ranks gives exactly what a gloo job gets.

- DistributedSampler, restart the epoch: the checkpoint holds no data position.
- DistributedSampler, skip the batches done: the usual fast-forward (skip as many
  batches per rank as were trained per rank before).
- torchdata StatefulDataLoader over DistributedSampler: each new rank loads the loader
  state of old rank ``r % old_world`` (there is no state for new ranks otherwise).
- elastic.ElasticDistributedSampler: any rank's saved state.

usage: python benchmarks/sampler_peers.py
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from elastic import ElasticDistributedSampler

N, BATCH, STEPS, OLD, SEED = 1001, 8, 30, 2, 11


class Index(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


def first_part(make: Callable[[int], Any]) -> tuple[list[int], list[Any]]:
    seen, states = [], []
    for r in range(OLD):
        loader, state_fn = make(r)
        it = iter(loader)
        for _ in range(STEPS):
            seen += next(it).tolist()
        states.append(state_fn())
    return seen, states


def rest(loaders: list[Any]) -> list[int]:
    return [int(i) for loader in loaders for b in loader for i in b]


def dist_restart(new: int) -> tuple[list[int], list[int]]:
    ds = Index()
    def make(r):
        return DataLoader(ds, BATCH, sampler=DistributedSampler(ds, OLD, r, seed=SEED)), lambda: None
    before, _ = first_part(make)
    after = rest([DataLoader(ds, BATCH, sampler=DistributedSampler(ds, new, r, seed=SEED)) for r in range(new)])
    return before, after


def dist_skip(new: int) -> tuple[list[int], list[int]]:
    ds = Index()
    def make(r):
        return DataLoader(ds, BATCH, sampler=DistributedSampler(ds, OLD, r, seed=SEED)), lambda: STEPS
    before, states = first_part(make)
    after = []
    for r in range(new):
        batches = DataLoader(ds, BATCH, sampler=DistributedSampler(ds, new, r, seed=SEED))
        after += [int(i) for b in itertools.islice(batches, states[0], None) for i in b]
    return before, after


def stateful(new: int) -> tuple[list[int], list[int]]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    ds = Index()
    def make(r):
        loader = StatefulDataLoader(ds, BATCH, sampler=DistributedSampler(ds, OLD, r, seed=SEED))
        return loader, loader.state_dict
    before, states = first_part(make)
    loaders = []
    for r in range(new):
        loader = StatefulDataLoader(ds, BATCH, sampler=DistributedSampler(ds, new, r, seed=SEED))
        loader.load_state_dict(states[r % OLD])
        loaders.append(loader)
    return before, rest(loaders)


def ours(new: int) -> tuple[list[int], list[int], int]:
    ds = Index()
    def make(r):
        s = ElasticDistributedSampler(ds, OLD, r, seed=SEED)
        return DataLoader(ds, BATCH, sampler=s), s.state_dict
    before, states = first_part(make)
    new_samplers = []
    for r in range(new):
        s = ElasticDistributedSampler(ds, new, r, seed=SEED)
        s.load_state_dict(states[r % OLD])
        s.set_epoch(0)
        new_samplers.append(s)
    after = rest([DataLoader(ds, BATCH, sampler=s) for s in new_samplers])
    return before, after, new_samplers[0].padding


def score(before: list[int], after: list[int], padding: int | None) -> dict[str, int]:
    counts = Counter(before + after)
    repeats = sum(c - 1 for c in counts.values())
    return {
        "missing": N - len(counts),
        "repeats": repeats,
        "declared_padding": -1 if padding is None else padding,
    }


def run() -> dict[str, dict[int, dict[str, int]]]:
    results: dict[str, dict[int, dict[str, int]]] = {}
    for name, fn in [("DistributedSampler, restart epoch", dist_restart),
                     ("DistributedSampler, skip batches done", dist_skip),
                     ("torchdata StatefulDataLoader", stateful),
                     ("elastic.ElasticDistributedSampler", ours)]:
        results[name] = {}
        for new in (3, 1):
            try:
                out = fn(new)
            except Exception as e:  # a peer that cannot run at all is a result too
                results[name][new] = {"error": f"{type(e).__name__}: {e}"}  # type: ignore[dict-item]
                continue
            padding = out[2] if len(out) == 3 else None
            results[name][new] = score(out[0], out[1], padding)
    return results


def main() -> None:
    print(f"N={N}: {OLD} ranks x {STEPS} batches of {BATCH}, checkpoint, resume with 3 and with 1")
    print(f"{'approach':40s} {'new world':>9s} {'missing':>8s} {'repeats':>8s} {'padding':>8s}")
    for name, per_world in run().items():
        for new, r in per_world.items():
            if "error" in r:
                print(f"{name:40s} {new:9d}  error: {r['error']}")
                continue
            pad = "-" if r["declared_padding"] < 0 else str(r["declared_padding"])
            print(f"{name:40s} {new:9d} {r['missing']:8d} {r['repeats']:8d} {pad:>8s}")


if __name__ == "__main__":
    main()
