"""One rank of the DeepSpeed tag test on two node-local "nodes" (``tests/checkpoint/test_replica_node_local.py``'s
rounds: its own FLASHCKPT_SHM_DIR tmpfs and its own directory bind-mounted at the checkpoint path).

    python _node_local_tag_worker.py RANK PORT DIR REPLICAS OUT_JSON MODE [KIND]  (MODE, KIND ignored)

A ZeRO-1 engine (torch's Adam) through ``DeepSpeedCheckpointer``, steps 1..3 each saved and
due for storage, then ``wait()`` and ``close()``; its node's saver writes the peer's replicas
``REPLICA_DELAY`` seconds late (``_slow_replicas/sitecustomize.py``), so this node commits a
step well after this rank's own persist of it is done. Reports the engine's state, what the
directory holds right after ``wait()`` and after ``close()`` returned on every rank, then the
state of a fresh engine that loads with DeepSpeed's own ``engine.load_checkpoint(DIR)`` (its
stock checkpoint engine, as a user without flashckpt would), and of a fresh engine that loads
through a new checkpointer's ``load``.
"""

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch.distributed as dist  # noqa: E402

from tests.checkpoint._replica_node import finish  # noqa: E402
from tests.deepspeed._ds_train import train_step  # noqa: E402
from tests.deepspeed._replica_worker import join, make_engine  # noqa: E402
from tests._exit import exit_now  # noqa: E402

REPLICA_DELAY = 2.0
"""Seconds the saver sleeps before writing a received replica (test-only, see ``_slow_replicas``)."""


def slow_replicas() -> None:
    """The saver this rank starts writes replicas late (its PYTHONPATH has ``_slow_replicas``)."""
    site = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_slow_replicas")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)
    os.environ["FLASHCKPT_TEST_REPLICA_DELAY"] = str(REPLICA_DELAY)


def state(engine) -> dict:
    """The rank's parameters and its partition of the optimizer state, as lists of floats."""
    params = [x for p in engine.module.parameters() for x in p.detach().flatten().tolist()]
    optim = [x for s in engine.optimizer.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")
             for x in s[k].flatten().tolist()]
    return {"params": params, "optim": optim, "global_steps": int(engine.global_steps)}


def holds(directory: str) -> dict:
    """DeepSpeed's files in ``directory``: ``latest`` and each tag folder's files."""
    latest = os.path.join(directory, "latest")
    return {"latest": open(latest).read() if os.path.exists(latest) else None,
            "tags": {name: sorted(os.listdir(os.path.join(directory, name))) for name in sorted(os.listdir(directory))
                     if name.startswith("global_step")}}


def main() -> None:
    rank, port, directory, replicas, out, _ = sys.argv[1:7]
    rank = join(rank, port)
    from flashckpt.deepspeed import DeepSpeedCheckpointer
    kwargs = {} if replicas == "auto" else {"replicas": int(replicas)}
    engine = make_engine()
    slow_replicas()
    ck = DeepSpeedCheckpointer(engine, directory, job_id="tags", persist_every=1, **kwargs)
    report: dict = {"saver_pid": ck._flash._client.saver_pid, "node_local": ck._flash.node_local is not None}
    for step in (1, 2, 3):
        train_step(engine, rank, step)
        ck.save(step)
    report["saved"] = state(engine)
    ck.wait()
    dist.barrier()  # every rank's wait returned
    report["after_wait"] = holds(directory)
    ck.close()
    dist.barrier()  # every rank's close returned
    report["after_close"] = holds(directory)
    stock = make_engine()  # DeepSpeed's own checkpoint engine: what a user without flashckpt runs
    path, _ = stock.load_checkpoint(directory)
    report["stock"] = {"path": path, **state(stock)}
    flash = make_engine()
    ck = DeepSpeedCheckpointer(flash, directory, job_id="tags", **kwargs)
    step = ck.load()
    report["flash"] = {"step": step, "source": ck._flash.last_load.source, **state(flash)}
    ck.close()
    dist.barrier()
    finish(report, out, "exit")  # every mode exits (no lost node here)


if __name__ == "__main__":
    main()
    exit_now()  # gloo groups still referenced can abort interpreter teardown
