"""The flashckpt command line: ls, verify, gc, persist, convert; errors as one line each."""

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from flashckpt import _names, cli
from flashckpt.torch import Checkpointer

from .conftest import shm_objects
from .test_ckpt_crash import saver_pids, start_trainer, wait_for_line


def flashckpt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashckpt.cli", *args], capture_output=True, text=True, timeout=60)


def convert(*args: str) -> subprocess.CompletedProcess:
    """``flashckpt convert ARGS`` run in this process, which imported torch already (a new
    process spends seconds importing it per conversion): exit code and output as the command's.
    ``test_convert_to_a_file_torch_load_reads`` runs the real command."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(["convert", *args])
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code
    return subprocess.CompletedProcess(["flashckpt", "convert", *args], code, out.getvalue(), err.getvalue())


def test_ls_and_verify(tmp_path, job_id):
    with Checkpointer(tmp_path, job_id=job_id) as ck:
        ck.save(10, {"w": torch.ones(1000)})
        ck.save(20, {"w": torch.ones(1000)})
    out = flashckpt("ls", str(tmp_path))
    assert out.returncode == 0
    lines = out.stdout.splitlines()
    assert lines[1].split()[:2] == ["10", "1"] and lines[2].split()[:2] == ["20", "1"] and "(latest)" in lines[2]
    assert flashckpt("verify", str(tmp_path)).stdout.split("\n")[:2] == ["step 10: ok", "step 20: ok"]
    shard = tmp_path / "step-20" / "rank-0.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    out = flashckpt("verify", str(tmp_path), "--step", "20")
    assert out.returncode == 1 and "DAMAGED" in out.stdout and "checksum" in out.stdout


def test_persist_rescues_a_dead_job_and_gc_cleans_up(tmp_path, job_id):
    proc = start_trainer(tmp_path, job_id, 3, 1000, 1, "--linger", 60)  # nothing reaches storage on its own
    wait_for_line(proc, "saved 3")
    for pid in saver_pids(job_id):  # the node's saver dies first, then the trainer
        os.kill(pid, signal.SIGKILL)
    proc.kill()
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    assert saver_pids(job_id) == []
    assert not (tmp_path / "latest").exists()

    out = flashckpt("gc")
    assert f"job {job_id}: keeping" in out.stdout and "in memory only" in out.stdout
    assert any(".slot" in p for p in shm_objects(job_id))

    out = flashckpt("persist", "--job-id", job_id)
    assert "persisted step 3" in out.stdout and "committed" in out.stdout, out.stdout + out.stderr
    assert (tmp_path / "latest").read_text().strip() == "3"

    out = flashckpt("gc")
    assert out.returncode == 0
    assert not [p for p in shm_objects(job_id) if ".slot" in p or ".rank" in p]



def test_gc_asking_a_saver_whether_it_serves_is_no_trainer_that_died(tmp_path, job_id):
    """``gc`` tells a live job by connecting to its saver's socket; the saver must not take
    that connection for a trainer that went without closing (a crash flush, a warning, and
    a job it no longer sees as ended cleanly)."""
    with Checkpointer(tmp_path, job_id=job_id) as ck:
        ck.save(1, {"w": torch.ones(10)})
        assert job_id not in flashckpt("gc", "--dry-run").stdout  # a live job: left alone
    [saver] = saver_pids(job_id)
    assert cli._job_alive(job_id, cli._segments()[job_id])  # after it closed, before the saver exits
    deadline = time.monotonic() + 30
    while saver in saver_pids(job_id):
        assert time.monotonic() < deadline, "the saver did not exit after its trainer closed"
        time.sleep(0.1)
    with open(_names.saver_log_path(job_id)) as f:
        log = f.read()
    assert "closed" in log and "without closing" not in log, log

_DEAD_JOB = textwrap.dedent("""
    import sys
    from flashckpt import _names
    from flashckpt.memory._slot import Slot, SlotState, mark_writing
    slot = Slot.open(_names.slot_path(sys.argv[1], 0, 0), writable=True, create=True)
    slot.ensure_capacity(64)
    header = mark_writing(slot, 3, 64, {"persist": True, "directory": sys.argv[2], "token": "t0",
                                        "storage_rank": 0, "storage_world": 1, "keep_last": 2})
    header.state = SlotState.COMPLETE
    slot.write_header(header)
