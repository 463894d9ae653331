"""The crash campaign's processes and checks (``_campaign`` plays the rounds): a round's
:class:`Spec` and :class:`Outcome`, the trainer processes of a role (:class:`Job` of
:class:`Rank`), killing and waiting for savers, and the restart every round ends with."""

from __future__ import annotations

import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from flashckpt import _names
from flashckpt.storage._local import LocalStorage

from .._fork import Forked
from .test_ckpt_crash import saver_pids

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGETS = ("trainer", "saver", "both")
MOMENTS = ("save", "persist", "commit", "close", "load", "capture")
WAIT_SECONDS = 60.0
"""Bound on each wait for a process (trainer saves, loader answers, saver ends)."""


@dataclass(frozen=True)
class Spec:
    """What one round does; a function of its seed alone."""

    seed: int
    world: int
    memory_slots: int
    persist_every: int
    mb: float
    target: str
    moment: str
    wipe: bool
    saves_before: int
    delay: float

    @classmethod
    def of(cls, seed: int, max_mb: float = 50.0) -> "Spec":
        rng = random.Random(seed)
        moment = MOMENTS[seed % len(MOMENTS)]
        world, target = 1 + seed % 2, TARGETS[seed % 3]
        if moment == "capture":  # seed % 6 == 5 would fix both
            world, target = rng.choice([1, 2]), rng.choice(TARGETS)
        return cls(seed=seed, world=world, memory_slots=1 + (seed % 7) % 2,
                   persist_every=rng.choice([1, 3]), mb=round(min(max_mb, 2 ** rng.uniform(0, 5.65)), 1),
                   target=target, moment=moment,
                   wipe=moment not in ("load", "capture") and rng.random() < 0.35,
                   saves_before=rng.randint(1, 5), delay=rng.uniform(0.0, 0.06))

    def describe(self) -> str:
        return (f"seed={self.seed} world={self.world} slots={self.memory_slots} persist_every={self.persist_every} "
                f"mb={self.mb} kill={self.target}@{self.moment}{' wipe' if self.wipe else ''}")


@dataclass
class Outcome:
    spec: Spec
    kills: int = 0
    loaded: int | None = None
    source: str | None = None
    floor: int | None = None
    committed: int | None = None
    captured: int | None = None
    """The step every rank captured (capture rounds)."""
    seconds: float = 0.0
    failures: list[tuple[str, str]] = field(default_factory=list)
    """(kind, message); kind is one of lost, torn, hung, older-than-committed, damaged, error."""

    def fail(self, kind: str, message: str) -> None:
        self.failures.append((kind, message))

    def line(self) -> str:
        status = "ok" if not self.failures else "FAIL " + "; ".join(f"{k}: {m}" for k, m in self.failures)
        captured = "" if self.captured is None else f", captured {self.captured}"
        return (f"{self.spec.describe()} -> loaded {self.loaded} from {self.source} (floor {self.floor}, "
                f"committed {self.committed}{captured}) kills={self.kills} {self.seconds:.1f}s {status}")


class Hung(Exception):
    """A bounded wait ran out."""


def _trainer(args: list[str]) -> None:
    os.chdir(REPO)
    sys.argv = ["tests.checkpoint._campaign_trainer", *args]
    from . import _campaign_trainer
    _campaign_trainer.main()


