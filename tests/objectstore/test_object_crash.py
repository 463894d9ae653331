"""Crash safety on a real S3 server: writers killed at random moments, the server cut mid-upload."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import pytest

from flashckpt import CheckpointError

from .conftest import MotoServer, image, proxy_to, raw_fs, token, use_endpoint
from .test_object_storage import objects, read, save, store

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_killed_writers_leave_no_half_committed_step(url):
    """Each round a new run (a newer line, branching from the newest step) saves until
    SIGKILL at a random moment after its first commit: during an upload, a multipart
    part, a marker, the metadata or the retention. Every visible step verifies, and the
    next run's commit removes what the killed ones left."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    storage = store(url)
    for round_ in range(4):
        run = token()
        branch = storage.latest_step()
        start = -1 if branch is None else branch
        writer = subprocess.Popen([sys.executable, "-m", "tests.objectstore._writer", url, run, str(start),
                                   str(start + 1), str(seed + round_)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        try:
            first = writer.stdout.readline()
            assert first.strip(), f"round {round_} (seed {seed}): the writer committed nothing"
            time.sleep(rng.uniform(0, 1.5))
        finally:
            writer.send_signal(signal.SIGKILL)
            writer.wait(10)
        steps = storage.committed_steps()
        assert int(first) in steps or len(steps) >= 2, f"seed {seed}: {steps}"
        for step in steps:
            assert storage.verify(step) == [], f"seed {seed}: step {step} of {steps} is torn"
        assert storage.metadata(storage.latest_step())["token"] == run, f"seed {seed}"
    last = token()
    save(storage, storage.latest_step() + 1, last, [1000, 1000], keep_last=2, branch=storage.latest_step())
    left = objects(url)
    steps = storage.committed_steps()
    assert len(steps) == 2 and all(storage.verify(s) == [] for s in steps), f"seed {seed}"
    stray = [k for k in left if k.startswith("step-") and int(k[5:k.index("/")]) not in steps]
    assert stray == [], f"seed {seed}: left behind {stray}"
    assert raw_fs().list_multipart_uploads(url.removeprefix("s3://").split("/")[0]) == [], f"seed {seed}"


def uploader(storage, step: int, run: str, img: bytes) -> tuple[threading.Thread, list[BaseException]]:
    """A thread (not started) writing rank 0 of ``step``, and the list its error lands in."""
    failed: list[BaseException] = []

    def upload() -> None:
        try:
            storage.write_shard(step, 0, run, memoryview(img))
        except BaseException as exc:
            failed.append(exc)

    return threading.Thread(target=upload), failed


def test_server_cut_mid_upload(moto_server, url, monkeypatch):
    """The connection to the server dies mid multipart upload (the server killed; moto
    keeps its state in memory, so a relay in front of it is what dies and restarts): a
    clear error naming the object, the previous committed step intact, and a retry after
    the restart commits."""
    run = token()
    with proxy_to(moto_server) as proxy:
        use_endpoint(proxy.endpoint, monkeypatch)
        storage = store(url)
        first = save(storage, 1, run, [1000])
        big = image(run, 40 << 20)
        writer, failed = uploader(storage, 2, run, big)
        start = proxy.sent_up
        writer.start()
        deadline = time.monotonic() + 30
        while proxy.sent_up - start < 8 << 20 and writer.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        proxy.kill()
        writer.join(60)
        assert not writer.is_alive()
        assert len(failed) == 1 and isinstance(failed[0], CheckpointError), failed
        assert f"{url}/step-2/rank-0.{run}.safetensors" in str(failed[0])
        assert "the previous committed step is intact" in str(failed[0])
        with pytest.raises(CheckpointError, match=f"listing {url} failed"):
            storage.committed_steps()
        proxy.start()
        assert storage.committed_steps() == [1] and storage.verify(1) == [] and read(storage, 1, 0) == first[0]
        storage.write_shard(2, 0, run, memoryview(big))
        assert storage.try_commit(2, 1, run, 0) and read(storage, 2, 0) == big


def keep_replayable_requests(log: os.PathLike) -> None:
    """Keep the lines of moto's request log that its replay can play: whole requests,
    and no multipart part (the restarted server gives an upload a new id, so the parts
    of the upload cut by the kill, the only one in this log, cannot be replayed; lines of
    parts the server was taking in several threads also interleave)."""
    lines = open(log, encoding="utf-8").read().splitlines(keepends=True)

    def replayable(line: str) -> bool:
        try:
            request = json.loads(line)
        except ValueError:
            return False
        return isinstance(request, dict) and "partNumber=" not in str(request.get("url"))

    with open(log, "w", encoding="utf-8") as out:
        out.writelines(line for line in lines if replayable(line))


def test_server_killed_and_restarted_mid_upload(tmp_path, monkeypatch):
    """The S3 server process SIGKILLed mid multipart upload and started again on the same
    port (its objects kept by moto's recorder, replayed at the restart, as a real store
    keeps them): the upload fails with a clear error naming the object, the listing
    fails while the server is down (no commit claimed), and after the restart step 1 is
    intact, step 2 is not committed, and a retry commits it."""
    env = {"MOTO_ENABLE_RECORDING": "True", "MOTO_RECORDER_FILEPATH": str(tmp_path / "recording")}
    server = MotoServer(env)
    try:
        use_endpoint(server.endpoint, monkeypatch)
        bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
        raw_fs().mkdir(bucket)
        url = f"s3://{bucket}/runs/a"
        storage = store(url)
        run = token()
        first = save(storage, 1, run, [1000, 6 << 20])
        big = image(run, 40 << 20)
        writer, failed = uploader(storage, 2, run, big)
        recorded = os.path.getsize(tmp_path / "recording")
        writer.start()
        deadline = time.monotonic() + 60
        while os.path.getsize(tmp_path / "recording") < recorded + (5 << 20) and time.monotonic() < deadline:
            time.sleep(0.005)  # until the server has taken a part of the upload
        assert writer.is_alive(), "the upload ended before the server was killed"
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)
        writer.join(120)
        assert not writer.is_alive()
        assert len(failed) == 1 and isinstance(failed[0], CheckpointError), failed
        assert f"{url}/step-2/rank-0.{run}.safetensors" in str(failed[0])
        with pytest.raises(CheckpointError, match=f"listing {url} failed"):
            storage.committed_steps()
        keep_replayable_requests(tmp_path / "recording")
        server = MotoServer(env, port=server.port)
        urllib.request.urlopen(urllib.request.Request(f"{server.endpoint}/moto-api/recorder/replay-recording",
                                                      method="POST"), timeout=120).close()
        assert storage.committed_steps() == [1] and storage.verify(1) == []
        assert [read(storage, 1, r) for r in (0, 1)] == [first[0], first[1]]
        assert not storage.try_commit(2, 2, run, 0)  # rank 0's upload never finished: nothing to commit
        for rank, img in ((0, big), (1, image(run, 1000))):
            storage.write_shard(2, rank, run, memoryview(img))
        assert storage.try_commit(2, 2, run, 0)
        assert storage.committed_steps() == [1, 2] and storage.verify(2) == [] and read(storage, 2, 0) == big
    finally:
        server.stop()

