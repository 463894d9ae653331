"""`make demo`: a DDP training run that is killed mid-way, restarts and restores from memory.

Runs examples/train_ddp.py under `torchrun --nproc_per_node=2 --max-restarts=3`, sends
SIGKILL to worker rank 1 half-way through, and reports what the restart did: where it
restored from and how fast, how many steps were lost and how many data shards were
redone from their checkpointed positions.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
KILL_AT_STEP = 60


def main() -> int:
    workdir = tempfile.mkdtemp(prefix="flashckpt-demo-")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--max-restarts=3", os.path.join(HERE, "train_ddp.py"), "--workdir", workdir]
    print(f"flashckpt demo: 2 DDP workers (gloo) under torchrun --max-restarts=3, data in shards from "
          f"SQLite, a flash checkpoint every step (storage every 20th)\n  workdir {workdir}\n", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    began = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    pids: dict[tuple[int, int], int] = {}
    last_step_before_kill = None
    killed_at = None
    restored: list[dict] = []
    done = None
    for line in proc.stdout:
        line = line.strip()
        try:
            event = json.loads(line)
        except ValueError:
            continue
        kind, rank = event["event"], event.get("rank")
        if kind == "start":
            pids[(event["attempt"], rank)] = event["pid"]
        elif kind == "step" and rank == 0 and event["step"] % 20 == 0:
            print(f"  step {event['step']:4d}  loss {event['loss']:.4f}", flush=True)
        if kind == "step" and rank == 1 and killed_at is None and event["step"] >= KILL_AT_STEP:
            last_step_before_kill = event["step"]
            killed_at = time.perf_counter()
            os.kill(pids[(0, 1)], signal.SIGKILL)
            print(f"  step {event['step']:4d}  kill -9 worker rank 1 (pid {pids[(0, 1)]})", flush=True)
        elif kind == "restored":
            restored.append(event)
            if len(restored) == 1:
                print(f"  torchrun restarted the workers after {time.perf_counter() - killed_at:.1f}s", flush=True)
            print(f"  rank {rank}: restored step {event['step']} from {event['source']} in "
                  f"{event['seconds'] * 1000:.1f} ms", flush=True)
        elif kind == "done" and rank == 0:
            done = event
    proc.wait()
    total = time.perf_counter() - began
    if proc.returncode != 0 or done is None or not restored:
        print(f"demo FAILED: torchrun exited {proc.returncode}; see {workdir}", file=sys.stderr)
        return 1
    steps_lost = last_step_before_kill - min(r["step"] for r in restored)
    print(f"\nwhat happened\n"
          f"  killed at step {last_step_before_kill}; restored step {restored[0]['step']} from "
          f"{restored[0]['source']} on all ranks in {max(r['seconds'] for r in restored) * 1000:.1f} ms\n"
          f"  steps lost: {steps_lost}\n"
          f"  data shards redone (resumed at their checkpointed position): {restored[0]['shards_redone']}\n"
          f"  finished at step {done['step']}, final loss {done['loss']:.4f}, {total:.1f}s in all")
    subprocess.run([sys.executable, "-m", "flashckpt.cli", "ls", os.path.join(workdir, "ckpt")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
