"""Flattening a nested training state into tensors plus a JSON skeleton, and back.

A state is any nesting of dict / list / tuple whose leaves are tensors (of a
registered :class:`TensorKind`) or plain values (int, float, str, bool, None). The
skeleton keeps the structure and the plain values; tensors become named entries of
the safetensors body. Loading walks the caller's state and the skeleton together and
fills the caller's tensors in place.
"""

from __future__ import annotations

import base64
import gc
import pickle
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator, Protocol

from .._errors import CheckpointError, StateMismatchError

__all__ = ["TensorKind", "Leaf", "Flat", "Merge", "Places", "flatten", "gc_paused", "merge_into", "register_kind"]

PLAIN_TYPES = (int, float, str, bool, type(None))
KEY_TYPES = (str, int, float, bool, type(None))


SHOWN = 20
"""How many lines (and key names per line) a mismatch error shows before "... and N more"."""


class TensorKind(Protocol):
    """How the engine handles one framework's tensors (torch, numpy, ...)."""

    name: str

    def matches(self, obj: Any) -> bool: ...

    def describe(self, obj: Any) -> tuple[str, tuple[int, ...]]:
        """Safetensors dtype name and shape."""

    def identity(self, obj: Any) -> Hashable | None:
        """A key equal for two objects that are views of the same bytes, else None."""

    def empty(self, dtype: str, shape: tuple[int, ...]) -> Any:
        """A new host tensor to load into (for entries the caller's state lacks)."""

    # Optional: ``page_locker(objs) -> PageLocker | None`` -- for kinds whose tensors may
    # live on an accelerator, what page-locks the shared memory their copies go through
    # (see :class:`flashckpt.memory._slot.PageLocker`).


_kinds: list[TensorKind] = []
_kind_by_type: dict[type, TensorKind | None] = {}


def register_kind(kind: TensorKind) -> None:
    if all(k.name != kind.name for k in _kinds):
        _kinds.append(kind)
        _kind_by_type.clear()


def kind_of(obj: Any) -> TensorKind | None:
    cls = type(obj)
    try:
        return _kind_by_type[cls]
    except KeyError:
        kind = _kind_by_type[cls] = next((k for k in _kinds if k.matches(obj)), None)
        return kind


def kind_named(name: str) -> TensorKind:
    for kind in _kinds:
        if kind.name == name:
            return kind
    raise CheckpointError(f"checkpoint holds {name!r} tensors but that framework is not loaded")


@dataclass(slots=True)
class Leaf:
    """One tensor entry of a flattened state."""

    name: str
    obj: Any
    kind: TensorKind
    dtype: str
    shape: tuple[int, ...]


@dataclass(slots=True)
class Flat:
    skeleton: Any
    leaves: list[Leaf]


def _escape(part: Any) -> str:
    return str(part).replace("~", "~0").replace("/", "~1")


def flatten(state: Any, *, allow_pickle: bool = False) -> Flat:
    """Split ``state`` into a JSON skeleton and its tensor leaves (deduplicated views)."""
    leaves: list[Leaf] = []
    names: set[str] = {"__metadata__"}  # the safetensors header's own key: no tensor may be named so
    seen: dict[Hashable, str] = {}

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, bool) or type(obj) in PLAIN_TYPES:
            return {"v": obj}
        kind = kind_of(obj)
        if kind is not None:
            key = kind.identity(obj)
            if key is not None and key in seen:
                return {"t": seen[key], "k": kind.name}
            name = path or "_"
            while name in names:
                name += "#"
            names.add(name)
            if key is not None:
                seen[key] = name
            dtype, shape = kind.describe(obj)
            leaves.append(Leaf(name, obj, kind, dtype, shape))
            return {"t": name, "k": kind.name}
        if type(obj) is tuple or type(obj) is list:
            items = [walk(v, _child(path, i)) for i, v in enumerate(obj)]
            return {"u" if type(obj) is tuple else "l": items}
        if isinstance(obj, dict) and all(type(k) in KEY_TYPES for k in obj):
            return {"d": [[k, walk(v, _child(path, _escape(k)))]
                          for k, v in obj.items()]}
        if not allow_pickle:
            raise CheckpointError(
                f"state entry {path or '<root>'!r} is a {type(obj).__qualname__}, which is neither "
                "a tensor nor a plain value (int, float, str, bool, None, dict, list, tuple); "
                "pass allow_pickle=True to store it pickled")
        try:
            blob = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise CheckpointError(f"state entry {path!r} ({type(obj).__qualname__}) cannot be pickled: {exc}") from exc
        return {"p": base64.b64encode(blob).decode("ascii")}

    if not isinstance(state, (dict, list)):
        raise CheckpointError(f"a state must be a dict or list, got {type(state).__qualname__}")
    return Flat(walk(state, ""), leaves)


