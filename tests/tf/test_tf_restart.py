"""Kill -9 and restart: estimator workers sharing a SQLite coordinator and Keras fit.

Each worker counts, in a checkpointed variable, how often it trained each record; after
kills and restores, the final checkpoints of all workers must count every record exactly
once (records trained after the last restored checkpoint were rolled back with the model,
and their shards went back to the queue at the positions that checkpoint saved).
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import sharding
from flashckpt.storage._local import LocalStorage
from flashckpt.tf._export import read_step

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def spawn(script, *args, log):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, script), *map(str, args)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    proc.log_path = log.name
    return proc


def wait_for(path, proc, timeout=240):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None, f"worker exited with {proc.returncode} before {path}: {_log_tail(proc)}"
        assert time.monotonic() < deadline, f"no {path} after {timeout}s"
        time.sleep(0.1)


def _log_tail(proc) -> str:
    """The end of the log of a worker that :func:`spawn` started."""
    with open(proc.log_path) as log:
        return log.read()[-4000:]


def finish(proc, timeout=240):
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert rc == 0, _log_tail(proc)


def final_state(directory):
    arrays, _, mm = read_step(directory, LocalStorage(directory).latest_step())
    state = {k: np.array(v) for k, v in arrays.items()}
    del arrays
    mm.close()
    return state


def test_estimator_two_workers_one_killed_every_record_once(tmp_path):
    n = 480
    url = f"sqlite:///{tmp_path}/coord.db"
    sharding.connect(url).dataset("train", size=n, shard_size=20, num_epochs=1, lease_timeout=30.0)
    logs = {w: open(tmp_path / f"{w}.log", "w") for w in ("w0", "w1", "w0b")}
    args = {w: (tmp_path / f"ckpt-{w[:2]}", tmp_path / f"model-{w[:2]}", url, w[:2], n) for w in logs}
    w0 = spawn("_estimator_worker.py", *args["w0"], 7, tmp_path / "w0.json", log=logs["w0"])
    w1 = None
    try:
        # w0 holds its first lease round trip (8 shards, 20 batches) before w1 leases: w1's
        # pipeline leases ahead, and on a loaded machine once left w0 less than its 7 steps
        wait_for(tmp_path / "w0.json.started", w0)
        w1 = spawn("_estimator_worker.py", *args["w1"], 0, tmp_path / "w1.json", 8, tmp_path / "w0.json.paused",
                   log=logs["w1"])
        wait_for(tmp_path / "w0.json.paused", w0)
        w0.send_signal(signal.SIGKILL)
        w0.wait()
        w0b = spawn("_estimator_worker.py", *args["w0b"], 0, tmp_path / "w0b.json", log=logs["w0b"])
        finish(w0b)
        finish(w1)
    finally:
        for p in (w0, w1):
            if p is not None and p.poll() is None:
                p.kill()
    restarted = json.loads((tmp_path / "w0b.json").read_text())
    assert restarted["restored"] == 4  # saves every 4 steps; killed after step 7
    assert restarted["loads"][0]["source"] == "memory"
    seen = final_state(tmp_path / "ckpt-w0")["seen"] + final_state(tmp_path / "ckpt-w1")["seen"]
    assert seen.shape == (n,)
    assert (seen == 1).all(), f"records trained != once: {np.flatnonzero(seen != 1)[:20]} -> {seen[seen != 1][:20]}"
    progress = sharding.connect(url).dataset("train").progress()
    assert progress["finished"] and progress["leased"] == 0


@pytest.mark.parametrize("mode", ["blocking", "background"])
def test_keras_fit_killed_resumes_from_memory_with_saved_weights(tmp_path, mode):
    n = 240
    url = f"sqlite:///{tmp_path}/coord.db"
    sharding.connect(url).dataset("train", size=n, shard_size=16, num_epochs=1)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with open(tmp_path / "a.log", "w") as log:
        first = spawn("_keras_worker.py", tmp_path / "ckpt", url, n, 8, tmp_path / "a", mode, log=log)
        try:
            wait_for(tmp_path / "a" / "paused", first)
            first.send_signal(signal.SIGKILL)
            first.wait()
        finally:
            if first.poll() is None:
                first.kill()
    for f in (tmp_path / "a").glob("weights-*.npz"):
        f.rename(tmp_path / "b" / f.name)
    with open(tmp_path / "b.log", "w") as log:
        second = spawn("_keras_worker.py", tmp_path / "ckpt", url, n, 0, tmp_path / "b", mode, log=log)
        finish(second)
    result = json.loads((tmp_path / "b" / "result.json").read_text())
    assert result["restored"] == 6  # saves every 3 batches; killed after batch 8
    assert result["loads"][0]["source"] == "memory"
    assert result["equal"] is True
    seen = np.array(result["seen"])
    assert (seen == 1).all(), f"records trained != once: {np.flatnonzero(seen != 1)[:20]}"
    assert result["step"] == n // 8
