"""``save_on_failure`` in one process: bad ``state_fn`` at the first save, the step count,
capture at most once, nothing mid-update, handlers given back at close."""

from __future__ import annotations

import signal
import sys
import threading

import pytest
import torch

from flashckpt import CheckpointError, StateMismatchError
from flashckpt.torch import Checkpointer


def _model():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model, opt) -> None:
    opt.zero_grad()
    model(torch.ones(3, 4)).sum().backward()
    opt.step()


def _state(model, opt) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def test_state_fn_that_raises_fails_the_first_save(tmp_path, job_id):
    model, opt = _model()
    with Checkpointer(tmp_path, job_id=job_id) as ckpt:
        ckpt.save_on_failure(lambda: 1 / 0, optimizer=opt)
        _step(model, opt)
        with pytest.raises(CheckpointError, match="state_fn.*ZeroDivisionError"):
            ckpt.save(1, _state(model, opt))


def test_state_fn_of_another_tree_fails_the_first_save(tmp_path, job_id):
    model, opt = _model()
    with Checkpointer(tmp_path, job_id=job_id) as ckpt:
        ckpt.save_on_failure(lambda: {"model": model.state_dict()}, optimizer=opt)
        _step(model, opt)
        with pytest.raises(StateMismatchError, match="state_fn.*optim"):
            ckpt.save(1, _state(model, opt))


@pytest.mark.parametrize("may_lack", [("/optim",), ("/opt",)])
def test_may_lack_leaves_only_those_subtrees_out_of_the_check(tmp_path, job_id, may_lack):
    """An adapter whose capture lacks a subtree by design (the Trainer's ZeRO-3 weights)
    names it; the check skips that subtree only (a mere prefix of a name is not one)."""
    model, opt = _model()
    with Checkpointer(tmp_path, job_id=job_id) as ckpt:
        ckpt.capture_with(ckpt.engine_capture(lambda: {"model": model.state_dict()}, opt, may_lack=may_lack))
        _step(model, opt)
        if may_lack == ("/optim",):
            ckpt.save(1, _state(model, opt))
        else:
            with pytest.raises(StateMismatchError, match="state_fn.*optim"):
                ckpt.save(1, _state(model, opt))


def test_capture_counts_steps_once_and_never_mid_update(tmp_path, job_id):
    model, opt = _model()
    before = signal.getsignal(signal.SIGTERM), sys.excepthook, threading.excepthook
    with Checkpointer(tmp_path, job_id=job_id) as ckpt:
        capture = ckpt.save_on_failure(lambda: _state(model, opt), optimizer=opt)
        assert signal.getsignal(signal.SIGTERM) is not before[0]
        assert capture.capture("no step yet") is None  # and that was the one capture of this process
        _step(model, opt)
        assert capture.capture("again") is None
    with Checkpointer(tmp_path, job_id=job_id) as ckpt:  # the first closed: its hooks are gone
        assert (signal.getsignal(signal.SIGTERM), sys.excepthook, threading.excepthook) == before
        capture = ckpt.save_on_failure(lambda: _state(model, opt), optimizer=opt)
        for step in (1, 2):
            _step(model, opt)
        ckpt.save(2, _state(model, opt))
        for step in (3, 4, 5):
            _step(model, opt)
        seen = {}
        opt.register_step_pre_hook(lambda *_: seen.setdefault("mid", capture.capture("mid-update probe")))
        _step(model, opt)  # the probe runs inside step 6's update: nothing captured, and no capture after
        assert seen["mid"] is None and capture.capture("after") is None
        assert 5 not in ckpt.engine.memory_steps() and 6 not in ckpt.engine.memory_steps()


