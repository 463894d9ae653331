"""Flash DCP saves side by side with stock ``torch.distributed.checkpoint``, one run, interleaved.

    python benchmarks/dcp.py [--size small|large|both] [--repeats 3] [--dir DIR]
                             [--methods floor,dcp,flash,protocol,mlf] [--json results/dcp.json]

The state is the GPT-2-shaped AdamW state of ``save_load.py`` (357 MB "small", 1.49 GB
"large"), saved with ``dcp.save`` and no process group. Each repeat runs every method
once, in an order rotated per repeat; the table shows medians and ratios to the floor.

- floor: one copy of every tensor into an already-touched /dev/shm file (the save floor),
  the same copy into a new /dev/shm file whose pages the copy faults in (``save_fresh``:
  the floor of any first save into memory not made ready before), and a new process mapping
  that file and copying out (the floor of a load from memory after a restart).
- dcp.save: stock ``FileSystemWriter``, blocking until durable (it fsyncs).
- dcp.async_save (thread executor): stall until staged, total until the future resolves;
  with its default per-call stager, and with one ``DefaultStager`` kept across saves
  (cached staging buffers: first and steady).
- flashckpt writer: ``dcp.save(state, storage_writer=FlashStorageWriter(f"{dir}/step-N"))``
  in a process of its own, a new id and a new writer object every save (as torchtitan
  does), each save followed by the wait until its stock files are on storage (as training
  computes between saves): stall (first, steady) and time to durable (steady; ``.metadata``
  published, every file fsynced); then the process exits without closing,
  as a crash would; a NEW process loads it with ``FlashStorageReader`` from memory (the
  reader's construction timed apart) and, 2 s of "training" later, saves once more (the
  first save of a resumed run, whose slots the load sized); then a cold ``dcp.load`` of the stock files with
  stock ``FileSystemReader`` (page cache dropped with posix_fadvise); and a fresh process that
  calls ``flashckpt.dcp.prepare(state, dir)`` once its state exists (``prepare_call``: its
  seconds), trains 2 s, then saves for the first time (``first_prepared``).
- flashckpt protocol: the same with no writer and reader, only
  ``checkpoint_id="flashckpt://{dir}/step-N"`` (DCP's ``FsspecWriter`` / ``FsspecReader`` over
  flashckpt's fsspec protocol): stall (first, steady), durable, load from memory in a new
  process, first save after ``prepare``; its ratio to the writer's steady stall is printed (goal: within 2x).
  The import of ``flashckpt.dcp`` that the URL's first use triggers is timed apart (``import``):
  the writer's and reader's runs import it before their clocks start.
- ml-flashpoint 0.0.10's ``MemoryStorageWriter`` (``mlf``, in .bench-mlf: benchmarks/setup_peer_venv.sh
  mlf): ``dcp.save`` + its ``finalize_checkpoint`` into its tmpfs tier under /dev/shm, one gloo
  rank (blocking: the stall, first and steady), and a new process loading the newest step
  from that tmpfs through its ``MemoryStorageReader`` (benchmarks/_mlf_peer.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from save_load import _async_save, evict, run_json  # noqa: E402
from _state import SPECS, ShmFloor, build_state, fingerprint, nbytes, tensors  # noqa: E402

RESULT = "RESULT "
STEADY = 3
AFTER_LOAD = 2.0
"""Seconds between the load in a new process and its first save (the resumed run trains)."""
SHM = Path("/dev/shm")


def _timed(fn: Callable[[], Any]) -> float:
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _child(*argv: str) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", *argv]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    for line in reversed(out.stdout.splitlines()):
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}):\n{out.stderr[-3000:]}")


# ---- methods (each adds samples to ``samples``) --------------------------------------------

def bench_floor(size: str, state: dict[str, Any], work: Path, samples: dict[str, list[float]]) -> None:
    ts = tensors(state)
    path = SHM / f"flashckpt-dcp-floor-{os.getpid()}"
    floor = ShmFloor(path, ts, create=True)
    try:
        for _ in range(3):
            samples.setdefault("floor.save", []).append(_timed(lambda: floor.save(ts)))
        result = _child("floor-load", "--size", size, "--path", str(path))
        samples.setdefault("floor.load_new_process", []).append(result["seconds"])
    finally:
        floor.close(unlink=True)
    fresh = ShmFloor(path, ts, create=True, touch=False)
    try:
        samples.setdefault("floor.save_fresh", []).append(_timed(lambda: fresh.save(ts)))
    finally:
        fresh.close(unlink=True)


def bench_stock(size: str, state: dict[str, Any], work: Path, samples: dict[str, list[float]]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    def add(key: str, value: float) -> None:
        samples.setdefault(key, []).append(value)

    add("dcp.save", _timed(lambda: dcp.save(state, checkpoint_id=work / "sync")))
    evict(work / "sync")
    add("dcp.load_cold", _timed(lambda: dcp.load(state, checkpoint_id=work / "sync")))
    stall, total = _async_save(dcp, state, work / "async", None)
    add("dcp.async_stall", stall)
    add("dcp.async_total", total)
    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        for i in range(1 + STEADY):
            stall, total = _async_save(dcp, state, work / f"reused-{i}", stager)
            add("dcp.reused_stall_first" if i == 0 else "dcp.reused_stall_steady", stall)
    finally:
        stager.close()


def _save_then_load(name: str, size: str, state: dict[str, Any], work: Path,
                    samples: dict[str, list[float]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``name``-save in a process (stalls, durable), then ``name``-load in a new one, which
    must read the saved state from memory; the samples added under ``name.``."""
    saved = _child(f"{name}-save", "--size", size, "--dir", str(work))
    for key in ("first", "steady", "durable"):
        samples.setdefault(f"{name}.{key}", []).extend(saved[key])
    if "import" in saved:
        samples.setdefault(f"{name}.import", []).append(saved["import"])
    loaded = _child(f"{name}-load", "--size", size, "--dir", str(work), "--id", saved["id"])
    if loaded["fingerprint"] != fingerprint(state) or loaded["source"] != "memory":
        raise RuntimeError(f"the {name} load in a new process read {loaded['source']}, fingerprint "
                           f"{loaded['fingerprint']} (saved {fingerprint(state)})")
    samples.setdefault(f"{name}.load_new_process", []).append(loaded["seconds"])
    prepared = _child(f"{name}-prepared", "--size", size, "--dir", str(work / "prepared"))
    samples.setdefault(f"{name}.first_prepared", []).append(prepared["first"])
    samples.setdefault(f"{name}.prepare_call", []).append(prepared["prepare"])
    return saved, loaded


