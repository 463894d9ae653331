"""The two-rank capture tests' training: save step 2, then three updates."""

from __future__ import annotations

from typing import Any


def train_to_5(ckpt: Any, model: Any, opt: Any) -> Any:
    """Arm ``ckpt``'s failure capture, save step 2 (persisted) and make three updates:
    step 5 is the last finished one. Returns the capture."""
    import torch

    capture = ckpt.save_on_failure(lambda: {"model": model.state_dict(), "optim": opt.state_dict()}, optimizer=opt)
    ckpt.save(2, {"model": model.state_dict(), "optim": opt.state_dict()}, persist=True)
    ckpt.wait()
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
    return capture
