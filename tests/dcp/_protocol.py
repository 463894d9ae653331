"""The ``flashckpt://`` protocol registered with fsspec in the test processes and their
forked workers (the installed package registers it through its ``fsspec.specs`` entry
point; the suite must not depend on which checkout is installed), and the states the
protocol tests save."""

from __future__ import annotations

import fsspec
import torch

fsspec.register_implementation("flashckpt", "flashckpt.dcp._fs.FlashFileSystem", clobber=True)


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "half": torch.randn(7, generator=g).to(torch.bfloat16),
            "t": torch.randn(5, 3, generator=g).t(),  # not contiguous
            "n": torch.tensor(seed), "sched": {"lr": 0.1 * seed, "name": f"run{seed}"}}


def blank() -> dict:
    return {"w": torch.zeros(64, 32), "half": torch.zeros(7, dtype=torch.bfloat16), "t": torch.zeros(3, 5),
            "n": torch.tensor(0), "sched": {"lr": 0.0, "name": ""}}


def equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in ("w", "half", "t", "n")) and a["sched"] == b["sched"]
