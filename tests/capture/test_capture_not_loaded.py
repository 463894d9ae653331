"""The agreement says why a failure capture is not loaded (issue 42, item 2): per-rank state
(``Checkpointer``) on 2 gloo ranks, rank 0 captured step 5 and rank 1 did not (it died, or
was caught inside an update). Every rank's capture is needed, so the restart loads the
newest regular save, 2, and rank 0 logs one line naming the captured step, the loaded one
and the rank that lacks the capture."""

from __future__ import annotations

from tests._fork import run_ranks

from ._steps import train_to_5


def _model(rank: int):
    import torch

    torch.manual_seed(rank)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _fail(rank: int, world: int, directory: str, job: str) -> None:
    """Save 2 (persisted), three updates, rank 0 captures 5; then the process ends unclosed,
    as a killed one does (a worker leaves through ``os._exit``: no close, no atexit)."""
    from flashckpt.torch import Checkpointer

    model, opt = _model(rank)
    capture = train_to_5(Checkpointer(directory, job_id=job, persist_every=100), model, opt)
    if rank == 0:
        assert capture.capture("test") == 5


def _restart(rank: int, world: int, directory: str, job: str) -> tuple[int | None, list[str]]:
    import logging

    from flashckpt.torch import Checkpointer

    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("flashckpt").addHandler(handler)
    logging.getLogger("flashckpt").setLevel(logging.INFO)
    model, opt = _model(rank)
    with Checkpointer(directory, job_id=job) as ckpt:
        step = ckpt.load({"model": model.state_dict(), "optim": opt.state_dict()})
    return step, lines


def test_a_capture_one_rank_lacks_is_not_loaded_and_the_log_says_why(tmp_path, job_id):
    run_ranks(_fail, 2, str(tmp_path / "ckpt"), job_id)
    results = run_ranks(_restart, 2, str(tmp_path / "ckpt"), job_id)
    assert [step for step, _ in results] == [2, 2]
    said = [line for line in results[0][1] if "captured" in line]
    assert len(said) == 1, results[0][1]
    assert "step 5" in said[0] and "loading step 2 from memory" in said[0] and "rank(s) 1 hold no copy" in said[0], said
    assert not any("captured" in line for line in results[1][1]), results[1][1]
