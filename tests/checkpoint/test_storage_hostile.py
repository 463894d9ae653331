"""Hostile checkpoint directories: FIFOs, /dev/zero, symlinks, traversal, wrong types,
huge counts, a shard of another run, a second live run, a full disk. Nothing hangs,
nothing outside the directory is read, every error is a flashckpt error."""

import json
import os
import subprocess
import sys
import zlib

import pytest

from flashckpt import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, JobConflictError, \
    UnsafeFileError
from flashckpt.storage._local import LocalStorage

from .conftest import small_tmpfs
from .test_storage_lineage import A, B, commit, image

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def ckpt(tmp_path):
    storage = LocalStorage(tmp_path / "ck")
    storage.check_writable()
    for step in (1, 2):
        commit(storage, step, A, branch=-1)
    return storage


def meta_path(storage, step=2):
    return os.path.join(storage.step_dir(step), "metadata.json")


def rewrite_meta(storage, changes=None):
    """Step 2's metadata with ``changes`` applied (written back)."""
    with open(meta_path(storage)) as f:
        meta = json.load(f)
    meta.update(changes or {})
    with open(meta_path(storage), "w") as f:
        json.dump(meta, f)
    return meta


def flashckpt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashckpt.cli", *args], capture_output=True, text=True, timeout=25)


def one_line_error(out: subprocess.CompletedProcess) -> None:
    assert out.returncode != 0, out.stdout
    assert "Traceback" not in out.stderr + out.stdout, out.stderr


# -- metadata.json and latest -----------------------------------------------------------

def test_metadata_fifo_is_refused_without_blocking(ckpt):
    os.unlink(meta_path(ckpt))
    os.mkfifo(meta_path(ckpt))
    with pytest.raises(UnsafeFileError, match="not a regular file"):
        ckpt.metadata(2)
    assert ckpt.latest_step() == 1  # a step whose metadata is not a regular file is not committed
    one_line_error(flashckpt("verify", ckpt.root, "--step", "2"))


@pytest.mark.parametrize("target", ["/dev/zero", "/etc/passwd"])
def test_metadata_symlink_is_refused(ckpt, target):
    os.unlink(meta_path(ckpt))
    os.symlink(target, meta_path(ckpt))
    with pytest.raises(UnsafeFileError) as info:
        ckpt.metadata(2)
    assert target not in str(info.value)
    assert ckpt.latest_step() == 1
    out = flashckpt("verify", ckpt.root, "--step", "2")
    one_line_error(out)
    assert target not in out.stdout + out.stderr


def test_huge_metadata_is_refused_without_reading_it(ckpt):
    with open(meta_path(ckpt), "r+b") as f:
        f.truncate(65 << 20)
    with pytest.raises(CorruptCheckpointError, match="metadata"):
        ckpt.metadata(2)


@pytest.mark.parametrize("make", ["fifo", "zero", "huge", "symlink-out"])
def test_a_hostile_latest_is_ignored_and_repaired(ckpt, tmp_path, make):
    latest = os.path.join(ckpt.root, "latest")
    os.unlink(latest)
    if make == "fifo":
        os.mkfifo(latest)
    elif make == "zero":
        os.symlink("/dev/zero", latest)
    elif make == "huge":
        with open(latest, "wb") as f:
            f.truncate(1 << 30)
    else:
        outside = tmp_path / "outside"
        outside.write_text("1\n")
        os.symlink(outside, latest)
    assert ckpt.latest_step() == 2
    assert not os.path.islink(latest) and open(latest).read().strip() == "2"
    if make == "symlink-out":
        assert (tmp_path / "outside").read_text() == "1\n"  # the link was replaced, not written through


@pytest.mark.parametrize("changes", [{"world_size": "2"}, {"shards": []}, {"world_size": 10**12},
                                     {"shards": {"0": "x"}}, {"shards": {"0": {"file": 3, "size": 1}}},
                                     {"step": "two"}, {"committed_at": "yesterday"}])
def test_wrongly_typed_metadata_is_a_corrupt_checkpoint(ckpt, changes):
    rewrite_meta(ckpt, changes)
    with pytest.raises(CorruptCheckpointError):
        ckpt.metadata(2)
    for command in ("ls", "verify"):
        out = flashckpt(command, ckpt.root)
        one_line_error(out)
        assert "step 2" in out.stdout + out.stderr


def test_metadata_that_is_not_an_object(ckpt):
    with open(meta_path(ckpt), "w") as f:
        f.write("[1, 2, 3]")
    with pytest.raises(CorruptCheckpointError):
        ckpt.metadata(2)


