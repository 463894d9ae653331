"""A small FSDP model with uneven dimensions, deterministic training, and helpers
to compare sharded states with consolidated ones. Runs on CPU over gloo."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class Net(nn.Module):
    """Dimensions 11, 13, 5, 3: not divisible by 2, 3 or 4; with 4 ranks ``head``'s
    3 rows leave rank 3 an empty shard."""

    def __init__(self, hidden: int = 13, extra_layer: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.l1 = nn.Linear(6, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.l2 = nn.Linear(hidden, 5)
        self.head = nn.Linear(5, 3)
        if extra_layer:
            self.more = nn.Linear(3, 3)
        self.register_buffer("scale", torch.tensor([1.0, 0.5, 2.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x).mean(1)
        h = torch.relu(self.norm(self.l1(h)))
        return self.head(torch.relu(self.l2(h))) * self.scale


def make(seed: int = 0, *, fsdp: int = 2, lr: float = 0.01, mesh: tuple[int, int] | None = None, **kw):
    """Net + AdamW, sharded with FSDP2 (``fsdp=2``; HSDP on a 2-D ``mesh`` of
    (replicas, shards)) or FSDP1 (``fsdp=1``, CPU device)."""
    torch.manual_seed(seed)
    model = Net(**kw)
    if fsdp == 2:
        from torch.distributed.fsdp import fully_shard
        device_mesh = None
        if mesh is not None:
            from torch.distributed.device_mesh import init_device_mesh
            device_mesh = init_device_mesh("cpu", mesh, mesh_dim_names=("replicate", "shard"))
        fully_shard(model.l1, mesh=device_mesh)
        fully_shard(model.l2, mesh=device_mesh)
        fully_shard(model, mesh=device_mesh)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        model = FSDP(model, device_id=torch.device("cpu"))
    return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * rank + step)
    return torch.randint(0, 11, (8, 4), generator=g), torch.randn(8, 3, generator=g)


def train_step(model, opt, rank: int, step: int) -> float:
    x, y = batch(rank, step)
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def micro_batch(model, opt, rank: int, step: int, per: int) -> None:
    """Micro-batch ``step`` of gradient accumulation over ``per`` (FSDP2: no reduce-scatter
    but at the last micro-batch of an update, which steps the optimizer)."""
    x, y = batch(rank, step)
    if step % per == 1 % per:
        opt.zero_grad()
    updates = step % per == 0
    model.set_requires_gradient_sync(updates)
    (nn.functional.mse_loss(model(x), y) / per).backward()
    if updates:
        opt.step()


def full_state(model, opt=None) -> dict:
    """The consolidated model (and optimizer) state on every rank (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    if opt is None:
        return {"model": {k: v.clone() for k, v in get_model_state_dict(model, options=options).items()}}
    msd, osd = get_state_dict(model, opt, options=options)
    return {"model": {k: v.clone() for k, v in msd.items()},
            "optim": {fqn: {k: v.clone() for k, v in st.items()} for fqn, st in osd["state"].items()},
            "param_groups": osd["param_groups"]}


def local_state(model, opt) -> dict:
    """This rank's local shards as plain tensors (clones)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=False))

    def local(t):
        if hasattr(t, "to_local"):
            return t.to_local().clone()
        if hasattr(t, "local_shards"):
            return [s.tensor.clone() for s in t.local_shards()]
        return t.clone()
    return {"model": {k: local(v) for k, v in msd.items()},
            "optim": {fqn: {k: local(v) for k, v in st.items()} for fqn, st in osd["state"].items()}}


def assert_equal_states(got: dict, want: dict, what: str = "") -> None:
    """Exact equality (bits, dtype, shape) of two nested states."""
    def walk(a, b, path):
        if isinstance(b, dict):
            assert isinstance(a, dict) and set(a) == set(b), f"{what}{path}: keys {sorted(a)} != {sorted(b)}"
            for k in b:
                walk(a[k], b[k], f"{path}/{k}")
        elif isinstance(b, (list, tuple)):
            assert len(a) == len(b), f"{what}{path}: lengths differ"
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{path}/{i}")
        elif isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape, f"{what}{path}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
            assert torch.equal(a, b), f"{what}{path}: values differ"
        else:
            assert a == b, f"{what}{path}: {a!r} != {b!r}"
    walk(got, want, "")


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
