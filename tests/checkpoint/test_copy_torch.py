"""torch host copies (save into a slot, load out of one): contiguous CPU tensors are copied
as bytes on flashckpt's copy threads, everything else by torch; every byte lands exactly."""

import mmap
import threading

import pytest
import torch

from flashckpt import CheckpointError
from flashckpt.memory import _copy
from flashckpt.memory._format import Entry
from flashckpt.torch._tensors import TorchKind

from .test_ckpt_copy import spy_threads

KIND = TorchKind()


def slot_views(tensors: list[torch.Tensor]) -> tuple[mmap.mmap, list[torch.Tensor]]:
    """Views of a shared mapping packed back to back as in a slot (larger items first): a
    4-byte scalar (AdamW's ``step``) leaves the tensors after it off 64-byte alignment."""
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    entries, offset = {}, 0
    for i in order:
        t = tensors[i]
        nbytes = t.numel() * t.element_size()
        entries[i] = Entry(str(i), KIND.describe(t)[0], tuple(t.shape), offset, nbytes)
        offset += nbytes
    mm = mmap.mmap(-1, offset + 1)
    return mm, KIND.views(mm, 0, [entries[i] for i in range(len(tensors))])


def test_large_cpu_copies_run_on_the_copy_threads(monkeypatch):
    monkeypatch.setenv("FLASHCKPT_COPY_THREADS", "2")
    seen = spy_threads(monkeypatch, 2)
    src = torch.arange(_copy.PARALLEL_MIN_BYTES // 4, dtype=torch.float32)
    _, (dst,) = slot_views([src])
    KIND.copy([dst], [src])
    assert torch.equal(dst, src)
    assert len(seen) == 2 and threading.current_thread().name in seen


@pytest.mark.parametrize("threads", ["1", "3"])
def test_save_and_load_through_misaligned_slot_views_are_exact(monkeypatch, threads):
    monkeypatch.setenv("FLASHCKPT_COPY_THREADS", threads)
    gen = torch.Generator().manual_seed(0)
    srcs = [torch.tensor(3.0), torch.randn(3_000_001, generator=gen), torch.randn(1000, 777, generator=gen),
            torch.randn(513, generator=gen).to(torch.bfloat16), torch.randint(0, 2, (4097,), generator=gen).bool(),
            torch.randint(-2**31, 2**31 - 1, (1_000_003,), dtype=torch.int64, generator=gen),
            torch.randn(5, 3, generator=gen, dtype=torch.complex64), torch.empty(0, 7),
            torch.nn.Parameter(torch.randn(4096, 1025, generator=gen))]
    mm, views = slot_views(srcs)
    KIND.copy(views, srcs)
    back = [torch.zeros_like(t.detach()) for t in srcs]
    KIND.copy(back, views)
    for src, view, out in zip(srcs, views, back):
        assert torch.equal(view, src.detach()) and torch.equal(out, src.detach())
    del views
    mm.close()


def test_strided_conjugate_and_negative_views_copy_what_they_show():
    base = torch.randn(600, 800)
    complex_base = torch.randn(300, 400, dtype=torch.complex64)
    srcs = [base.t(), base[::3], complex_base.conj(), torch.randn(1000, dtype=torch.complex64).conj()._neg_view(),
            torch.randn(2048, 512).expand(2, 2048, 512)[1]]
    mm, views = slot_views(srcs)
    KIND.copy(views, srcs)
    for view, src in zip(views, srcs):
        assert torch.equal(view, src.resolve_conj().resolve_neg())
    dsts = [torch.empty(t.shape, dtype=t.dtype).t().contiguous().t() if t.dim() == 2 else torch.empty_like(t)
            for t in srcs]  # strided targets too
    KIND.copy(dsts, views)
    for dst, src in zip(dsts, srcs):
        assert torch.equal(dst, src.resolve_conj().resolve_neg())
    del views
    mm.close()



def test_a_copy_counts_as_an_in_place_write_for_autograd(monkeypatch):
    monkeypatch.setenv("FLASHCKPT_COPY_THREADS", "2")
    weight = torch.nn.Parameter(torch.randn(_copy.PARALLEL_MIN_BYTES // 4))
    loss = (weight * weight).sum()  # saves weight for backward
    _, (view,) = slot_views([weight])
    KIND.copy([view], [weight])
    KIND.copy([weight], [view])  # a load into the parameter, as the engine does
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_tensor_whose_storage_was_freed_is_a_clear_error_not_a_crash():
    freed = torch.randn(1 << 20)
    freed.untyped_storage().resize_(0)  # as FSDP frees an unsharded parameter
    mm, (view,) = slot_views([torch.empty(1 << 20)])
    with pytest.raises(CheckpointError, match="storage holds 0 bytes"):
        KIND.copy([view], [freed])  # save: a raw copy would read out of bounds
    with pytest.raises(CheckpointError, match="storage holds 0 bytes"):
        KIND.copy([freed], [view])  # load: it would write out of bounds
    with pytest.raises(RuntimeError):
        KIND.copy([view], [torch._efficientzerotensor(1 << 20)])  # no storage: torch's copy decides
    del view
    mm.close()
