"""Session fixtures: the FSDP tests share a few gloo runs (each run costs seconds of
process start-up), in the order 2 ranks -> 4 -> 3 / 1 / 2 so that every resharding
direction has a checkpoint to load."""

import glob
import os
import uuid

import pytest

from flashckpt._convert import convert

from tests._fork import run_ranks
from ._fsdp_ranks import run_plan
from flashckpt._names import job_prefix


@pytest.fixture(scope="session")
def fsdp_job():
    job = "f" + uuid.uuid4().hex[:10]
    yield job
    for path in glob.glob(job_prefix(job) + "*"):
        os.unlink(path)


@pytest.fixture(scope="session")
def fsdp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fsdp"))


def _run(world, root, job, plan):
    return run_ranks(run_plan, world, root, job, plan, timeout=300)


@pytest.fixture(scope="session")
def ran2(fsdp_root, fsdp_job):
    """2 ranks: same-world round trips and bad input; saves ``w2`` (FSDP2) and ``v1`` (FSDP1)."""
    return _run(2, fsdp_root, fsdp_job, [
        ("fsdp2", "round_trip", {"fsdp": 2}), ("fsdp1", "round_trip", {"fsdp": 1}),
        ("model_only", "model_only", {}), ("fresh_optimizer", "fresh_optimizer", {}),
        ("repeated_saves", "repeated_saves", {}), ("bad_input", "bad_input", {}),
        ("capture_bad_input", "capture_bad_input", {}), ("capture_accumulate", "capture_accumulate", {}),
        ("save w2", "save", {"name": "w2", "seed": 7}), ("save v1", "save", {"name": "v1", "fsdp": 1, "seed": 3})])


@pytest.fixture(scope="session")
def ran4(ran2, fsdp_root, fsdp_job):
    """4 ranks: loads ``w2``; saves ``w4`` and its DCP twin, imported by ``convert`` as
    ``dcp4``; saves ``h4`` with HSDP (2 replicas x 2 shards) and loads it as FSDP on 4."""
    dcp_dir = os.path.join(fsdp_root, "w4-dcp")
    results = _run(4, fsdp_root, fsdp_job, [
        ("2->4", "load", {"name": "w2"}), ("save w4", "save", {"name": "w4", "dcp_dir": dcp_dir}),
        ("save h4", "save", {"name": "h4", "seed": 11, "mesh": (2, 2)}), ("hsdp 2x2->fsdp 4", "load", {"name": "h4"})])
    if all(r.get("save w4") == "ok" for r in results):
        convert(dcp_dir, 3, "flashckpt", os.path.join(fsdp_root, "dcp4"), source="dcp")
        os.link(os.path.join(fsdp_root, "w4.pt"), os.path.join(fsdp_root, "dcp4.pt"))
    return results


@pytest.fixture(scope="session")
def ran3(ran4, fsdp_root, fsdp_job):
    return _run(3, fsdp_root, fsdp_job, [
        ("4->3", "load", {"name": "w4"}), ("fsdp1 2->fsdp2 3", "load", {"name": "v1"}),
        ("dcp 4->3", "load", {"name": "dcp4"})])


@pytest.fixture(scope="session")
def ran1(ran4, fsdp_root, fsdp_job):
    return _run(1, fsdp_root, fsdp_job, [
        ("4->1", "load", {"name": "w4"}), ("fsdp1 2->1", "load", {"name": "v1", "fsdp": 1}),
        ("mismatch", "mismatch", {"name": "w4"})])


@pytest.fixture(scope="session")
def ran2b(ran4, fsdp_root, fsdp_job):
    return _run(2, fsdp_root, fsdp_job, [("4->2", "load", {"name": "w4"}), ("mismatch", "mismatch", {"name": "w4"}),
                                         ("damaged", "damaged", {"name": "w4"})])


def assert_ok(results, check):
    for rank, r in enumerate(results):
        assert r.get(check) == "ok", f"rank {rank} of {len(results)}: {r.get(check, 'not reached')}"
