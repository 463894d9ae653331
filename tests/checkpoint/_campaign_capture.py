"""The crash campaign's failure-capture rounds (moment ``capture``; the driver: ``_campaign``).

The trainer runs with ``--capture E``: its state changes only inside an optimizer's
``step()``, 5-50 ms after each step began, every E-th step is saved (E of 2-4), and
``save_on_failure`` is armed. After a
few saves every rank gets SIGTERM at a random instant (inside an update, a save, the barrier
between steps, or between them), and captures its last finished step unless it was inside
an update. With target "saver" the saver is SIGKILLed 0-30 ms later (during the capture's
copy or its persist), with "both" the trainer and then the saver (a second failure during
the capture). Every trainer process must end within the campaign's bound (else hung). Then
the restart loads, checked as every round is (torn, older-than-committed, damaged), with:

- **lost**: the floor is that of a kill without capture (memory survives: ``returned`` with
  two slots, the newest due step with one unless the saver was killed), raised to the
  captured step where every rank logged capturing the same step (the log line comes once
  the copy is whole, so a later SIGKILL does not undo it);
- **torn**: also a loaded step newer than any rank's last finished update (plus one: a rank
  may finish an update and be stopped before it prints it).
"""

from __future__ import annotations

import random
import re
import signal
import time

from ._campaign_job import WAIT_SECONDS, Hung, Job, Outcome, Spec, kill_savers, restart, saver_pids

CAPTURED = re.compile(r"captured step (\d+) into memory")


def play_capture(spec: Spec, rng: random.Random, directory: str, job: str, workdir: str, jobs: list[Job],
                 out: Outcome) -> None:
    every = rng.randint(2, 4)
    compute = rng.uniform(0.005, 0.05)  # a step's time before its update: where most SIGTERMs land
    trainer = Job("train", spec, directory, job, workdir, ["--capture", str(every), "--sleep", f"{compute:.4f}"])
    jobs.append(trainer)
    first = spec.saves_before * every
    trainer.wait_for(lambda lines: f"saved {first}" in lines, f"the trainer's save({first}) never returned")
    time.sleep(rng.uniform(0, 1.5 * every * compute))  # up to the next save and past it
    out.kills += sum(rank.kill(signal.SIGTERM) for rank in trainer.ranks)
    if spec.target != "trainer":
        time.sleep(rng.uniform(0, 0.03))
        if spec.target == "both":
            out.kills += sum(rank.kill() for rank in trainer.ranks)
        out.kills += kill_savers(job)
    _wait_exited(trainer, job)
    trainer.kill()  # reaps

    returned = trainer.returned()
    due = returned - returned % (every * spec.persist_every)  # saves are every `every` steps
    captured = {_captured(rank.err) for rank in trainer.ranks}
    if spec.memory_slots == 2:
        floor = returned
    else:
        floor = due if spec.target == "trainer" else None
    if len(captured) == 1 and None not in captured:
        out.captured = captured.pop()
        floor = max(floor or 0, out.captured)
    out.floor = floor or None
    restart(spec, directory, job, workdir, jobs, out)
    finished = max(rank.last("updated") for rank in trainer.ranks)
    if out.loaded is not None and out.loaded > finished + 1:
        out.fail("torn", f"the restart loaded step {out.loaded}, but no rank finished an update past {finished}")


def _wait_exited(trainer: Job, job: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    for r, rank in enumerate(trainer.ranks):
        while rank.proc.poll() is None:
            if time.monotonic() > deadline:
                raise Hung(f"rank {r} did not end within {WAIT_SECONDS:.0f}s of its SIGTERM (savers "
                           f"{saver_pids(job)}); {rank.stacks()}")
            time.sleep(0.05)


def _captured(err: list[str]) -> int | None:
    for line in reversed(list(err)):
        found = CAPTURED.search(line)
        if found:
            return int(found.group(1))
    return None
