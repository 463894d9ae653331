"""Lineage through DeepSpeedCheckpointer (issue 24, item 1), ZeRO-0 on one gloo rank: a run
loads step 3 of a 1..6 run and saves 4 and 5; the new line commits and is the newest, the
old 4..6 are gone (flash steps and the DeepSpeed tags exported from them), retention keeps
the newest 3 by line, and a third run (and stock DeepSpeed) reads the new values."""

import os

import pytest

from tests._fork import run_ranks

from . import _ds_train


def _listing(directory: str) -> tuple[list[int], list[str]]:
    flash = os.path.join(directory, "flashckpt")
    steps = sorted(int(n[5:]) for n in os.listdir(flash) if n.startswith("step-") and n[5:].isdigit())
    tags = sorted(n for n in os.listdir(directory) if n.startswith("global_step") and not n.endswith("flashckpt"))
    return steps, tags


def _params(engine) -> dict:
    return _ds_train.consolidated(engine)


def _rollback(rank, world, directory, job):
    import deepspeed
    import torch
    from flashckpt.storage._local import LocalStorage
    from flashckpt.deepspeed import DeepSpeedCheckpointer

    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed.init_distributed("gloo")
    storage = LocalStorage(os.path.join(directory, "flashckpt"))

    engine = _ds_train.make_engine(0)
    with DeepSpeedCheckpointer(engine, directory, job_id=job, keep_last=0) as ck:  # keeps 1..6
        for step in range(1, 7):
            _ds_train.train_step(engine, rank, step)
            ck.save(step, client_state={"marker": f"first-{step}"})
        ck.wait()
    assert _listing(directory) == ([1, 2, 3, 4, 5, 6], [f"global_step{s}" for s in range(1, 7)])

    engine = _ds_train.make_engine(0)
    saved = {}
    with DeepSpeedCheckpointer(engine, directory, job_id=job, keep_last=3) as ck:
        assert ck.load(step=3) == 3 and ck.client_state["marker"] == "first-3"
        for step in (4, 5):
            _ds_train.train_step(engine, rank + 7, step)  # another course than the first run's
            ck.save(step, client_state={"marker": f"second-{step}"})
            saved[step] = _params(engine)
            ck.wait()
            assert ck.latest_step() == step and storage.latest_step() == step
            assert storage.metadata(step)["branch"] == 3
            kept = [2, 3, 4] if step == 4 else [3, 4, 5]  # old 4..6 gone, newest 3 by line
            assert _listing(directory) == (kept, [f"global_step{s}" for s in kept]), (step, _listing(directory))
        with open(os.path.join(directory, "latest")) as f:
            assert f.read().strip() == "global_step5"

    for step in (None, 4):
        engine = _ds_train.make_engine(0)
        with DeepSpeedCheckpointer(engine, directory, job_id=job, keep_last=3) as ck:
            got = ck.load(step=step)
            assert got == (step or 5) and ck.client_state["marker"] == f"second-{got}"
        params = _params(engine)
        assert all(torch.equal(params[k], saved[got][k]) for k in saved[got]), f"step {got} differs"

    engine = _ds_train.make_engine(0)  # stock DeepSpeed reads the exported tag of the new line
    _, client = engine.load_checkpoint(directory, "global_step4")
    assert client["marker"] == "second-4"
    params = _params(engine)
    assert all(torch.equal(params[k], saved[4][k]) for k in saved[4])


@pytest.mark.timeout(300)
def test_deepspeed_rollback_starts_a_line_that_commits_and_retains_by_line(tmp_path, job_id):
    run_ranks(_rollback, 1, str(tmp_path / "ckpt"), job_id, timeout=280)
