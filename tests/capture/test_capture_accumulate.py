"""``save_on_failure(..., steps_per_update=N)``: gradient accumulation where ``save``'s step
counts micro-batches and ``optimizer.step()`` runs every N of them (issue 42). The capture is
numbered ``last save + updates * N``; saves that contradict that count are warned about once,
and the capture writes nothing until a save agrees with the count again."""

from __future__ import annotations

import pytest
import torch

from flashckpt.torch import Checkpointer, DdpCheckpointer

N = 4  # micro-batches per optimizer update


def _model():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _state(model, opt) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _micro(model, opt, micro: int) -> None:
    """Micro-batch ``micro`` (1-based): its gradient accumulates, every N-th one updates."""
    x = torch.full((3, 4), float(micro))
    (model(x).sum() / N).backward()
    if micro % N == 0:
        opt.step()
        opt.zero_grad()


def _train(ckpt, model, opt, micros: range, save_every: int = 8) -> None:
    for micro in micros:
        _micro(model, opt, micro)
        if micro % save_every == 0:
            ckpt.save(micro, _state(model, opt))


def test_a_capture_inside_an_accumulation_is_the_last_update_numbered_in_micro_batches(tmp_path, job_id, caplog):
    """Saves every 8 micro-batches; a failure in micro-batch 14 (after the update of 12,
    two micro-batches into the next accumulation) captures step 12 with 12's weights."""
    model, opt = _model()
    with caplog.at_level("WARNING", logger="flashckpt"):
        with Checkpointer(tmp_path, job_id=job_id, persist_every=1000) as ckpt:
            capture = ckpt.save_on_failure(lambda: _state(model, opt), optimizer=opt, steps_per_update=N)
            _train(ckpt, model, opt, range(1, 13))  # saves 8, updates at 4, 8, 12
            at12 = {k: v.clone() for k, v in model.state_dict().items()}
            _train(ckpt, model, opt, range(13, 15))  # partial gradients only
            assert capture.current_step == 12
            assert capture.capture("test") == 12
    assert "steps_per_update" not in caplog.text, caplog.text
    model2, opt2 = _model()
    with Checkpointer(tmp_path, job_id=job_id) as ckpt:
        assert ckpt.load(_state(model2, opt2)) == 12
        assert all(torch.equal(v, at12[k]) for k, v in model2.state_dict().items())


def test_the_count_goes_on_from_a_load_and_agrees_with_later_saves(tmp_path, job_id, caplog):
    """A restart at step 16 (loaded, then armed): saves at 24 and 32 agree with the count
    (no warning); a failure after the update of 36 captures 36."""
    model, opt = _model()
    with Checkpointer(tmp_path, job_id=job_id, persist_every=1000) as ckpt:
        _train(ckpt, model, opt, range(1, 17))
    model, opt = _model()
    with caplog.at_level("WARNING", logger="flashckpt"):
        with DdpCheckpointer(tmp_path, job_id=job_id, persist_every=1000) as ckpt:
            assert ckpt.load(_state(model, opt)) == 16
            capture = ckpt.save_on_failure(lambda: _state(model, opt), optimizer=opt, steps_per_update=N)
            _train(ckpt, model, opt, range(17, 39))
            assert capture.capture("test") == 36
    assert "steps_per_update" not in caplog.text, caplog.text


def test_saves_that_contradict_steps_per_update_warn_once_and_the_capture_writes_nothing(tmp_path, job_id, caplog):
    """steps_per_update=2 where the loop accumulates 4: save(16) comes 2 updates after 8
    (2 would make it 12): one warning naming what was seen and that 4 fits; a later
    contradicting save adds no warning; a capture then writes nothing (its number would be wrong),
    and the restart loads the newest save."""
    model, opt = _model()
    with caplog.at_level("WARNING", logger="flashckpt"):
        with Checkpointer(tmp_path, job_id=job_id, persist_every=1000) as ckpt:
            capture = ckpt.save_on_failure(lambda: _state(model, opt), optimizer=opt, steps_per_update=2)
            _train(ckpt, model, opt, range(1, 9))  # save 8 after 2 updates of a fresh run: no base to check
            assert "steps_per_update" not in caplog.text, caplog.text
            _train(ckpt, model, opt, range(9, 17))
            warned = [r.getMessage() for r in caplog.records if "steps_per_update" in r.getMessage()]
            assert len(warned) == 1, warned
            assert all(part in warned[0] for part in ("save(16)", "2 optimizer update(s) after step 8",
                                                      "steps_per_update=2", "12", "4 save steps per update would fit",
                                                      "steps_per_update=4)")), \
                warned[0]
            _train(ckpt, model, opt, range(17, 29))  # save 24 contradicts again: no second warning
            assert len([r for r in caplog.records if "would fit" in r.getMessage()]) == 1, caplog.text
            assert capture.capture("test") is None
            assert "nothing captured" in caplog.text and "save(24)" in caplog.text, caplog.text
    with Checkpointer(tmp_path, job_id=job_id) as ckpt:
        assert ckpt.load(_state(*_model())) == 24


def test_a_save_that_agrees_again_arms_the_capture_again(tmp_path, job_id, caplog):
    """steps_per_update=1 (the default) where one update was skipped (a GradScaler's inf step):
    save(10) after 9 updates since 0 (loaded) contradicts; save(20) 10 updates after it agrees,
    so a capture 3 updates later writes 23."""
    model, opt = _model()
    with Checkpointer(tmp_path, job_id=job_id, persist_every=1000) as ckpt:
        ckpt.save(0, _state(model, opt))
    with caplog.at_level("WARNING", logger="flashckpt"):
        with Checkpointer(tmp_path, job_id=job_id, persist_every=1000) as ckpt:
            assert ckpt.load(_state(model, opt)) == 0
            capture = ckpt.save_on_failure(lambda: _state(model, opt), optimizer=opt)
            for step in range(1, 24):
                if step != 5:  # step 5's update skipped
                    model(torch.ones(3, 4)).sum().backward()
                    opt.step()
                    opt.zero_grad()
                if step % 10 == 0:
                    ckpt.save(step, _state(model, opt))
            assert "save(10)" in caplog.text and "9 optimizer update(s) after step 0" in caplog.text, caplog.text
            assert "no number of save steps per update fits" in caplog.text, caplog.text
            assert capture.capture("test") == 23


@pytest.mark.parametrize("value, error, match", [
    (0, ValueError, "steps_per_update must be >= 1"), (-4, ValueError, "steps_per_update must be >= 1"),
    (2.0, TypeError, "steps_per_update must be an int"), (True, TypeError, "steps_per_update must be an int"),
    ("4", TypeError, "steps_per_update must be an int")])
def test_bad_steps_per_update_is_a_clear_error_before_anything_is_armed(tmp_path, job_id, value, error, match):
    model, opt = _model()
    with Checkpointer(tmp_path, job_id=job_id) as ckpt:
        with pytest.raises(error, match=match):
            ckpt.save_on_failure(lambda: _state(model, opt), optimizer=opt, steps_per_update=value)
        assert opt._optimizer_step_pre_hooks == {} and opt._optimizer_step_post_hooks == {}
        ckpt.save_on_failure(lambda: _state(model, opt), optimizer=opt, steps_per_update=N)  # still armable
