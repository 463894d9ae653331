"""Ending a worker process once its work is done and checked."""

import os
import sys


def exit_now(code: int = 0) -> None:
    """Flush stdio and end the process without interpreter finalization.

    With torch 2.13, a gloo group that ``torch.distributed.nn.functional`` pinned (it binds
    the default group into default arguments when first imported after the group formed,
    which ``torch._dynamo`` does, and an optimizer imports dynamo) outlives
    ``destroy_process_group`` and is torn down during finalization, where it aborted a
    worker that had finished cleanly ("terminate called without an active exception") in
    one CI run of these tests; DeepSpeed's groups (``deepspeed.utils.groups._WORLD_GROUP``)
    outlive it too, and a restarted DeepSpeed worker aborted the same way at its exit
    (4.4 s after its start, as long as the whole restarted run takes) in another.
    Freeing the group earlier is worse: its destructor joins gloo's threads while holding
    the GIL they may need, a hang. Every file the worker wrote is closed before this is
    called; nothing else is lost by skipping finalization."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
