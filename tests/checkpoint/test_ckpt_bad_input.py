"""Bad input gets a clear exception naming the problem; committed steps stay intact."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from flashckpt import CheckpointError, StateMismatchError
from flashckpt.torch import Checkpointer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def committed(tmp_path, job_id, steps=(1, 2)):
    with Checkpointer(tmp_path, job_id=job_id, keep_last=0) as ck:
        for step in steps:
            ck.save(step, {"w": torch.full((1000,), float(step)), "b": torch.arange(10)})
    return tmp_path / f"step-{steps[-1]}" / "rank-0.safetensors"


def load(tmp_path, job_id, step=None, state=None):
    state = state or {"w": torch.zeros(1000), "b": torch.zeros(10, dtype=torch.int64)}
    with Checkpointer(tmp_path, job_id=job_id) as ck:
        return ck.load(state, step=step), state


def test_flipped_byte_is_a_checksum_error_naming_the_file_and_older_step_loads(tmp_path, job_id):
    shard = committed(tmp_path, job_id)
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank-0\.safetensors.*checksum") as info:
        load(tmp_path, job_id, step=2)  # asked for: no fallback to step 1
    assert isinstance(info.value.__cause__ or info.value, CheckpointError)
    step, state = load(tmp_path, job_id, step=1)
    assert step == 1 and state["w"][0] == 1


def test_truncated_shard(tmp_path, job_id):
    shard = committed(tmp_path, job_id)
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        load(tmp_path, job_id, step=2)  # asked for: no fallback to step 1


def test_corrupt_header(tmp_path, job_id):
    shard = committed(tmp_path, job_id)
    data = bytearray(shard.read_bytes())
    data[8:20] = b"not json!!!!"
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="rank-0.safetensors"):
        load(tmp_path, job_id, step=2)  # asked for: no fallback to step 1


def test_missing_rank_file(tmp_path, job_id):
    shard = committed(tmp_path, job_id)
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing shard file"):
        load(tmp_path, job_id, step=2)  # asked for: no fallback to step 1


def test_uncommitted_step_is_not_found(tmp_path, job_id):
    committed(tmp_path, job_id)
    with pytest.raises(CheckpointError, match="not committed"):
        load(tmp_path, job_id, step=5)


@pytest.mark.parametrize("state, match", [
    ({"w": torch.zeros(999), "b": torch.zeros(10, dtype=torch.int64)}, r"w: checkpoint has F32\[1000\], state has F32\[999\]"),
    ({"w": torch.zeros(1000, dtype=torch.float16), "b": torch.zeros(10, dtype=torch.int64)}, r"w: .*state has F16"),
    ({"w": torch.zeros(1000), "c": torch.zeros(10)}, r"keys differ.*'b'.*'c'"),
    ({"w": torch.zeros(1000), "b": 3}, r"b: checkpoint has a tensor, state has int"),
])
def test_state_mismatch_names_the_entry_and_touches_nothing(tmp_path, job_id, state, match):
    committed(tmp_path, job_id)
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    with pytest.raises(StateMismatchError, match=match):
        load(tmp_path, job_id, state=state)
    for k, v in state.items():
        assert torch.equal(v, before[k]) if isinstance(v, torch.Tensor) else v == before[k]
    assert (tmp_path / "latest").read_text().strip() == "2"


def test_unwritable_directory(tmp_path, job_id):
    target = tmp_path / "file-not-dir"
    target.write_text("x")
    with pytest.raises(CheckpointError, match="not writable"):
        Checkpointer(target / "ckpt", job_id=job_id)


def test_bad_options(tmp_path):
    with pytest.raises(ValueError, match="persist_every"):
        Checkpointer(tmp_path, persist_every=0)
    with pytest.raises(ValueError, match="keep_last"):
        Checkpointer(tmp_path, keep_last=-1)
    with pytest.raises(ValueError, match="job_id"):
        Checkpointer(tmp_path, job_id="a/b")


def run_in_private_mounts(script: str, mounts: str, tmp_path) -> subprocess.CompletedProcess:
    """Run a python script in a private mount namespace with small tmpfs mounts."""
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    cmd = f"{mounts} && exec {sys.executable} {path}"
    return subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})


def test_state_larger_than_dev_shm_is_a_clear_error_not_sigbus(tmp_path):
    out = run_in_private_mounts("""
        import torch
        from flashckpt import SharedMemoryError
        from flashckpt.torch import Checkpointer
        ck = Checkpointer(%r, job_id="small")
        ck.save(1, {"w": torch.ones(1000)})                      # fits
        try:
            ck.save(2, {"w": torch.ones(1000), "big": torch.ones(30 * 2**20)})  # 120 MB
        except SharedMemoryError as exc:
            print("ERROR:", exc)
        ck.wait()
        ck.close()
        print("latest", ck.latest_step())
    """ % str(tmp_path / "ck"), "mount -t tmpfs -o size=64m tmpfs /dev/shm", tmp_path)
    assert out.returncode == 0, out.stderr
    assert "ERROR: the state needs 12" in out.stdout and "MiB are free" in out.stdout and "--shm-size" in out.stdout
    assert "latest 1" in out.stdout


def test_full_disk_is_reported_and_previous_commit_survives(tmp_path):
    out = run_in_private_mounts("""
        import torch
        from flashckpt import CheckpointError
        from flashckpt.torch import Checkpointer
        ck = Checkpointer("/mnt/ck", job_id="disk")
        ck.save(1, {"w": torch.ones(1000)})
        ck.wait()
        try:
            ck.save(2, {"w": torch.ones(1000), "big": torch.ones(5 * 2**20)})   # 20 MB on a 4 MB disk
            ck.wait()
        except CheckpointError as exc:
            print("ERROR:", exc)
        print("latest", ck.latest_step())
        state = {"w": torch.zeros(1000)}
        import os; print(sorted(os.listdir("/mnt/ck")))
    """, "mkdir -p /mnt && mount -t tmpfs -o size=4m tmpfs /mnt && mount -t tmpfs -o size=256m tmpfs /dev/shm", tmp_path)
    assert out.returncode == 0, out.stderr
    assert "ERROR: persisting to /mnt/ck failed" in out.stdout and "No space left on device" in out.stdout
    assert "latest 1" in out.stdout
