"""A saver, played: saves 2-rank steps of one run to an object-store URL until killed.

``python -m tests.objectstore._writer URL TOKEN BRANCH FIRST_STEP SEED``; prints each
committed step. Shards of 1 KB to 11 MiB (multipart above 10 MiB), keep_last=2.
"""

from __future__ import annotations

import random
import sys

from flashckpt.storage._object import ObjectStorage

from .conftest import image


def main() -> None:
    url, run, branch, step, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    storage = ObjectStorage(url, part_bytes=5 << 20, concurrency=4)
    rng = random.Random(seed)
    while True:
        for rank in range(2):
            img = image(run, rng.choice([1000, 3 << 20, 11 << 20]), seed=step + rank)
            storage.write_shard(step, rank, run, memoryview(img))
            if storage.try_commit(step, 2, run, 2, branch=branch):
                print(step, flush=True)
        step += 1


if __name__ == "__main__":
    main()