def _holds_tensors(node: Any) -> bool:
    if "t" in node:
        return True
    if "d" in node:
        return any(_holds_tensors(child) for _, child in node["d"])
    return any(_holds_tensors(child) for child in node.get("l", node.get("u", ())))


def _obj_holds_tensors(obj: Any) -> bool:
    if isinstance(obj, dict):
        return any(_obj_holds_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_obj_holds_tensors(v) for v in obj)
    return kind_of(obj) is not None


@dataclass(slots=True)
class Merge:
    """What loading a checkpoint into a state takes: tensors to fill, then plain writes."""

    fills: list[tuple[str, Any]]
    """(entry name, the caller's tensor, or a new one where its container was empty)."""
    writes: list[Callable[[], None]]

    def apply_plain(self) -> None:
        """Write the plain values (and new containers) into the state; call after the fills."""
        for write in self.writes:
            write()


Places = Callable[[str], Any]
"""Tree path (keys and indices joined by ``/`` as they are: ``"a/0/b"``) -> a tensor the
caller offers to receive that leaf, or None."""


def merge_into(state: Any, skeleton: Any, entries: dict[str, tuple[str, tuple[int, ...]]],
               *, allow_pickle: bool, places: Places | None = None) -> Merge:
    """Match ``state`` against the checkpoint described by ``skeleton``.

    Returns the tensors to fill in place and the plain values to write. Every mismatch
    (keys, shapes, dtypes, kinds) is collected and raised together as
    :class:`StateMismatchError` before anything is modified: keys on one side only, shape
    and dtype changes of the keys both sides share, all in one message (the first
    ``SHOWN`` lines, then a count; the first line counts each kind). An empty dict in the state
    where the checkpoint has entries (an optimizer before its first step) is filled, and
    a subtree without tensors on either side (a sampler's state) is replaced whole.

    A tensor the state has no place for is new, unless ``places`` offers one for its path
    of the same kind, dtype and shape, that no other entry takes (memory a process touched
    already fills several times faster than fresh pages).
    """
    problems: list[str] = []
    counts: dict[str, int] = {}

    def count(what: str, n: int = 1) -> None:
        counts[what] = counts.get(what, 0) + n

    plain_writes: list[Callable[[], None]] = []
    fills: list[tuple[str, Any]] = []

    def build(node: Any, path: str) -> Any:
        """A fresh object for a checkpoint node the caller's state has no place for."""
        if "v" in node:
            return node["v"]
        if "p" in node:
            return unpickle(node, path)
        if "t" in node:
            dtype, shape = entries[node["t"]]
            obj = offered(node, path, dtype, shape)
            if obj is None:
                obj = kind_named(node["k"]).empty(dtype, shape)
            fills.append((node["t"], obj))
            return obj
        if "d" in node:
            return {k: build(v, _child(path, k)) for k, v in node["d"]}
        items = [build(v, _child(path, i)) for i, v in enumerate(node.get("l", node.get("u")))]
        return tuple(items) if "u" in node else items

    taken: dict[Hashable, str] = {}

    def offered(node: Any, path: str, dtype: str, shape: tuple[int, ...]) -> Any:
        """The tensor ``places`` offers for ``path`` if it can take exactly this entry."""
        obj = places(path) if places is not None else None
        kind = kind_of(obj) if obj is not None else None
        if kind is None or kind.name != node["k"] or kind.describe(obj) != (dtype, shape):
            return None
        key = kind.identity(obj)
        if key is None or taken.setdefault(key, node["t"]) != node["t"]:
            return None  # a view shared with another entry would be written twice
        return obj

    def unpickle(node: Any, path: str) -> Any:
        if not allow_pickle:
            raise CheckpointError(f"checkpoint entry {path!r} is pickled; pass allow_pickle=True "
                                  "to load it (only for checkpoints you trust)")
        return pickle.loads(base64.b64decode(node["p"]))

    def walk(obj: Any, node: Any, path: str) -> Any:
        where = path or "<root>"
        if path and not _holds_tensors(node) and not _obj_holds_tensors(obj):
            return build(node, path)  # plain data (a sampler's state, say) is replaced whole
        if "t" in node:
            kind = kind_of(obj)
            if kind is None:
                count("other")
                problems.append(f"{where}: checkpoint has a tensor, state has {type(obj).__qualname__}")
                return obj
            if kind.name != node["k"]:
                count("other")
                problems.append(f"{where}: checkpoint has a {node['k']} tensor, state a {kind.name} one")
                return obj
            dtype, shape = kind.describe(obj)
            want_dtype, want_shape = entries[node["t"]]
            if (dtype, shape) != (want_dtype, want_shape):
                if shape != want_shape:
                    count("shape")
                if dtype != want_dtype:
                    count("dtype")
                problems.append(f"{where}: checkpoint has {want_dtype}{list(want_shape)}, "
                                f"state has {dtype}{list(shape)}")
            fills.append((node["t"], obj))
            return obj
        if "v" in node or "p" in node:
            if kind_of(obj) is not None:
                count("other")
                problems.append(f"{where}: checkpoint has a plain value, state has a tensor")
                return obj
            return build(node, path)
        if "d" in node:
            if not isinstance(obj, dict):
                count("other")
                problems.append(f"{where}: checkpoint has a dict, state has {type(obj).__qualname__}")
                return obj
            if not obj and node["d"]:  # an empty container is a place to fill (Adam before step 1)
                new = build(node, path)
                plain_writes.append(lambda: obj.update(new))
                return obj
            keys = {k for k, _ in node["d"]}
            missing = [k for k, _ in node["d"] if k not in obj]
            extra = [k for k in obj if k not in keys]
            if missing or extra:
                count("missing", len(missing))
                count("unexpected", len(extra))
                problems.append(f"{where}: keys differ; only in checkpoint: {_some(missing)}, "
                                f"only in state: {_some(extra)}")
            for k, child in node["d"]:
                if k not in obj:
                    continue
                new = walk(obj[k], child, _child(path, k))
                if new is not obj[k]:
                    plain_writes.append(lambda o=obj, k=k, v=new: o.__setitem__(k, v))
            return obj
        items = node.get("l", node.get("u"))
        if not isinstance(obj, (list, tuple)) or len(obj) != len(items):
            got = f"{type(obj).__qualname__} of {len(obj)}" if isinstance(obj, (list, tuple)) else type(obj).__qualname__
            count("other")
            problems.append(f"{where}: checkpoint has a sequence of {len(items)}, state has {got}")
            return obj
        new_items = [walk(o, child, _child(path, i)) for i, (o, child) in enumerate(zip(obj, items))]
        if isinstance(obj, tuple):
            return obj if all(a is b for a, b in zip(obj, new_items)) else tuple(new_items)
        for i, (old, new) in enumerate(zip(obj, new_items)):
            if new is not old:
                plain_writes.append(lambda o=obj, i=i, v=new: o.__setitem__(i, v))
        return obj

    walk(state, skeleton, "")
    if problems:
        raise StateMismatchError(_mismatch_message(problems, counts))
    return Merge(fills, plain_writes)


