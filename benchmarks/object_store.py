"""Object-store persist and load: ObjectStorage next to the floor of the same server and client.

    python benchmarks/object_store.py [--large-mib 256] [--many 8] [--many-mib 32] [--repeats 3]
                                      [--endpoint URL --bucket NAME] [--json results/object_store.json]

Without ``--endpoint`` it starts moto's S3 server (``moto[server]``, the tests' server)
on a loopback port; with it, any S3-compatible endpoint (credentials from the
environment). The floor is s3fs itself on the same bytes: ``pipe_file`` (its multipart
upload) and ``cat_file`` (its parallel ranged GETs) of one large object, with
ObjectStorage's part size and concurrency; ``pipe`` (same part size) and ``cat`` of many
objects at once, ``cat`` in s3fs's default (a HEAD and one GET per object: its fastest
here, as moto reads a whole object for every ranged GET, so each extra GET of a shard
costs the server the whole shard again; S3 serves ranges natively).
ObjectStorage: ``write_shard`` (upload, block checksums, done marker) then ``try_commit``
of one rank, and of ``--many`` ranks written by as many threads (as savers of that many
nodes would); load: what a load does to each whole shard (by as many threads):
``open_shard(..., whole=True)`` (a HEAD; the header's read brings the first 32 MiB
chunk), every chunk read and every block verified
(:class:`~flashckpt.restore._shard_read.ShardReader`), one GET per chunk, into buffers allocated
and touched beforehand (as a load copies into the model's existing tensors); and
``verify`` of the large one. Floor and flashckpt run in turn
``--repeats`` times: best MiB/s of each, the median of the paired ratios (flashckpt /
floor throughput, 1.0 = the floor), and CPU seconds per GiB of client plus server (the
server's from /proc when it is our moto), which other load on a shared machine does not
skew. flashckpt's write includes the commit (keep_last=2), whose median time is printed
apart. Against moto the server (Python, one
process) bounds both sides, so the ratios matter more than the MiB/s.

Two more comparisons on the same bucket:

- ``torch.distributed.checkpoint`` with its fsspec writer and reader (``FsspecWriter`` /
  ``FsspecReader`` on an ``s3://`` URL of the same server, no process group, its default
  settings) saving and loading ``{"w": <the large shard's bytes as a uint8 tensor>}``,
  next to flashckpt's write (with commit) and read of the same bytes: the ratio is
  flashckpt over DCP; skipped, with the reason, where DCP's fsspec storage does not run.
- The save stall (what ``save`` blocks for) of a ``DdpCheckpointer`` on the bucket and on
  a local directory, alternating, ``--stall-steps`` saves of ``--stall-mib`` each (the
  first, which allocates the shared memory, not counted), each save's persist awaited
  before the next: the upload runs in the saver process, so the ratio should be 1.

Prints tables and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flashckpt._engine import new_token  # noqa: E402
from flashckpt.memory._format import plan_image  # noqa: E402
from flashckpt.storage._object import CONCURRENCY, PART_BYTES, ObjectStorage  # noqa: E402
from flashckpt.restore._shard_read import open_shard  # noqa: E402

log = logging.getLogger("object_store")
MiB = 1 << 20


def start_moto() -> tuple[subprocess.Popen, str]:
    """moto's S3 server on a free loopback port, and its endpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
            return proc, endpoint
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("moto server did not start")
            time.sleep(0.05)


def make_image(token: str, size: int) -> bytes:
    """A flashckpt image saved by ``token``: its header and one random U8 tensor of ``size`` bytes."""
    head = plan_image([("w", "U8", (size,))], {"token": token, "kinds": {"w": "numpy"}}).header
    return head + os.urandom(size)


def cpu_seconds(server_pid: int | None) -> float:
    """CPU time of this process (every thread) plus the server's, when it is a local process."""
    used = time.process_time()
    if server_pid is not None:
        fields = Path(f"/proc/{server_pid}/stat").read_text().rsplit(")", 1)[1].split()
        used += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return used