def test_verify_of_a_huge_world_size_is_bounded_by_the_shards_present(ckpt):
    rewrite_meta(ckpt, {"world_size": 1 << 20})
    problems = ckpt.verify(2)
    assert len(problems) == 1 and "missing" in problems[0] and str((1 << 20) - 1) in problems[0]


# -- shards -------------------------------------------------------------------------------

def shard(ckpt, step=2, rank=0):
    return os.path.join(ckpt.step_dir(step), f"rank-{rank}.safetensors")


def test_open_shard_returns_a_raw_file_and_its_record(ckpt):
    f, record = ckpt.open_shard(2, 0)
    with f:
        assert f.raw is f if hasattr(f, "raw") else True
        assert f.read(8) and record["size"] == os.fstat(f.fileno()).st_size
    with pytest.raises(CheckpointNotFoundError):
        ckpt.open_shard(2, 1)
    with pytest.raises(CheckpointNotFoundError):
        ckpt.open_shard(3, 0)


def test_shard_fifo_is_refused_without_blocking(ckpt):
    os.unlink(shard(ckpt))
    os.mkfifo(shard(ckpt))
    with pytest.raises(UnsafeFileError, match="not a regular file"):
        ckpt.open_shard(2, 0)
    with pytest.raises(UnsafeFileError):
        ckpt.shard_path(2, 0)
    problems = ckpt.verify(2)
    assert len(problems) == 1 and "regular file" in problems[0]
    out = flashckpt("verify", ckpt.root)
    assert out.returncode == 1 and "step 1: ok" in out.stdout and "DAMAGED" in out.stdout


def test_shard_symlink_to_a_file_outside_is_refused_and_not_described(ckpt, tmp_path):
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"s" * 12345)
    os.unlink(shard(ckpt))
    os.symlink(outside, shard(ckpt))
    with pytest.raises(UnsafeFileError) as info:
        ckpt.open_shard(2, 0)
    assert "secret" not in str(info.value) and "12345" not in str(info.value)
    problems = ckpt.verify(2)
    assert problems and not any("secret" in p or "12345" in p for p in problems)


@pytest.mark.parametrize("name", ["../../../etc/passwd", "/etc/passwd", "sub/rank-0.safetensors", "..", ""])
def test_shard_names_must_be_plain(ckpt, name):
    meta = rewrite_meta(ckpt)
    meta["shards"]["0"]["file"] = name
    rewrite_meta(ckpt, {"shards": meta["shards"]})
    size = str(os.path.getsize("/etc/passwd"))
    with pytest.raises(CorruptCheckpointError) as info:
        ckpt.open_shard(2, 0)
    assert "passwd" not in str(info.value) or size not in str(info.value)
    problems = ckpt.verify(2)
    assert problems and not any(f"{size} bytes" in p for p in problems)
    one_line_error(flashckpt("verify", ckpt.root, "--step", "2"))


def test_a_name_leaving_the_directory_is_also_unsafe(ckpt):
    meta = rewrite_meta(ckpt)
    meta["shards"]["0"]["file"] = "../step-1/rank-0.safetensors"
    rewrite_meta(ckpt, {"shards": meta["shards"]})
    with pytest.raises(UnsafeFileError):
        ckpt.open_shard(2, 0)


