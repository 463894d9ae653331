"""Module buffers as DDP broadcasts them: rank 0's values of the last step boundary.

``DistributedDataParallel`` (``broadcast_buffers=True``, its default) broadcasts its module's
buffers from rank 0 at the start of each update's first forward. So what a run goes on from
after step k is rank 0's buffers of k's boundary (BatchNorm's running statistics), not each
rank's own, which k's forward moved with the rank's own batch. A failure capture of step k by
another rank (rank 0 dead, or a node's copy that another local rank writes) would write that
rank's own. :class:`DdpBroadcasts` calls back right after each DDP module's first broadcast
since a step boundary, before the wrapped module's own forward, with the DDP module: the
boundary's copy of its buffers is then taken again, now rank 0's.

The DDP module is found by a global forward pre-hook from the first boundary (and from each
load: the module may be wrapped anew) until its first forward, or for one step where none comes
(one Python call per module forward meanwhile); it gets a forward pre-hook of its own (one call
per forward), which arms a one-shot pre-hook on the wrapped module when the forward broadcasts.
The hooks run outside ``torch.compile``'s graphs (``torch.compiler.disable``: traced, their copy
would be of the rank's own buffers). Not found, so their captures keep the rank's own buffers:
a second DDP module (the first one found ends the search, which spares ``DDP(torch.compile(m))``
a compile for the global hook), a module wrapped anew without a load, one first called after the
step that looked. Under ``torch.compile`` the step that looks may still compile a module called
before the DDP module's forward once more (the global hook is part of its guards).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

__all__ = ["DdpBroadcasts"]


class DdpBroadcasts:
    """Calls ``on_broadcast(ddp)`` after each DDP module's first buffer broadcast since a
    step boundary (see the module docstring); all on the training thread."""

    def __init__(self, on_broadcast: Callable[[Any], None]) -> None:
        self._on_broadcast = on_broadcast
        self._boundaries = 0
        self._looking: Any = None
        """The global forward pre-hook's handle while DDP modules are looked for."""
        self._looked = False
        self._handles: list[Any] = []
        self._armed: Any = None
        """The one-shot hook of a broadcast armed and not yet done (one that raised leaves it)."""
        self._refreshed: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        """DDP module -> the boundary whose broadcast it last called back for."""

    def boundary(self) -> None:
        """A step boundary: the next forward of each DDP module broadcasts the buffers kept."""
        self._boundaries += 1
        if self._looking is not None:  # a whole step was looked through
            self._looking.remove()
            self._looking = None
        elif not self._looked and _distributed():
            from torch.nn.modules.module import register_module_forward_pre_hook

            self._looked = True
            self._looking = register_module_forward_pre_hook(_eager(self._find))

    def forget(self) -> None:
        """A load: look for the DDP modules again at the next boundary."""
        self._looked = False

    def close(self) -> None:
        for handle in [*self._handles, self._looking, self._armed]:
            if handle is not None:
                handle.remove()
        self._handles, self._looking, self._armed = [], None, None

    def _find(self, module: Any, args: Any) -> None:
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(module, DistributedDataParallel) and module not in self._refreshed:
            self._looking.remove()
            self._looking = None
            self._refreshed[module] = 0
            self._handles.append(module.register_forward_pre_hook(_eager(self._forward)))
            self._forward(module, args)  # its own hook runs from its next forward on

    def _forward(self, ddp: Any, args: Any) -> None:
        """A DDP module's forward begins: arm the callback where this is its first since the
        boundary and it broadcasts its buffers before the wrapped module's forward."""
        boundary = self._boundaries
        if self._refreshed.get(ddp) == boundary:
            return
        self._refreshed[ddp] = boundary
        if self._armed is not None:
            self._armed.remove()
            self._armed = None
        broadcasts = getattr(ddp, "_check_sync_bufs_pre_fwd", None)  # torch's own test, where it has one
        if not (broadcasts() if callable(broadcasts) else getattr(ddp, "broadcast_buffers", False)):
            return

        def broadcast_done(module: Any, inner_args: Any) -> None:
            if self._armed is not None:
                self._armed.remove()
                self._armed = None
            if self._boundaries == boundary:  # not a forward after a broadcast that raised
                self._on_broadcast(ddp)

        self._armed = ddp.module.register_forward_pre_hook(_eager(broadcast_done))


def _eager(hook: Callable[..., None]) -> Callable[..., None]:
    """``hook`` run as it is where ``torch.compile`` traces the module calling it."""
    import torch

    return torch.compiler.disable(hook)


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
