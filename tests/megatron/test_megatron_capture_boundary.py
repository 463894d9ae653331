"""The step boundary of a megatron-core optimizer wrapper (``flashckpt.megatron._capture``),
one process, no megatron: a capture inside ``step`` but before ``step_with_ready_grads``
(gradient preparation and clipping, with their all-reduces) writes the last finished step;
one inside ``step_with_ready_grads`` (the torch step, the copy into the model) writes
nothing; a step that skipped its update (inf/NaN) still counts; ``remove`` restores both."""

from __future__ import annotations

from flashckpt._capture import FailureCapture
from flashckpt.megatron._capture import StepBoundary


class _Wrapper:
    """The shape of megatron's ``MegatronOptimizer.step``: prepare, maybe skip, update."""

    def __init__(self) -> None:
        self.during_prepare = self.during_update = lambda: None
        self.skip = False

    def step(self):
        self.during_prepare()
        if self.skip:
            return False, None, None
        return self.step_with_ready_grads(), None, None

    def step_with_ready_grads(self) -> bool:
        self.during_update()
        return True


def test_the_update_is_step_with_ready_grads_and_every_step_counts():
    saved: list[int] = []
    capture = FailureCapture(lambda: {}, None, save=lambda step, state: saved.append(step), last_load=lambda: None)
    opt = _Wrapper()
    boundary = StepBoundary(opt, capture)
    opt.step(), opt.step()
    assert capture.current_step == 2
    opt.skip = True
    opt.step()  # an update skipped for inf/NaN gradients is still a step (as Megatron-LM counts it)
    assert capture.current_step == 3
    opt.skip = False
    got: list = []
    opt.during_update = lambda: got.append(capture.capture("inside the update"))
    opt.step()  # raises nothing: the capture says None and the step goes on
    assert got == [None] and saved == []
    assert capture.current_step == 4
    boundary.remove()
    assert "step" not in vars(opt) and "step_with_ready_grads" not in vars(opt)


def test_a_capture_while_gradients_are_prepared_writes_the_last_finished_step():
    saved: list[int] = []
    capture = FailureCapture(lambda: {}, None, save=lambda step, state: saved.append(step), last_load=lambda: None)
    opt = _Wrapper()
    StepBoundary(opt, capture)
    opt.step(), opt.step()
    got: list = []
    opt.during_prepare = lambda: got.append(capture.capture("blocked in the gradients' all-reduce"))
    opt.step()
    assert got == [2] and saved == [2]
