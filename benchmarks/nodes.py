"""Peer-memory replicas on two network-namespace nodes (root): throughput, save stall, recovery.

    sudo python benchmarks/nodes.py [--mib 256] [--repeats 3] [--json results/nodes.json]

The nodes are tests/nodes/_netns.py's: two network namespaces joined by a veth pair, each
with a private /dev/shm. What is measured, and against what:

- **replication throughput**: one saver's ``ReplicaService`` pushes a complete slot of
  ``--mib`` MiB to the other node's (authenticated, crc32 on both ends, acknowledged once the
  replica verified); the floor is one TCP stream of the same bytes between the same
  namespaces (``sendall`` of a buffer, ``recv_into`` a buffer, a one-byte ack at the end).
  Interleaved, median over ``--repeats``, after the first two pushes (each of the receiver's
  two copies of a rank allocates its shared memory once; reported apart).
- **save stall**: a torchrun job of one worker per node saves a ``--mib / 2`` MiB state
  every step (0.3 s of "compute" between saves, memory only), with ``replicas=1`` and with
  ``replicas=0``: the median ``save()`` blocking time of each.
- **time from node loss to training again**: the same job, every rank saving its own state
  (``Checkpointer``, storage every 5 steps); at step 7 node 1 is lost whole and a fresh
  node 1 joins; the time from the kill to the first step every rank finished afterwards,
  restoring from the peer's replica (``replicas=1``), from storage (``replicas=0``: steps 6
  and 7 are lost too), and a bare restart of the same job that loads nothing.
- **node-local directories** (each node its own directory at the checkpoint path, see
  ``flashckpt.replicas._node_local``): the save stall with storage every 5 steps, node-local against
  one shared directory (``stall_shared`` / ``stall_node_local``, both ``replicas=1``); and
  node loss -> training with node 1's directory wiped too (``recover_peer_node_local``),
  against ``recover_peer`` on a shared directory.

``--runs a,b`` measures only the named job runs (and not the link).

Prints a table with ratios; writes JSON. Numbers on a shared 2-core machine are noisy:
compare ratios taken in one run.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RESULT = "RESULT "
FLOOR_PORT, REPLICA_PORT, RDZV_PORT = 29610, 29611, 29400
KILL_STEP, STEPS, STEP_SECONDS = 7, 10, 0.3
_NODE_LOCAL_RUNS = ("stall_shared", "stall_node_local", "recover_peer_node_local")


# -- roles run inside the nodes --------------------------------------------------------------

def role_receive(args: argparse.Namespace) -> None:
    """Node 1: the floor's TCP sink (``repeats`` streams) and a replica endpoint."""
    from flashckpt.replicas._service import ReplicaService
    service = ReplicaService("bench")
    service.configure(args.secret, "0.0.0.0", "node1", REPLICA_PORT)
    size = args.mib << 20
    buf = bytearray(size)
    with socket.create_server(("0.0.0.0", FLOOR_PORT)) as server:
        print("ready", flush=True)
        for _ in range(args.repeats + 2):
            conn, _ = server.accept()
            with conn:
                view, got = memoryview(buf), 0
                while got < size:
                    got += conn.recv_into(view[got:])
                conn.sendall(b"k")
    time.sleep(600)  # replicas keep arriving until node 0 is done; the harness kills this


def role_push(args: argparse.Namespace) -> None:
    """Node 0: alternately, one plain TCP stream and one replica push of the same bytes."""
    from flashckpt.replicas._service import ReplicaService
    from tests.checkpoint.test_replica import make_slot
    size = args.mib << 20
    payload = os.urandom(1 << 20) * args.mib
    service = ReplicaService("bench")
    service.configure(args.secret, "0.0.0.0", "node0")
    service.set_peer(("node1", REPLICA_PORT))
    floor, pushed = [], []
    for _ in range(args.repeats + 2):
        started = time.perf_counter()
        with socket.create_connection(("node1", FLOOR_PORT)) as conn:
            conn.sendall(payload)
            assert conn.recv(1) == b"k"
        floor.append(time.perf_counter() - started)
        msg = make_slot("bench", len(pushed) + 1, payload)
        before = len(service.pushed_log)
        service.offer(msg)
        while len(service.pushed_log) == before:
            time.sleep(0.005)
        pushed.append(service.pushed_log[-1]["seconds"])
    # the first push into each of the receiver's two copies also allocates its shared memory
    print(RESULT + json.dumps({"bytes": size, "floor_s": floor[2:], "replica_s": pushed[2:],
                               "replica_first_s": pushed[:2]}), flush=True)


