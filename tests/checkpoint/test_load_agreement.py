"""The one load agreement (``flashckpt.restore._agreement``, issue 21 item 4): a rank that fails
while looking for checkpoints fails every rank with the same error naming it, rather than
leaving the others waiting in the agreement's collective."""

import torch

from tests._fork import run_ranks


def _one_rank_cannot_look(rank: int, world: int, directory: str, job: str):
    from flashckpt import CheckpointError
    from flashckpt.torch import Checkpointer

    with Checkpointer(directory, job_id=job) as ck:
        ck.save(1, {"w": torch.full((4,), float(rank))})
        ck.wait()
        if rank == 1:
            def broken():
                raise OSError("shared memory unreadable")
            ck.engine.slots.copies = broken
        try:
            ck.load({"w": torch.zeros(4)})
        except CheckpointError as exc:
            return str(exc)
        finally:
            ck.engine.slots.__dict__.pop("copies", None)
    return None


def test_a_rank_that_fails_to_look_fails_every_rank_alike(tmp_path, job_id):
    errors = run_ranks(_one_rank_cannot_look, 2, str(tmp_path), job_id, timeout=90)
    assert errors[0] == errors[1] and errors[0] is not None, errors
    assert "rank 1: shared memory unreadable" in errors[0], errors
