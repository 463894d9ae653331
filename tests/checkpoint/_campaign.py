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
import os
import random
import shutil
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from ._campaign_capture import play_capture
from ._campaign_job import (MOMENTS, TARGETS, WAIT_SECONDS, Hung, Job, Outcome, Spec, check_load, kill_savers, restart,
                            saver_pids, wait_savers_gone, wipe_shared_memory)

DEFAULT_SEED = 20


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
            check_load(loader, out, floor=None, committed=None, who="the loader whose saver was killed")
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
