"""Trainer save stall: the stock save vs FlashCheckpointCallback, side by side.

A GPT-2-small-sized model (124M parameters, built from a config, no download) trains
on CPU with AdamW; every ``--save-steps`` steps the Trainer saves. The stall of a save
step is the time from ``on_step_end`` to ``on_save`` (logging and evaluation are off,
so that interval is the save alone). Printed next to it: the memcpy floor, one copy of
the same bytes (weights and both Adam moments) into a buffer that is already mapped.

    .venv/bin/python benchmarks/hf_trainer.py [--steps 10 --save-steps 2 --seq 64]

Writes results/hf_trainer.json. Goal (issue 9): steady stall within 1.3x of the
floor and at least 10x below the stock save. "Steady" leaves out the first save into
each of the engine's two shared-memory slots, which also maps the fresh pages, and the
last save, which waits until every folder is written (printed apart).
Also printed: save to durable, from the end of a saved step until its ``checkpoint-N``
folder is complete on disk (issue 21: a Trainer killed soon after a save must find
that save's folder), for the stock save and for the callback.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from flashckpt.hf import FlashCheckpointCallback  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int) -> None:
        self.n, self.seq = n, seq

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 50257, (self.seq,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class StallTimer(TrainerCallback):
    """Seconds from the end of a step to the end of its save (the stall), and to the
    moment its ``checkpoint-N`` folder exists (durable), per saved step.

    The flash callback's exporter renames a finished folder into place, so the folder's
    appearance is the moment it is complete; the stock save writes the folder in place
    and is complete when ``on_save`` runs. A thread polls for folders every 2 ms.
    """

    def __init__(self, out: str) -> None:
        self.out = out
        self.stalls: dict[int, float] = {}
        self.durable: dict[int, float] = {}
        self.step_times: list[float] = []
        self._begin = self._end = 0.0
        self._ends: dict[int, float] = {}
        self._seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.002):
            try:
                names = os.listdir(self.out)
            except FileNotFoundError:
                continue
            now = time.perf_counter()
            for name in names:
                if name.startswith("checkpoint-") and name[len("checkpoint-"):].isdigit():
                    self._seen.setdefault(int(name[len("checkpoint-"):]), now)

    def finish(self) -> None:
        """Stop watching; durable time of each saved step (its folder seen, or its save returned)."""
        self._stop.set()
        self._watcher.join()
        for step, end in self._ends.items():
            done = max(self._seen.get(step, float("inf")), end + self.stalls[step])
            self.durable[step] = done - end

    def on_step_begin(self, args, state, control, **kwargs):
        self._begin = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self._end = time.perf_counter()
        self.step_times.append(self._end - self._begin)

    def on_save(self, args, state, control, **kwargs):
        self.stalls[state.global_step] = time.perf_counter() - self._end
        self._ends[state.global_step] = self._end


def run(out: str, flash: bool, opts) -> tuple[StallTimer, float, float]:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config())
    args = TrainingArguments(out, max_steps=opts.steps, save_steps=opts.save_steps, logging_steps=10_000,
                             per_device_train_batch_size=1, report_to=[], use_cpu=True, disable_tqdm=True,
                             seed=1, save_total_limit=2)
    timer = StallTimer(out)
    callbacks = ([FlashCheckpointCallback()] if flash else []) + [timer]
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(64, opts.seq), callbacks=callbacks)
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start
    timer.finish()
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    state_bytes += sum(t.numel() * t.element_size() for s in trainer.optimizer.state.values()
                       for t in s.values() if torch.is_tensor(t))
    return timer, total, state_bytes


def memcpy_floor(nbytes: int, repeats: int = 5) -> tuple[float, float]:
    """One copy of ``nbytes`` in tensors shaped like the state into a buffer already
    mapped: (fastest, median) of ``repeats``."""
    model = GPT2LMHeadModel(GPT2Config())
    srcs = [p.detach() for p in model.parameters()] * 3  # weights + exp_avg + exp_avg_sq
    total = sum(t.numel() * t.element_size() for t in srcs)
    dst = torch.empty(total, dtype=torch.uint8)
    dst.fill_(1)  # map every page first, as the callback's shared memory is after its first save
    views, at = [], 0
    for t in srcs:
        n = t.numel() * t.element_size()
        views.append(dst[at:at + n].view(t.dtype).view(t.shape))
        at += n
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch._foreach_copy_(views, srcs)
        times.append((time.perf_counter() - start) * nbytes / total)
    return min(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results", "hf_trainer.json"))
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads of training (both runs); fewer than the cores leaves the saver a core")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    work = tempfile.mkdtemp(prefix="flashckpt-bench-hf-")
    try:
        stock, stock_total, nbytes = run(os.path.join(work, "stock"), False, opts)
        flash, flash_total, _ = run(os.path.join(work, "flash"), True, opts)
        floor, floor_median = memcpy_floor(nbytes)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    steps = sorted(stock.stalls)
    stock_mean = statistics.mean(stock.stalls.values())
    # the engine has two slots: the first save into each maps fresh shared memory
    flash_first = statistics.mean(flash.stalls[s] for s in steps[:2])
    # the last save waits for every folder (the Trainer then reads the best one): timed apart
    middle = steps[2:-1] or steps[-1:]
    flash_steady = statistics.mean(flash.stalls[s] for s in middle)
    flash_last, stock_last = flash.stalls[steps[-1]], stock.stalls[steps[-1]]
    step_time = statistics.median(stock.step_times)
    print(f"GPT-2 small ({nbytes / 2**30:.2f} GiB of weights + Adam state), {opts.steps} steps, "
          f"save every {opts.save_steps}; median step {step_time:.2f}s")
    print(f"{'step':>6} {'stock save (s)':>15} {'flash (s)':>10} {'stock/flash':>12}")
    for s in steps:
        print(f"{s:>6} {stock.stalls[s]:>15.3f} {flash.stalls[s]:>10.3f} {stock.stalls[s] / flash.stalls[s]:>12.1f}")
    print(f"memcpy floor {floor:.3f}s ({nbytes / floor / 2**30:.2f} GiB/s; median of 5: {floor_median:.3f}s)")
    print(f"flash steady stall / floor: {flash_steady / floor:.2f}x (goal <= 1.3x); "
          f"stock / flash steady: {stock_mean / flash_steady:.1f}x (goal >= 10x); "
          f"first save into each of the two slots (maps shared memory): {flash_first:.3f}s")
    print(f"last save (step {steps[-1]}: the callback waits until every folder is written): stock {stock_last:.2f}s, "
          f"flash {flash_last:.2f}s")
    flash_step = statistics.median(flash.step_times)
    print(f"median training step (no save in it): stock run {step_time:.2f}s, flash run {flash_step:.2f}s "
          f"(the saver writes in the background on the same cores)")
    stock_durable = statistics.median(stock.durable.values())
    flash_durable = statistics.median(flash.durable.values())
    print(f"save to durable (step end -> checkpoint-N folder complete), median: stock {stock_durable:.2f}s, "
          f"flash {flash_durable:.2f}s ({flash_durable / stock_durable:.2f}x the stock save; "
          "per step: " + ", ".join(f"{s}: {flash.durable[s]:.2f}s" for s in steps) + ")")
    print(f"whole train(): stock {stock_total:.1f}s, flash {flash_total:.1f}s (flash waits for the last folder)")
    result = {
        "benchmark": "hf_trainer", "model": "gpt2-small (GPT2Config())", "state_bytes": nbytes,
        "steps": opts.steps, "save_steps": opts.save_steps, "seq": opts.seq, "threads": opts.threads,
        "median_step_seconds": step_time,
        "median_step_seconds_flash_run": statistics.median(flash.step_times),
        "stall_seconds": {"stock": {str(s): stock.stalls[s] for s in steps},
                          "flash": {str(s): flash.stalls[s] for s in steps}},
        "stock_mean_seconds": stock_mean, "flash_first_seconds": flash_first, "flash_steady_seconds": flash_steady,
        "steady_steps": middle, "last_save_seconds": {"stock": stock_last, "flash": flash_last},
        "memcpy_floor_seconds": floor, "memcpy_floor_median_seconds": floor_median,
        "ratio_flash_steady_to_floor": flash_steady / floor, "ratio_stock_to_flash_steady": stock_mean / flash_steady,
        "train_seconds": {"stock": stock_total, "flash": flash_total},
        "durable_seconds": {"stock": {str(s): stock.durable[s] for s in steps},
                            "flash": {str(s): flash.durable[s] for s in steps}},
        "ratio_flash_to_stock_durable_median": flash_durable / stock_durable,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "load_average": os.getloadavg()},
    }
    os.makedirs(os.path.dirname(os.path.abspath(opts.out)), exist_ok=True)
    with open(opts.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {os.path.abspath(opts.out)}")


if __name__ == "__main__":
    main()
