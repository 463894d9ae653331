"""A seeded random-SIGKILL driver for flash checkpoints: the suite's crash campaign and
the soak (``python -m tests.soak``) run the same rounds.

One round (all of it derived from its seed, so ``python -m tests.soak --round SEED``
replays it) starts a fresh job — 1 or 2 gloo ranks of ``_campaign_trainer`` saving a
1-50 MB state whose tensors hold the step number, ``persist_every`` 1 or 3,
``memory_slots`` 1 or 2 — and SIGKILLs the trainer, the saver or both at one moment:

- ``save``: a random instant after a few saves (saves run back to back, so mostly inside one);
- ``persist``: while a shard is being written (a ``step-N.tmp-*`` holds a shard file);
- ``commit``: once a shard is durable (``rank-R.done``), around the commit;
- ``close``: inside ``close()`` after a few saves;
- ``load``: the trainer is killed, then a restarted loader is killed (or its saver) mid-``load``;
- ``capture``: failure capture armed, the trainer gets SIGTERM and captures its last finished
  step; "saver" and "both" also kill the saver, or the trainer and the saver, during the capture
  (the round and what it checks on top: ``_campaign_capture``).

Killing "saver" kills only the saver and lets the trainer go on (it must get a new saver
and keep saving), then kills the trainer too. "both" kills the trainer, then the saver.
Sometimes ("wipe") the node's shared memory is then lost: the driver waits for any saver
still alive to end, removes every object under ``_names.job_prefix(job)``, and the restart
has only storage. A fresh loader (all ranks) then loads and the round checks:

- **torn**: every rank's state holds one step in every tensor, and all ranks the same step;
- **older-than-committed**: the loaded step is >= the newest step committed on storage
  when the loader started (the directory's ``step-N/metadata.json``, not ``latest``);
- **lost**: the loaded step is >= the *floor*, defined below;
- **damaged**: every committed step verifies (``LocalStorage(dir).verify(step) == []``);
- **hung**: no wait passes its bound (a trainer that stops printing, a loader that does not
  answer, a saver that never ends); the failure names the round's seed and the stacks.

The floor. ``returned`` is the newest step whose ``save()`` returned on every rank (each
rank prints ``saved N`` after it returns); ``due`` is the newest returned step that was due
to persist (``N % persist_every == 0``; steps count saves from 1). Ranks step together, as
data-parallel training does (a collective per step, here a barrier before each save), so no
rank runs more than one save ahead: ranks that drift further apart than the two slots span
cannot all still hold the newest step every rank returned, and per-rank state needs all.

- memory survived, ``memory_slots=2``: floor = ``returned``. Two copies mean a save never
  overwrites the newest complete copy that is not on storage yet, whoever dies when.
- memory survived, ``memory_slots=1``: floor = ``due`` (the weaker, documented guarantee: a
  save waits while storage reads the only copy of a due step, so a due step is committed
  before it is overwritten; a step not due lives only in the copy a crash may tear). When
  the saver was killed while the trainer lived, a due step's copy may be overwritten
  before any saver read it: no floor beyond the committed one.
- memory wiped: floor = ``due`` when a saver was alive after the trainer died (it persists
  what was asked of it and the dead trainer's newest copy; the driver lets it finish
  before wiping); with no saver alive (killed with the trainer) nothing beyond the
  committed steps is promised. With one slot and the saver killed under a living
  trainer, again no floor beyond the committed one.
"""

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
DEFAULT_SEED = 20
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


