"""A DeepSpeed restart: the first load in a new process, flashckpt from memory vs DeepSpeed's own.

    DS_ACCELERATOR=cpu python benchmarks/deepspeed_restart.py [--rounds 2] [--json results/deepspeed_restart.json]

Each round: one process builds a ZeRO-1 engine with Adam (``--hidden``/``--layers``, the
sizes of ``deepspeed_megatron.py``), flash-saves step 1 (memory only) and writes the same
state with ``engine.save_checkpoint`` (DeepSpeed's default engine, into the page cache),
then ends without closing, as a killed process would: the step stays in shared memory. A
new process then loads, each into a new engine (which has not stepped): DeepSpeed's
``load_checkpoint`` of the tag and ``DeepSpeedCheckpointer.load()`` of the same job. The
order of the two alternates between rounds (this machine's speed drifts). One process, a
gloo group of one, CPU. The job's memory (its own only) is freed after each round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(mode: str, root: str, job: str, hidden: int, layers: int, flash_first: bool) -> None:
    """The saving process (``save``) or the restarted one (``load``, prints JSON)."""
    for key, value in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(key, value)
    sys.path.insert(0, str(HERE))
    import deepspeed
    from deepspeed_megatron import ds_engine
    from flashckpt.deepspeed import DeepSpeedCheckpointer
    deepspeed.init_distributed("gloo")
    if mode == "save":
        engine = ds_engine(hidden, layers)
        ck = DeepSpeedCheckpointer(engine, os.path.join(root, "flash"), job_id=job, persist_every=1000)
        ck.save(1)
        engine.checkpoint_engine = ck._previous_engine  # DeepSpeed's default TorchCheckpointEngine
        engine.save_checkpoint(os.path.join(root, "stock"), tag="t")
        os._exit(0)  # no close(): the step stays in memory, as a crash leaves it
    times: dict[str, float] = {}

    def stock() -> None:
        engine = ds_engine(hidden, layers)
        start = time.perf_counter()
        engine.load_checkpoint(os.path.join(root, "stock"), tag="t")
        times["stock_s"] = time.perf_counter() - start

    def flash() -> None:
        from flashckpt import _events
        _events.subscribe(lambda event, **info: times.update(source=info["source"]) if event == "load" else None)
        ck = DeepSpeedCheckpointer(ds_engine(hidden, layers), os.path.join(root, "flash"), job_id=job)
        start = time.perf_counter()
        if ck.load() != 1:
            raise SystemExit("the flash load did not restore step 1")
        times["flash_s"] = time.perf_counter() - start
        ck._ckpt.engine.close(unlink=False)

    for run in ((flash, stock) if flash_first else (stock, flash)):
        run()
    print(json.dumps(times), flush=True)
    os._exit(0)


def free_job(job: str) -> None:
    """Remove this round's shared memory (slots, locks, socket, saver log): this job's only.
    ``flashckpt gc --force`` here freed every other job of this user whose processes were
    gone at that moment (a test's between its kill and its restart, its returned saves
    with them), and skipped this one while its saver still lingered."""
    from flashckpt._names import job_objects, saver_log_path

    for path in [*job_objects(job), saver_log_path(job)]:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", nargs=3, metavar=("MODE", "ROOT", "JOB"), help=argparse.SUPPRESS)
    parser.add_argument("--flash-first", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child, args.hidden, args.layers, args.flash_first)
        return
    env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_PORT=str(29500 + os.getpid() % 400))
    rounds = []
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory(dir=args.dir) as root:
            job = "restart" + uuid.uuid4().hex[:8]
            base = [sys.executable, __file__, "--hidden", str(args.hidden), "--layers", str(args.layers)]
            try:
                subprocess.run(base + ["--child", "save", root, job], env=env, check=True, capture_output=True)
                order = ["--flash-first"] if i % 2 else []
                out = subprocess.run(base + ["--child", "load", root, job] + order, env=env, check=True,
                                     capture_output=True, text=True).stdout
            finally:
                free_job(job)
            result = json.loads(out.strip().splitlines()[-1])
            result["flash_first"] = bool(i % 2)
            rounds.append(result)
            print(f"round {i}: DeepSpeed's load_checkpoint {result['stock_s'] * 1e3:.0f} ms, flash load from "
                  f"{result['source']} {result['flash_s'] * 1e3:.0f} ms ({result['stock_s'] / result['flash_s']:.1f}x)",
                  flush=True)
    stock = statistics.median(r["stock_s"] for r in rounds)
    flash = statistics.median(r["flash_s"] for r in rounds)
    print(f"median of {len(rounds)}: DeepSpeed {stock * 1e3:.0f} ms, flashckpt {flash * 1e3:.0f} ms: "
          f"{stock / flash:.1f}x faster")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rounds": rounds, "stock_load_s": stock, "flash_load_s": flash,
                                               "hidden": args.hidden, "layers": args.layers}, indent=2))


if __name__ == "__main__":
    main()