def test_a_symlinked_step_directory_is_not_followed(ckpt, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    os.rename(ckpt.step_dir(2), elsewhere)
    os.symlink(elsewhere, ckpt.step_dir(2))
    assert ckpt.committed_steps() == [1]
    assert ckpt.latest_step() == 1
    with pytest.raises(UnsafeFileError):
        ckpt.open_shard(2, 0)
    with pytest.raises(UnsafeFileError):
        ckpt.metadata(2)


def test_a_truncated_shard_is_reported_by_open_shard(ckpt):
    with open(shard(ckpt), "r+b") as f:
        f.truncate(100)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        ckpt.open_shard(2, 0)


def test_verify_detects_a_shard_of_another_run(ckpt):
    foreign = bytes(image(2, B))
    with open(shard(ckpt), "wb") as f:
        f.write(foreign)
    meta = rewrite_meta(ckpt)
    rec = meta["shards"]["0"]
    rec["size"] = len(foreign)
    rec["block_crc32"] = [zlib.crc32(foreign[i:i + rec["block_size"]])
                          for i in range(0, len(foreign), rec["block_size"])]
    rewrite_meta(ckpt, {"shards": meta["shards"]})
    problems = ckpt.verify(2)
    assert len(problems) == 1 and "another run" in problems[0] and B in problems[0]
    assert ckpt.verify(1) == []


def test_a_shard_of_another_run_is_refused_at_write(tmp_path):
    storage = LocalStorage(tmp_path)
    with pytest.raises(CheckpointError, match="another run"):
        storage.write_shard(3, 0, A, image(3, B))
    assert not os.listdir(tmp_path) or not [n for n in os.listdir(tmp_path) if n.startswith("step-3")]


# -- one live run per directory -------------------------------------------------------------

CLAIM = """
import sys, time
from flashckpt.storage._local import LocalStorage
LocalStorage(sys.argv[1]).claim_run(sys.argv[2])
print("claimed", flush=True)
time.sleep(60)
"""


def test_a_second_live_run_on_the_directory_is_refused(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", CLAIM, str(tmp_path), A], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "claimed"
        storage = LocalStorage(tmp_path)
        with pytest.raises(JobConflictError) as info:
            storage.claim_run(B)
        assert str(proc.pid) in str(info.value) and os.uname().nodename in str(info.value)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    storage.claim_run(B)  # the kernel released the dead run's lock
    storage.claim_run(B)
    LocalStorage(tmp_path).claim_run(B)  # a second checkpointer in the same process
    content = json.loads(open(tmp_path / ".flashckpt-run.lock").read())
    assert content["pid"] == os.getpid() and content["token"] == B and "host" in content and "started_at" in content
    storage.release_run()
    storage.release_run()
    LocalStorage(tmp_path).release_run()


def test_a_released_run_lets_another_process_claim(tmp_path):
    storage = LocalStorage(tmp_path)
    storage.claim_run(A)
    storage.release_run()
    out = subprocess.run([sys.executable, "-c", CLAIM.replace("time.sleep(60)", ""), str(tmp_path), B],
                         capture_output=True, text=True, timeout=25)
    assert out.returncode == 0 and "claimed" in out.stdout, out.stderr


# -- a full disk --------------------------------------------------------------------------

@pytest.fixture
def small_fs(tmp_path):
    with small_tmpfs(tmp_path / "small", "4m") as mnt:
        yield mnt


def test_a_full_disk_leaves_no_partial_files_and_commits_resume(small_fs):
    storage = LocalStorage(small_fs / "ck")
    storage.check_writable()
    big = 1 << 20
    storage.write_shard(1, 0, A, image(1, A, big))
    assert storage.try_commit(1, 1, A, 1, branch=-1)
    os.makedirs(small_fs / "ck" / f"step-2.tmp-{A}")  # a crashed save's leftovers
    (small_fs / "ck" / f"step-2.tmp-{A}" / "rank-0.safetensors").write_bytes(b"x" * 1000)
    filler = small_fs / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    with pytest.raises(CheckpointError, match="No space left"):
        storage.write_shard(3, 0, A, image(3, A, big))
    assert not (small_fs / "ck" / f"step-3.tmp-{A}").exists()
    assert storage.latest_step() == 1 and storage.verify(1) == []
    filler.unlink()
    storage.write_shard(4, 0, A, image(4, A, big))
    assert storage.try_commit(4, 1, A, 1, branch=-1)
    assert storage.committed_steps() == [4] and storage.verify(4) == []
    assert sorted(os.listdir(small_fs / "ck")) == [".commit.lock", "latest", "step-4"]


def test_verify_detects_a_shard_of_another_run_saved_by_the_engine(tmp_path, job_id):
    import shutil

    import torch

    from flashckpt.torch import Checkpointer
    for name in ("a", "b"):
        with Checkpointer(tmp_path / name, job_id=f"{job_id}{name}") as ck:
            ck.save(3, {"w": torch.ones(1000)})
    shutil.copy(tmp_path / "b" / "step-3" / "rank-0.safetensors", tmp_path / "a" / "step-3" / "rank-0.safetensors")
    problems = LocalStorage(tmp_path / "a").verify(3)
    assert len(problems) == 1 and "another run" in problems[0], problems


def test_two_checkpointers_of_one_process_share_the_directory(tmp_path, job_id):
    import torch

    from flashckpt.torch import Checkpointer
    with Checkpointer(tmp_path, job_id=job_id) as first, Checkpointer(tmp_path, job_id=job_id) as second:
        first.save(1, {"w": torch.ones(10)})
        assert second.latest_step() in (None, 1)
    out = subprocess.run([sys.executable, "-c", CLAIM.replace("time.sleep(60)", ""), str(tmp_path), B],
                         capture_output=True, text=True, timeout=25)  # both released at close
    assert out.returncode == 0 and "claimed" in out.stdout, out.stderr