def bench_flash(size: str, state: dict[str, Any], work: Path, samples: dict[str, list[float]]) -> None:
    import torch.distributed.checkpoint as dcp

    saved, loaded = _save_then_load("flash", size, state, work, samples)
    samples.setdefault("flash.open_new_process", []).append(loaded["open"])
    samples.setdefault("flash.first_after_load", []).append(loaded["first_after_load"])
    evict(Path(saved["id"]))
    samples.setdefault("flash.load_cold_stock_reader", []).append(
        _timed(lambda: dcp.load(state, storage_reader=dcp.FileSystemReader(saved["id"]))))


def bench_protocol(size: str, state: dict[str, Any], work: Path, samples: dict[str, list[float]]) -> None:
    _save_then_load("protocol", size, state, work, samples)


def bench_mlf(size: str, state: dict[str, Any], work: Path, samples: dict[str, list[float]]) -> None:
    """ml-flashpoint's ``MemoryStorageWriter`` through its driver (benchmarks/_mlf_peer.py) in
    .bench-mlf (``benchmarks/setup_peer_venv.sh mlf``); its tmpfs tier under /dev/shm."""
    python = HERE.parent / ".bench-mlf" / "bin" / "python"
    if not python.exists():
        print("  ml-flashpoint skipped: no .bench-mlf (run benchmarks/setup_peer_venv.sh mlf)", flush=True)
        return
    directory = SHM / f"flashckpt-dcp-mlf-{os.getpid()}"
    cmd = [str(python), str(HERE / "_mlf_peer.py")]
    try:
        saved = run_json(cmd + ["save", "--size", size, "--dir", str(directory), "--saves", str(1 + STEADY)])
        loaded = run_json(cmd + ["load", "--size", size, "--dir", str(directory)])
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if loaded["fingerprint"] != fingerprint(state) or saved["fingerprint"] != fingerprint(state):
        raise RuntimeError("ml-flashpoint's load in a new process read other values than were saved")
    samples.setdefault("mlf.first", []).append(saved["stall_first"])
    samples.setdefault("mlf.steady", []).extend(saved["stall_steady"])
    samples.setdefault("mlf.load_new_process", []).append(loaded["load"])


METHODS = {"floor": bench_floor, "dcp": bench_stock, "flash": bench_flash, "protocol": bench_protocol,
           "mlf": bench_mlf}


# ---- child processes -----------------------------------------------------------------------

