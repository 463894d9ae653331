"""The optimizer's step as a boundary: calls before and after every ``optimizer.step()``.

Parameters and optimizer state change only inside ``optimizer.step()`` (torch's
``register_step_pre_hook`` / ``register_step_post_hook``). Failure capture
(:mod:`flashckpt._capture`) learns from them whether an update is in progress; an overlapped
save (:mod:`flashckpt.torch._overlap`) makes the update wait for its copy.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["check_optimizer", "hook_steps"]


def check_optimizer(optimizer: Any) -> None:
    """A TypeError naming what is missing unless ``optimizer`` has torch's step hooks."""
    for name in ("register_step_pre_hook", "register_step_post_hook"):
        if not callable(getattr(optimizer, name, None)):
            raise TypeError(f"optimizer {type(optimizer).__qualname__} has no {name}() "
                            "(a torch.optim.Optimizer has)")


def hook_steps(optimizer: Any, pre: Callable[[], None], post: Callable[[], None] | None = None) -> list[Any]:
    """Call ``pre()`` before and ``post()`` after each ``optimizer.step()``; returns the
    handles (``.remove()`` each to stop). A ``pre`` that raises fails the step before any
    update."""
    check_optimizer(optimizer)
    handles = [optimizer.register_step_pre_hook(lambda *_: pre())]
    if post is not None:
        handles.append(optimizer.register_step_post_hook(lambda *_: post()))
    return handles
