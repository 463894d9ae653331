"""Loads from storage with a cold page cache: flashckpt, DCP and torch.load against one read floor.

    python benchmarks/cold_read.py [--sizes tiny,medium,small,large] [--repeats 3]
                                   [--dir DIR] [--json results/cold_read.json]

Sizes are the GPT-2-shaped AdamW states of _state.py: tiny 33 MB, medium 134 MB, small 357 MB,
large 1.49 GB. Each size is written once by each method into DIR: flashckpt's committed step
(``Checkpointer.save`` + ``wait``), a DCP checkpoint (``dcp.save``, no process group) and a
``torch.save`` file. Each repeat then runs every load, in an order rotated per repeat, each from
a cold cache made and checked by ``_cold.make_cold`` (root: ``sync`` + ``drop_caches``, else
``posix_fadvise``; ``fincore`` counts what stayed resident, reported per load) and each in a NEW
process that built its state first; only the load is timed, until the state's tensors hold the
checkpoint. The whole cache is dropped before the process starts, and the checkpoint's pages
once more (``posix_fadvise``) just before its load: the library code it imported stays cached,
as in a restarted job, while no page of the checkpoint is.

- flashckpt: ``Checkpointer.load`` (a job id with nothing in memory: it reads storage);
- dcp: ``torch.distributed.checkpoint.load`` in place;
- torch: ``torch.load(weights_only=True)`` + a copy into the state; torch-mmap: the same with
  ``mmap=True``;
- the read floor of each method's own files (``_cold.read_floor``: the faster of one
  ``dd iflag=direct`` stream and 8 threads of buffered preads, each cold).

Printed per size: the median seconds, each load over the floor of its own files, and
flashckpt's speed over DCP's and torch.load's (>1: flashckpt is faster). JSON has every sample.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO)]

from _cold import make_cold, read_floor  # noqa: E402
from _peer_cli import RESULT_PREFIX  # noqa: E402
from _state import SPECS, build_state, copy_into, fingerprint, nbytes  # noqa: E402

SIZES = ["tiny", "medium", "small", "large"]
LOADS = ["flashckpt", "dcp", "torch", "torch-mmap"]
FLOORS = {"flashckpt": "floor.flashckpt", "dcp": "floor.dcp", "torch": "floor.torch", "torch-mmap": "floor.torch"}
CHILD_TIMEOUT_SECONDS = 600


def write_all(spec_name: str, root: Path) -> tuple[dict[str, Path], float, int]:
    """Each method's checkpoint of the size's state: method -> path; the state's fingerprint and bytes."""
    from flashckpt.torch import Checkpointer
    import torch.distributed.checkpoint as dcp

    state = build_state(SPECS[spec_name])
    paths = {"flashckpt": root / "flashckpt", "dcp": root / "dcp", "torch": root / "state.pt"}
    with Checkpointer(str(paths["flashckpt"]), job_id=f"cold-{uuid.uuid4().hex[:12]}") as ck:
        ck.save(1, state)
        ck.wait()
    dcp.save(state, checkpoint_id=paths["dcp"])
    with open(paths["torch"], "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return paths, fingerprint(state), nbytes(state)


def load_in_child(kind: str, spec_name: str, path: Path) -> dict[str, Any]:
    """A new process builds its state, then (once the cache was made cold here) times ``kind``'s load."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, spec_name, str(path)]
    make_cold(path)  # the whole cache: the child then reads its own code back before it is timed
    with tempfile.TemporaryFile(mode="w+") as err:
        child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            ready = child.stdout.readline()
            if ready.strip() != "READY":
                raise RuntimeError(f"{kind} child did not start: {ready!r}")
            resident = make_cold(path, everything=False)  # what its setup read of the checkpoint
            child.stdin.write("go\n")
            child.stdin.flush()
            out, _ = child.communicate(timeout=CHILD_TIMEOUT_SECONDS)
        finally:
            if child.poll() is None:
                child.kill()
        err.seek(0)
        for line in out.splitlines():
            if line.startswith(RESULT_PREFIX):
                return {**json.loads(line[len(RESULT_PREFIX):]), "resident": resident}
        raise RuntimeError(f"{kind} child exited {child.returncode}: {err.read()[-2000:]}")


def child_main(kind: str, spec_name: str, path: Path) -> None:
    """The child side of :func:`load_in_child`."""
    state = build_state(SPECS[spec_name], seed=1)
    if kind == "flashckpt":
        from flashckpt.torch import Checkpointer

        ck = Checkpointer(str(path), job_id=f"cold-{uuid.uuid4().hex[:12]}")
        load = lambda: ck.load(state)  # noqa: E731
    elif kind == "dcp":
        import torch.distributed.checkpoint as dcp

        load = lambda: dcp.load(state, checkpoint_id=path)  # noqa: E731
    else:
        mmap = kind == "torch-mmap"
        load = lambda: copy_into(state, torch.load(path, weights_only=True, mmap=mmap))  # noqa: E731
    print("READY", flush=True)
    sys.stdin.readline()
    start = time.perf_counter()
    load()
    seconds = time.perf_counter() - start
    if kind == "flashckpt":
        ck.close()
    print(RESULT_PREFIX + json.dumps({"seconds": seconds, "fingerprint": fingerprint(state)}), flush=True)


def run_size(spec_name: str, repeats: int, root: Path) -> dict[str, Any]:
    """Every load and floor of one size, ``repeats`` times, interleaved; samples and medians."""
    work = root / spec_name
    work.mkdir()
    paths, expected, size = write_all(spec_name, work)
    paths["torch-mmap"] = paths["torch"]
    samples: dict[str, list[dict[str, Any]]] = {}
    jobs = LOADS + sorted(set(FLOORS.values()))
    for repeat in range(repeats):
        for job in jobs[repeat % len(jobs):] + jobs[:repeat % len(jobs)]:
            if job.startswith("floor."):
                sample = read_floor(paths[job.removeprefix("floor.")])
                sample["seconds"] = sample["floor"]
            else:
                sample = load_in_child(job, spec_name, paths[job])
                if abs(sample["fingerprint"] - expected) > 1e-6 * max(1.0, abs(expected)):
                    raise RuntimeError(f"{job} at {spec_name} loaded other values than were saved")
            samples.setdefault(job, []).append(sample)
            print(f"  {spec_name} repeat {repeat}: {job} {sample['seconds']:.3f}s", flush=True)
    shutil.rmtree(work)
    medians = {job: statistics.median(s["seconds"] for s in runs) for job, runs in samples.items()}
    ratios = {f"{load}/floor": medians[load] / medians[FLOORS[load]] for load in LOADS}
    ratios.update({f"flashckpt speed/{peer}": medians[peer] / medians["flashckpt"] for peer in LOADS[1:]})
    return {"bytes": size, "repeats": repeats, "medians": medians, "ratios": ratios, "samples": samples,
            "max_resident": max((s.get("resident") or 0) for runs in samples.values() for s in runs)}


def print_table(name: str, result: dict[str, Any]) -> None:
    m, r = result["medians"], result["ratios"]
    print(f"\n{name}: {result['bytes'] / 1e6:.0f} MB, median of {result['repeats']}, "
          f"most bytes left resident before a timed read: {result['max_resident']}")
    print(f"  {'load':<12} {'seconds':>8} {'GB/s':>6} {'x floor':>8}  {'floor s':>8}")
    for load in LOADS:
        floor = m[FLOORS[load]]
        print(f"  {load:<12} {m[load]:8.3f} {result['bytes'] / m[load] / 1e9:6.2f} {r[load + '/floor']:8.2f}  {floor:8.3f}")
    print("  flashckpt speed over: " + ", ".join(f"{peer} {r['flashckpt speed/' + peer]:.2f}x" for peer in LOADS[1:]))


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        child_main(sys.argv[2], sys.argv[3], Path(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/tmp", help="storage directory (a temp folder is made inside)")
    parser.add_argument("--json", default=str(REPO / "results" / "cold_read.json"))
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    if set(sizes) - set(SIZES) or args.repeats < 1:
        parser.error(f"--sizes of {', '.join(SIZES)}; --repeats at least 1")
    warnings.filterwarnings("ignore")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="flashckpt-cold-", dir=args.dir))
    results: dict[str, Any] = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "root": os.geteuid() == 0,
                               "load_average_before": os.getloadavg(), "sizes": {}}
    try:
        for name in sizes:
            results["sizes"][name] = run_size(name, args.repeats, root)
            print_table(name, results["sizes"][name])
            results["load_average_after"] = os.getloadavg()
            out.write_text(json.dumps(results, indent=2) + "\n")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
