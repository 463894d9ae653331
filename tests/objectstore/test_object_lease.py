"""The run lease is exclusive on a real S3 server (moto) and Azure's emulator (Azurite): of
many runs claiming one URL at the same instant (no lease, or an expired one), exactly one
wins and every other gets a JobConflictError; renewals and the release are conditional
too. A store without conditional writes keeps an advisory lease."""

from __future__ import annotations

import json
import logging
import time
import uuid

import fsspec
import pytest
from fsspec.core import url_to_fs

from flashckpt._errors import JobConflictError
from flashckpt.storage._object import ObjectStorage

from . import _lease_racer
from .._fork import Inherit, context
from .conftest import token

RACERS, ROUNDS = 8, 6


@pytest.fixture(params=["s3", "az"])
def lease_url(request: pytest.FixtureRequest) -> str:
    """A new URL in a store with conditional writes: S3 (moto) or Azure Blob (Azurite)."""
    if request.param == "s3":
        return request.getfixturevalue("url")
    return f"az://{request.getfixturevalue('container')}/runs/a"


def _lease_object(url: str):
    """The fsspec filesystem of ``url`` and the path of its lease (to look at or replace it)."""
    fs, path = url_to_fs(f"{url}/.flashckpt-run.json")
    fs.invalidate_cache()
    return fs, path


def test_one_of_many_simultaneous_claims_wins(lease_url):
    urls = [f"{lease_url}/round-{k}" for k in range(ROUNDS)]
    for k, u in enumerate(urls):
        if k % 2:  # odd rounds: the racers take over a lease that expired (its run died elsewhere)
            fs, path = _lease_object(u)
            fs.pipe_file(path, json.dumps(
                {"token": "dead", "pid": 1, "host": "elsewhere", "heartbeat_at": time.time() - 3600}).encode())
    ctx = context()  # forked, not spawned: eight new interpreters took ten seconds on two busy cores
    barrier, results = ctx.Barrier(RACERS), ctx.Queue()
    procs = [ctx.Process(target=_lease_racer.race, args=(Inherit(), urls, barrier, results)) for _ in range(RACERS)]
    for p in procs:
        p.start()
    try:
        outcomes = [results.get(timeout=120) for _ in range(RACERS * ROUNDS)]
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    for u in urls:
        mine = [(kind, detail) for kind, where, detail in outcomes if where == u]
        kinds = sorted(kind for kind, _ in mine)
        assert kinds == ["conflict"] * (RACERS - 1) + ["won"], f"{u}: {mine}"
        assert all("another run is live" in d for kind, d in mine if kind == "conflict"), mine


def test_renewals_take_overs_and_releases_are_conditional(lease_url, caplog):
    """A run renews its lease (on the version it wrote) and its release deletes it; a run
    whose lease another run took over stops renewing and leaves the new lease alone; no
    step falls back to an advisory lease."""
    with caplog.at_level(logging.WARNING, logger="flashckpt.storage._object_lease"):
        run = ObjectStorage(lease_url, lease_seconds=0.4)
        run.claim_run(token())
        fs, path = _lease_object(lease_url)
        first = json.loads(fs.cat_file(path))
        time.sleep(0.5)  # past renewals (every 0.1 s)
        assert json.loads(fs.cat_file(path))["heartbeat_at"] > first["heartbeat_at"]
        run.release_run()
        assert not _lease_object(lease_url)[0].exists(path)

        stalled = ObjectStorage(lease_url, lease_seconds=0.4)
        stalled.claim_run(token())
        other = {"token": "newer", "pid": 1, "host": "elsewhere", "heartbeat_at": time.time()}
        fs.pipe_file(path, json.dumps(other).encode())
        time.sleep(0.5)
        stalled.release_run()
        assert json.loads(fs.cat_file(path)) == other
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "advisory" in m], messages
    assert len([m for m in messages if "was taken over" in m]) == 1, messages


def test_a_store_without_conditional_writes_keeps_an_advisory_lease(caplog):
    url = f"memory://box-{uuid.uuid4().hex[:8]}/run"
    with caplog.at_level(logging.WARNING, logger="flashckpt.storage._object_lease"):
        first = ObjectStorage(url)
        first.claim_run(token())
        first.release_run()
        second = ObjectStorage(url)
        second.claim_run(token())
        second.release_run()
    advisory = [r.getMessage() for r in caplog.records if "advisory" in r.getMessage()]
    assert len(advisory) == 1 and url in advisory[0], advisory


def _leased_elsewhere(url: str, run_id: str) -> None:
    """A live run on another host holds ``url``'s lease."""
    fsspec.filesystem("memory").pipe_file(url[len("memory://"):] + "/.flashckpt-run.json", json.dumps(
        {"token": token(), "pid": 1, "host": "elsewhere", "run_id": run_id, "heartbeat_at": time.time()}).encode())


def test_torchruns_default_run_id_is_not_taken_for_the_same_job(monkeypatch):
    """Every torchrun without ``--rdzv-id`` has run id "none": two such jobs on one URL are
    two runs, and the second is refused; a named run id still lets a restart take over."""
    url = f"memory://box-{uuid.uuid4().hex[:8]}/run"
    _leased_elsewhere(url, "none")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    with pytest.raises(JobConflictError, match="another run is live"):
        ObjectStorage(url).claim_run(token())

    _leased_elsewhere(url, "job-7")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    restarted = ObjectStorage(url)
    restarted.claim_run(token())
    restarted.release_run()
