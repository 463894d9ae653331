"""The process's RNG states as a tree ``save`` takes, and back.

``rng_state()`` gives torch's CPU generator (a uint8 tensor), every CUDA device's where CUDA
is initialised, Python's ``random`` and numpy's global generator where numpy is imported
(Python's as its tuple of ints, a plain value; numpy's key array as an int64 tensor: each cheap
to keep at every step boundary).
``set_rng_state(state)`` restores what it holds. Put ``rng_state()`` in the state you save and
in ``save_on_failure``'s ``boundary_state``, so a failure capture holds the states of its step.
"""

from __future__ import annotations

import random
import sys
import threading
from typing import Any

__all__ = ["rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """The RNG states of this process now (see the module docstring)."""
    import torch

    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(),
                             "python": {"version": version, "state": internal, "gauss": gauss}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = _NUMPY.read(numpy)
    return state


class _NumpyState:
    """numpy's global generator state as ``rng_state`` gives it, read in full only when it may
    have changed: ``numpy.random.get_state()`` copies the 624 words of its key one by one
    (about 37 us, most of a step boundary's cost), while a view of the generator's own
    memory (its key and position, ``MT19937.ctypes.state_address``) compares in about 1 us.

    The last full read is given again (as new objects) when the key and position are those
    it read and its cached Gaussian was empty: every draw moves the key or the position,
    except one Gaussian taken from the cache, which only empties it. Where the view cannot
    be checked against ``get_state()`` (another generator layout) every call reads in full.
    The one change it cannot see: ``numpy.random.set_state`` of exactly the words read last
    with a Gaussian cached (``set_rng_state`` makes the next read a full one)."""

    def __init__(self) -> None:
        self._source: Any = None
        """The bit generator ``_view`` is of (None: none seen yet)."""
        self._view: Any = None
        """Its live words (key, position); None where they cannot be read."""
        self._last: Any = None
        """The words at the last full read, kept for as long as ``_given`` is."""
        self._given: dict[str, Any] | None = None
        """What the last full read gave (None: read in full next time)."""
        self._lock = threading.Lock()  # the step boundary's thread and a capture's

    def read(self, numpy: Any) -> dict[str, Any]:
        with self._lock:
            return self._read(numpy)

    def forget(self) -> None:
        """The state was set (``set_rng_state``): read it in full next time."""
        with self._lock:
            self._given = None

    def _read(self, numpy: Any) -> dict[str, Any]:
        import torch

        view = self._view_of(numpy)
        if view is not None and self._given is not None and not self._given["has_gauss"] and \
                numpy.array_equal(view, self._last):
            return {**self._given, "keys": self._given["keys"].clone()}
        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        given = {"kind": kind, "keys": torch.from_numpy(keys.astype(numpy.int64)), "pos": int(pos),
                 "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
        if view is not None:
            self._last, self._given = view.copy(), {**given, "keys": given["keys"].clone()}
        return given

    def _view_of(self, numpy: Any) -> Any:
        """The live words (key, position) of numpy's global generator, or None."""
        generator = getattr(getattr(numpy.random, "mtrand", None), "_rand", None)
        source = getattr(generator, "_bit_generator", None)
        if source is None or type(source).__name__ != "MT19937":
            return None
        if source is not self._source:
            self._source, self._view, self._given = source, _words(numpy, source), None
        return self._view


def _words(numpy: Any, source: Any) -> Any:
    """A uint32 view of ``source``'s key and position, if it holds what ``get_state()`` says."""
    import ctypes

    try:
        words = numpy.ctypeslib.as_array((ctypes.c_uint32 * 625).from_address(source.ctypes.state_address))
        _, keys, pos, _, _ = numpy.random.get_state()
    except (AttributeError, TypeError, ValueError):
        return None
    return words if numpy.array_equal(words[:624], keys) and int(words[624]) == int(pos) else None


_NUMPY = _NumpyState()


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the RNG states of :func:`rng_state` (those it holds)."""
    import torch

    if not isinstance(state, dict) or "torch" not in state or "python" not in state:
        raise TypeError("set_rng_state takes what flashckpt.rng_state() returned (a dict with 'torch' and 'python')")
    torch.set_rng_state(state["torch"])
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss"]))
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        saved = state["numpy"]
        _NUMPY.forget()
        numpy.random.set_state((saved["kind"], saved["keys"].numpy().astype(numpy.uint32), saved["pos"],
                                saved["has_gauss"], saved["cached_gaussian"]))
