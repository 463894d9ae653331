"""Overlapped saves for torch: which tensors the optimizer owns, and its step waiting for the copy.

``save(step, state, overlap=True)`` copies the tensors that ``forward`` may change (BatchNorm
running statistics, other buffers, anything that is no parameter of the optimizer and not in
its state) before it returns, and leaves the optimizer's own tensors to the copy threads. The
optimizer's step pre-hook (:func:`flashckpt._step_hooks.hook_steps`) waits for that copy, so
parameters and moments never change under it. Ownership is by storage: a ``state_dict()``
tensor is a view of the parameter's storage, whatever its name.

Trade-off, plainly: the copy competes with forward and backward for memory bandwidth and
cores; it pays where a step's compute outlasts the copy. A tensor the optimizer owns but the
script changes outside ``optimizer.step()`` (an EMA written into a parameter between the
save and the next step) must wait for the copy first (``handle.wait_copy()``).
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Iterable

import torch

from .._step_hooks import check_optimizer, hook_steps

__all__ = ["StepWaits", "owned_storages"]


def _storage_key(t: torch.Tensor) -> Hashable | None:
    """The tensor's storage (device and address), or None for one without memory of its own."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a functional wrapper, a meta tensor
        return None
    return None if ptr == 0 else (t.device, ptr)


def owned_storages(optimizers: Iterable[Any]) -> set[Hashable]:
    """The storages of every parameter and state tensor of ``optimizers``: what only their
    ``step()`` changes."""
    owned: set[Hashable] = set()
    for optimizer in optimizers:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        # a parameter's state is a dict of tensors and values (a tensor nested deeper counts as
        # not owned: it is copied before save returns, which is safe)
        state = [v for per in optimizer.state.values() if isinstance(per, dict) for v in per.values()]
        for t in params + [v for v in state if isinstance(v, torch.Tensor)]:
            key = _storage_key(t)
            if key is not None:
                owned.add(key)
    return owned


class StepWaits:
    """The optimizers whose ``step()`` first calls ``finish_copy()`` (hooked once each)."""

    def __init__(self, finish_copy: Callable[[], None]) -> None:
        self._finish_copy = finish_copy
        self._hooked: dict[int, tuple[Any, list[Any]]] = {}

    def __bool__(self) -> bool:
        return bool(self._hooked)

    def add(self, optimizer: Any) -> None:
        """Hook ``optimizer`` (or each of a list or tuple of them), unless it is already."""
        for one in optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]:
            check_optimizer(one)
            if id(one) not in self._hooked:
                self._hooked[id(one)] = (one, hook_steps(one, self._finish_copy))

    def deferred(self) -> Callable[[Any], bool]:
        """Whether a leaf of the state may be copied after ``save`` returns: a tensor whose
        storage one of the optimizers owns (taken now: an optimizer's state appears at its
        first step)."""
        owned = owned_storages(optimizer for optimizer, _ in self._hooked.values())
        return lambda obj: isinstance(obj, torch.Tensor) and _storage_key(obj) in owned

    def close(self) -> None:
        """Remove the hooks."""
        for _, handles in self._hooked.values():
            for handle in handles:
                handle.remove()
        self._hooked.clear()
