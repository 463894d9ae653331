"""The public API: options checked at construction, idempotent start, diagnosis rules,
node check and stragglers."""

from __future__ import annotations

import datetime
import os
import random
import statistics

import pytest

import elastic
from elastic import Action, Kind, NodeCheckResult, diagnose, find_stragglers


def test_options_are_checked_at_construction():
    with pytest.raises(elastic.ElasticError, match="heartbeat_interval"):
        elastic.AgentOptions(heartbeat_interval=10.0, hang_timeout=5.0)
    with pytest.raises(elastic.ElasticError, match="on_hang"):
        elastic.AgentOptions(on_hang="reboot")
    with pytest.raises(elastic.ElasticError):
        elastic.AgentOptions(hang_timeout=-1)
    with pytest.raises(elastic.ElasticError, match="hang_floor_seconds"):
        elastic.AgentOptions(hang_floor_seconds=100, warmup_timeout_seconds=10)
    opts = elastic.AgentOptions(hang_timeout=datetime.timedelta(minutes=2), on_hang="exit")
    assert opts.hang_timeout == 120.0 and opts.on_hang is elastic.OnHang.EXIT
    with pytest.raises(elastic.ElasticError, match="unexpected keyword"):
        elastic.start_agent(no_such_option=1)


def test_default_heartbeat_interval_follows_the_hang_timeout(tmp_path):
    assert elastic.AgentOptions().heartbeat_interval == 5.0
    assert elastic.AgentOptions(hang_timeout=2.0).heartbeat_interval == 0.5
    assert elastic.AgentOptions(hang_floor_seconds=8.0).heartbeat_interval == 2.0
    assert elastic.AgentOptions(hang_timeout=2.0, heartbeat_interval=1.0).heartbeat_interval == 1.0
    agent = elastic.start_agent(hang_timeout=2.0, metrics_dir=str(tmp_path), handle_failures=False,
                                job_id="thb" + str(os.getpid()))
    try:
        assert agent.options.heartbeat_interval == 0.5
    finally:
        agent.stop()
    agent = elastic.start_agent(hang_timeout=2.0, coordinator="memory://", handle_failures=False,
                                job_id="thc" + str(os.getpid()))
    try:
        assert agent.options.heartbeat_interval == 0.5
    finally:
        agent.stop()


def test_a_heartbeat_interval_the_caller_set_is_checked_against_the_hang_timeout():
    with pytest.raises(elastic.ElasticError, match=r"heartbeat_interval \(3.0s\).*hang_timeout \(2.0s\)"):
        elastic.start_agent(hang_timeout=2.0, heartbeat_interval=3.0, coordinator="memory://", handle_failures=False)
    with pytest.raises(elastic.ElasticError, match=r"heartbeat_interval \(9.0s\).*hang_floor_seconds \(8.0s\)"):
        elastic.AgentOptions(hang_floor_seconds=8.0, heartbeat_interval=9.0)
    assert elastic.current_agent() is None


def test_start_agent_is_idempotent_and_counts_steps(tmp_path):
    agent = elastic.start_agent(metrics_dir=str(tmp_path), handle_failures=False, job_id="tapi" + str(os.getpid()))
    try:
        assert elastic.start_agent() is agent and elastic.current_agent() is agent
        for _ in range(5):
            agent.step()
        assert agent.current_step == 5
        kinds = [e["type"] for e in agent.events()]
        assert kinds == ["start"]
        assert agent.metrics()["job"]["last_step"] == 5
        assert 0 <= agent.goodput() <= 1
    finally:
        agent.stop()
    assert elastic.current_agent() is None
    assert [e["type"] for e in agent.events()][-1] == "stop"


def _raise(exc):
    try:
        raise exc
    except BaseException as e:
        return e