""")


@pytest.mark.parametrize("where", ["bucket", "directory"])
def test_gc_and_persist_go_on_past_a_job_whose_storage_cannot_be_reached(tmp_path, job_id, where):
    """A dead job's slot names storage this process cannot read (a bucket whose endpoint is
    down or whose credentials are gone; a directory that cannot be listed, here a symlink
    loop): gc keeps that job's objects and says why, and still cleans up the others;
    persist names the failure and goes on to the other jobs."""
    env = {**os.environ, "AWS_DEFAULT_REGION": "us-east-1", "FSSPEC_S3": json.dumps(
        {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s",
         "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}})}
    directory = "s3://gone/run" if where == "bucket" else str(tmp_path / "loop")
    if where == "directory":
        os.symlink(directory, directory)
    stuck, stale = job_id + "s", job_id + "d"
    subprocess.run([sys.executable, "-c", _DEAD_JOB, stuck, directory], check=True, timeout=60)
    log = os.path.join(os.path.dirname(shm_objects(stuck)[0]), f"{stale}-saver.log")
    open(log, "w").close()
    try:
        out = subprocess.run([sys.executable, "-m", "flashckpt.cli", "gc"], capture_output=True, text=True,
                             timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        assert f"job {stuck}: keeping" in out.stdout and directory in out.stdout, out.stdout
        assert shm_objects(stuck) and not os.path.exists(log)
        out = subprocess.run([sys.executable, "-m", "flashckpt.cli", "persist"], capture_output=True, text=True,
                             timeout=120, env=env)
        assert out.returncode == 1 and f"job {stuck}" in out.stderr and directory in out.stderr, out.stderr
    finally:
        for path in shm_objects(stuck):
            os.unlink(path)


def test_convert_to_a_file_torch_load_reads(tmp_path, job_id):
    with Checkpointer(tmp_path / "ck", job_id=job_id) as ck:
        ck.save(3, {"model": {"w": torch.arange(6.0)}, "step": 3})
    out = flashckpt("convert", str(tmp_path / "ck"), str(tmp_path / "out.pt"), "--to", "torch")
    assert out.returncode == 0, out.stderr
    loaded = torch.load(tmp_path / "out.pt")
    assert loaded["step"] == 3 and torch.equal(loaded["model"]["w"], torch.arange(6.0))
    out = convert(str(tmp_path / "nothing"), str(tmp_path / "x.pt"), "--to", "torch")
    assert out.returncode == 2 and out.stderr.startswith("error:")


# -- errors, help, convert of every rank, DCP steps (issues 20 and 24) -------------------------

def per_rank_checkpoint(directory, step: int, states: list) -> None:
    """A committed step whose every rank saved its own state (no sharded layout), as
    flashckpt.torch.Checkpointer writes one under a 2-rank process group."""
    from flashckpt._engine import new_token
    from flashckpt.memory._format import plan_image
    from flashckpt.storage._local import LocalStorage
    from flashckpt.memory._tree import flatten
    from flashckpt.torch import _tensors  # noqa: F401
    storage = LocalStorage(directory)
    storage.check_writable()
    token = new_token()
    for rank, state in enumerate(states):
        flat = flatten(state)
        meta = {"format": "flashckpt/1", "step": step, "tree": flat.skeleton, "rank": rank,
                "world_size": len(states), "kinds": {leaf.name: leaf.kind.name for leaf in flat.leaves}}
        image = plan_image([(leaf.name, leaf.dtype, leaf.shape) for leaf in flat.leaves], meta)
        buf = bytearray(image.size)
        buf[:len(image.header)] = image.header
        by_name = {leaf.name: leaf.obj for leaf in flat.leaves}
        for entry in image.entries:
            data = by_name[entry.name].contiguous().view(torch.uint8).numpy().reshape(-1)
            at = len(image.header) + entry.offset
            buf[at:at + entry.nbytes] = memoryview(data)
        storage.write_shard(step, rank, token, memoryview(bytes(buf)))
    assert storage.try_commit(step, len(states), token, 0, branch=step - 1)


def test_ls_of_a_missing_directory_says_so(tmp_path):
    for command in ("ls", "verify"):
        out = flashckpt(command, str(tmp_path / "nothing"))
        assert out.returncode != 0 and "no such directory" in out.stderr, out
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    out = flashckpt("ls", str(tmp_path))
    assert out.returncode == 1 and "no committed steps" in out.stdout


def test_every_subcommand_help_describes_its_arguments():
    wanted = {"ls": ["checkpoint directory"], "verify": ["checkpoint directory", "--step N", "only step N"],
              "gc": ["--dry-run", "would be removed", "--force"], "persist": ["--job-id", "only this job"],
              "convert": ["checkpoint directory", "output file", "--to", "output format", "--from",
                          "input format", "--step", ".rank-R"]}
    for command, phrases in wanted.items():
        out = flashckpt(command, "--help")
        assert out.returncode == 0
        text = " ".join(out.stdout.split())
        for phrase in phrases:
            assert phrase in text, (command, phrase, text)


@pytest.mark.timeout(60)
def test_cli_errors_are_one_line_per_problem_without_tracebacks(tmp_path, job_id):
    with Checkpointer(tmp_path, job_id=job_id, keep_last=0) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"w": torch.ones(1000)})
    meta = tmp_path / "step-2" / "metadata.json"
    bad = json.loads(meta.read_text())
    bad["world_size"] = "two"
    meta.write_text(json.dumps(bad))
    os.unlink(tmp_path / "step-3" / "rank-0.safetensors")
    os.mkfifo(tmp_path / "step-3" / "rank-0.safetensors")
    os.unlink(tmp_path / "latest")
    os.symlink("/dev/zero", tmp_path / "latest")
    out = flashckpt("ls", str(tmp_path))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "step-2/metadata.json: world_size 'two'" in out.stdout
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    out = flashckpt("verify", str(tmp_path))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    lines = out.stdout.splitlines()
    assert lines == ["step 1: ok", "step 2: DAMAGED", lines[2], "step 3: DAMAGED", lines[4]], lines
    assert "world_size" in lines[2] and "not a regular file" in lines[4]
    out = convert(str(tmp_path), str(tmp_path / "x.pt"), "--to", "torch", "--step", "3")
    assert out.returncode == 2 and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    out = convert(str(tmp_path / "nothing"), str(tmp_path / "x.pt"), "--to", "torch", "--from", "dcp")
    assert out.returncode == 2 and "no such directory" in out.stderr and "Traceback" not in out.stderr


def test_convert_writes_every_rank_of_a_per_rank_checkpoint(tmp_path):
    states = [{"model": {"w": torch.full((4,), float(r))}, "rank": r} for r in range(2)]
    per_rank_checkpoint(tmp_path / "ck", 6, states)
    out = convert(str(tmp_path / "ck"), str(tmp_path / "model.pt"), "--to", "torch")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["wrote", str(tmp_path / "model.rank-0.pt"), "wrote", str(tmp_path / "model.rank-1.pt")]
    for rank in range(2):
        got = torch.load(tmp_path / f"model.rank-{rank}.pt")
        assert got["step"] == 6 and got["rank"] == rank and torch.equal(got["model"]["w"], states[rank]["model"]["w"])
    assert not (tmp_path / "model.pt").exists()


def test_convert_from_dcp_keeps_its_step(tmp_path, job_id):
    import torch.distributed.checkpoint as dcp
    from flashckpt.storage._local import LocalStorage
    dcp.save({"model": {"w": torch.arange(4.0)}, "step": 7}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    out = convert(str(tmp_path / "dcp"), str(tmp_path / "flash"), "--from", "dcp", "--to", "flashckpt")
    assert out.returncode == 0, out.stderr
    assert LocalStorage(tmp_path / "flash").committed_steps() == [7]
    dcp.save({"model": {"w": torch.arange(4.0)}}, checkpoint_id=str(tmp_path / "step-12"), no_dist=True)
    out = convert(str(tmp_path / "step-12"), str(tmp_path / "flash12"), "--from", "dcp", "--to",
                    "flashckpt")
    assert out.returncode == 0, out.stderr
    assert LocalStorage(tmp_path / "flash12").committed_steps() == [12]
    dcp.save({"model": {"w": torch.arange(4.0)}}, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    out = convert(str(tmp_path / "plain"), str(tmp_path / "flash0"), "--from", "dcp", "--to",
                    "flashckpt")
    assert out.returncode == 2 and "--step" in out.stderr
    out = convert(str(tmp_path / "plain"), str(tmp_path / "flash0"), "--from", "dcp", "--to",
                    "flashckpt", "--step", "3")
    assert out.returncode == 0 and LocalStorage(tmp_path / "flash0").committed_steps() == [3]


def test_ls_shows_the_steps_held_in_memory_on_this_node(tmp_path, job_id):
    with Checkpointer(tmp_path, job_id=job_id, persist_every=100) as ck:
        ck.save(1, {"w": torch.ones(100)}, persist=True)
        ck.wait()
        ck.save(3, {"w": torch.ones(100)})
        out = flashckpt("ls", str(tmp_path))
        assert out.returncode == 0, out.stderr
        assert "step 3 rank 0: in memory on this node" in out.stdout
        assert "(latest)" in out.stdout