def test_capture_writes_the_last_finished_step(tmp_path, job_id):
    model, opt = _model()
    with Checkpointer(tmp_path, job_id=job_id) as ckpt:
        capture = ckpt.save_on_failure(lambda: _state(model, opt), optimizer=opt)
        for _ in range(3):
            _step(model, opt)
        ckpt.save(3, _state(model, opt))
        for _ in range(4):
            _step(model, opt)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        assert capture.capture("test") == 7
        assert capture.capture("second failure") == 7  # once: the same answer, no second copy
        assert ckpt.engine.memory_info(7).get("captured") is True
    model2, opt2 = _model()
    with Checkpointer(tmp_path, job_id=job_id) as ckpt:
        assert ckpt.load(_state(model2, opt2)) == 7
        for k, v in model2.state_dict().items():
            assert torch.equal(v, expected[k])


def _forked_child_takes_sigterm(directory: str, job: str) -> str:
    """In a worker: a child forked after ``save_on_failure`` (a data-loader worker) gets
    SIGTERM; this process must neither capture nor end."""
    import os
    import time
    model, opt = _model()
    with Checkpointer(directory, job_id=job) as ckpt:
        ckpt.save_on_failure(lambda: _state(model, opt), optimizer=opt)
        _step(model, opt)
        pid = os.fork()
        if pid == 0:
            os.kill(os.getpid(), signal.SIGTERM)
            os._exit(3)  # not reached: the child ends by the signal
        _, status = os.waitpid(pid, 0)
        time.sleep(1.5)  # past the watcher's grace for the main thread
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
        assert ckpt.engine.memory_steps() == {}, ckpt.engine.memory_steps()
    return "alive"


def test_a_forked_childs_signal_is_not_this_processs_failure(tmp_path, job_id):
    from .._fork import Forked
    proc = Forked(_forked_child_takes_sigterm, str(tmp_path), job_id)
    assert proc.wait(60) == 0, proc.stderr.read()


def test_a_checkpointer_without_capture_says_so():
    from flashckpt._base import EngineCheckpointer

    class Other(EngineCheckpointer):
        pass

    with pytest.raises(CheckpointError, match="Other has no failure capture yet"):
        Other().save_on_failure(lambda: {}, optimizer=None)


def test_an_exception_leaving_the_with_block_captures_before_close(tmp_path, job_id):
    model, opt = _model()
    with pytest.raises(RuntimeError, match="lost"):
        with Checkpointer(tmp_path, job_id=job_id, persist_every=1000) as ckpt:
            ckpt.save_on_failure(lambda: _state(model, opt), optimizer=opt)
            _step(model, opt)
            ckpt.save(1, _state(model, opt))
            _step(model, opt), _step(model, opt)
            raise RuntimeError("lost the peer")
    with Checkpointer(tmp_path, job_id=job_id) as ckpt:
        assert ckpt.latest_step() == 3  # captured, then persisted by close's flush
        assert ckpt.load(_state(*_model())) == 3


def test_a_failure_during_a_load_captures_nothing(tmp_path, job_id, monkeypatch, caplog):
    """A load into the live state after arming (a rollback to step 2, one update later): a
    failure while the tensors are being overwritten finds the state part old, part loaded,
    so nothing is captured (not step 3 with step 2's first tensors); the load goes on."""
    from flashckpt.torch._tensors import TorchKind

    model, opt = _model()
    with Checkpointer(tmp_path, job_id=job_id) as ckpt:
        capture = ckpt.save_on_failure(lambda: _state(model, opt), optimizer=opt)
        _step(model, opt)
        _step(model, opt)
        ckpt.save(2, _state(model, opt))
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        _step(model, opt)
        fired, outcome = [], []
        real = TorchKind.copy

        def copy_with_a_failure(self, dsts, srcs):
            if not fired:  # the load's first copy into the model: a failure arrives
                fired.append(True)
                outcome.append(capture.capture("injected mid-load"))
            return real(self, dsts, srcs)

        monkeypatch.setattr(TorchKind, "copy", copy_with_a_failure)
        with caplog.at_level("WARNING", logger="flashckpt"):
            assert ckpt.load(_state(model, opt), step=2) == 2
        assert outcome == [None], outcome
        assert "inside a load" in caplog.text
        assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
        assert 3 not in ckpt.engine.memory_steps()