class Rank:
    """One process of the campaign trainer, its output collected by threads."""

    def __init__(self, args: list[str]) -> None:
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
               "OMP_NUM_THREADS": "1", "FLASHCKPT_SAVER_TIMEOUT": os.environ.get("FLASHCKPT_SAVER_TIMEOUT", "60")}
        self.proc = Forked(_trainer, list(args), env=env)  # torch is imported already: ~3 s less a process
        self.lines: list[str] = []
        self.err: list[str] = []
        self.changed = threading.Condition()
        self._readers = [threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines), daemon=True),
                         threading.Thread(target=self._pump, args=(self.proc.stderr, self.err), daemon=True)]
        for t in self._readers:
            t.start()

    def _pump(self, stream, into: list[str]) -> None:
        for line in stream:
            with self.changed:
                into.append(line.rstrip("\n"))
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def wait_for(self, pred: Callable[[list[str]], bool], what: str, timeout: float = WAIT_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        with self.changed:
            while not pred(self.lines):
                if self.proc.poll() is not None and not self._readers[0].is_alive():
                    raise AssertionError(f"{what}: the process exited {self.proc.returncode} first; "
                                         f"stderr: {self.stderr_tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Hung(f"{what}: nothing within {timeout:.0f}s; {self.stacks()}")
                self.changed.wait(min(left, 0.5))

    def saved(self) -> int:
        return self.last("saved")

    def last(self, word: str) -> int:
        """The largest N of the lines ``<word> N`` printed so far (0 if none)."""
        return max((int(line.split()[1]) for line in list(self.lines) if line.startswith(word + " ")), default=0)

    def stacks(self) -> str:
        """Ask a process that seems stuck for its stacks (faulthandler on SIGUSR1)."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGUSR1)
            except ProcessLookupError:
                pass
            time.sleep(0.5)
        return "stderr: " + self.stderr_tail(60)

    def stderr_tail(self, n: int = 15) -> str:
        return "\n".join(list(self.err)[-n:])

    def kill(self, sig: int = signal.SIGKILL) -> bool:
        if self.proc.poll() is not None:
            return False
        try:
            self.proc.send_signal(sig)
        except ProcessLookupError:
            return False
        return True

    def reap(self) -> None:
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for t in self._readers:
            t.join(timeout=2)


class Job:
    """All ranks of one role (``train`` or ``load``) of a round."""

    def __init__(self, role: str, spec: Spec, directory: str, job: str, workdir: str, extra: list[str] = ()) -> None:
        store = os.path.join(workdir, f"store-{role}-{uuid.uuid4().hex[:8]}")
        self.ranks = [Rank([role, directory, job, "--rank", str(r), "--world", str(spec.world), "--store", store,
                            "--persist-every", str(spec.persist_every), "--memory-slots", str(spec.memory_slots),
                            "--mb", str(spec.mb), *extra]) for r in range(spec.world)]

    def wait_for(self, pred: Callable[[list[str]], bool], what: str, timeout: float = WAIT_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        for r, rank in enumerate(self.ranks):
            rank.wait_for(pred, f"rank {r}: {what}", max(1.0, deadline - time.monotonic()))

    def returned(self) -> int:
        """The newest step whose save returned on every rank."""
        return min(rank.saved() for rank in self.ranks)

    def kill(self) -> int:
        killed = sum(rank.kill() for rank in self.ranks)
        for rank in self.ranks:
            rank.reap()
        return killed

    def results(self) -> list[dict]:
        out = []
        for rank in self.ranks:
            line = next(line for line in rank.lines if line.startswith("{"))
            out.append(json.loads(line))
        return out


def kill_savers(job: str) -> int:
    n = 0
    for pid in saver_pids(job):
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
            n += 1
        except ProcessLookupError:
            pass
    return n


def wait_savers_gone(job: str, timeout: float = WAIT_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    while saver_pids(job):
        if time.monotonic() > deadline:
            raise Hung(f"the saver of job {job} (pids {saver_pids(job)}) did not end within {timeout:.0f}s "
                       "after its last trainer died")
        time.sleep(0.1)


def wipe_shared_memory(job: str) -> None:
    for path in glob.glob(_names.job_prefix(job) + ".*"):
        try:
            os.unlink(path)
        except IsADirectoryError:
            shutil.rmtree(path, ignore_errors=True)
        except FileNotFoundError:
            pass


def newest_committed(directory: str) -> int | None:
    steps = LocalStorage(directory).committed_steps()
    return steps[-1] if steps else None


def restart(spec: Spec, directory: str, job: str, workdir: str, jobs: list[Job], out: Outcome) -> None:
    """A fresh loader of every rank loads; its load and every committed step are checked."""
    out.committed = newest_committed(directory)
    loader = Job("load", spec, directory, job, workdir)
    jobs.append(loader)
    loader.wait_for(lambda lines: any(line.startswith("{") for line in lines), "the restart's load never returned",
                    timeout=WAIT_SECONDS * 1.5)
    check_load(loader, out, floor=out.floor, committed=out.committed, who="the restart")
    loader.kill()
    storage = LocalStorage(directory)
    for step in storage.committed_steps():
        problems = storage.verify(step)
        # the restart's saver may still flush its step and retire the oldest (keep_last, metadata
        # first): a step no longer committed once checked was retired meanwhile, not damaged
        if problems and step in storage.committed_steps():
            out.fail("damaged", f"committed step {step} does not verify: {problems}")


def check_load(loader: Job, out: Outcome, *, floor: int | None, committed: int | None, who: str) -> None:
    """Fail ``out`` where what ``loader`` loaded is torn, older than ``committed`` or below ``floor``."""
    results = loader.results()
    torn = [f"rank {r}: {res['torn']}" for r, res in enumerate(results) if res["torn"]]
    if torn:
        out.fail("torn", f"{who} loaded a torn state: {'; '.join(torn)}")
    steps = {res["step"] for res in results}
    if len(steps) > 1:
        out.fail("torn", f"{who}: ranks loaded different steps {[res['step'] for res in results]}")
    step = results[0]["step"]
    if who == "the restart":
        out.loaded, out.source = step, results[0]["source"]
    if committed is not None and (step is None or step < committed):
        out.fail("older-than-committed", f"{who} loaded {step} from {results[0]['source']}, "
                                         f"but step {committed} was committed")
    if floor is not None and (step is None or step < floor):
        out.fail("lost", f"{who} loaded {step} from {results[0]['source']}, but save({floor}) had returned "
                         f"or every rank had captured step {floor} (the floor of this round)")