def _wait_storage_activity(directory: str, suffix: str, timeout: float) -> bool:
    """Wait until a pending step directory holds a file ending in ``suffix`` (a shard being
    written: ``.safetensors``; a durable shard: ``.done``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pending in glob.glob(os.path.join(directory, "step-*.tmp-*")):
            try:
                if any(name.endswith(suffix) for name in os.listdir(pending)):
                    return True
            except FileNotFoundError:
                pass
        time.sleep(0.002)
    return False


def run_round(seed: int, workdir: str, max_mb: float = 50.0) -> Outcome:
    """One round; never raises for what it finds (the outcome lists it), and leaves no process."""
    spec = Spec.of(seed, max_mb)
    out = Outcome(spec)
    rng = random.Random(seed * 7919)
    directory = os.path.join(workdir, f"ckpt-{seed}")
    job = f"camp{uuid.uuid4().hex[:12]}"
    jobs: list[Job] = []
    start = time.monotonic()
    try:
        _play(spec, rng, directory, job, workdir, jobs, out)
    except Hung as exc:
        out.fail("hung", str(exc))
    except AssertionError as exc:
        out.fail("error", str(exc))
    except Exception as exc:  # the driver's own trouble is reported, never hidden
        out.fail("error", f"{type(exc).__name__}: {exc}")
    finally:
        for j in jobs:
            j.kill()
        kill_savers(job)
        wipe_shared_memory(job)
        shutil.rmtree(directory, ignore_errors=True)
        out.seconds = time.monotonic() - start
    return out


def _play(spec: Spec, rng: random.Random, directory: str, job: str, workdir: str, jobs: list[Job],
          out: Outcome) -> None:
    if spec.moment == "capture":
        from ._campaign_capture import play_capture
        return play_capture(spec, rng, directory, job, workdir, jobs, out)
    extra = ["--steps", str(spec.saves_before + rng.randint(0, 3)), "--close"] if spec.moment == "close" else []
    trainer = Job("train", spec, directory, job, workdir, extra)
    jobs.append(trainer)
    first = spec.saves_before
    trainer.wait_for(lambda lines: f"saved {first}" in lines, f"the trainer's save({first}) never returned")
    saver_killed_under_trainer = False

    # -- the kill -------------------------------------------------------------------
    if spec.moment == "close":
        trainer.wait_for(lambda lines: "closing" in lines, "the trainer never reached close()")
        time.sleep(rng.uniform(0, 0.15))
    elif spec.moment in ("persist", "commit"):
        _wait_storage_activity(directory, ".safetensors" if spec.moment == "persist" else ".done", 10.0)
        time.sleep(rng.uniform(0, 0.005))
    else:
        time.sleep(spec.delay)
    target = "trainer" if spec.moment == "load" else spec.target
    if target == "saver":
        out.kills += kill_savers(job)
        saver_killed_under_trainer = True
        if spec.moment != "close":  # it must go on saving through a new saver
            after = trainer.returned() + 2
            trainer.wait_for(lambda lines: any(line == f"saved {after}" for line in lines),
                             f"the trainer stopped saving after its saver was killed (no save({after}))",
                             timeout=WAIT_SECONDS / 2)
            time.sleep(spec.delay)
        else:
            trainer.wait_for(lambda lines: "closed" in lines, "close() never returned after the saver was killed",
                             timeout=WAIT_SECONDS / 2)
    out.kills += trainer.kill()
    if target == "both":
        time.sleep(rng.uniform(0, 0.03))
        out.kills += kill_savers(job)
    returned = trainer.returned()
    due = returned - returned % spec.persist_every
    saver_alive = bool(saver_pids(job))

    # -- a restart killed mid-load ----------------------------------------------------
    if spec.moment == "load":
        loader = Job("load", spec, directory, job, workdir)
        jobs.append(loader)
        loader.wait_for(lambda lines: "loading" in lines, "the first loader never started loading")
        time.sleep(rng.uniform(0, 0.3))
        if spec.target in ("saver", "both"):
            out.kills += kill_savers(job)
        if spec.target in ("trainer", "both"):
            out.kills += loader.kill()
        else:  # the loader lives on: its load must still finish and be whole
            loader.wait_for(lambda lines: any(line.startswith("{") for line in lines),
                            "a load whose saver was killed never returned")
            _check_load(loader, out, floor=None, committed=None, who="the loader whose saver was killed")
            loader.kill()

    # -- the floor ------------------------------------------------------------------
    if spec.wipe:
        wait_savers_gone(job)
        wipe_shared_memory(job)
        floor = due if saver_alive and not (spec.memory_slots == 1 and saver_killed_under_trainer) else None
    elif spec.memory_slots == 2:
        floor = returned
    else:
        floor = None if saver_killed_under_trainer else due
    out.floor = floor or None

    restart(spec, directory, job, workdir, jobs, out)


def restart(spec: Spec, directory: str, job: str, workdir: str, jobs: list[Job], out: Outcome) -> None:
    """A fresh loader of every rank loads; its load and every committed step are checked."""
    out.committed = newest_committed(directory)
    loader = Job("load", spec, directory, job, workdir)
    jobs.append(loader)
    loader.wait_for(lambda lines: any(line.startswith("{") for line in lines), "the restart's load never returned",
                    timeout=WAIT_SECONDS * 1.5)
    _check_load(loader, out, floor=out.floor, committed=out.committed, who="the restart")
    loader.kill()
    storage = LocalStorage(directory)
    for step in storage.committed_steps():
        problems = storage.verify(step)
        # the restart's saver may still flush its step and retire the oldest (keep_last, metadata
        # first): a step no longer committed once checked was retired meanwhile, not damaged
        if problems and step in storage.committed_steps():
            out.fail("damaged", f"committed step {step} does not verify: {problems}")


def _check_load(loader: Job, out: Outcome, *, floor: int | None, committed: int | None, who: str) -> None:
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


@dataclass
class Summary:
    seed: int
    outcomes: list[Outcome] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        c = {"rounds": len(self.outcomes), "kills": sum(o.kills for o in self.outcomes),
             "captured": sum(1 for o in self.outcomes if o.captured is not None)}
        for kind in ("lost", "torn", "hung", "older-than-committed", "damaged", "error"):
            c[kind] = sum(1 for o in self.outcomes if any(k == kind for k, _ in o.failures))
        return c

    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.failures]

    def report(self) -> str:
        c = self.counts()
        head = f"campaign seed {self.seed}: " + ", ".join(f"{k} {v}" for k, v in c.items())
        return "\n".join([head] + [o.line() for o in self.failed()])


def campaign_seed() -> int:
    return int(os.environ.get("FLASHCKPT_CAMPAIGN_SEED", DEFAULT_SEED))


def run_campaign(*, seed: int, workdir: str, rounds: int | None = None, seconds: float | None = None,
                 max_mb: float = 50.0, log: Callable[[str], None] = print) -> Summary:
    """Rounds ``seed*100000 + i`` for i = 0, 1, ... until ``rounds`` ran or ``seconds`` passed
    (a round under way finishes; each round is bounded by its waits)."""
    summary = Summary(seed)
    log(f"campaign seed {seed} (FLASHCKPT_CAMPAIGN_SEED); replay a round: python -m tests.soak --round SEED")
    start = time.monotonic()
    i = 0
    while (rounds is None or i < rounds) and (seconds is None or time.monotonic() - start < seconds):
        outcome = run_round(seed * 100000 + i, workdir, max_mb)
        summary.outcomes.append(outcome)
        log(outcome.line())
        i += 1
    return summary


__all__ = ["MOMENTS", "TARGETS", "Outcome", "Spec", "Summary", "campaign_seed", "run_campaign", "run_round"]
