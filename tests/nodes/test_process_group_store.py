"""``flashckpt.torch.init_process_group`` against a store that outlives its rounds, on one
machine and without root: the test process plays torchrun's agent and hosts the store
(``TORCHELASTIC_USE_AGENT_STORE=True``), and each round's ranks are fresh processes, as
torchrun's are. Also the plain launch, where rank 0 hosts the store."""

import datetime
import json
import os
import signal
import subprocess
import sys
import time

import torch.distributed as dist

from tests._net import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RANK_CODE = """
import datetime, json, sys
import torch, torch.distributed as dist
from flashckpt.torch import init_process_group
init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
print(json.dumps({"rank": dist.get_rank(), "sum": t.item()}), flush=True)
dist.destroy_process_group()
"""


def start_rank(rank: int, world: int, port: int, agent_store: bool) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": REPO, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "RANK": str(rank), "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    if agent_store:
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    return subprocess.Popen([sys.executable, "-c", RANK_CODE], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(procs: list[subprocess.Popen]) -> list[dict]:
    results = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def agent_store(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True,
                         timeout=datetime.timedelta(seconds=30))


def test_rounds_in_one_long_lived_store_each_form_once_whoever_comes_first():
    port = free_port()
    store = agent_store(port)
    # round 1: every rank forms the group, then the round ends
    assert finish([start_rank(r, 3, port, True) for r in range(3)]) == [
        {"rank": r, "sum": 6.0} for r in range(3)]
    # a dead round: rank 1 posted its nonce and died before it was answered; the keys stay
    first = store.get("flashckpt/pg/hello/1")
    dead = start_rank(1, 3, port, True)
    while store.get("flashckpt/pg/hello/1") == first:
        assert dead.poll() is None, dead.communicate()
        time.sleep(0.05)
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    # round 2, ranks arriving in reverse order, rank 0 last: the dead round's keys mislead nobody
    procs = []
    for r in (2, 1, 0):
        procs.append(start_rank(r, 3, port, True))
        time.sleep(0.5)
    assert sorted(finish(procs), key=lambda e: e["rank"]) == [{"rank": r, "sum": 6.0} for r in range(3)]
    assert int(store.add("flashckpt/pg/generation", 0)) == 2  # one generation per round that formed


def test_plain_launch_rank_0_hosts_the_store():
    port = free_port()
    assert finish([start_rank(r, 2, port, False) for r in range(2)]) == [
        {"rank": r, "sum": 3.0} for r in range(2)]
