"""Worker of ``test_capture_ddp_buffers.py`` (importable by forked ranks)."""

from __future__ import annotations

import torch

WAYS = ("plain", "compiled", "inference first")


def broadcast_ranks(rank: int, world: int) -> dict:
    """For each of :data:`WAYS`, a ``DDP`` of a BatchNorm model (``torch.compile(ddp,
    backend="eager")``, or a validation forward under ``torch.inference_mode`` first after
    step 1) under a ``FailureCapture``: two steps on the rank's own batches, then step 3's
    forward, whose DDP broadcast gives every rank rank 0's statistics of step 2. Per way: the
    rank's own running mean at step 2's boundary and the one a capture writes then."""
    from torch.nn.parallel import DistributedDataParallel

    import flashckpt._capture as capture

    got = {}
    for way in WAYS:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        ddp = DistributedDataParallel(model)
        net = torch.compile(ddp, backend="eager") if way == "compiled" else ddp
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        failure = capture.FailureCapture(lambda: {"model": model.state_dict()}, optimizer,
                                         save=lambda step, state: None, last_load=lambda: None)
        boundary = None
        for step in (1, 2, 3):
            if step == 2 and way == "inference first":
                ddp.eval()
                with torch.inference_mode():
                    net(torch.randn(8, 4))
                ddp.train()
            batch = torch.randn(8, 4, generator=torch.Generator().manual_seed(100 * rank + step))
            optimizer.zero_grad()
            net(batch).square().mean().backward()
            if step < 3:
                optimizer.step()
                boundary = model[1].running_mean.clone()
        captured = failure._boundary.apply({"model": model.state_dict()})["model"]["1.running_mean"]
        got[way] = {"boundary": boundary, "captured": captured.clone()}
        failure.close()
    return got
