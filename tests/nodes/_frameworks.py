"""The multi-node worker's framework trainings (``_worker.py --deepspeed``) and the digest of a state.

``DeepSpeedTraining`` has the interface of ``_worker._Training``: ``load``, ``step``, ``save``,
``bias_sum``, ``flash`` (the flash engine under the adapter), ``close`` and ``digest``: a hash of the
rank's whole training state (parameters, under ZeRO-3 the rank's partition of them, ZeRO's fp32 partition,
optimizer state and step count: ``tests.deepspeed._ds_train.live``), which a restored step must match
exactly. A ``Linear(16, 16)`` under ZeRO stage 1, 2 or 3 (every rank's fp32 partition and optimizer state are
its own; under ZeRO-3 its parameters too, and ``bias_sum`` gathers the bias) with torch's SGD, saved by
``DeepSpeedCheckpointer``; an input of ones and a loss of ``world * step`` times the output's sum give the
bias the update the other trainings give it (DeepSpeed averages the gradients; no clipping), and move the
weights too (they are in other ranks' partitions). ``test_nodes_three.py`` runs ZeRO-3.

(megatron-core on three node-local directories fails construction: tests/checkpoint/test_ckpt_nodes.py.)
"""

from __future__ import annotations

import hashlib
import os

import torch
import torch.distributed as dist

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before anything imports deepspeed


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """A hash of every tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous().reshape(-1)  # a 0-dim tensor as one element
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class DeepSpeedTraining:
    """ZeRO-``stage`` on CPU (gloo), torch's SGD, ``DeepSpeedCheckpointer``."""

    def __init__(self, directory: str, replicas: int | None, stage: int) -> None:
        import deepspeed
        from flashckpt.deepspeed import DeepSpeedCheckpointer

        # DeepSpeed's CPU backend JIT-compiles its shared-memory all-reduce (for ranks of one node) when it starts
        # if its build cache does not match, on every node at once here (the first run passed the test's 90 s
        # deadline in it, on 2 cores): with one rank per node it is never used, so it is left unbuilt (gloo does all)
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed("gloo")  # takes the group flashckpt.torch.init_process_group formed
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 16)
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
                  "gradient_clipping": 0.0, "steps_per_print": 10**9}
        self.engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                                    optimizer=torch.optim.SGD(model.parameters(), lr=1e-3))
        self.ckpt = DeepSpeedCheckpointer(self.engine, directory, persist_every=5, replicas=replicas)

    @property
    def flash(self):
        return self.ckpt._flash

    def load(self) -> int | None:
        return self.ckpt.load()

    def step(self, step: int) -> None:
        loss = self.engine(torch.ones(1, 16)).sum() * dist.get_world_size() * step
        self.engine.backward(loss)
        self.engine.step()

    def save(self, step: int) -> None:
        self.ckpt.save(step)

    def bias_sum(self) -> float:
        """The full bias's sum (gathered under ZeRO-3, where each rank holds a partition): all ranks call it."""
        import deepspeed
        bias = self.engine.module.bias
        with deepspeed.zero.GatheredParameters([bias], enabled=self.engine.zero_optimization_stage() == 3):
            return bias.sum().item()

    def digest(self) -> str:
        """This rank's parameters (its ZeRO-3 partition), fp32 partition, optimizer state and step count."""
        from tests.deepspeed._ds_train import live
        return digest(live(self.engine))

    def close(self) -> None:
        self.ckpt.close()