def role_train(args: argparse.Namespace) -> None:
    """One torchrun worker: save every step, events in ``args.dir``."""
    import datetime

    import torch
    import torch.distributed as dist

    from flashckpt.replicas._store import replica_index
    from flashckpt.torch import Checkpointer, init_process_group
    log = Path(args.dir) / f"events-{socket.gethostname()}-{os.getpid()}.jsonl"

    def emit(**event) -> None:
        with open(log, "a") as f:
            f.write(json.dumps({**event, "time": time.time()}) + "\n")

    emit(event="launch", rank=int(os.environ["RANK"]))
    init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    emit(event="group", rank=rank)
    state = {"w": torch.full(((args.mib << 20) // 4,), float(rank))}
    ck = Checkpointer(Path(args.dir) / "ckpt", persist_every=args.persist_every, replicas=args.replicas)
    emit(event="constructed", rank=rank)
    step = 0 if args.bare else (ck.load(state) or 0)
    emit(event="restored", rank=rank, step=step, source=ck.last_load.source if ck.last_load else None)
    while step < args.steps:
        step += 1
        time.sleep(STEP_SECONDS)
        dist.all_reduce(torch.ones(1))
        started = time.perf_counter()
        ck.save(step, state)
        emit(event="step", rank=rank, step=step, stall=time.perf_counter() - started)
        if step == args.kill_step and not (Path(args.dir) / f"reached-{rank}").exists():
            (Path(args.dir) / f"reached-{rank}").touch()
            deadline = time.monotonic() + 30
            while args.replicas and not any(h.step == step for _, h in replica_index(ck.job_id)):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            emit(event="paused", rank=rank, step=step)
            time.sleep(2)  # node 1 is killed meanwhile: node 0's next all_reduce fails, its agent restarts it
    ck.close()
    emit(event="done", rank=rank, step=step)
    dist.destroy_process_group()


# -- the harness -----------------------------------------------------------------------------

def events(shared: Path) -> list[dict]:
    out = []
    for path in glob.glob(str(shared / "events-*.jsonl")):
        with open(path) as f:
            out += [json.loads(line) for line in f if line.endswith("\n")]
    return out


def torchrun_job(nodes, shared: Path, train_args: list[str], *, lose_node1: bool,
                 node_local: bool = False) -> tuple[list[dict], float]:
    """Run the 2x1 job; with ``lose_node1``, kill node 1 once both ranks paused and start a
    fresh one (with ``node_local``, each node's checkpoint directory is its own, and node 1's
    is wiped with it). Returns the events and the kill time (0 without a kill)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    logs = []
    disks = [shared / f"disk{i}" for i in range(2)]
    if node_local:
        for d in disks + [shared / "ckpt"]:
            d.mkdir()

    def start(i: int):
        log = open(shared / f"torchrun-{i}-{len(logs)}.log", "w")
        logs.append(log)
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=node0:{RDZV_PORT}", f"--rdzv-id={nodes.namespaces[0]}",
                "--rdzv-conf=keep_alive_interval=1,keep_alive_max_attempt=5", "--max-restarts=3",
                __file__, "--role", "train", "--dir", str(shared), *train_args]
        if node_local:  # node i's own directory at the one checkpoint path, in its mount namespace
            argv = ["sh", "-c", 'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh", str(disks[i]),
                    str(shared / "ckpt"), *argv]
        return nodes.spawn(i, argv, cwd=str(REPO), env=env, stdout=log, stderr=subprocess.STDOUT)

    agents = {0: start(0), 1: start(1)}
    killed_at = 0.0
    deadline = time.monotonic() + 300
    if lose_node1:
        while len([e for e in events(shared) if e["event"] == "paused"]) < 2:
            assert time.monotonic() < deadline, "the job never reached the kill step"
            time.sleep(0.05)
        killed_at = time.time()
        nodes.kill_node(1)
        agents[1].wait()
        if node_local:
            subprocess.run(["rm", "-rf", str(disks[1])], check=True)
            disks[1].mkdir()
        agents[1] = start(1)
    for agent in agents.values():
        agent.wait(timeout=max(1.0, deadline - time.monotonic()))
    for log in logs:
        log.close()
    if any(agent.returncode for agent in agents.values()):
        tails = "".join(open(log.name).read()[-2000:] for log in logs)
        raise RuntimeError(f"a torchrun failed:\n{tails}")
    return events(shared), killed_at


def measure_throughput(nodes_cls, args: argparse.Namespace) -> dict:
    from flashckpt.replicas._protocol import new_secret
    secret = new_secret()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    common = ["--mib", str(args.mib), "--repeats", str(args.repeats), "--secret", secret]
    with nodes_cls(2, shm_size=f"{args.mib * 4 + 64}m") as nodes:
        receiver = nodes.spawn(1, [sys.executable, __file__, "--role", "receive", *common], cwd=str(REPO), env=env,
                               stdout=subprocess.PIPE, text=True)
        assert receiver.stdout.readline().strip() == "ready"
        pusher = nodes.spawn(0, [sys.executable, __file__, "--role", "push", *common], cwd=str(REPO), env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stdout, stderr = pusher.communicate(timeout=600)
    line = next((l for l in stdout.splitlines() if l.startswith(RESULT)), None)
    if line is None:
        raise RuntimeError(f"the push role failed: {stderr[-3000:]}")
    return json.loads(line[len(RESULT):])


def _record(evs: list[dict], killed_at: float, lose: bool) -> dict:
    """One run's median save stall and, after a node loss, the time to training again."""
    steps = sorted((e for e in evs if e["event"] == "step"), key=lambda e: e["time"])
    record: dict = {"median_stall_s": statistics.median(e["stall"] for e in steps[4:])}
    if lose:  # the first step every rank finished after the kill
        first: dict[int, float] = {}
        for e in steps:
            if e["time"] > killed_at:
                first.setdefault(e["rank"], e["time"])
        record["to_training_s"] = max(first.values()) - killed_at
        record["restored"] = sorted({(e["step"], e["source"]) for e in evs
                                     if e["event"] == "restored" and e["time"] > killed_at})
        record["timeline"] = sorted((round(e["time"] - killed_at, 2), e["event"], e["rank"]) for e in evs
                                    if e["time"] > killed_at and e["event"] != "step")
    return record


def measure_jobs(nodes_cls, args: argparse.Namespace) -> dict:
    half = str(max(1, args.mib // 2))
    results: dict = {}
    runs = {"stall_replicas_1": (["--replicas", "1", "--persist-every", "1000", "--steps", "20"], False),
            "stall_replicas_0": (["--replicas", "0", "--persist-every", "1000", "--steps", "20"], False),
            "recover_peer": (["--replicas", "1", "--kill-step", str(KILL_STEP)], True),
            "recover_storage": (["--replicas", "0", "--kill-step", str(KILL_STEP)], True),
            "recover_bare": (["--replicas", "0", "--bare", "--kill-step", str(KILL_STEP)], True),
            "stall_shared": (["--replicas", "1", "--persist-every", "5", "--steps", "20"], False),
            "stall_node_local": (["--replicas", "1", "--persist-every", "5", "--steps", "20"], False),
            "recover_peer_node_local": (["--replicas", "1", "--kill-step", str(KILL_STEP)], True)}
    chosen = args.runs.split(",") if args.runs else [n for n in runs if n not in _NODE_LOCAL_RUNS]
    records: dict[str, list[dict]] = {name: [] for name in chosen}
    for _ in range(args.repeats):  # interleaved: the machine's load drifts alike for every run
        for name in chosen:
            train_args, lose = runs[name]
            shared = Path(tempfile.mkdtemp(prefix=f"fcn-bench-{name}-", dir="/tmp"))
            with nodes_cls(2, shm_size=f"{int(half) * 6 + 64}m") as nodes:
                evs, killed_at = torchrun_job(nodes, shared, ["--mib", half, *train_args], lose_node1=lose,
                                              node_local=name.endswith("node_local"))
            subprocess.run(["rm", "-rf", str(shared)], check=False)
            records[name].append(_record(evs, killed_at, lose))
    for name, runs_of in records.items():
        results[name] = {"runs": runs_of, **{key: statistics.median(r[key] for r in runs_of)
                                             for key in ("median_stall_s", "to_training_s") if key in runs_of[0]}}
        results[name]["restored"] = runs_of[0].get("restored")
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["bench", "receive", "push", "train"], default="bench")
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--secret", default="")
    p.add_argument("--json", default=str(REPO / "results" / "nodes.json"))
    p.add_argument("--dir", default="")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--persist-every", type=int, default=5)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--bare", action="store_true")
    p.add_argument("--runs", default="", help="only these job runs, comma-separated (e.g. "
                   "stall_shared,stall_node_local,recover_peer,recover_peer_node_local); not the link")
    args = p.parse_args()
    if args.role != "bench":
        {"receive": role_receive, "push": role_push, "train": role_train}[args.role](args)
        return
    from tests.nodes._netns import Nodes, missing_requirements
    if missing_requirements():
        sys.exit(f"benchmarks/nodes.py: {missing_requirements()}")
    if args.runs:
        jobs = measure_jobs(Nodes, args)
        print_runs(jobs, args)
        return
    link = measure_throughput(Nodes, args)
    jobs = measure_jobs(Nodes, args)
    floor, replica = statistics.median(link["floor_s"]), statistics.median(link["replica_s"])
    mib = link["bytes"] / 2**20
    rows = [("link floor (one TCP stream)", f"{mib / floor:8.0f} MiB/s", "1.00"),
            ("replication (push, verified)", f"{mib / replica:8.0f} MiB/s", f"{floor / replica:.2f} of the floor"),
            ("replication, first push into fresh memory", f"{mib / max(link['replica_first_s']):8.0f} MiB/s",
             f"{floor / max(link['replica_first_s']):.2f} of the floor"),
            ("save stall, replicas=0", f"{jobs['stall_replicas_0']['median_stall_s'] * 1e3:8.1f} ms", "1.00"),
            ("save stall, replicas=1", f"{jobs['stall_replicas_1']['median_stall_s'] * 1e3:8.1f} ms",
             f"{jobs['stall_replicas_1']['median_stall_s'] / jobs['stall_replicas_0']['median_stall_s']:.2f}x")]
    bare = jobs["recover_bare"]["to_training_s"]
    for name in ("recover_bare", "recover_peer", "recover_storage"):
        r = jobs[name]
        rows.append((f"node loss -> training, {name[8:]} {r['restored']}", f"{r['to_training_s']:8.2f} s",
                     f"{r['to_training_s'] / bare:.2f}x bare"))
    print(f"two namespace nodes, {mib:.0f} MiB replicated, {mib / 2:.0f} MiB per rank in the jobs")
    for row in rows:
        print(f"  {row[0]:<58} {row[1]:>16}   {row[2]}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"link": link, "jobs": jobs}, indent=2) + "\n")
    print(f"wrote {out}")


def print_runs(jobs: dict, args: argparse.Namespace) -> None:
    """The chosen job runs, with node-local against shared where both ran; writes JSON."""
    pairs = {"stall_node_local": "stall_shared", "recover_peer_node_local": "recover_peer"}
    print(f"two namespace nodes, {max(1, args.mib // 2)} MiB per rank, load average {os.getloadavg()[0]:.1f}")
    for name, r in jobs.items():
        value = r.get("to_training_s", r["median_stall_s"])
        unit = f"{value:8.2f} s" if "to_training_s" in r else f"{value * 1e3:8.1f} ms"
        base = jobs.get(pairs.get(name, ""))
        ratio = f"{value / base.get('to_training_s', base['median_stall_s']):.2f}x {pairs[name]}" if base else ""
        print(f"  {name + ' ' + str(r.get('restored') or ''):<58} {unit:>12}   {ratio}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"jobs": jobs, "load_average": os.getloadavg()[0]}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
