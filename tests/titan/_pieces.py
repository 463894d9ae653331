"""What torchtitan's trainer hands its checkpoint manager, built from torchtitan's own
components on CPU: a tiny FSDP2 model (``model_parts``), ``OptimizersContainer`` (AdamW),
``LRSchedulersContainer`` (warmup), ``ParallelAwareDataloader`` and a train state.

torchtitan's ``Trainer`` itself is not built: it needs a model spec, a tokenizer, HF
``datasets`` and an accelerator. The manager gets what ``Trainer.__init__`` passes it."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard
from torch.utils.data import IterableDataset
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig

from ..fsdp._fsdp_common import Net


class Tokens(IterableDataset):
    """Rows of 4 token ids, different on every data-parallel rank."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __iter__(self):
        for i in range(10_000):
            yield torch.tensor([(7 * i + 3 * j + self.rank) % 11 for j in range(4)])


class TrainState(Stateful):
    """The trainer's own state (torchtitan saves its ``Trainer`` as ``train_state``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


@dataclasses.dataclass
class Training:
    model: torch.nn.Module
    optimizers: OptimizersContainer
    lr_schedulers: LRSchedulersContainer
    dataloader: ParallelAwareDataloader
    train_state: TrainState
    batches: Any = None

    def components(self) -> dict[str, Any]:
        """``CheckpointManager.Config.build``'s keyword arguments, as the trainer passes them."""
        return {"dataloader": self.dataloader, "model_parts": [self.model], "optimizers": self.optimizers,
                "lr_schedulers": self.lr_schedulers, "states": {"train_state": self.train_state},
                "sd_adapter": None}

    def step(self) -> None:
        """One training step, as torchtitan's: forward, backward, optimizers and schedulers."""
        if self.batches is None:
            self.batches = iter(self.dataloader)
        x = next(self.batches)
        self.optimizers.zero_grad()
        self.model(x).pow(2).mean().backward()
        self.optimizers.step()
        self.lr_schedulers.step()
        self.train_state.step += 1

    def next_batch(self) -> torch.Tensor:
        if self.batches is None:
            self.batches = iter(self.dataloader)
        return next(self.batches)

    def local_state(self) -> dict[str, Any]:
        """This rank's shards of model and optimizer, the schedulers' and the step (clones)."""
        def local(v: Any) -> Any:
            return v.to_local().clone() if hasattr(v, "to_local") else v.clone() if torch.is_tensor(v) else v
        return {"model": {k: local(v) for k, v in self.model.state_dict().items()},
                "optim": {k: local(v) for k, v in self.optimizers.state_dict().items()},
                "lr": self.lr_schedulers.state_dict(), "step": self.train_state.step}


def build(seed: int) -> Training:
    """The pieces on this rank (FSDP2 over every rank of the default group)."""
    torch.manual_seed(seed)
    model = Net()
    if dist.is_initialized():
        fully_shard(model.l1)
        fully_shard(model.l2)
        fully_shard(model)
    group = ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.01, "weight_decay": 0.1})
    optimizers = OptimizersContainer.Config(param_groups=[group], implementation="for-loop").build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=20)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    dataloader = ParallelAwareDataloader(Tokens(rank), dp_rank=rank, dp_world_size=world, batch_size=2)
    return Training(model, optimizers, lr_schedulers, dataloader, TrainState())


def manager(config: CheckpointManager.Config, training: Training, folder: str) -> CheckpointManager:
    """The manager as torchtitan's trainer builds it (``base_folder`` its dump folder)."""
    return config.build(**training.components(), base_folder=folder)


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal local states (:meth:`Training.local_state`)."""
    if a.keys() != b.keys() or a["step"] != b["step"] or a["lr"] != b["lr"]:
        return False
    return all(a[part].keys() == b[part].keys() and
               all(torch.equal(a[part][k], b[part][k]) if torch.is_tensor(a[part][k]) else a[part][k] == b[part][k]
                   for k in a[part]) for part in ("model", "optim"))
