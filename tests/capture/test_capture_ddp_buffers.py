"""Module buffers under DDP: a capture writes rank 0's of the step boundary on every rank.

DDP broadcasts rank 0's buffers (BatchNorm's running statistics) at each update's first
forward, so those are what a run goes on from; a capture by another rank after that forward
writes them, not its own (``flashckpt._ddp_buffers``). Also under ``torch.compile`` of the DDP
module (its hooks traced would copy the rank's own), and where the first forward after a
boundary is a validation one under ``torch.inference_mode`` (copies made there could not be
written at the next boundary: training failed there).
"""

import torch

from tests._fork import run_ranks

from ._broadcast_ranks import WAYS, broadcast_ranks


def test_a_capture_after_ddps_broadcast_writes_rank_0s_buffers_on_every_rank():
    ranks = run_ranks(broadcast_ranks, 2, timeout=240)
    for way in WAYS:
        own, rank0 = ranks[1][way]["boundary"], ranks[0][way]["boundary"]
        assert not torch.equal(own, rank0), way  # the ranks' own statistics differ: the test can tell
        assert torch.equal(ranks[0][way]["captured"], rank0), way
        assert torch.equal(ranks[1][way]["captured"], rank0), way
