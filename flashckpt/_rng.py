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
        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype(numpy.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss),
                          "cached_gaussian": float(cached)}
    return state


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
        numpy.random.set_state((saved["kind"], saved["keys"].numpy().astype(numpy.uint32), saved["pos"],
                                saved["has_gauss"], saved["cached_gaussian"]))
