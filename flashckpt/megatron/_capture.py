"""The step boundary of a megatron-core optimizer, for failure capture (``flashckpt._capture``).

megatron-core's optimizers (``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``,
``ChainedOptimizer``) are no ``torch.optim.Optimizer``: they have no step hooks. The
torch optimizers inside them do, but their step is not the whole update: the fp16/bf16
optimizer copies its fp32 main parameters into the model after it, and a chained
optimizer steps several of them. So the boundary is the wrapper's own: the update begins
when its ``step_with_ready_grads`` is entered (before it, ``step`` only prepares, checks and
clips gradients, which a capture does not save) and ends when ``step`` returns (also where
it skipped the update for an inf/NaN gradient: the step still counts, as in Megatron-LM).
Both are wrapped on the instance. The distributed optimizer is refused: its sharded state
dict is gathered over the data-parallel group (a collective, which a capture cannot make
while a peer is dead or blocked), and its state lives in flat buffers. What the update owns
(:class:`UpdateTensors`) is left out when the tensors outside it (module buffers) are looked
for in a capture's tree (``flashckpt._boundary``).
"""

from __future__ import annotations

from typing import Any

from .._capture import FailureCapture
from .._errors import CheckpointError

__all__ = ["StepBoundary", "UpdateTensors", "check_capturable", "is_megatron_optimizer"]


def is_megatron_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is one of megatron-core's optimizer wrappers."""
    from megatron.core.optimizer import MegatronOptimizer

    return isinstance(optimizer, MegatronOptimizer)


def _chain_members(optimizer: Any) -> list[Any]:
    """The optimizers a ``ChainedOptimizer`` chains, or ``optimizer`` alone."""
    return getattr(optimizer, "chained_optimizers", None) or [optimizer]


def check_capturable(optimizer: Any) -> None:
    """A :class:`~flashckpt.CheckpointError` where ``optimizer`` is or chains the
    distributed optimizer (see the module docstring)."""
    from megatron.core.optimizer import DistributedOptimizer

    for member in _chain_members(optimizer):
        if isinstance(member, DistributedOptimizer):
            raise CheckpointError(
                "save_on_failure: megatron-core's DistributedOptimizer has no failure capture: its sharded state "
                "dict is gathered over the data-parallel group (a collective, which a capture cannot make while a "
                "peer is dead or blocked in another one); use it without failure capture, or the plain "
                "(non-distributed) optimizer")


class StepBoundary:
    """``capture``'s update is the megatron optimizer's ``step_with_ready_grads`` through
    the end of its ``step`` (see the module docstring); :meth:`remove` restores both."""

    def __init__(self, optimizer: Any, capture: FailureCapture) -> None:
        stock_step, stock_update = optimizer.step, optimizer.step_with_ready_grads

        def step(*args: Any, **kwargs: Any) -> Any:
            result = stock_step(*args, **kwargs)
            capture.update_ends()  # not reached when the step raised: nothing is captured then
            return result

        def step_with_ready_grads(*args: Any, **kwargs: Any) -> Any:
            capture.update_begins()  # waits while a capture copies
            return stock_update(*args, **kwargs)

        optimizer.step, optimizer.step_with_ready_grads = step, step_with_ready_grads
        self._optimizer, self._wrappers = optimizer, {"step": step, "step_with_ready_grads": step_with_ready_grads}

    def remove(self) -> None:
        """The class's methods again, where the wrappers are still the instance's."""
        attributes = vars(self._optimizer)
        for name, wrapper in self._wrappers.items():
            if attributes.get(name) is wrapper:
                del attributes[name]
        self._wrappers = {}


class UpdateTensors:
    """What a megatron optimizer wrapper's update writes, shaped as a torch optimizer's
    ``param_groups`` and ``state`` (read at the first step boundary): each member's torch
    optimizer's parameters and state, and the fp16/bf16 model parameters the main ones are
    copied into (``float16_groups``)."""

    def __init__(self, optimizer: Any) -> None:
        self._members = _chain_members(optimizer)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        groups = [group for member in self._members for group in member.optimizer.param_groups]
        return groups + [{"params": list(params)} for member in self._members
                         for params in getattr(member, "float16_groups", ())]

    @property
    def state(self) -> dict[Any, Any]:
        return {param: state for member in self._members for param, state in member.optimizer.state.items()}
