"""No leaks across 200 save/load cycles: shared memory, file descriptors, RSS."""

import glob
import os
import resource

import torch

from flashckpt.torch import Checkpointer
from flashckpt._names import job_prefix


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def test_200_save_load_cycles_leak_nothing(tmp_path, job_id):
    state = {"model": {f"w{i}": torch.randn(64, 1024) for i in range(8)}, "step": 0}  # 2 MiB
    target = {"model": {f"w{i}": torch.zeros(64, 1024) for i in range(8)}, "step": 0}
    baseline = None
    with Checkpointer(tmp_path, job_id=job_id, persist_every=20, keep_last=2) as ck:
        for cycle in range(1, 201):
            state["step"] = cycle
            ck.save(cycle, state)
            assert ck.load(target) == cycle
            if cycle == 20:
                ck.wait()
                baseline = (open_fds(), rss_mib(), len(glob.glob(job_prefix(job_id) + "*")))
        ck.wait()
        fds, rss, segments = open_fds(), rss_mib(), len(glob.glob(job_prefix(job_id) + "*"))
    assert fds <= baseline[0], f"file descriptors grew from {baseline[0]} to {fds}"
    assert segments <= baseline[2], f"shared-memory objects grew from {baseline[2]} to {segments}"
    assert rss - baseline[1] < 16, f"RSS grew by {rss - baseline[1]:.1f} MiB over 180 cycles"
    assert len(list(tmp_path.glob("step-*"))) == 2
    assert not [p for p in glob.glob(job_prefix(job_id) + "*") if ".slot" in p]
