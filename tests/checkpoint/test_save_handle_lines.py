"""``SaveHandle.durable()`` asks for this save's (line, step), not its step number: after a
rollback in the same process, the abandoned line's committed step of the same number is not
this save's, and once the new line commits it, the abandoned line's handle is not durable."""

import torch

from flashckpt.torch import Checkpointer


def test_durable_follows_the_line_of_the_save_not_its_step_number(tmp_path, job_id):
    w = torch.zeros(8)
    with Checkpointer(tmp_path, job_id=job_id, persist_every=1, keep_last=0) as ck:
        ck.save(1, {"w": w}).wait(timeout=60)
        abandoned = ck.save(2, {"w": w.fill_(2.0)})
        abandoned.wait(timeout=60)
        assert abandoned.durable()
        assert ck.load({"w": w}, step=1) == 1  # a rollback: the next saves start a new line
        again = ck.save(2, {"w": w.fill_(20.0)}, persist=False)  # memory only
        assert again.done() and not again.durable()  # the abandoned line's step 2 is not this one
        ck.flush(timeout=60)  # the new line's step 2 commits, replacing the abandoned one
        assert again.durable() and not abandoned.durable()
