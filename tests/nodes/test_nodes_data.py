"""Elastic data across nodes: every sample trained exactly once through 4 -> 2 -> 5 ranks.

One elastic torchrun job (``--nnodes=1:2``, own rendezvous store) on two namespace nodes,
the ``ShardSampler``'s coordinator on SQLite in the shared directory or on a redis-server
in node 0's namespace, a ``DdpCheckpointer`` saving the model and the sampler's state
every 3 steps (``_data_worker.py``):

1. 2 nodes x 2 ranks train to step 5, where node 1's ranks stop; the test SIGKILLs every
   process of node 1. Node 0's workers fail on the lost peer, its agent restarts them alone.
2. 1 node x 2 ranks restore step 3 from memory (steps 4-5 are rolled back), train to step 8
   and stop; a new node 1 with 3 ranks joins, node 0's agent restarts its workers for it.
3. 2 + 3 ranks restore step 6 (node 1's memory is new: from storage or node 0's replica)
   and finish the epoch.

Workers log the samples they train per round and step; a round that restored step S
keeps the timeline's steps up to S and replaces the rest. The surviving timeline must
hold every sample exactly once, as must the final model (a count per sample). Each run is
bounded: a hang fails the test after DEADLINE.
"""

import os
import subprocess
import sys
import time
from collections import Counter, defaultdict

import pytest

from ..elastic_data.test_sampler_shard import sqlite_url
from ._netns import Nodes, missing_requirements
from ._torchrun import AGENT, RDZV_PORT
from .test_nodes_restart import Job

WORKER = os.path.join(os.path.dirname(__file__), "_data_worker.py")
SAMPLES = 120
REDIS_PORT = 6379  # node 0's own network namespace: free
DEADLINE = 150.0
LONG = f"{DEADLINE:.0f}"  # a pause that ends when the test kills the node or node 1 joins

pytestmark = pytest.mark.skipif(missing_requirements() is not None, reason=str(missing_requirements()))


class DataJob(Job):
    """An elastic job of one or two nodes, each with its own number of ranks."""

    def __init__(self, nodes: Nodes, tmp_path, worker_args: list[str]) -> None:
        # a node is gone 5 s after its last heartbeat (default 15 s). Not 2 s: torch 2.13's agent
        # may beat only every other keep_alive_interval (its timer ticks each interval, but beats
        # only if the last beat is at least an interval old), so with keep_alive_max_attempt=2 a
        # live node 0 is taken for dead and a joining node 1 forms a round of its own (3 runs in 3)
        super().__init__(nodes, tmp_path, kill_rank=-1, share_store=False, worker_args=tuple(worker_args),
                         rdzv_conf="keep_alive_interval=1,keep_alive_max_attempt=5,last_call_timeout=1")
        self.env["LOGLEVEL"] = "INFO"  # the agents' rendezvous decisions, in the logs a failure shows

    def start(self, i: int, nproc: int, pauses: tuple[str, ...]) -> None:
        log = open(self.tmp_path / f"torchrun-node{i}-{len(self.logs)}.log", "w")
        self.logs.append(log)
        argv = [sys.executable, AGENT, "--nnodes=1:2", f"--nproc-per-node={nproc}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={self.nodes.hostnames[0]}:{RDZV_PORT}",
                f"--rdzv-id={self.nodes.namespaces[0]}", f"--rdzv-conf={self.rdzv_conf}", "--max-restarts=3",
                "--monitor-interval=0.5", WORKER, "--dir", str(self.shared), *self.worker_args,
                *[a for pause in pauses for a in ("--pause", pause)]]
        self.agents[i] = self.nodes.spawn(i, argv, cwd=self.tmp_path, env=self.env, stdout=log,
                                          stderr=subprocess.STDOUT)

    def wait_for(self, what: str, ready, end: float) -> None:
        """Until ``ready()``; fails at ``end``, or at once when a torchrun has failed."""
        while not ready():
            failed = [i for i, agent in self.agents.items() if agent.poll() not in (None, 0)]
            if failed and (0 in failed or 0 not in self.agents):
                self.fail(f"node {failed[0]}'s torchrun failed before {what}")
            if time.monotonic() > end:
                self.fail(f"{what} not seen within {DEADLINE:.0f} s")
            if starved := self.memory.starved():
                self.fail(f"{what} not seen: {starved}")
            time.sleep(0.2)

    def importing_torch(self, i: int) -> bool:
        """Whether a process of node ``i`` has mapped torch's library."""
        for pid in self.nodes.pids(i):
            try:
                with open(f"/proc/{pid}/maps") as maps:
                    if "libtorch_python" in maps.read():
                        return True
            except OSError:
                continue
        return False

    def paused(self, world: int) -> int:
        return len([e for e in self.events("pause") if e["world"] == world])


