"""The crash campaign as a soak: ``python -m tests.soak --minutes 30`` (from the repository root).

Runs the rounds of ``tests.checkpoint._campaign`` (seeded random SIGKILLs of trainer, saver
or both during save, persist, commit, close and load, and SIGTERMs of a trainer with failure
capture armed; 1 and 2 slots; 1 and 2 gloo ranks; sometimes the node's shared memory lost)
until the time is up, prints each failing round as it happens and a summary (rounds, kills,
rounds whose capture every rank wrote, lost, torn, hung, older-than-committed, damaged,
error), and exits 1 on any failure. ``--round SEED`` replays one round.
Seed: ``--seed`` or ``FLASHCKPT_CAMPAIGN_SEED`` (default 20). Since the capture rounds came
(2026-12-03) a seed names another round than it did before: a round seed from an earlier
report replays under the code of that time only.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from tests.checkpoint._campaign import campaign_seed, run_campaign, run_round


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.soak")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--rounds", type=int, default=None, help="stop after this many rounds")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--round", type=int, default=None, help="replay the one round of this seed")
    p.add_argument("--max-mb", type=float, default=50.0, help="largest state per rank (MB)")
    p.add_argument("--verbose", action="store_true", help="print every round, not only failing ones")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="flashckpt-soak-") as workdir:
        if a.round is not None:
            outcome = run_round(a.round, workdir, a.max_mb)
            print(outcome.line(), flush=True)
            return 1 if outcome.failures else 0
        seed = a.seed if a.seed is not None else campaign_seed()

        def log(line: str) -> None:
            if a.verbose or " FAIL " in line or line.startswith("campaign"):
                print(line, flush=True)

        summary = run_campaign(seed=seed, workdir=workdir, rounds=a.rounds, seconds=a.minutes * 60,
                               max_mb=a.max_mb, log=log)
    print(summary.report().splitlines()[0], flush=True)
    return 1 if summary.failed() else 0


if __name__ == "__main__":
    sys.exit(main())