def pair(repeats: int, floor: Callable[[int], None], ours: Callable[[int], None], nbytes: int,
         server_pid: int | None) -> dict[str, float]:
    """Floor and flashckpt run in turn ``repeats`` times (so both see the same load on a
    shared machine): best MiB/s of each, the median of the paired throughput ratios, and
    the CPU seconds per GiB (client + server) of each, robust to other load."""
    rates: dict[str, list[float]] = {"floor": [], "flashckpt": []}
    cpu: dict[str, list[float]] = {"floor": [], "flashckpt": []}
    for attempt in range(repeats):
        for name, run in (("floor", floor), ("flashckpt", ours)):
            used, start = cpu_seconds(server_pid), time.perf_counter()
            run(attempt)
            rates[name].append(nbytes / MiB / (time.perf_counter() - start))
            cpu[name].append((cpu_seconds(server_pid) - used) / (nbytes / 2**30))
    ratios = sorted(b / a for a, b in zip(rates["floor"], rates["flashckpt"]))
    return {"floor": max(rates["floor"]), "flashckpt": max(rates["flashckpt"]), "ratio": ratios[len(ratios) // 2],
            "floor_cpu_s_per_gib": min(cpu["floor"]), "flashckpt_cpu_s_per_gib": min(cpu["flashckpt"])}


def measure(args: argparse.Namespace, bucket: str, server_pid: int | None) -> tuple[dict[str, Any], float]:
    import fsspec

    fs = fsspec.filesystem("s3")
    large = make_image(new_token(), args.large_mib * MiB)
    many = [make_image(new_token(), args.many_mib * MiB) for _ in range(args.many)]
    many_bytes = sum(len(m) for m in many)
    floor_dir = f"{bucket}/floor-{uuid.uuid4().hex[:8]}"
    url = f"s3://{bucket}/ckpt-{uuid.uuid4().hex[:8]}"
    storage = ObjectStorage(url)
    rows: dict[str, dict[str, float]] = {}

    def floor_put_one(_: int) -> None:
        fs.pipe_file(f"{floor_dir}/large", large, chunksize=PART_BYTES, max_concurrency=CONCURRENCY)

    def floor_get_one(_: int) -> None:
        assert len(fs.cat_file(f"{floor_dir}/large", chunksize=PART_BYTES, max_concurrency=CONCURRENCY)) == len(large)

    def floor_put_many(_: int) -> None:
        fs.pipe({f"{floor_dir}/many-{i}": m for i, m in enumerate(many)}, chunksize=PART_BYTES,
                max_concurrency=CONCURRENCY)

    def floor_get_many(_: int) -> None:
        assert sum(map(len, fs.cat([f"{floor_dir}/many-{i}" for i in range(len(many))]).values())) == many_bytes

    token = new_token()
    images = {"large": [make_image(token, len(large))],
              "many": [make_image(token, len(m)) for m in many]}

    commit_seconds: list[float] = []

    def ckpt_put(kind: str, step_base: int) -> Callable[[int], None]:
        def run(attempt: int) -> None:
            step, shards = step_base + attempt, images[kind]
            with ThreadPoolExecutor(len(shards)) as pool:
                list(pool.map(lambda r: storage.write_shard(step, r, token, memoryview(shards[r])),
                              range(len(shards))))
            start = time.perf_counter()
            assert storage.try_commit(step, len(shards), token, 2)
            commit_seconds.append(time.perf_counter() - start)
        return run

    into = {kind: [bytearray(b"\1" * len(img)) for img in shards] for kind, shards in images.items()}

    def ckpt_get(kind: str, step: int) -> Callable[[int], None]:
        def one(rank: int) -> None:  # what a load does: open, parse the header, read all, verify every block
            with open_shard(storage, step, rank, whole=True) as reader:
                reader.read_all([(0, memoryview(into[kind][rank]))])

        def run(_: int) -> None:
            with ThreadPoolExecutor(len(images[kind])) as pool:
                list(pool.map(one, range(len(images[kind]))))
        return run

    def ckpt_verify(_: int) -> None:
        assert storage.verify(100 + args.repeats - 1) == []

    r, pid = args.repeats, server_pid
    rows["one large: write"] = pair(r, floor_put_one, ckpt_put("large", 100), len(large), pid)
    rows["one large: read"] = pair(r, floor_get_one, ckpt_get("large", 100 + r - 1), len(large), pid)
    rows["one large: verify"] = pair(r, floor_get_one, ckpt_verify, len(large), pid)
    rows[f"{args.many} in parallel: write"] = pair(r, floor_put_many, ckpt_put("many", 200), many_bytes, pid)
    rows[f"{args.many} in parallel: read"] = pair(r, floor_get_many, ckpt_get("many", 200 + r - 1), many_bytes, pid)
    return rows, sorted(commit_seconds)[len(commit_seconds) // 2]


def dcp_fsspec() -> tuple[Any, Any]:
    """DCP's fsspec writer and reader classes (public in some torch versions, private in others)."""
    try:
        from torch.distributed.checkpoint import FsspecReader, FsspecWriter
    except ImportError:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    return FsspecWriter, FsspecReader


def measure_dcp(args: argparse.Namespace, bucket: str, server_pid: int | None) -> dict[str, dict[str, float]]:
    """DCP (fsspec, no process group) and flashckpt saving and loading the same bytes."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    writer_cls, reader_cls = dcp_fsspec()
    token = new_token()
    image = make_image(token, args.large_mib * MiB)
    body = torch.frombuffer(bytearray(image[-args.large_mib * MiB:]), dtype=torch.uint8)
    base = f"s3://{bucket}/dcp-{uuid.uuid4().hex[:8]}"
    storage = ObjectStorage(f"s3://{bucket}/ckpt-dcp-{uuid.uuid4().hex[:8]}")

    def dcp_save(attempt: int) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no process group: saving as one process"
            dcp.save({"w": body}, storage_writer=writer_cls(f"{base}/{attempt}"))

    def dcp_load(attempt: int) -> None:
        into = {"w": torch.empty_like(body)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(into, storage_reader=reader_cls(f"{base}/{args.repeats - 1}"))
        assert torch.equal(into["w"][-64:], body[-64:])

    def ours_save(attempt: int) -> None:
        storage.write_shard(attempt, 0, token, memoryview(image))
        assert storage.try_commit(attempt, 1, token, 2)

    def ours_load(attempt: int) -> None:
        shard, record = storage.open_shard(args.repeats - 1, 0)
        shard.pread_into(bytearray(record["size"]), 0)

    r, n = args.repeats, len(image)
    return {"one large: save": pair(r, dcp_save, ours_save, n, server_pid),
            "one large: load": pair(r, dcp_load, ours_load, n, server_pid)}


def measure_stall(args: argparse.Namespace, bucket: str) -> dict[str, float]:
    """Median save stall (seconds) of a DdpCheckpointer on the bucket and on a local directory."""
    import torch

    from flashckpt.torch import DdpCheckpointer

    state = {"w": torch.zeros(args.stall_mib * MiB // 4), "step": 0}
    stalls: dict[str, list[float]] = {"local": [], "bucket": []}
    with tempfile.TemporaryDirectory(prefix="flashckpt-stall-") as local:
        job = f"bench-stall-{uuid.uuid4().hex[:8]}"
        where = {"local": local, "bucket": f"s3://{bucket}/stall-{uuid.uuid4().hex[:8]}"}
        cks = {name: DdpCheckpointer(path, job_id=f"{job}-{name}", persist_every=1, keep_last=2)
               for name, path in where.items()}
        try:
            for step in range(args.stall_steps + 1):
                for name, ck in cks.items():
                    state["w"].fill_(float(step))
                    state["step"] = step
                    start = time.perf_counter()
                    ck.save(step, state)
                    if step:  # the first save allocates the shared memory
                        stalls[name].append(time.perf_counter() - start)
                    ck.wait()
        finally:
            for ck in cks.values():
                ck.close()
    return {name: statistics.median(values) for name, values in stalls.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--large-mib", type=int, default=256)
    parser.add_argument("--many", type=int, default=8)
    parser.add_argument("--many-mib", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stall-mib", type=int, default=256, help="the DdpCheckpointer state of the stall rows")
    parser.add_argument("--stall-steps", type=int, default=5)
    parser.add_argument("--no-dcp", action="store_true", help="skip the torch.distributed.checkpoint rows")
    parser.add_argument("--endpoint", help="an S3 endpoint to use instead of a moto server of its own")
    parser.add_argument("--bucket", help="with --endpoint: an existing bucket")
    parser.add_argument("--json", default=str(ROOT / "results" / "object_store.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    proc = None
    if args.endpoint is None:
        proc, args.endpoint = start_moto()
        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    os.environ["AWS_ENDPOINT_URL"] = args.endpoint
    try:
        import fsspec

        bucket = args.bucket or f"bench-{uuid.uuid4().hex[:8]}"
        if args.bucket is None:
            fsspec.filesystem("s3").mkdir(bucket)
        pid = proc.pid if proc is not None else None
        rows, commit = measure(args, bucket, pid)
        dcp_rows: dict[str, dict[str, float]] = {}
        dcp_skipped = "--no-dcp" if args.no_dcp else None
        if not args.no_dcp:
            try:
                dcp_rows = measure_dcp(args, bucket, pid)
            except Exception as exc:  # where DCP's fsspec storage does not run (torch version, s3fs)
                dcp_skipped = f"{type(exc).__name__}: {exc}"[:300]
        stall = measure_stall(args, bucket)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
    print(f"{'':28} {'floor MiB/s':>11} {'flashckpt MiB/s':>15} {'ratio':>6} {'CPU s/GiB floor':>15} "
          f"{'flashckpt':>9}")
    for name, row in rows.items():
        print(f"{name:28} {row['floor']:11.0f} {row['flashckpt']:15.0f} {row['ratio']:6.2f} "
              f"{row['floor_cpu_s_per_gib']:15.2f} {row['flashckpt_cpu_s_per_gib']:9.2f}")
    if dcp_rows:
        print(f"\n{'vs torch.distributed.checkpoint':28} {'DCP MiB/s':>11} {'flashckpt MiB/s':>15} {'ratio':>6} "
              f"{'CPU s/GiB DCP':>15} {'flashckpt':>9}")
        for name, row in dcp_rows.items():
            print(f"{name:28} {row['floor']:11.0f} {row['flashckpt']:15.0f} {row['ratio']:6.2f} "
                  f"{row['floor_cpu_s_per_gib']:15.2f} {row['flashckpt_cpu_s_per_gib']:9.2f}")
    else:
        print(f"\ntorch.distributed.checkpoint (fsspec): skipped ({dcp_skipped})")
    print(f"\nsave stall, DdpCheckpointer, {args.stall_mib} MiB, median of {args.stall_steps}: local directory "
          f"{stall['local'] * 1000:.1f} ms, bucket {stall['bucket'] * 1000:.1f} ms, "
          f"ratio {stall['bucket'] / stall['local']:.2f}")
    result = {"endpoint": "moto (own)" if proc is not None else args.endpoint, "part_bytes": PART_BYTES,
              "concurrency": CONCURRENCY, "large_mib": args.large_mib, "many": args.many,
              "many_mib": args.many_mib, "repeats": args.repeats, "cpus": os.cpu_count(), "rows": rows,
              "commit_seconds_median": commit, "dcp_rows": {name: {k.replace("floor", "dcp"): v for k, v in row.items()}
                                                     for name, row in dcp_rows.items()},
              "dcp_skipped": dcp_skipped, "stall_mib": args.stall_mib, "stall_seconds_median": stall}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"try_commit (the last rank's: listing, markers, metadata, retention, latest): median {commit * 1000:.0f} ms")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