def start_redis(nodes: Nodes, tmp_path) -> subprocess.Popen:
    """A redis-server on node 0's address (only the nodes reach it), no persistence."""
    log = tmp_path / "redis.log"
    with open(log, "w") as out:
        server = nodes.spawn(0, ["redis-server", "--bind", nodes.addresses[0], "--port", str(REDIS_PORT),
                                 "--protected-mode", "no", "--save", "", "--appendonly", "no"],
                             cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    end = time.monotonic() + 20
    while "Ready to accept connections" not in log.read_text():
        if server.poll() is not None or time.monotonic() > end:
            pytest.fail(f"redis-server in {nodes.namespaces[0]} did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.1)
    return server


def stop(server: subprocess.Popen | None) -> None:
    if server is not None and server.poll() is None:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def surviving_timeline(events: list[dict]) -> tuple[list[dict], dict[int, list[int]], int]:
    """From the workers' ``start`` and ``trained`` events: the rounds (the first start event of
    each, in order), the samples of each step of the timeline that survived the rollbacks,
    and how many trained samples were rolled back."""
    starts = defaultdict(list)
    for e in events:
        if e["event"] == "start":
            starts[e["round"]].append(e)
    rounds = sorted(starts.values(), key=lambda s: min(e["time"] for e in s))
    for members in rounds:
        world = members[0]["world"]
        assert sorted(e["rank"] for e in members) == list(range(world)), members
        assert len({e["restored"] for e in members}) == 1, f"the ranks of a round restored different steps: {members}"
    trained = defaultdict(lambda: defaultdict(list))  # round -> step -> ids of every rank
    for e in events:
        if e["event"] == "trained":
            trained[e["round"]][e["step"]].append(e)
    timeline: dict[int, list[dict]] = {}
    rolled_back = 0
    for members in rounds:
        first = members[0]
        assert first["restored"] == 0 or first["restored"] in timeline, f"restored a step never trained: {first}"
        for step in [s for s in timeline if s > first["restored"]]:
            rolled_back += sum(len(e["ids"]) for e in timeline.pop(step))
        for step, entries in trained[first["round"]].items():
            timeline[step] = [{**e, "world": first["world"]} for e in entries]
    for step, entries in timeline.items():  # every rank of the round logged each step that survived
        assert sorted(e["rank"] for e in entries) == list(range(entries[0]["world"])), (step, entries)
    samples = {step: [i for e in entries for i in e["ids"]] for step, entries in timeline.items()}
    return [members[0] for members in rounds], samples, rolled_back


def test_the_surviving_timeline_drops_the_steps_after_the_restored_one():
    """The counting itself, without processes: 2 ranks train steps 1-3, 1 rank restores step 2."""
    def start(rnd, rank, world, restored, time):
        return {"event": "start", "round": rnd, "rank": rank, "world": world, "restored": restored, "time": time}

    def trained(rnd, rank, step, ids):
        return {"event": "trained", "round": rnd, "rank": rank, "step": step, "ids": ids}

    events = [start("b", 0, 1, 2, 9.0), trained("b", 0, 3, [5, 6]), trained("b", 0, 4, [7]),
              start("a", 1, 2, 0, 1.0), start("a", 0, 2, 0, 1.1),
              *[trained("a", r, s, [2 * s + r - 2]) for s in (1, 2, 3) for r in (0, 1)]]
    rounds, samples, rolled_back = surviving_timeline(events)
    assert [(r["round"], r["restored"]) for r in rounds] == [("a", 0), ("b", 2)]
    assert samples == {1: [0, 1], 2: [2, 3], 3: [5, 6], 4: [7]} and rolled_back == 2
    assert surviving_timeline(events[:-1])[1] == samples  # rank 1's step 3 was rolled back anyway
    with pytest.raises(AssertionError):  # but its step 1 survives, and every rank must have logged it
        surviving_timeline([e for e in events if (e["event"], e["rank"], e.get("step")) != ("trained", 1, 1)])


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
def test_every_sample_once_through_4_to_2_to_5_ranks_across_nodes(tmp_path, backend):
    with Nodes(2) as nodes:
        redis = None
        job = None
        try:
            if backend == "redis":
                redis = start_redis(nodes, tmp_path)
                url = f"redis://{nodes.hostnames[0]}:{REDIS_PORT}/0"
            else:
                url = sqlite_url(tmp_path)  # tmp_path is on the host's /tmp: shared by both nodes
            job = DataJob(nodes, tmp_path, ["--coordinator", url, "--samples", str(SAMPLES)])
            # world:step:seconds. Node 1 stays at step 5 until it is killed; node 0's ranks go on
            # into the next all-reduce, which fails when node 1 dies; alone, they wait at step 8
            # until node 1 joins and their agent restarts them
            # node 1 first, node 0 once node 1 is importing torch: node 1 then waits in the
            # rendezvous for node 0's store, and the first round has both nodes however loaded
            # the machine (node 0 alone for its 1 s last call trained past step 5 once)
            end = time.monotonic() + DEADLINE
            job.start(1, 2, (f"4:5:{LONG}",))
            job.wait_for("node 1's torchrun importing torch", lambda: job.importing_torch(1), end)
            job.start(0, 2, ("4:5:1", f"2:8:{LONG}"))
            job.wait_for("4 ranks at step 5", lambda: job.paused(4) == 4, end)
            nodes.kill_node(1)  # torchrun, workers, saver; its /dev/shm goes with them
            job.agents[1].wait(timeout=30)
            job.wait_for("2 ranks of node 0 alone at step 8", lambda: job.paused(2) == 2, end)
            job.start(1, 3, ())
            job.finish(end)
        finally:
            if job is not None:
                job.close()
            stop(redis)

    rounds, timeline, rolled_back = surviving_timeline(job.events())
    # round 3: step 6 if it was committed by then (node 1's memory is new), else step 3
    assert [(r["world"], r["restored"]) for r in rounds] in ([(4, 0), (2, 3), (5, 6)], [(4, 0), (2, 3), (5, 3)]), rounds
    assert rolled_back > 0, "no trained sample was rolled back: the test did not exercise a restore"
    counts = Counter(i for ids in timeline.values() for i in ids)
    missing = sorted(set(range(SAMPLES)) - set(counts))
    twice = sorted(i for i, c in counts.items() if c > 1)
    assert not missing and not twice and set(counts) == set(range(SAMPLES)), \
        f"{backend}: samples never trained {missing}, trained more than once {twice}"
    [done] = job.events("done")
    assert done["model"] == [1] * SAMPLES, f"the final model counts {Counter(done['model'])}"
    progress = done["progress"]  # the coordinator agrees: every shard done, none held
    assert progress["finished"] and (progress["todo"], progress["leased"]) == (0, 0), progress
