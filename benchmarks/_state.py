"""The training state the save/load benchmark checkpoints, and small helpers over it.

The state is a real ``torch.optim.AdamW`` state over a module with GPT-2's parameter
shapes (token and position embeddings, blocks of layer norms, fused QKV attention and a
4x MLP; the LM head is tied to the token embedding, so it adds no parameter), after one
optimizer step: ``{"model": model.state_dict(), "optim": optim.state_dict(), "step": n}``.
Every parameter is fp32 and has two fp32 Adam moments, so the state is 12 bytes a parameter.

Also here: ``ShmFloor``, the state's plain image in shared memory that the benchmark's
floor copies into and out of. This module imports only torch and the standard library,
so the DLRover peer script (another venv) can use it too.
"""

from __future__ import annotations

import gc
import mmap
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["SPECS", "PinnedFloor", "ShmFloor", "StateSpec", "build_state", "copy_into", "fingerprint", "nbytes", "tensors"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StateSpec:
    """Shape of a GPT-2-like model; the benchmark state is its AdamW training state."""

    name: str
    vocab: int
    positions: int
    width: int
    layers: int

    def describe(self) -> str:
        return (
            f"{self.name}: GPT-2 shapes, vocab {self.vocab}, {self.positions} positions, "
            f"width {self.width}, {self.layers} blocks"
        )


SPECS: dict[str, StateSpec] = {
    # GPT-2 small: 124.4M parameters, 1.49 GB with the two Adam moments.
    "large": StateSpec(name="large", vocab=50257, positions=1024, width=768, layers=12),
    # Same width and block shapes, 3 blocks and a 10k vocabulary: 29.7M parameters, 357 MB.
    "small": StateSpec(name="small", vocab=10000, positions=1024, width=768, layers=3),
    # Smaller states for the cold-read curve (benchmarks/cold_read.py): 33 MB and 134 MB.
    "tiny": StateSpec(name="tiny", vocab=7000, positions=512, width=256, layers=1),
    "medium": StateSpec(name="medium", vocab=8500, positions=1024, width=512, layers=2),
}


_ALIGN = 64


class _Attention(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)


class _Mlp(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width)
        self.c_proj = nn.Linear(4 * width, width)


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = _Attention(width)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = _Mlp(width)


class _Gpt2Shaped(nn.Module):
    """Parameters only: the benchmark never runs a forward pass."""

    def __init__(self, spec: StateSpec) -> None:
        super().__init__()
        self.wte = nn.Embedding(spec.vocab, spec.width)
        self.wpe = nn.Embedding(spec.positions, spec.width)
        self.h = nn.ModuleList(_Block(spec.width) for _ in range(spec.layers))
        self.ln_f = nn.LayerNorm(spec.width)


def build_state(spec: StateSpec, *, seed: int = 0) -> dict[str, Any]:
    """AdamW state after one step with random gradients; every tensor is touched."""
    torch.manual_seed(seed)
    model = _Gpt2Shaped(spec)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p).mul_(1e-2)
    optim.step()
    model.zero_grad(set_to_none=True)
    return {"model": model.state_dict(), "optim": optim.state_dict(), "step": 1}


def _walk(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _walk(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _walk(value)


def tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor of a nested dict/list/tuple, in a deterministic order."""
    return list(_walk(tree))


def nbytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(tree))


def copy_into(dst: Any, src: Any) -> None:
    """Copy the tensors of ``src`` into the same places of ``dst`` (what an in-place load does)."""
    _map_pairs(dst, src, lambda d, s: d.copy_(s))


def _map_pairs(dst: Any, src: Any, fn: Callable[[torch.Tensor, torch.Tensor], Any]) -> None:
    if isinstance(dst, torch.Tensor):
        fn(dst, src)
    elif isinstance(dst, dict):
        for key, value in dst.items():
            _map_pairs(value, src[key], fn)
    elif isinstance(dst, (list, tuple)):
        for value, other in zip(dst, src, strict=True):
            _map_pairs(value, other, fn)


def fingerprint(tree: Any) -> float:
    """A cheap checksum of a strided sample of every tensor, to check a load's bytes."""
    total = 0.0
    for t in tensors(tree):
        flat = t.reshape(-1)
        stride = max(1, flat.numel() // 4096)
        total += float(flat[::stride].double().sum())
    return total


class ShmFloor:
    """A /dev/shm file mapped once, with one ``torch.frombuffer`` view per tensor; a file
    created with ``touch=False`` has no page yet (the first copy into it faults them in)."""

    def __init__(self, path: Path, like: list[torch.Tensor], *, create: bool, touch: bool = True) -> None:
        self.path = path
        offsets, size = _layout(like)
        self._fd = os.open(path, (os.O_CREAT | os.O_EXCL if create else 0) | os.O_RDWR, 0o600)
        try:
            if create:
                os.ftruncate(self._fd, max(size, 1))
            self._mm = mmap.mmap(self._fd, max(size, 1))
            self._views = [_view(self._mm, t, offset) for t, offset in zip(like, offsets, strict=True)]
            if create and touch:
                for view in self._views:
                    view.zero_()  # touch every page before anything is timed
        except BaseException:  # an interrupted benchmark must not leave the file in /dev/shm
            os.close(self._fd)
            if create:
                path.unlink()
            raise

    def save(self, ts: list[torch.Tensor]) -> None:
        for view, t in zip(self._views, ts, strict=True):
            view.copy_(t)

    def load(self, ts: list[torch.Tensor]) -> None:
        for view, t in zip(self._views, ts, strict=True):
            t.copy_(view)

    def close(self, *, unlink: bool) -> None:
        self._views = []
        gc.collect()  # the views export the mmap's buffer; it cannot close before they go
        self._mm.close()
        os.close(self._fd)
        if unlink:
            self.path.unlink()


class PinnedFloor:
    """The GPU floor: one page-locked host buffer with a view per tensor; copies are
    queued without waiting and waited for once."""

    def __init__(self, like: list[torch.Tensor]) -> None:
        offsets, size = _layout(like)
        self._buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        self._views = [self._buf[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                       for t, o in zip(like, offsets, strict=True)]

    def save(self, ts: list[torch.Tensor]) -> None:
        for view, t in zip(self._views, ts):
            view.copy_(t, non_blocking=True)
        torch.cuda.current_stream().synchronize()

    def load(self, ts: list[torch.Tensor]) -> None:
        for view, t in zip(self._views, ts):
            t.copy_(view, non_blocking=True)
        torch.cuda.current_stream().synchronize()


def _layout(like: list[torch.Tensor]) -> tuple[list[int], int]:
    """Each tensor's byte offset in the image (64-byte aligned), and the image's size."""
    offsets, end = [], 0
    for t in like:
        offsets.append(end)
        end = -(-(end + t.numel() * t.element_size()) // _ALIGN) * _ALIGN
    return offsets, end


def _view(buf: mmap.mmap, like: torch.Tensor, offset: int) -> torch.Tensor:
    if not like.numel():
        return like.new_empty(like.shape)
    return torch.frombuffer(buf, dtype=like.dtype, count=like.numel(), offset=offset).view(like.shape)
