"""Bad input end to end, through ``DdpCheckpointer`` on an S3 URL: a missing bucket, wrong
credentials and a dead endpoint fail construction at once with a flashckpt error that
names the bucket (and the endpoint); a shard deleted or altered in the bucket makes
``load`` warn naming the object and fall back to the older good step, as on disk."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from flashckpt import CheckpointError, CheckpointNotFoundError
from flashckpt.torch import DdpCheckpointer

from .conftest import MotoServer, free_port, raw_fs, use_endpoint


def _construct(url: str, job_id: str) -> CheckpointError:
    """Construct a DdpCheckpointer on ``url``: the flashckpt error it raises, in bounded time."""
    start = time.monotonic()
    with pytest.raises(CheckpointError) as info:
        DdpCheckpointer(url, job_id=job_id)
    assert time.monotonic() - start < 30, "construction took too long (a hang?)"
    assert type(info.value).__module__.startswith("flashckpt"), type(info.value)
    return info.value


def test_missing_bucket(s3, job_id):
    exc = _construct("s3://no-such-bucket-xyz/run", job_id)
    assert isinstance(exc, CheckpointNotFoundError)
    assert "s3://no-such-bucket-xyz/run: its bucket does not exist" in str(exc)


def test_wrong_credentials(monkeypatch, job_id):
    strict = MotoServer(env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"})  # every key is unknown to it
    try:
        use_endpoint(strict.endpoint, monkeypatch)
        exc = _construct("s3://some-bucket/run", job_id)
    finally:
        strict.stop()
    assert "s3://some-bucket/run is not writable" in str(exc) and "access denied" in str(exc), exc
    assert "credentials" in str(exc)


def test_endpoint_down(monkeypatch, job_id):
    endpoint = f"http://127.0.0.1:{free_port()}"
    use_endpoint(endpoint, monkeypatch)
    exc = _construct("s3://some-bucket/run", job_id)
    assert "s3://some-bucket/run is not writable" in str(exc), exc
    assert endpoint in str(exc), f"the endpoint is not named: {exc}"


def _save_steps(url: str, job_id: str, steps: list[int]) -> None:
    with DdpCheckpointer(url, job_id=job_id, keep_last=0) as ck:
        for step in steps:
            ck.save(step, {"w": torch.full((4096,), float(step)), "step": step})
            ck.wait()
        ck.flush()


def _shard(url: str, step: int) -> str:
    fs = raw_fs()
    names = [n for n in fs.ls(f"{url}/step-{step}", refresh=True) if n.endswith(".safetensors")]
    assert len(names) == 1, names
    return "s3://" + names[0]


@pytest.mark.parametrize("damage", ["deleted", "altered"])
def test_a_damaged_newest_step_falls_back_to_the_older_good_step(url, job_id, caplog, damage):
    _save_steps(url, job_id, [1, 2, 3])
    bad = _shard(url, 3)
    fs = raw_fs()
    if damage == "deleted":
        fs.rm(bad)
    else:
        data = bytearray(fs.cat_file(bad))
        data[-7] ^= 0xFF
        fs.pipe_file(bad, bytes(data))
    state = {"w": torch.zeros(4096), "step": 0}
    with caplog.at_level(logging.WARNING, logger="flashckpt"):
        with DdpCheckpointer(url, job_id=job_id + "b") as ck:  # another job: nothing in memory
            assert ck.load(state) == 2
            assert ck.last_load.source == "storage"
    assert state["step"] == 2 and bool((state["w"] == 2).all())
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(bad in m for m in warned), f"no warning names {bad}: {warned}"
