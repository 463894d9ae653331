"""Two "nodes" — processes with private /dev/shm mounts — sharing one checkpoint directory."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests._net import free_port

WORKER = os.path.join(os.path.dirname(__file__), "_node_worker.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_nodes(tmp_path, mode: str, *, node_local: bool = False, replicas: str = "", count: int = 2,
              own: tuple[int, ...] = (), env: dict[str, str] | None = None) -> list[dict]:
    """``count`` nodes; the nodes in ``own`` (node 1 with ``node_local``) have their own (empty)
    directory at the checkpoint path; ``env`` added to the workers' environment."""
    own = (1,) if node_local else own
    port = free_port()
    procs = []
    (tmp_path / "ck").mkdir(exist_ok=True)
    for rank in range(count):
        own_dir = f"mount -t tmpfs -o size=64m tmpfs {tmp_path / 'ck'} && " if rank in own else ""
        cmd = (f"mount -t tmpfs -o size=256m tmpfs /dev/shm && {own_dir}exec {sys.executable} {WORKER} "
               f"{rank} {count} {port} {tmp_path / 'ck'} {mode} {tmp_path / f'node{rank}.json'} {replicas}")
        procs.append(subprocess.Popen(["unshare", "-m", "-u", "sh", "-c", cmd], cwd=REPO,
                                      env={**os.environ, "PYTHONPATH": REPO, **(env or {})},
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    return [json.loads((tmp_path / f"node{r}.json").read_text()) for r in range(count)]


def test_each_nodes_saver_persists_its_rank_and_one_commit_joins_them(tmp_path):
    reports = run_nodes(tmp_path, "own")
    assert [r["local_rank"] for r in reports] == [0, 0]  # different /dev/shm: different nodes
    assert reports[0]["slots"] == ["nodes.rank0.slot0", "nodes.rank0.slot1"]
    assert reports[1]["slots"] == reports[0]["slots"]  # each node sees only its own rank's memory
    assert [(r["step"], r["source"], r["w"]) for r in reports] == [(2, "memory", 2.0), (2, "memory", 3.0)]
    meta = json.loads((tmp_path / "ck" / "step-2" / "metadata.json").read_text())
    assert meta["world_size"] == 2 and sorted(meta["shards"]) == ["0", "1"]
    assert (tmp_path / "ck" / "latest").read_text().strip() == "2"


def test_ddp_keeps_a_copy_on_every_node_and_one_on_storage(tmp_path):
    reports = run_nodes(tmp_path, "ddp")
    assert all(len(r["slots"]) == 2 for r in reports)  # local rank 0 of each node holds the node's copy
    assert [(r["step"], r["source"], r["w"]) for r in reports] == [(2, "memory", 9.0), (2, "memory", 9.0)]
    assert sorted(os.listdir(tmp_path / "ck" / "step-2")) == ["metadata.json", "rank-0.done", "rank-0.safetensors"]


@pytest.mark.parametrize("mode", ["own", "ddp"])
def test_a_directory_that_is_not_shared_fails_construction_on_every_node_without_replicas(tmp_path, mode):
    # with replicas (the default on two nodes) node-local directories are a mode: test_replica_node_local.py
    reports = run_nodes(tmp_path, mode, node_local=True, replicas="0")
    for report in reports:
        assert "is not shared" in report["error"] and "node1:" in report["error"], report
    assert not [n for n in os.listdir(tmp_path / "ck") if n.startswith("step-")]


def test_node_local_directories_whose_replicas_cannot_connect_fail_construction_on_every_node(tmp_path):
    # replicas on (two nodes), but each saver advertises its hostname, which no other node resolves here
    reports = run_nodes(tmp_path, "own", node_local=True)
    for report in reports:
        assert "node-local" in report["error"] and "do not connect" in report["error"], report
        assert "cannot reach node node1:" in report["error"], report
    assert not [n for n in os.listdir(tmp_path / "ck") if n.startswith("step-")]


def test_a_directory_two_of_three_nodes_share_fails_construction_on_every_node_naming_them(tmp_path):
    # replicas on: node 2's own directory alone would make the job node-local, but nodes 0 and 1 share theirs
    # (before: rank 1 alone failed, taking its own job's run lock for another run's, the others in a collective)
    reports = run_nodes(tmp_path, "own", count=3, own=(2,))
    errors = {report["error"] for report in reports}
    assert len(errors) == 1, reports
    error = errors.pop()
    assert "shared by some nodes but not all: nodes node0:" in error and ", node1:" in error, error
    assert "node(s) node2:" in error, error
    assert not [n for n in os.listdir(tmp_path / "ck") if n.startswith(("step-", ".flashckpt"))]


def test_megatron_on_three_node_local_directories_fails_construction_on_every_node(tmp_path):
    # a megatron load reads blocks from every rank's shard (replicated blocks are saved by data-parallel rank 0
    # only): from three nodes on, a node's directory holds two nodes' shards (before: a data-parallel GPTModel's
    # load after a lost node, on three namespace nodes under torchrun, still waited in a flush 90 s on, issue 43)
    pytest.importorskip("megatron.core")
    # the "nodes" share one network: their replica endpoints on the loopback connect
    reports = run_nodes(tmp_path, "megatron", count=3, own=(0, 1, 2), env={"FLASHCKPT_REPLICA_ADDR": "127.0.0.1"})
    errors = {report["error"] for report in reports}
    assert len(errors) == 1 and None not in errors, reports
    error = errors.pop()
    assert error.startswith("MegatronCheckpointer cannot use node-local directories on 3 nodes") and \
        re.search(r"of node\(s\) node0:\d+, node1:\d+, node2:\d+ holds only", error), error


@pytest.fixture(autouse=True)
def _root_only():
    if os.geteuid() != 0:
        pytest.fail("the multi-node tests mount private tmpfs filesystems and need root (CI runs as root)")