def _child(path: str, key: Any) -> str:
    """The tree path of ``key`` under ``path`` (what messages name and :data:`Places` is asked for)."""
    return f"{path}/{key}" if path else str(key)


def _some(keys: list[Any]) -> str:
    """``keys`` as a list, the first :data:`SHOWN` of them, then how many more."""
    more = f" ... and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
    return f"{keys[:SHOWN]}{more}"


_KINDS = {  # what a mismatch error counts: (one, many)
    "missing": ("key only in the checkpoint", "keys only in the checkpoint"),
    "unexpected": ("key only in the state", "keys only in the state"),
    "shape": ("shape change", "shape changes"),
    "dtype": ("dtype change", "dtype changes"),
    "other": ("other difference", "other differences"),
}


def _mismatch_message(problems: list[str], counts: dict[str, int]) -> str:
    """One message for every difference: a count of each kind, then the first lines."""
    summary = ", ".join(f"{counts[what]} {one if counts[what] == 1 else many}"
                        for what, (one, many) in _KINDS.items() if counts.get(what))
    shown = "\n  ".join(problems[:SHOWN])
    more = f"\n  ... and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
    return f"checkpoint does not match the state ({summary}):\n  {shown}{more}"


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for a save: flattening a state allocates
    thousands of short-lived containers (the skeleton), enough to set off several
    collections, each of which walks every object of a process that has torch loaded
    (milliseconds each, 40% of a save of 800 small tensors). What a save allocates is
    freed by reference counting; nothing waits for the collector."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
