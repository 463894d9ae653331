"""A worker for the process tests: consumes a data set and logs what it did.

Run as ``python sharding_worker.py CONFIG_JSON`` (or call :func:`run` in a thread).
Each line of its log is ``event epoch shard value lease``, written with O_APPEND and
before/after each call, so a SIGKILL between two lines still leaves a usable trail:
``acquire`` (value = resume position), ``sample`` (value = sample index), ``reporting`` /
``reported`` (value = position), ``completing`` / ``complete``, ``lost``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import sharding  # noqa: E402


def run(config: dict[str, Any]) -> None:
    coord = sharding.connect(config["url"], **config.get("options", {}))
    ds = coord.dataset(config["dataset"], **config["definition"])
    worker, delay, every = config["worker"], config["delay"], config.get("report_every", 3)
    fd = os.open(config["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def log(event: str, shard: sharding.Shard, value: int = -1) -> None:
        os.write(fd, f"{event} {shard.epoch} {shard.index} {value} {shard.lease}\n".encode())

    if config.get("release_first"):
        try:
            ds.release(worker)  # a restarted worker gives back what its previous life held
        except sharding.UnknownWorker:
            pass
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(ds.definition.lease_timeout / 4):
            ds.heartbeat(worker)

    threading.Thread(target=beat, daemon=True).start()
    go = config.get("go_file")
    while go and not os.path.exists(go):
        time.sleep(0.005)
    try:
        while (shard := ds.acquire(worker, timeout=120)) is not None:
            log("acquire", shard, shard.consumed)
            try:
                for position, sample in enumerate(shard.indices(), start=shard.consumed + 1):
                    time.sleep(delay)
                    log("sample", shard, sample)
                    if position % every == 0 and position < len(shard):
                        log("reporting", shard, position)
                        ds.report(shard, position)
                        log("reported", shard, position)
                log("completing", shard)
                ds.complete(shard)
                log("complete", shard)
            except sharding.LeaseLost:
                log("lost", shard)
    finally:
        stop.set()
        os.close(fd)


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
