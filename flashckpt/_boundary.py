"""What changes outside ``optimizer.step()``, kept as of the last step boundary (issue 42).

A failure capture writes ``state_fn()`` as the last finished step k from whichever thread
comes first, while the main thread may have gone on into step k+1: drawn its batch (the
sampler's position moved), used the RNGs, run its forward (BatchNorm's running statistics
moved). Parameters and optimizer state cannot have moved (a capture during an update writes
nothing), but these can. So at each step boundary (the end of the update: the optimizer's
step post-hook, an adapter's ``update_ends``) :meth:`BoundarySnapshot.take` keeps

- what ``boundary_state()`` returns: the user's partial tree of small state that changes
  outside the update (a sampler's ``state_dict()``, ``flashckpt.rng_state()``), copied;
- the tensors of the tree a capture saves (``state_fn()``'s, or the adapter's tree around it:
  FSDP's local shards) that the optimizer does not own (its parameters and
  their state) and that are the same tensors at each call: module buffers such as
  BatchNorm's statistics, copied into tensors of their own. They are found once, at the
  first boundary (two calls of ``state_fn()``), where the optimizer is a torch one (or the
  adapter gives what its update owns: megatron's wrappers); when
  they hold more than ``max(4 MiB, 1% of what the optimizer owns)`` (frozen parameters, an
  EMA of the weights) none is kept, with a warning. Where an adapter's capture writes the
  module through a save of its own (DeepSpeed's ``save_checkpoint``, the Trainer's save), the
  adapter names the module and its optimizer (:class:`ModuleBuffers`) and these tensors are the
  module's buffers (its state dict's tensors that are no parameter), under the same bound.

:meth:`BoundarySnapshot.apply` lays them over the capture's ``state_fn()`` tree: dicts merge
key by key, any other value is replaced; a module's buffers replace every tensor of the tree
(:meth:`BoundarySnapshot.swap`: also a tree the adapter's own save built) that shares their
bytes. The live tensors are never written: training may go on after an explicit capture.
Trade-offs, plainly: each step pays one call of ``boundary_state()`` and one copy of those
buffers (``benchmarks/capture_overhead.py``); the values are those at the end of
``optimizer.step()``, so state the loop changes after ``step()`` returns and before the
failure (a scheduler's step, an EMA update) is a step behind in a capture when it is in
``boundary_state`` or one of those tensors -- leave it to ``state_fn``. A module buffer
replaced by a new tensor after the first boundary is written as it is. Under DDP, whose
next forward broadcasts rank 0's buffers, the copies of a DDP module's buffers are taken again
right after that broadcast (:mod:`flashckpt._ddp_buffers`): a capture by any rank writes rank
0's, which the run goes on from.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ._ddp_buffers import DdpBroadcasts

__all__ = ["BoundarySnapshot", "ModuleBuffers"]

log = logging.getLogger("flashckpt")

BUFFER_BYTES_FLOOR = 4 << 20
BUFFER_SHARE = 0.01
"""The tensors outside the optimizer are copied at each boundary only when they hold at most
``max(BUFFER_BYTES_FLOOR, BUFFER_SHARE * bytes the optimizer owns)``."""

Path = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class ModuleBuffers:
    """The tensors outside the optimizer of an adapter whose capture writes the module through
    a save of its own: ``module``'s buffers (BatchNorm's statistics; a frozen parameter is none:
    ``forward`` does not change it). ``optimizer`` (wrappers such as accelerate's or DeepSpeed's
    ZeRO optimizers are looked through to the torch one inside) gives the size bound."""

    module: Any
    optimizer: Any


class BoundarySnapshot:
    """The values as of the last step boundary that a capture writes in place of the live
    ones (see the module docstring). ``optimizer``: a torch optimizer (or what has its
    ``param_groups`` and ``state``), or None where the adapter's state is not the optimizer's
    (then only ``boundary_state`` is kept, and ``buffers``' where given)."""

    def __init__(self, state_fn: Callable[[], Any], boundary_state: Callable[[], Any] | None,
                 optimizer: Any, tree: Callable[[Any], Any] | None = None, *,
                 buffers: ModuleBuffers | None = None) -> None:
        """``tree(state)``: the whole tree a capture saves, made from ``state_fn()``'s (an
        adapter's: FSDP's local shards around the ``extra``); ``boundary_state`` overlays
        ``state_fn()``'s tree, the tensors outside the optimizer are looked for in the whole,
        or are ``buffers``' where given."""
        if boundary_state is not None and not callable(boundary_state):
            raise TypeError("boundary_state must be callable (returning the parts of state_fn's tree as of a "
                            f"step boundary), got {type(boundary_state).__name__}")
        self.boundary_state = boundary_state
        self._state_fn, self._optimizer = state_fn, optimizer
        self._tree, self._module = tree, buffers
        self._taken = False
        """A boundary was taken since the start or the last load (:meth:`forget`)."""
        self._given: Any = None
        """``boundary_state()`` of the last boundary, copied."""
        self._buffers: list[tuple[Path, Any, Any]] | None = \
            None if optimizer is not None or buffers is not None else []
        """(path, live tensor, its copy) of the tensors outside the optimizer; None: not found yet."""
        self._spare: list[Any] = []
        """Copies of those tensors that a DDP broadcast is written into (no capture reads them), then
        swapped with ``_buffers``' (see :meth:`_broadcast`)."""
        self._ddp = DdpBroadcasts(self._broadcast)

    def take(self) -> None:
        """At a step boundary, on the thread that ends the update (no capture runs meanwhile)."""
        if self._buffers is None:
            self._find_buffers()
        if self._buffers:
            import torch

            torch._foreach_copy_([copy for _, _, copy in self._buffers], [live for _, live, _ in self._buffers])
            self._ddp.boundary()
        if self.boundary_state is not None:
            self._given = _copied(self.boundary_state())
        self._taken = True

    def forget(self) -> None:
        """A load replaced the live state: what the last boundary kept is of another step."""
        self._taken, self._given = False, None
        self._ddp.forget()

    def close(self) -> None:
        """Remove the forward hooks that watch DDP's broadcasts."""
        self._ddp.close()

    def _broadcast(self, ddp: Any) -> None:
        """DDP broadcast rank 0's buffers of the last boundary into ``ddp``'s module: they are
        what the run goes on from, kept in place of this rank's own (the same for rank 0). Written
        into the spare copies, which then take the place of the ones a capture may be reading."""
        import torch

        current = self._buffers
        if not current:
            return
        broadcast = {_key(b) for b in ddp.module.buffers()} - {None}
        with torch.inference_mode(False), torch.no_grad():  # a validation forward's: still copies to write later
            if len(self._spare) != len(current):
                self._spare = [copy.clone() for _, _, copy in current]
            torch._foreach_copy_(self._spare, [live if _key(live) in broadcast else copy for _, live, copy in current])
        self._buffers = [(path, live, spare) for (path, live, _), spare in zip(current, self._spare)]
        self._spare = [copy for _, _, copy in current]

    def apply(self, state: Any) -> Any:
        """The whole tree of ``state`` (a fresh ``state_fn()``) with the values of the last
        boundary in place of the live ones (as it is where no boundary came since the start
        or the last load); the containers on their paths are copied, the caller's left as
        they are."""
        if self._taken and self._given is not None:
            state = _overlay(state, self._given)
        tree = self._whole(state)
        if not self._taken:
            return tree
        if self._module is not None:
            return self.swap(tree)
        replaced = []
        given = {id(t) for _, t in _tensors(self._given, ())}  # boundary_state's copies stay
        for path, live, copy in self._buffers or ():
            now = _get(tree, path)
            if now is not None and _same_tensor(now, live):
                tree = _put(tree, path, copy)
            elif id(now) not in given:
                replaced.append("/" + "/".join(map(str, path)))
        if replaced:
            log.warning("failure capture: %s no longer the tensor(s) found at the first step boundary; written as "
                        "they are now (possibly changed since the step's end)", ", ".join(replaced[:5]))
        return tree

    def swap(self, tree: Any) -> Any:
        """``tree`` with each tensor that shares the bytes of one of the module's buffers (the
        same shape and dtype) replaced by its copy of the last boundary; the containers on the
        way copied. As it is where no boundary came since the start or the last load, or
        without :class:`ModuleBuffers`. For a tree an adapter's own save built during the
        capture (DeepSpeed's files), beside :meth:`apply`."""
        if not self._taken or not self._buffers or self._module is None:
            return tree
        kept = {_key(live): copy for _, live, copy in self._buffers}
        kept.pop(None, None)
        found = set()
        for path, t in list(_tensors(tree, ())):
            key = _key(t)
            if key in kept:
                tree = _put(tree, path, kept[key])
                found.add(key)
        if len(found) < len(kept):
            log.warning("failure capture: %d of the module's %d buffer(s) are not in the tree the capture writes (the "
                        "adapter's save copied them?): written as they are now (possibly changed since the step's end)",
                        len(kept) - len(found), len(kept))
        return tree

    def _whole(self, state: Any) -> Any:
        return state if self._tree is None else self._tree(state)

    def _find_buffers(self) -> None:
        """The tensors of the whole tree that the optimizer does not own, or the module's
        buffers, with a copy each."""
        if self._module is not None:
            optimizer = _torch_optimizer(self._module.optimizer)
            self._keep(_module_buffers(self._module.module),
                       _optimizer_storages(optimizer)[1] if optimizer is not None else 0,
                       "the module's {n} buffer(s) hold {mib:.1f} MiB (an EMA of the weights?)", "")
            return
        try:  # twice: a tensor made anew by each call (a value computed from others) is no buffer
            tree, again = self._whole(self._state_fn()), self._whole(self._state_fn())
        except Exception as exc:  # the first save's check says it; found at a later boundary
            log.debug("step boundary: state_fn() raised %s; its buffers are looked for at the next one", exc)
            return
        owned, owned_bytes = _optimizer_storages(self._optimizer)
        owned.add(None)  # a tensor whose storage cannot be read is left as it is
        outside = [(path, t) for path, t in _tensors(tree, ())
                   if _storage(t) not in owned and t.numel() and _same_tensor(_get(again, path), t)]
        self._keep(outside, owned_bytes, "the {n} tensor(s) of state_fn()'s tree outside the optimizer hold "
                   "{mib:.1f} MiB (frozen parameters?)", " (give the buffers forward changes in boundary_state)")

    def _keep(self, outside: list[tuple[Path, Any]], owned_bytes: int, what: str, advice: str) -> None:
        """A copy of each of ``outside``, where they fit the bound (see the module docstring);
        ``what``: a format of ``n`` and ``mib`` naming them in the warning."""
        size = sum(t.nelement() * t.element_size() for _, t in outside)
        limit = max(BUFFER_BYTES_FLOOR, BUFFER_SHARE * owned_bytes)
        if size > limit:
            log.warning("failure capture: %s, more than the %.1f MiB copied at each step boundary: none is; a capture "
                        "writes them as they are at the failure%s", what.format(n=len(outside), mib=size / 2**20),
                        limit / 2**20, advice)
            self._buffers = []
            return
        self._buffers = [(path, t, t.detach().clone()) for path, t in outside]
        if outside:
            log.info("failure capture: %d tensor(s) outside the optimizer (%.1f KiB, module buffers) are copied at "
                     "each step boundary", len(outside), size / 1024)


def _local(t: Any) -> Any:
    """``t``, or a DTensor's local shard."""
    return t.to_local() if callable(getattr(t, "to_local", None)) else t


def _storage(t: Any) -> int | None:
    """Where ``t``'s bytes live; None where that cannot be read (a tensor subclass without storage)."""
    try:
        return _local(t).untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _same_tensor(a: Any, b: Any) -> bool:
    """``a`` is ``b`` or a view of the same bytes alike (``state_dict()`` detaches anew each call)."""
    import torch

    if not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    try:
        return a is b or _local(a).data_ptr() == _local(b).data_ptr()
    except (RuntimeError, NotImplementedError):
        return False


def _key(t: Any) -> tuple[Any, ...] | None:
    """Where ``t``'s bytes start, its shape, dtype and device: equal for ``t`` and its views alike;
    None where its bytes cannot be read."""
    try:
        return _local(t).data_ptr(), tuple(t.shape), t.dtype, t.device
    except (RuntimeError, NotImplementedError):
        return None


def _module_buffers(module: Any) -> list[tuple[Path, Any]]:
    """The tensors of ``module``'s state dict that are no parameter, by name (non-persistent
    buffers are in no saved tree; state dict hooks and extra state are the module's)."""
    import torch

    params = {id(p) for p in module.parameters()}
    return [((name,), t) for name, t in module.state_dict(keep_vars=True).items()
            if isinstance(t, torch.Tensor) and id(t) not in params and t.numel()]


def _torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside wrappers (accelerate's, DeepSpeed's ZeRO optimizers), or None."""
    seen: set[int] = set()
    while getattr(optimizer, "optimizer", None) is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        optimizer = optimizer.optimizer
    return optimizer if hasattr(optimizer, "param_groups") and hasattr(optimizer, "state") else None


def _optimizer_storages(optimizer: Any) -> tuple[set[int], int]:
    """The storages of the optimizer's parameters and state tensors, and their bytes."""
    import torch

    tensors = [p for group in optimizer.param_groups for p in group["params"]]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return {_storage(t) for t in tensors}, sum(t.nelement() * t.element_size() for t in tensors)


def _tensors(node: Any, path: Path) -> Iterator[tuple[Path, Any]]:
    import torch

    if isinstance(node, torch.Tensor):
        yield path, node
    elif isinstance(node, dict):
        for key, child in node.items():
            yield from _tensors(child, path + (key,))
    elif isinstance(node, (list, tuple)):
        for i, child in enumerate(node):
            yield from _tensors(child, path + (i,))


def _copied(node: Any) -> Any:
    """``node`` with its dicts and lists rebuilt and its tensors and arrays copied; tuples
    and other values as they are (immutable, or the caller's to give fresh)."""
    kind = type(node)
    if kind in _KEPT:
        return node
    if isinstance(node, dict):
        return {key: _copied(child) for key, child in node.items()}
    if kind is list:
        return [_copied(child) for child in node]
    torch, numpy = sys.modules.get("torch"), sys.modules.get("numpy")
    if torch is not None and isinstance(node, torch.Tensor):
        return node.detach().clone()
    if numpy is not None and isinstance(node, numpy.ndarray):
        return node.copy()
    return node


_KEPT = (int, float, str, bool, type(None), tuple, bytes)


def _get(tree: Any, path: Path) -> Any:
    for key in path:
        try:
            tree = tree[key]
        except (KeyError, IndexError, TypeError):
            return None
    return tree


def _put(tree: Any, path: Path, value: Any) -> Any:
    """``tree`` with ``value`` at ``path``, its containers on the path copied."""
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(tree, dict):
        out = dict(tree)
        out[key] = _put(tree[key], rest, value)
        return out
    items = list(tree)
    items[key] = _put(items[key], rest, value)
    return type(tree)(items) if isinstance(tree, tuple) else items


def _overlay(tree: Any, given: Any) -> Any:
    """``given`` laid over ``tree``: dicts merge key by key, anything else replaces."""
    if isinstance(tree, dict) and isinstance(given, dict):
        out = dict(tree)
        for key, value in given.items():
            out[key] = _overlay(tree[key], value) if key in tree else value
        return out
    return given
