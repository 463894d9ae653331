"""A capture that does not fit in shared memory (issue 42, bad input): the state grew since
the last save (Adam's moments appear at the first update), and ``/dev/shm`` (a 64 MiB tmpfs
in a private mount namespace) holds the saves but not the capture. The capture says so in
one clear line and writes nothing; the newest save stays, and a restart loads it."""

from __future__ import annotations

from ..checkpoint.test_ckpt_bad_input import run_in_private_mounts

SCRIPT = """
    import logging, os, subprocess, sys
    if not sys.argv[1:]:  # the driver: a trainer that dies, then its restart, in this mount namespace
        for mode in ("train", "restart"):
            out = subprocess.run([sys.executable, __file__, mode], capture_output=True, text=True)
            print(out.stdout, out.stderr[-2000:], flush=True)
        sys.exit(0)
    import torch
    from flashckpt.torch import Checkpointer
    logging.basicConfig(level=logging.WARNING, format="LOG %%(message)s", stream=sys.stdout)

    def state(model, opt):
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 4096)                         # 16 MiB of parameters
    opt = torch.optim.Adam(model.parameters())
    ck = Checkpointer(%(dir)r, job_id="capsmall")
    if sys.argv[1] == "restart":
        print("loaded", ck.load(state(model, opt)), ck.last_load.source, flush=True)
        ck.close()
        sys.exit(0)
    capture = ck.save_on_failure(lambda: state(model, opt), optimizer=opt)
    ck.save(1, state(model, opt))                               # no moments yet: 16 MiB
    ck.wait()
    model(torch.ones(2, 1024)).sum().backward()
    opt.step()                                                  # step 2: Adam's moments, 48 MiB
    print("captured", capture.capture("injected failure"), flush=True)
    os._exit(0)                                                 # the trainer dies without closing
"""


def test_a_capture_larger_than_dev_shm_says_so_and_the_newest_save_stays(tmp_path):
    out = run_in_private_mounts(SCRIPT % {"dir": str(tmp_path / "ck")}, "mount -t tmpfs -o size=64m tmpfs /dev/shm",
                                tmp_path)
    assert out.returncode == 0, out.stderr
    assert "captured None" in out.stdout, out.stdout + out.stderr
    failed = [line for line in out.stdout.splitlines() if "capturing step 2 failed" in line]
    assert failed and "SharedMemoryError" in failed[0] and "MiB are free" in failed[0], out.stdout
    assert "loaded 1 memory" in out.stdout, out.stdout + out.stderr
