"""A trainer on a bucket for the saver-crash test: loads, then saves until killed.

``python -m tests.objectstore._saver_trainer URL JOB MIB``: loads the newest step
(memory or bucket) into a state of ``MIB`` MiB (one float32 tensor, each element the
step), prints ``loaded <step> <source>`` and the saver's pid (``saver <pid>``), then
saves steps from the loaded one + 1 with ``persist_every=1, keep_last=2``, printing
``saved <step>`` once each ``save`` has returned. With ``--finish N`` it saves N steps,
flushes, closes and prints ``done``.
"""

from __future__ import annotations

import sys

import torch

from flashckpt.torch import DdpCheckpointer


def main() -> None:
    url, job, mib = sys.argv[1], sys.argv[2], int(sys.argv[3])
    finish = int(sys.argv[5]) if sys.argv[4:5] == ["--finish"] else None
    state = {"w": torch.zeros(mib << 18), "step": -1}
    ck = DdpCheckpointer(url, job_id=job, persist_every=1, keep_last=2)
    loaded = ck.load(state)
    if loaded is not None:
        assert state["step"] == loaded and bool((state["w"] == float(loaded)).all()), "a torn load"
    print("loaded", loaded, ck.last_load.source if loaded is not None else "-", flush=True)
    print("saver", ck.engine._client.saver_pid, flush=True)
    step = 0 if loaded is None else loaded + 1
    while finish is None or finish > 0:
        state["w"].fill_(float(step))
        state["step"] = step
        ck.save(step, state)
        print("saved", step, flush=True)
        step += 1
        if finish is not None:
            finish -= 1
    ck.flush()
    ck.close()
    print("done", flush=True)


if __name__ == "__main__":
    main()
