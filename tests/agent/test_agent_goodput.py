"""Goodput from records (pure), the metrics of a real run, and the report CLI."""

from __future__ import annotations

import glob
import json
import struct
import subprocess
import sys
import zlib

import pytest

from elastic._goodput import summarize
from tests.agent.agent_helpers import ROOT, env, explain, run


def steps(pid, first, last, t_begin, t_end, busy, rank=0, **kw):
    return {"type": "steps", "rank": rank, "pid": pid, "first": first, "last": last,
            "t_begin": t_begin, "t_end": t_end, "time": t_end, "busy_seconds": busy, **kw}


def test_goodput_counts_rolled_back_steps_once_and_measures_downtime():
    recs = [
        {"type": "start", "rank": 0, "pid": 1, "time": 0.0},
        steps(1, 1, 10, 0.0, 10.0, 10.0, ckpt_seconds=0.5, saves=10),
        steps(1, 11, 14, 10.0, 14.0, 4.0),             # steps 11..14 are lost: restore to 10
        {"type": "failure", "rank": 0, "pid": 1, "time": 14.0, "diagnosis": {"kind": "oom"}},
        {"type": "start", "rank": 0, "pid": 2, "time": 16.0},
        {"type": "load", "rank": 0, "pid": 2, "time": 17.0, "step": 10},
        steps(2, 11, 20, 17.0, 27.0, 10.0),
    ]
    s = summarize(recs)["ranks"][0]
    assert s["wall_seconds"] == pytest.approx(27.0)
    assert s["useful_seconds"] == pytest.approx(20.0)  # steps 1..20 once each
    assert s["goodput"] == pytest.approx(20.0 / 27.0)
    assert s["rollback_steps"] == 4 and s["rollback_seconds"] == pytest.approx(4.0)
    assert s["restart_downtime_seconds"] == pytest.approx(3.0)  # last step 14.0 -> next at 17.0
    assert s["restarts"] == 1 and s["failures"] == 1 and s["failure_kinds"] == {"oom": 1}
    assert s["lost_seconds_per_restart"] == pytest.approx(7.0)
    assert s["checkpoint_blocking_seconds"] == pytest.approx(0.5) and s["last_step"] == 20


def test_partial_rollback_keeps_the_surviving_part_of_a_segment():
    recs = [steps(1, 1, 10, 0.0, 10.0, 10.0), steps(2, 6, 10, 12.0, 17.0, 5.0)]
    s = summarize(recs)["ranks"][0]
    assert s["rollback_steps"] == 5 and s["useful_seconds"] == pytest.approx(10.0)
    assert s["steps"] == 10


def test_metrics_of_a_run_across_a_torchrun_restart_and_the_report(tmp_path):
    out = str(tmp_path)  # no checkpoint: the restart re-does steps 1..6 (a rollback)
    proc = run(out, "--steps", "12", "--fault", "memory", "--fault-step", "7", nproc=2,
               max_restarts=1, timeout=180)
    assert proc.returncode == 0, explain(proc)
    rep = subprocess.run([sys.executable, "-m", "elastic.report", f"{out}/metrics"], env=env(),
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert rep.returncode == 0, rep.stderr
    assert "goodput:" in rep.stdout and "restarts: 1" in rep.stdout, rep.stdout
    png = open(f"{out}/metrics/timeline.png", "rb").read()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    idat = png.index(b"IDAT")
    length = int.from_bytes(png[idat - 4:idat], "big")
    assert zlib.decompress(png[idat + 4:idat + 4 + length])  # a valid image body
    from elastic._goodput import read_records
    job = summarize(read_records(f"{out}/metrics"))["job"]
    assert job["last_step"] == 12 and job["restarts"] == 1 and 0 < job["goodput"] < 1
    assert job["rollback_steps"] == 6 and job["restart_downtime_seconds"] > 0


def test_report_lists_every_rank_events_from_the_coordinator(tmp_path):
    import sharding

    url = f"sqlite:///{tmp_path}/job.db"
    coord = sharding.connect(url)
    coord.publish("failure", {"type": "failure", "rank": 1, "worker": "node2-rank1", "step": 40,
                              "diagnosis": {"kind": "oom", "action": "restart_process",
                                            "reason": "out of memory: MemoryError"}}, source="node2-rank1")
    coord.publish("load", {"type": "load", "rank": 0, "step": 40, "source": "memory"}, source="node1-rank0")
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    (metrics / "rank0.jsonl").write_text(json.dumps(steps(1, 1, 4, 0.0, 2.0, 2.0)) + "\n")
    rep = subprocess.run([sys.executable, "-m", "elastic.report", str(metrics), "--coordinator", url],
                         env=env(), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert rep.returncode == 0, rep.stderr
    lines = rep.stdout.splitlines()
    assert lines[0] == "events in the coordinator's log: 2", rep.stdout
    assert "node2-rank1" in lines[1] and "failure" in lines[1] and "oom -> restart_process" in lines[1]
    assert "node1-rank0" in lines[2] and "source=memory" in lines[2] and "step=40" in lines[2]
    assert "goodput:" in rep.stdout


def test_report_without_records_exits_1(tmp_path):
    rep = subprocess.run([sys.executable, "-m", "elastic.report", str(tmp_path)], env=env(),
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert rep.returncode == 1 and "no agent records" in rep.stderr


TB_SCRIPT = """
import sys
from elastic._goodput import MetricsLog
log = MetricsLog(sys.argv[1], rank=0)
log.write("steps", first=1, last=4, busy_seconds=2.0, ckpt_seconds=0.1, t_begin=0.0, t_end=2.0)
log.close()
print(sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "tensorboard")
             or m.startswith("torch.utils.tensorboard")))
"""


def test_tensorboard_scalars_without_importing_tensorboard_or_tensorflow(tmp_path):
    pytest.importorskip("tensorboard")  # scalars are written only where TensorBoard is installed
    proc = subprocess.run([sys.executable, "-c", TB_SCRIPT, str(tmp_path)], env=env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr
    from elastic._tensorboard import _masked, crc32c
    from tensorboard.compat.proto.event_pb2 import Event  # protobuf only, no TensorFlow

    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    (path,) = glob.glob(f"{tmp_path}/tensorboard/rank0/events.out.tfevents.*")
    raw, events = open(path, "rb").read(), []
    while raw:
        (n,), (head_crc,) = struct.unpack("<Q", raw[:8]), struct.unpack("<I", raw[8:12])
        data, (data_crc,) = raw[12:12 + n], struct.unpack("<I", raw[12 + n:16 + n])
        assert head_crc == _masked(crc32c(raw[:8])) and data_crc == _masked(crc32c(data))
        events.append(Event.FromString(data))
        raw = raw[16 + n:]
    assert events[0].file_version == "brain.Event:2"
    assert events[1].step == 4
    values = {v.tag: v.simple_value for v in events[1].summary.value}
    assert values == {"elastic/step_seconds": pytest.approx(0.5),
                      "elastic/ckpt_blocking_seconds": pytest.approx(0.1)}
