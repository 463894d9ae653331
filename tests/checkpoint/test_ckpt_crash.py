"""Crash safety with real signals: kill -9 at random moments, persist on failure."""

import glob
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from flashckpt import CheckpointNotFoundError
from flashckpt.storage._local import LocalStorage
from flashckpt.torch import Checkpointer

from .._fork import Forked
from ._trainer import check, make_state, main as _trainer_main
from flashckpt._names import job_prefix

TRAINER = os.path.join(os.path.dirname(__file__), "_trainer.py")


def _trainer(args: list[str]) -> None:
    sys.argv = [TRAINER, *args]
    _trainer_main()


def start_trainer(directory, job, *args) -> Forked:
    """``_trainer.py`` in a process of its own, forked with torch imported (``tests._fork``)."""
    return Forked(_trainer, [str(directory), job, *map(str, args)])


def wait_for_line(proc: Forked, prefix: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line
        if not line and proc.poll() is not None:
            raise AssertionError(f"trainer exited {proc.returncode}: {proc.stderr.read()}")
    raise AssertionError(f"no {prefix!r} within {timeout}s")


def saver_pids(job: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"flashckpt.saver._saver --job-id {job}"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def wait_committed(directory, step: int, timeout: float = 30.0) -> None:
    storage = LocalStorage(str(directory))
    deadline = time.monotonic() + timeout
    while (storage.latest_step() or -1) < step:
        assert time.monotonic() < deadline, f"step {step} never committed (latest {storage.latest_step()})"
        time.sleep(0.05)


def wipe_shared_memory(job: str) -> None:
    for path in glob.glob(job_prefix(job) + ".*"):
        os.unlink(path)


def assert_committed_steps_whole(storage: LocalStorage) -> None:
    """Every committed step verifies and holds only its committed files (a killed persist
    leaves only its pending ``step-N.tmp-*`` dir). The killed trainer's saver may still be
    committing its last steps, and its retention (``keep_last``) may retire a listed step
    mid-check: that step must then be gone from the committed ones, not half there."""
    for s in storage.committed_steps():
        try:
            problems = storage.verify(s)
            files = sorted(os.listdir(os.path.join(storage.root, f"step-{s}")))
        except (CheckpointNotFoundError, FileNotFoundError):
            problems, files = ["retired"], []
        if problems and s not in storage.committed_steps():
            continue  # retired between the listing and the check
        assert problems == [], f"committed step {s} damaged"
        assert files == ["metadata.json", "rank-0.done", "rank-0.safetensors"]


@pytest.mark.parametrize("memory_slots", [2, 1])
def test_kill9_at_random_moments_never_tears_or_damages(tmp_path, job_id, memory_slots):
    """Trainer (and sometimes the saver) killed mid-copy / mid-persist / mid-commit; every
    load gets one whole step, never older than the last committed one, and every
    committed step verifies."""
    rng = random.Random(1234)
    storage = LocalStorage(str(tmp_path))
    start = 1
    for attempt in range(12):
        proc = start_trainer(tmp_path, job_id, 10_000, rng.choice([1, 2]), 24, "--start", start,
                             "--memory-slots", memory_slots)
        wait_for_line(proc, f"saved {start + rng.randint(0, 3)}")
        time.sleep(rng.uniform(0, 0.05))
        committed_before = storage.latest_step()
        proc.kill()
        if attempt % 3 == 2:  # the saver too, at some point inside its persist
            time.sleep(rng.uniform(0, 0.05))
            for pid in saver_pids(job_id):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        state = make_state(24)
        with_memory = attempt % 4 != 3
        if not with_memory:
            time.sleep(0.5)
            wipe_shared_memory(job_id)  # a fresh machine: only storage is left
        ck = Checkpointer(tmp_path, job_id=job_id, keep_last=2, memory_slots=memory_slots)
        step = ck.load(state)
        if step is None:  # one slot: the kill tore the only copy before any step was committed
            assert memory_slots == 1 and committed_before is None and storage.latest_step() is None
        else:
            assert check(state) == step
            assert committed_before is None or step >= committed_before
        assert_committed_steps_whole(storage)
        ck.engine._client.close()  # leave memory as a crashed process would, without flushing,
        ck.engine.storage.release_run()  # and give up the directory, as a dead process's lock does
        start = (step or 0) + 1
    assert storage.latest_step() is not None


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_trainers_last_memory_step_reaches_storage(tmp_path, job_id, sig):
    proc = start_trainer(tmp_path, job_id, 5, 1000, 4, "--sleep", 0.0)
    wait_for_line(proc, "saved 5")
    proc.send_signal(sig)
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    wait_committed(tmp_path, 5)  # persisted by the saver, which outlived the trainer
    wipe_shared_memory(job_id)   # restart on a fresh machine
    state = make_state(4)
    with Checkpointer(tmp_path, job_id=job_id) as ck:
        assert ck.load(state) == 5
    assert check(state) == 5


def test_restart_loads_from_memory_not_storage(tmp_path, job_id):
    from flashckpt import _events
    proc = start_trainer(tmp_path, job_id, 3, 1000, 4)
    wait_for_line(proc, "done")
    proc.kill()
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    seen = []
    _events.subscribe(lambda event, **info: seen.append((event, info)))
    state = make_state(4)
    with Checkpointer(tmp_path, job_id=job_id) as ck:
        assert ck.load(state) == 3
    assert ("load", "memory") in [(e, i.get("source")) for e, i in seen]
    assert check(state) == 3


def test_trainer_survives_its_saver_being_killed(tmp_path, job_id):
    """A new saver takes over; what the dead one held is released; nothing is lost."""
    with Checkpointer(tmp_path, job_id=job_id, persist_every=1) as ck:
        ck.save(1, {"w": torch.full((1000,), 1.0)})
        ck.wait()
        for pid in saver_pids(job_id):
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
        for step in (2, 3, 4):  # would wait forever if a slot stayed held by the dead saver
            ck.save(step, {"w": torch.full((1000,), float(step))})
        ck.wait()
        assert ck.latest_step() == 4
        assert len(saver_pids(job_id)) == 1
    target = {"w": torch.zeros(1000)}
    with Checkpointer(tmp_path, job_id=job_id) as ck:
        assert ck.load(target) == 4 and target["w"][0] == 4