def child_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["floor-load", "flash-save", "flash-load", "flash-prepared", "protocol-save",
                                         "protocol-load", "protocol-prepared"])
    parser.add_argument("--size", required=True)
    parser.add_argument("--path")
    parser.add_argument("--dir")
    parser.add_argument("--id")
    args = parser.parse_args(argv)
    import warnings
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    state = build_state(SPECS[args.size], seed=0 if args.kind.endswith("-save") else 1)
    if args.kind == "floor-load":
        ts = tensors(state)
        gc.collect()
        start = time.perf_counter()
        floor = ShmFloor(Path(args.path), ts, create=False)
        floor.load(ts)
        result: dict[str, Any] = {"seconds": time.perf_counter() - start}
        floor.close(unlink=False)
    elif args.kind == "flash-save":
        result = _flash_save(state, Path(args.dir))
    elif args.kind == "flash-load":
        result = _flash_load(state, args.id)
    elif args.kind.endswith("-prepared"):
        result = _prepared_first(state, Path(args.dir), args.kind == "protocol-prepared")
    elif args.kind == "protocol-save":
        result = _protocol_save(state, Path(args.dir))
    else:
        result = _protocol_load(state, args.id)
    result["fingerprint"] = fingerprint(state)
    print(RESULT + json.dumps(result), flush=True)
    if args.kind.endswith("-save"):
        os._exit(0)  # no close: the memory stays, as after a crash


