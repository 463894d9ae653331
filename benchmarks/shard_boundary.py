"""What ``ShardSampler.boundary_state()`` costs at each step boundary, over SQLite.

    python benchmarks/shard_boundary.py [--calls 2000] [--rounds 5] [--shard-size 64] [--batch 8] [--distributed]

A ``ShardSampler`` over a SQLite coordinator file, one worker, drawing ``--batch``
samples between two boundaries (leasing and completing shards as training would). Per
boundary, interleaved in rounds: drawing alone (the baseline), ``boundary_state()`` (one
read of the coordinator: the snapshot, no write), and ``state_dict()`` (what a save calls:
one report per held lease, a write, then the snapshot). Prints the median of each per
boundary and their difference to drawing alone. ``--distributed`` runs it in a gloo group of
one rank, where ``boundary_state()`` reports the held leases' positions (a write) instead of
reading the coordinator, and a save's ``state_dict()`` adds two barriers.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Callable

from elastic import ShardSampler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shard-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--distributed", action="store_true", help="in a gloo group of one rank")
    args = parser.parse_args()
    if args.distributed:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as tmp:
        sampler = ShardSampler(10**9, coordinator=f"sqlite:///{tmp}/shards.db", name="bench",
                               shard_size=args.shard_size, num_epochs=None)
        it = iter(sampler)

        def draw() -> None:
            for _ in range(args.batch):
                next(it)

        kinds: dict[str, Callable[[], object]] = {"draw only": lambda: None,
                                                  "draw + boundary_state()": sampler.boundary_state,
                                                  "draw + state_dict()": sampler.state_dict}
        times: dict[str, list[float]] = {name: [] for name in kinds}
        for _ in range(args.rounds):
            for name, boundary in kinds.items():
                for _ in range(args.calls // args.rounds):
                    began = time.perf_counter()
                    draw()
                    boundary()
                    times[name].append(time.perf_counter() - began)
        sampler.close()
    base = statistics.median(times["draw only"])
    for name, got in times.items():
        median = statistics.median(got)
        print(f"{name:26s} {median * 1e6:8.1f} us per boundary (+{(median - base) * 1e6:7.1f} us)")


if __name__ == "__main__":
    main()