@pytest.mark.parametrize("exc, kind, action", [
    (MemoryError(), Kind.OOM, Action.RESTART_PROCESS),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), Kind.OOM, Action.RESTART_PROCESS),
    (RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for recv"),
     Kind.NETWORK, Action.RESTART_PROCESS),
    (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error"), Kind.NETWORK,
     Action.RESTART_PROCESS),
    (ConnectionResetError("Connection reset by peer"), Kind.NETWORK, Action.RESTART_PROCESS),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), Kind.HARDWARE,
     Action.REPLACE_NODE),
    (RuntimeError("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus"), Kind.HARDWARE,
     Action.REPLACE_NODE),
    (ValueError("Caught ValueError in DataLoader worker process 0."), Kind.DATA, Action.ABORT),
    (KeyError("weights"), Kind.SOFTWARE, Action.ABORT),
])
def test_diagnosis_rules(exc, kind, action):
    d = diagnose(_raise(exc))
    assert (d.kind, d.action) == (kind, action) and d.reason


def test_diagnosis_follows_the_cause_chain_and_real_dataloader_errors():
    try:
        try:
            bytearray(1 << 50)
        except MemoryError as e:
            raise RuntimeError("step failed") from e
    except RuntimeError as e:
        assert diagnose(e).kind is Kind.OOM
    torch = pytest.importorskip("torch")

    class Bad(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            raise OSError(f"cannot read record {i}")

    with pytest.raises(OSError) as info:
        next(iter(torch.utils.data.DataLoader(Bad())))
    assert diagnose(info.value).kind is Kind.DATA


def test_find_stragglers_flags_slow_and_failed_nodes_at_scale():
    results = [NodeCheckResult(r, f"h{r}", True, 1.0 + (r % 7) * 0.01, 0.1) for r in range(4096)]
    results[17] = NodeCheckResult(17, "h17", True, 2.5, 0.1)
    results[99] = NodeCheckResult(99, "h99", False, error="timed out")
    flagged = find_stragglers(results)
    assert [(s.rank, s.reason) for s in flagged] == [(17, "slow"), (99, "failed")]
    assert flagged[0].ratio > 2


def test_find_stragglers_compares_each_node_with_the_others():
    two = [NodeCheckResult(0, "a", True, 1.0, 0.1), NodeCheckResult(1, "b", True, 3.0, 0.1)]
    assert [(s.rank, s.reason) for s in find_stragglers(two)] == [(1, "slow")]
    assert find_stragglers(two[:1]) == []  # nothing to compare with
    rng = random.Random(0)
    for n in range(2, 40):  # the median leaving one node out, against a brute force
        times = [rng.choice([1.0, 1.5, 2.0, rng.uniform(0.5, 5.0)]) for _ in range(n)]
        results = [NodeCheckResult(i, f"h{i}", True, t) for i, t in enumerate(times)]
        want = [i for i, t in enumerate(times)
                if t > 2 * statistics.median(times[:i] + times[i + 1:])]
        assert [s.rank for s in find_stragglers(results)] == want, times


def test_check_node_under_torch_distributed_shares_results_and_flags_the_slow_rank():
    pytest.importorskip("torch")
    from tests.agent.agent_helpers import node_check_worker
    from tests._fork import run_ranks

    out = run_ranks(node_check_worker, 2)
    assert out[0] == out[1]  # every rank holds every rank's result
    first = [NodeCheckResult(**r) for r in out[0]["first"]]
    assert [r.rank for r in first] == [0, 1]
    assert all(r.ok and r.matmul_seconds and r.allreduce_seconds for r in first), first
    assert [(s.rank, s.reason) for s in find_stragglers(first)] == [(1, "slow")], first
    second = [NodeCheckResult(**r) for r in out[0]["second"]]
    assert all(r.ok for r in second)  # a second check reads its own results, not the first's
    assert [r.matmul_seconds for r in second] != [r.matmul_seconds for r in first]


def test_check_node_single_process():
    pytest.importorskip("torch")
    (res,) = elastic.check_node(timeout=60, size=128, repeats=2)
    assert res.ok and res.matmul_seconds > 0 and res.allreduce_seconds is None
