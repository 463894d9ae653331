"""Lineage through flashckpt.tf.Checkpointer (issue 24, item 1), eager Keras: a run loads
step 3 of a 1..6 run and saves 4 and 5; the new line commits and is the newest, the old
4..6 are gone, retention keeps the newest 3 by line, and a third run (and plain TF, from
the exported step) reads the new values."""

import numpy as np
import tensorflow as tf

from flashckpt.storage._local import LocalStorage
from flashckpt.tf import Checkpointer

from ._models import dense_model, same, values


def steps_on_disk(directory) -> list[int]:
    return sorted(int(p.name[5:]) for p in directory.iterdir() if p.name.startswith("step-") and p.name[5:].isdigit())


def train(model, target: float) -> None:
    model.fit(np.ones((8, 4)), np.full((8, 1), target), verbose=0)


def test_tf_rollback_starts_a_line_that_commits_and_retains_by_line(tmp_path, job_id):
    storage = LocalStorage(str(tmp_path))
    model = dense_model()
    first = {}
    with Checkpointer(tmp_path, model, job_id=job_id, keep_last=0) as ck:  # keeps 1..6 to roll back to
        for step in range(1, 7):
            train(model, step)
            ck.save(step)
            first[step] = values(model)
        ck.wait()
    assert steps_on_disk(tmp_path) == [1, 2, 3, 4, 5, 6]

    model = dense_model(seed=1)
    saved = {}
    with Checkpointer(tmp_path, model, job_id=job_id, keep_last=3) as ck:
        assert ck.load(step=3) == 3 and same(values(model), first[3])
        for step in (4, 5):
            train(model, -10.0 * step)  # another course than the first run's
            ck.save(step, export=True)
            saved[step] = values(model)
            ck.wait()
            assert ck.latest_step() == step and storage.latest_step() == step
            assert storage.metadata(step)["branch"] == 3
            assert steps_on_disk(tmp_path) == ([2, 3, 4] if step == 4 else [3, 4, 5])  # old 4..6 gone, 3 by line
    assert not same(saved[4], first[4])

    for want in (None, 4):
        model = dense_model(seed=2)
        with Checkpointer(tmp_path, model, job_id=job_id, keep_last=3) as ck:
            got = ck.load(step=want)
        assert got == (want or 5) and same(values(model), saved[got])

    stock = dense_model(trained=False, seed=3)  # the saver's export of the new 4, read by plain TF
    stock.optimizer.build(stock.trainable_variables)
    tf.train.Checkpoint(model=stock, optimizer=stock.optimizer).restore(
        str(tmp_path / "step-4" / "tf" / "ckpt")).assert_consumed()
    assert same(values(stock), saved[4])
