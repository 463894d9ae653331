"""The crash campaign of issue 20 in the suite: seeded random SIGKILLs of trainer, saver or
both (during save, persist, commit, close and load; 1 and 2 slots; 1 and 2 gloo ranks),
and the rerun-at-once case. The driver and what each round checks: ``_campaign``.

Seed: ``FLASHCKPT_CAMPAIGN_SEED`` (default 20). A failing round names its seed; replay it
with ``python -m tests.soak --round SEED``. The long run: ``python -m tests.soak --minutes 30``.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from flashckpt.storage._local import LocalStorage

from ._campaign import campaign_seed, run_campaign
from .test_ckpt_crash import saver_pids

ROUNDS = int(os.environ.get("FLASHCKPT_CAMPAIGN_ROUNDS", "8"))
BUDGET_SECONDS = float(os.environ.get("FLASHCKPT_CAMPAIGN_SECONDS", "90"))


@pytest.mark.timeout(BUDGET_SECONDS + 240)
def test_random_kills_never_lose_a_returned_save_tear_or_hang(tmp_path, capsys):
    """8 rounds (or 90 s, whichever first; a round under way finishes). Zero lost, torn,
    hung, older-than-committed or damaged rounds. The long campaign is ``python -m tests.soak``."""
    seed = campaign_seed()
    lines = []
    summary = run_campaign(seed=seed, workdir=str(tmp_path), rounds=ROUNDS, seconds=BUDGET_SECONDS,
                           log=lines.append)
    with capsys.disabled():
        print("\n" + "\n".join(lines + [summary.report().splitlines()[0]]))
    assert summary.counts()["rounds"] >= min(ROUNDS, 5), summary.report()
    assert not summary.failed(), summary.report()


RERUN = textwrap.dedent("""
    import sys, torch
    from flashckpt.torch import Checkpointer
    directory, job, cycles = sys.argv[1], sys.argv[2], int(sys.argv[3])
    state = {"w": torch.zeros(4096)}
    for step in range(1, cycles + 1):
        state["w"].fill_(step)
        ck = Checkpointer(directory, job_id=job, persist_every=1, keep_last=0)
        ck.save(step, state)
        ck.close()
    print("done", flush=True)
""")


@pytest.mark.timeout(200)
def test_rerun_at_once_after_close_persists_every_step(tmp_path, job_id):
    """construct, save(N), close(), construct again at once (same directory and job id, the
    saver of the previous run still lingering), save(N+1), close(), ...: every step must be
    committed (slot generations must not repeat across slot re-creation)."""
    cycles = 30
    proc = subprocess.Popen([sys.executable, "-c", RERUN, str(tmp_path), job_id, str(cycles)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{cycles} construct/save/close cycles did not finish within 150 s: {err[-2000:]}")
    finally:
        for pid in saver_pids(job_id):
            os.kill(pid, 9)
    assert proc.returncode == 0 and "done" in out, err[-2000:]
    storage = LocalStorage(str(tmp_path))
    committed = storage.committed_steps()
    lost = sorted(set(range(1, cycles + 1)) - set(committed))
    assert not lost, f"{len(lost)} of {cycles} closed saves never reached storage: steps {lost[:20]}"
    for step in committed:
        assert storage.verify(step) == [], f"step {step} does not verify"
