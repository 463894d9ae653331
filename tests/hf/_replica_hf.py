"""One rank of the Trainer's two "nodes" (its own FLASHCKPT_SHM_DIR tmpfs, one rank each).

    python _replica_hf.py NODE PORT OUTPUT_DIR REPLICAS OUT_JSON save|load [KIND]

The real Hugging Face ``Trainer`` (tiny GPT-2, DDP on gloo) with ``FlashCheckpointCallback
(memory_every=2)`` and ``save_steps=3``. ``save``: trains to step 5 (``checkpoint-3`` written,
step 4 a memory-only snapshot), records what step 4 saved (rank 0: the model's tensors;
every rank: its CPU RNG state), waits until this node holds the other node's replica of
step 4 (when replicas are on), reports, then waits to be killed. ``load``: a fresh process
builds the Trainer (the callback's resume decision runs in its constructor) and trains on
with ``resume_from_checkpoint=last_checkpoint(OUTPUT_DIR)``, reporting where it resumed.
KIND ``rank0-lost``: node 1 runs rank 0 (process 0, which writes the model files), so the
lost node is the one that hosted it; otherwise node N runs rank N.
Same protocol as ``tests/checkpoint/_replica_worker.py``, so ``test_replica_restore``'s
rounds drive it.
"""

import hashlib
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from flashckpt.hf import FlashCheckpointCallback, last_checkpoint  # noqa: E402
from tests.checkpoint._replica_node import finish, wait_for_replica  # noqa: E402
from tests.hf._hf import make_trainer  # noqa: E402
from tests._exit import exit_now  # noqa: E402

SNAPSHOT, HOLD = 4, 5


def sha(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class Record(TrainerCallback):
    """Records what a save holds, and the step training starts from."""

    def __init__(self, report: dict, flash: FlashCheckpointCallback, hold: str | None) -> None:
        self.report, self.flash, self.hold = report, flash, hold  # hold: the save round's report path

    def on_train_begin(self, args, state, control, **kwargs):
        self.report["start_step"] = state.global_step

    def on_save(self, args, state, control, model=None, **kwargs):
        if state.global_step == SNAPSHOT and self.hold:
            self.report["rng4"] = sha(torch.random.get_rng_state())
            if dist.get_rank() == 0:
                self.report["model4"] = {k: sha(v) for k, v in model.state_dict().items()}

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == HOLD and self.hold:  # step 4 is only in memory (and in a peer's)
            self.flash._ckpt.wait()  # checkpoint-3 is written (its exporter may run on node 1)
            engine = self.flash._ckpt.engine
            self.report.update(saver_pid=engine._client.saver_pid,
                               endpoints=sorted(map(list, engine.replicas.endpoints.values())),
                               replicas_here=wait_for_replica(engine, engine.job_id, SNAPSHOT))
            dist.barrier()
            finish(self.report, self.hold, "save")  # waits to be killed, as a lost node's processes are


def main() -> None:
    node, port, output_dir, replicas, out, mode = sys.argv[1:7]
    rank = str(1 - int(node)) if sys.argv[7:] == ["rank0-lost"] else node
    os.environ.update(RANK=rank, LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=port, HF_HUB_OFFLINE="1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=int(rank), world_size=2)
    kwargs = {} if replicas == "auto" else {"replicas": int(replicas)}
    flash = FlashCheckpointCallback(memory_every=2, **kwargs)
    report: dict = {"rank": int(rank)}
    trainer = make_trainer(output_dir, [flash, Record(report, flash, out if mode == "save" else None)], max_steps=8, save_steps=3, per_device_train_batch_size=2,
                           ddp_backend="gloo", dataloader_num_workers=0)
    report["resumed_from"] = flash.resumed_from
    trainer.train(resume_from_checkpoint=last_checkpoint(output_dir) if mode == "load" else None)
    report.update(global_step=trainer.state.global_step,
                  folders=sorted(n for n in os.listdir(output_dir) if n.startswith("checkpoint-")))
    dist.barrier()
    dist.destroy_process_group()
    finish(report, out, mode)


if __name__ == "__main__":
    main()
    exit_now()  # gloo groups still referenced can abort interpreter teardown
