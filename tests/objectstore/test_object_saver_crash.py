"""Crash safety of the real saver on a bucket: the saver process SIGKILLed while a trainer
saves every step to storage, at random moments (it is nearly always uploading a shard)
and in alternate rounds as soon as a done marker without metadata shows it committing a
step; then the trainer killed too; repeated, seed printed.

After each crash every visible step verifies (no torn commit); the restart loads the
newest committed step or a newer one from memory, never older than the last save that
returned; after the last run's commit the bucket holds only committed steps' objects
(no shard, marker or open multipart upload of a half-committed step)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from .conftest import raw_fs
from .test_object_storage import objects, store

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 34  # above two 16 MiB parts: each shard is a multipart upload


class Trainer:
    """``tests.objectstore._saver_trainer`` in a subprocess, its output read by a thread."""

    def __init__(self, url: str, job: str, *extra: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.objectstore._saver_trainer", url, job, str(MIB),
                                      *extra], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def first(self, word: str, timeout: float = 90) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if line == word or line.startswith(word + " "):
                    return line[len(word) + 1:]
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.01)
        raise AssertionError(f"no {word!r} from the trainer: {self.lines} {self.proc.stderr.read()[-3000:]}")

    def saved(self) -> list[int]:
        return [int(line.split()[1]) for line in list(self.lines) if line.startswith("saved ")]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self._reader.join(10)


def _evidence(trainer: Trainer, job_id: str, storage: Any) -> str:
    """What a failed round's message carries: the restarted trainer's log (its load's
    agreement), the committed steps, the slots' headers and the saver log's tail."""
    from flashckpt._names import saver_log_path, slot_path
    from flashckpt.memory._slot import Slot

    slots = [Slot.peek_header(slot_path(job_id, 0, i)) for i in range(2)]
    try:
        with open(saver_log_path(job_id)) as f:
            saver_log = f.read()[-4000:]
    except OSError as exc:
        saver_log = str(exc)
    return (f"\ncommitted {storage.committed_steps()}\nslots {slots}\ntrainer {trainer.lines}\n"
            f"trainer stderr {_stderr(trainer)[-4000:]}\nsaver log {saver_log}")


def _stderr(trainer: Trainer) -> str:
    trainer.kill()
    return trainer.proc.stderr.read()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _await_commit_window(url: str, deadline: float) -> None:
    """Return once the bucket holds a done marker of a step without metadata: the saver
    is committing that step (listing, metadata, retention, ``latest``)."""
    while time.monotonic() < deadline:
        names = objects(url)
        done = {k.split("/")[0] for k in names if k.endswith(".done")}
        if done - {k.split("/")[0] for k in names if k.endswith("/metadata.json")}:
            return
        time.sleep(0.005)


def test_saver_killed_during_upload_and_commit(url, job_id):
    seed = int(os.environ.get("FLASHCKPT_CRASH_SEED") or random.randrange(1 << 30))  # FLASHCKPT_CRASH_SEED: a failed run's kill moments again (not its timing)
    rng = random.Random(seed)
    print(f"seed {seed}")
    storage = store(url)
    floor = None  # the newest step a restart must load at least: max(newest committed, last returned save)
    for round_ in range(4):
        trainer = Trainer(url, job_id)
        try:
            loaded, source = trainer.first("loaded").split()
            if floor is not None:
                assert loaded != "None" and int(loaded) >= floor, \
                    f"seed {seed} round {round_}: loaded {loaded} ({source}), expected at least {floor}" \
                    + _evidence(trainer, job_id, storage)
            saver = int(trainer.first("saver"))
            start = len(trainer.saved())
            while len(trainer.saved()) - start < 2 and trainer.proc.poll() is None:
                time.sleep(0.01)
            if round_ % 2:  # the saver is committing a step
                _await_commit_window(url, time.monotonic() + 10)
            else:  # the saver is uploading a shard (mostly) or committing a step
                time.sleep(rng.uniform(0, 1.5))
            _kill(saver)
            time.sleep(rng.uniform(0, 0.3))  # the trainer may notice and start another saver
            trainer.kill()
        finally:
            trainer.kill()
        steps = storage.committed_steps()
        for step in steps:
            assert storage.verify(step) == [], f"seed {seed} round {round_}: step {step} of {steps} is torn"
        left = [k for k in objects(url) if k.startswith("step-") and int(k[5:k.index("/")]) not in steps]
        print(f"round {round_}: loaded {loaded} ({source}), saved {trainer.saved()[-1:]}, committed {steps}, "
              f"uncommitted objects {left}")
        saved = trainer.saved()
        assert saved, f"seed {seed} round {round_}: {trainer.lines}"
        floor = max([saved[-1], *steps])
    finisher = Trainer(url, job_id, "--finish", "2")
    try:
        loaded = int(finisher.first("loaded").split()[0])
        assert loaded >= floor, f"seed {seed}: the last restart loaded {loaded}, expected at least {floor}"
        finisher.first("done", timeout=120)
        assert finisher.proc.wait(30) == 0, finisher.proc.stderr.read()[-3000:]
    finally:
        finisher.kill()
    steps = storage.committed_steps()
    assert steps[-1] == loaded + 2 and len(steps) == 2, f"seed {seed}: {steps}"
    for step in steps:
        assert storage.verify(step) == [], f"seed {seed}: step {step} is torn"
    tokens = {storage.metadata(s)["token"] for s in steps}
    stray = [k for k in objects(url) if k.startswith("step-")
             and (int(k[5:k.index("/")]) not in steps or not (k.endswith("/metadata.json")
                                                               or any(t in k for t in tokens)))]
    assert stray == [], f"seed {seed}: half-committed objects left: {stray}"
    assert raw_fs().list_multipart_uploads(url.removeprefix("s3://").split("/")[0]) == [], f"seed {seed}"
