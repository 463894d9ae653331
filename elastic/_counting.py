"""``CountingLoader``: count what the training loop received, not what DataLoader prefetched.

A ``DataLoader(num_workers>0)`` pulls indices from its sampler ``prefetch_factor *
num_workers`` batches ahead of the loop. A sampler that counted its own yields would
save a position past the samples the model trained on, and a restore would skip them.
The wrapper counts delivered batches (the loader delivers batches in sampler order) and
tells the sampler; batch ``k`` of a ``BatchSampler`` holds samples ``[k*bs, (k+1)*bs)``.
"""

from __future__ import annotations

from typing import Any, Iterator

from torch.utils.data import BatchSampler, DataLoader

__all__ = ["CountingLoader"]


class CountingLoader:
    """Wrap ``loader`` (whose sampler is an elastic sampler) so the sampler's state counts
    only the samples the training loop received::

        loader = CountingLoader(DataLoader(ds, batch_size=32, sampler=sampler, num_workers=4))
        for batch in loader: ...
        state["sampler"] = sampler.state_dict()   # exact, despite prefetching
    """

    def __init__(self, loader: DataLoader) -> None:
        batch_sampler = getattr(loader, "batch_sampler", None)
        if batch_sampler is not None:
            if not isinstance(batch_sampler, BatchSampler) or type(batch_sampler) is not BatchSampler:
                raise TypeError(
                    "CountingLoader needs the DataLoader's own BatchSampler (batch_size=...), "
                    f"not a custom batch_sampler {type(batch_sampler).__name__}"
                )
            sampler, per_batch = batch_sampler.sampler, batch_sampler.batch_size
        else:
            sampler, per_batch = loader.sampler, 1
        if not hasattr(sampler, "_delivered"):
            raise TypeError(
                "CountingLoader needs an ElasticDistributedSampler or ShardSampler as the "
                f"loader's sampler, got {type(sampler).__name__}"
            )
        self.loader = loader
        self.sampler = sampler
        self._per_batch = int(per_batch)
        self.consumed = 0  # samples of the current iteration received by the loop

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        self.sampler._track_delivery = True
        self.consumed = 0
        batches = 0
        try:
            for batch in self.loader:
                batches += 1
                self.consumed = batches * self._per_batch
                self.sampler._delivered(self.consumed)
                yield batch
            # the loader is exhausted: everything the sampler yielded was delivered
            # (a BatchSampler drop_last tail is dropped, as it would be without us)
            self.sampler._delivered(None)
        finally:
            self.sampler._track_delivery = False
