"""DeepSpeed ZeRO-2 (CPU, gloo) training with failure capture, for test_ds_capture.

    torchrun --standalone --nproc_per_node=2 --max-restarts=2 _ds_capture.py CKPT OUT

15 steps, saves to memory every 5 (persist_every is large), ``save_on_failure`` armed
after the load with the client state ``{"marker": "gs-<engine.global_steps>"}``.
Attempt 0: rank 1 SIGKILLs itself inside step 8's backward (rank 0 captures step 7 alone).
Attempt 1: both ranks SIGTERM themselves right after step 12's ``engine.step``, having
written their parameters to OUT/at12-<rank>.pt. Each rank writes what it loaded to
OUT/load-<rank>-<attempt>.json and, after the load, its parameters to
OUT/loaded-<rank>-<attempt>.pt.
"""

import json
import logging
import os
import signal
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from flashckpt.torch import init_process_group  # noqa: E402
from tests._exit import exit_now  # noqa: E402
from tests.deepspeed._ds_train import make_engine, train_step  # noqa: E402

STEPS, SAVE_EVERY, KILL_AT, TERM_AT = 15, 5, 8, 12


def params(engine) -> dict:
    return {name: p.detach().clone() for name, p in engine.module.named_parameters()}


def main() -> None:
    import deepspeed
    from flashckpt import _events
    from flashckpt.deepspeed import DeepSpeedCheckpointer

    logging.basicConfig(level=logging.INFO, format="%(process)d %(name)s %(levelname)s %(message)s")
    directory, out = sys.argv[1], sys.argv[2]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    init_process_group()
    deepspeed.init_distributed("gloo")
    rank = dist.get_rank()
    loads = []
    _events.subscribe(lambda event, **info: loads.append(info) if event == "load" else None)
    engine = make_engine(2)
    ck = DeepSpeedCheckpointer(engine, directory, persist_every=1000, job_id=os.environ["FLASHCKPT_TEST_JOB"])
    start = ck.load() or 0
    with open(os.path.join(out, f"load-{rank}-{attempt}.json"), "w") as f:
        json.dump({"step": start, "source": loads[0]["source"] if loads else None,
                   "captured": bool(loads and loads[0].get("captured")),
                   "client": (ck.client_state or {}).get("marker")}, f)
    torch.save(params(engine), os.path.join(out, f"loaded-{rank}-{attempt}.pt"))
    ck.save_on_failure(lambda: {"marker": f"gs-{engine.global_steps}"})
    for step in range(start + 1, STEPS + 1):
        if attempt == 0 and rank == 1 and step == KILL_AT:
            next(engine.module.parameters()).register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
        train_step(engine, rank, step)
        if attempt == 1 and step == TERM_AT:
            torch.save(params(engine), os.path.join(out, f"at{TERM_AT}-{rank}.pt"))
            os.kill(os.getpid(), signal.SIGTERM)
        if step % SAVE_EVERY == 0:
            ck.save(step, client_state={"marker": f"gs-{engine.global_steps}"})
    ck.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now()