def _flash_save(state: dict[str, Any], work: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from flashckpt.dcp import FlashStorageWriter

    return _saves(lambda target: dcp.save(state, storage_writer=FlashStorageWriter(target, keep_last=2)), work)


def _saves(save: Callable[[str], Any], work: Path, prefix: str = "") -> dict[str, Any]:
    """``1 + STEADY`` saves into ``work/step-N`` (``prefix`` before the path), each followed by
    the wait until its stock files are on storage (as training computes between saves): the
    stall until the save returns, and the time until ``.metadata`` is published."""
    stalls: list[float] = []
    durable: list[float] = []
    target = ""
    for step in range(1 + STEADY):
        target = str(work / f"step-{step}")
        gc.collect()
        start = time.perf_counter()
        save(prefix + target)
        stalls.append(time.perf_counter() - start)
        while not os.path.exists(os.path.join(target, ".metadata")):
            time.sleep(0.002)
        durable.append(time.perf_counter() - start)
    return {"first": stalls[:1], "steady": stalls[1:], "durable": durable[1:], "id": target}


def _flash_load(state: dict[str, Any], target: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from flashckpt.dcp import FlashStorageReader, FlashStorageWriter, close

    gc.collect()
    start = time.perf_counter()
    reader = FlashStorageReader(target, keep_last=2)  # the writer's options: one run over the store
    opened = time.perf_counter()
    dcp.load(state, storage_reader=reader)
    loaded = time.perf_counter()
    source = reader.last_load.source
    result = {"open": opened - start, "seconds": loaded - opened, "source": source}
    time.sleep(AFTER_LOAD)  # training, before the first save of the resumed run
    step = int(target.rsplit("-", 1)[1]) + 1
    gc.collect()
    start = time.perf_counter()
    dcp.save(state, storage_writer=FlashStorageWriter(f"{os.path.dirname(target)}/step-{step}", keep_last=2))
    result["first_after_load"] = time.perf_counter() - start
    close()
    return result


def _prepared_first(state: dict[str, Any], work: Path, protocol: bool) -> dict[str, Any]:
    """A fresh process that calls ``flashckpt.dcp.prepare`` once its state exists, trains
    ``AFTER_LOAD`` s, then saves for the first time (writer, or ``flashckpt://``)."""
    import torch.distributed.checkpoint as dcp

    from flashckpt.dcp import FlashStorageWriter, close, prepare

    if protocol:
        _protocol()
    start = time.perf_counter()
    prepare(state, f"flashckpt://{work}" if protocol else work, **({} if protocol else {"keep_last": 2}))
    seconds = time.perf_counter() - start
    time.sleep(AFTER_LOAD)  # training, before the first save
    target = str(work / "step-0")
    gc.collect()
    start = time.perf_counter()
    if protocol:
        dcp.save(state, checkpoint_id=f"flashckpt://{target}")
    else:
        dcp.save(state, storage_writer=FlashStorageWriter(target, keep_last=2))
    first = time.perf_counter() - start
    close()
    return {"prepare": seconds, "first": first}


def _protocol() -> float:
    """Register ``flashckpt://`` (where the checkout is not the installed package) and import
    its file system, as the URL's first use would: the seconds that import took."""
    import fsspec.config
    from fsspec.registry import known_implementations

    if "flashckpt" not in known_implementations:  # a checkout that is not the installed one
        fsspec.register_implementation("flashckpt", "flashckpt.dcp._fs.FlashFileSystem")
    fsspec.config.conf["flashckpt"] = {"keep_last": 2}
    start = time.perf_counter()
    fsspec.get_filesystem_class("flashckpt")
    return time.perf_counter() - start


def _protocol_save(state: dict[str, Any], work: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    imported = _protocol()
    return {**_saves(lambda target: dcp.save(state, checkpoint_id=target), work, "flashckpt://"), "import": imported}


def _protocol_load(state: dict[str, Any], target: str) -> dict[str, Any]:
    import fsspec
    import torch.distributed.checkpoint as dcp

    from flashckpt.dcp import close

    _protocol()
    url = f"flashckpt://{target}"
    gc.collect()
    start = time.perf_counter()
    dcp.load(state, checkpoint_id=url)
    seconds = time.perf_counter() - start
    source = fsspec.filesystem("flashckpt").last_source(f"{url}/__0_0.distcp")
    close()  # the load opened the run: its memory is freed
    return {"seconds": seconds, "source": source}


# ---- the run ---------------------------------------------------------------------------------

def run_size(size: str, repeats: int, root: Path, methods: list[str]) -> dict[str, Any]:
    state = build_state(SPECS[size], seed=0)
    samples: dict[str, list[float]] = {}
    order = list(methods)
    for repeat in range(repeats):
        for name in order[repeat % len(order):] + order[:repeat % len(order)]:
            work = root / f"{size}-{name}-{repeat}"
            work.mkdir(parents=True)
            try:
                METHODS[name](size, state, work, samples)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            print(f"  {size} repeat {repeat + 1}/{repeats}: {name} done", flush=True)
    medians = {k: statistics.median(v) for k, v in samples.items()}
    floor_save, floor_load = medians["floor.save"], medians["floor.load_new_process"]
    ratios = {k: v / (floor_load if "load_new_process" in k or "open_new" in k else floor_save)
              for k, v in medians.items() if not k.startswith("floor.") and "cold" not in k and "durable" not in k
              and "prepare_call" not in k and "import" not in k and k not in ("dcp.save", "dcp.async_total")}
    for key in ("flash.first", "protocol.first", "mlf.first", "dcp.async_stall", "dcp.reused_stall_first"):
        if key in medians:  # first saves into memory nothing made ready: against the fresh-page floor
            ratios[f"{key}_to_fresh_floor"] = medians[key] / medians["floor.save_fresh"]
    if "protocol.steady" in medians and "flash.steady" in medians:
        ratios["protocol.steady_to_writer"] = medians["protocol.steady"] / medians["flash.steady"]
    for key in ("steady", "first", "load_new_process"):  # > 1: flashckpt's writer/reader is faster
        if f"mlf.{key}" in medians and f"flash.{key}" in medians:
            ratios[f"mlf.{key}_over_flash"] = medians[f"mlf.{key}"] / medians[f"flash.{key}"]
    return {"bytes": nbytes(state), "samples": samples, "medians": medians, "ratios_to_floor": ratios}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=["small", "large", "both"], default="small")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated, of {','.join(METHODS)} (floor is always measured: the ratios need it)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    methods = ["floor"] + [m for m in args.methods.split(",") if m and m != "floor"]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown methods {unknown}; the methods are {', '.join(METHODS)}")
    sizes = ["small", "large"] if args.size == "both" else [args.size]
    root = Path(tempfile.mkdtemp(prefix="flashckpt-dcp-bench-", dir=args.dir))
    results: dict[str, Any] = {"torch": torch.__version__, "cpus": os.cpu_count(), "sizes": {}}
    try:
        for size in sizes:
            results["sizes"][size] = result = run_size(size, args.repeats, root, methods)
            print(f"\n{size}: {result['bytes'] / 1e6:.0f} MB, medians over {args.repeats} repeats")
            for key, value in sorted(result["medians"].items()):
                ratio = result["ratios_to_floor"].get(key)
                print(f"  {key:32s} {value:8.3f} s" + (f"   {ratio:5.2f}x floor" if ratio is not None else ""))
            for key, ratio in sorted(result["ratios_to_floor"].items()):
                if key.endswith("_to_fresh_floor"):
                    print(f"  {key[:-len('_to_fresh_floor')]:32s} {ratio:5.2f}x the fresh-page floor (floor.save_fresh)")
            if "protocol.steady_to_writer" in result["ratios_to_floor"]:
                print(f"  protocol steady stall / writer steady stall: "
                      f"{result['ratios_to_floor']['protocol.steady_to_writer']:.2f}x (goal <= 2x)")
            for key in ("steady", "first", "load_new_process"):
                if f"mlf.{key}_over_flash" in result["ratios_to_floor"]:
                    print(f"  ml-flashpoint {key} / flashckpt writer's: "
                          f"{result['ratios_to_floor'][f'mlf.{key}_over_flash']:.2f}x (> 1: flashckpt faster)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
