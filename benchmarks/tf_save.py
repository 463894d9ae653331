"""TensorFlow: flashckpt.tf side by side with TF's own checkpoints, and elastic.tf input speed.

    python benchmarks/tf_save.py [--params 100e6] [--repeats 3] [--records 1000000]
                                 [--input-fresh] [--input-chunk 100] [--dir DIR] [--json results/tf_save.json]

Part 1, eager (Keras): a stack of Dense layers with about ``--params`` parameters, Adam
state built (parameters + two moments). Timed, medians over repeats, methods interleaved:
- floor: one ``np.copyto`` of every variable (through a view of its buffer) into a
  preallocated, already-touched shared-memory mapping: the memcpy floor; and the same
  copies dealt out to as many threads as a save's copy uses (``flashckpt.memory._copy``: the
  usable CPUs, at most 4), the floor for a save that uses the machine's bandwidth.
- ``Checkpointer.save`` blocking time (steady state, persist on; ``--pairs`` saves per repeat,
  each right after a threaded floor copy, with the median of their paired ratios), ``save`` + ``wait``
  (durable), ``load`` from memory (in place);
- ``tf.train.Checkpoint.write`` (synchronous, to the same disk), its async variant
  (``CheckpointOptions(experimental_enable_async_checkpoint=True)``: blocking part only)
  and ``tf.train.Checkpoint.read`` + ``assert_consumed``;
- training time lost per checkpoint where the copy is deferred (``Checkpointer(...,
  background=True)`` and TF's async write): blocking part + (the training step right
  after it - a training step), as both leave the variables' buffers to copy-on-write.

Part 2, graph mode (tf.estimator's session): the same parameter count as graph variables;
floors (one copy into touched shared memory from a ``tf.numpy_function`` over the
variables' reads, on one thread and on the save's threads), ``FlashCheckpointHook``'s
load from memory and save, and ``tf.compat.v1.train.Saver.save`` (what the estimator's
``CheckpointSaverHook`` calls; to the page cache, no fsync, like
``tf.train.Checkpoint.write`` in part 1).

Part 3, input: records/s of ``make_input_fn``'s pipeline (SQLite coordinator, shards of
``--shard-size`` records, the consumer counting each batch as the hook does) vs a plain
``tf.data.Dataset.range`` over the same shards with the same reader. Both pipelines are open
in one process and consumed in turns of ``--input-chunk`` batches, so the machine's drift
(its speed swings by a fifth within a minute here, and runs of one pipeline alone land on
one of two speeds) hits both alike; separate runs back to back measured anywhere from 56%
to 135% by pair. Reported: each pass's ratio and their median, and records per CPU-second
of the consuming thread. Each repeat also runs a pass with tf.data's autotuning off.
``--input-fresh`` runs each pass in a fresh process, as a training job has.
"""

from __future__ import annotations

import argparse
import itertools
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import elastic.tf as etf  # noqa: E402
from flashckpt.tf import Checkpointer, FlashCheckpointHook  # noqa: E402
from flashckpt.memory import _copy  # noqa: E402
from flashckpt.tf import _variables  # noqa: E402


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def dense_stack(params: float) -> tuple[tf.keras.Model, int]:
    width = 4096
    layers = max(1, round(params / (width * width)))
    model = tf.keras.Sequential([tf.keras.Input((width,))] + [tf.keras.layers.Dense(width) for _ in range(layers)])
    model.compile(tf.keras.optimizers.Adam(1e-4), "mse")
    model.optimizer.build(model.trainable_variables)
    return model, int(sum(np.prod(v.shape) for v in model.trainable_variables))


def copy_pairs(pairs: list[tuple[np.ndarray, np.ndarray]], threads: int = 1) -> None:
    """``np.copyto`` of each pair; with ``threads``, the pairs are dealt out round-robin to
    that many threads (numpy copies without the GIL): the floors' copies, with no engine."""
    if threads == 1:
        for dst, src in pairs:
            np.copyto(dst, src)
        return
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(copy_pairs, [pairs[i::threads] for i in range(threads)]))


class Floor:
    """A touched shared-memory mapping the size of the state, and one copy into it."""

    def __init__(self, variables: list[tf.Variable]) -> None:
        self.path = f"/dev/shm/tfbench-{uuid.uuid4().hex[:8]}"
        self.size = sum(_variables.read_alias(v).nbytes for v in variables)
        with open(self.path, "w+b") as f:
            f.truncate(self.size)
            self.mm = mmap.mmap(f.fileno(), self.size)
        np.frombuffer(self.mm, np.uint8)[:] = 1
        self.views, at = [], 0
        for v in variables:
            a = _variables.read_alias(v)
            self.views.append(np.frombuffer(self.mm, a.dtype, a.size, at).reshape(a.shape))
            at += a.nbytes

    def copy(self, variables: list[tf.Variable], threads: int = 1) -> None:
        copy_pairs([(dst, _variables.read_alias(v)) for dst, v in zip(self.views, variables)], threads)

    def close(self) -> None:
        self.views = []
        self.mm.close()
        os.unlink(self.path)


def bench_eager(args, root: Path) -> dict:
    model, nparams = dense_stack(args.params)
    ckpt_obj = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    variables = list(_variables.collect(_variables.as_checkpoint(ckpt_obj))[0].values())
    state_bytes = sum(_variables.read_alias(v).nbytes for v in variables)
    print(f"eager: {nparams / 1e6:.1f}M parameters, state {state_bytes / 2**30:.2f} GiB "
          f"({len(variables)} variables with Adam moments)", flush=True)
    floor = Floor(variables)
    threads = _copy.copy_threads()  # what a save's copy uses here
    flash = Checkpointer(root / "flash", ckpt_obj, keep_last=1, job_id=f"tfbench{uuid.uuid4().hex[:6]}")
    flash.save(0)  # first save maps fresh pages; steady state is what training sees
    flash.wait()
    flash.save(1)
    flash.wait()
    async_opts = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True)
    x, y = tf.random.uniform([8, 4096]), tf.zeros([8, 4096])
    model.train_on_batch(x, y)  # traced once: a step is one optimizer update of every variable

    def train_step() -> None:
        model.train_on_batch(x, y)

    r: dict[str, list[float]] = {k: [] for k in (
        "floor", "floor_threads", "flash_save", "flash_durable", "flash_load_memory", "tf_write", "tf_async_write_blocking",
        "tf_read", "train_step", "flash_background_save", "step_after_flash_background", "step_after_tf_async", "save_over_floor_threads_paired")}
    step = 2
    for rep in range(args.repeats):
        r["floor"].append(median([timed(lambda: floor.copy(variables)) for _ in range(3)]))
        # steady saves alternate with the threaded floor, back to back, each save persisted before
        # the next pair: their ratios cancel this machine's drift in memory bandwidth
        pairs = []
        for _ in range(args.pairs):
            pairs.append((timed(lambda: floor.copy(variables, threads)), timed(lambda: flash.save(step))))
            flash.wait()
            step += 1
        r["floor_threads"].append(median([f for f, _ in pairs]))
        r["flash_save"].append(median([s for _, s in pairs]))
        r["save_over_floor_threads_paired"].append(median([s / f for f, s in pairs]))
        r["flash_durable"].append(timed(lambda: (flash.save(step), flash.wait())))
        step += 1
        r["flash_load_memory"].append(timed(lambda: flash.load()))
        r["train_step"].append(timed(train_step))
        flash._background = True  # Checkpointer(background=True): the copy overlaps the next step
        r["flash_background_save"].append(timed(lambda: flash.save(step)))
        r["step_after_flash_background"].append(timed(train_step))  # pays copy-on-write and a busy core
        flash.wait()
        flash._background = False
        step += 1
        path = str(root / f"tf-{rep}" / "ckpt")
        r["tf_write"].append(timed(lambda: ckpt_obj.write(path)))
        apath = str(root / f"tfa-{rep}" / "ckpt")
        r["tf_async_write_blocking"].append(timed(lambda: ckpt_obj.write(apath, options=async_opts)))
        r["step_after_tf_async"].append(timed(train_step))
        ckpt_obj.sync() if hasattr(ckpt_obj, "sync") else None
        time.sleep(1)
        r["tf_read"].append(timed(lambda: ckpt_obj.read(path).assert_consumed()))
        shutil.rmtree(root / f"tf-{rep}", ignore_errors=True)
        shutil.rmtree(root / f"tfa-{rep}", ignore_errors=True)
        print(f"  repeat {rep}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in r.items()), flush=True)
    flash.close()
    floor.close()
    out = {k: median(v) for k, v in r.items()}
    out.update(params=nparams, state_bytes=state_bytes, copy_threads=threads, samples=r)
    return out


def bench_graph(args, root: Path) -> dict:
    width = 4096
    layers = max(1, round(args.params / (width * width)))
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.train.get_or_create_global_step()  # the hook reads it
        for i in range(layers):
            tf.compat.v1.get_variable(f"w{i}", [width, width], initializer=tf.compat.v1.ones_initializer(),
                                      use_resource=True)
        hook = FlashCheckpointHook(root / "hook", every_steps=1 << 30, keep_last=1,
                                   job_id=f"tfbenchg{uuid.uuid4().hex[:6]}")
        hook.begin()
        saver = tf.compat.v1.train.Saver(sharded=False, max_to_keep=1)
        variables = tf.compat.v1.global_variables()
        floor_path = f"/dev/shm/tfbench-{uuid.uuid4().hex[:8]}"
        size = sum(int(np.prod(v.shape)) * v.dtype.size for v in variables)
        with open(floor_path, "w+b") as f:
            f.truncate(size)
            floor_mm = mmap.mmap(f.fileno(), size)
        np.frombuffer(floor_mm, np.uint8)[:] = 1

        views, at = [], 0
        for v in variables:
            shape, dtype = tuple(v.shape), v.dtype.as_numpy_dtype
            views.append(np.frombuffer(floor_mm, dtype, int(np.prod(shape)), at).reshape(shape))
            at += views[-1].nbytes
        threads = _copy.copy_threads()

        def floor_copy(*arrays):  # the same one copy, from the same views, with no engine
            copy_pairs(list(zip(views, arrays)))
            return np.int64(0)

        def floor_copy_threads(*arrays):
            copy_pairs(list(zip(views, arrays)), threads)
            return np.int64(0)

        reads = [v.value() for v in variables]
        floor_op = tf.numpy_function(floor_copy, reads, tf.int64, stateful=True)
        floor_threads_op = tf.numpy_function(floor_copy_threads, reads, tf.int64, stateful=True)
        r: dict[str, list[float]] = {"floor": [], "floor_threads": [], "hook_save": [], "hook_durable": [], "saver_save": [],
                                     "hook_load_memory": [], "saver_restore": []}
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run([floor_op, floor_threads_op])
            for warm in (0, 1, 2):  # both memory slots mapped and touched
                hook._save(sess, 100 + warm)
                hook._engine.wait()
            for rep in range(args.repeats):
                r["floor"].append(timed(lambda: sess.run(floor_op)))
                r["floor_threads"].append(timed(lambda: sess.run(floor_threads_op)))
                # steps after the warm-up's: memory must hold the newest step for a load from memory
                r["hook_load_memory"].append(timed(lambda: hook._load(sess)))  # one copy into the buffers
                r["hook_save"].append(timed(lambda: hook._save(sess, 200 + 2 * rep)))
                hook._engine.wait()
                r["hook_durable"].append(timed(lambda: (hook._save(sess, 201 + 2 * rep), hook._engine.wait())))
                prefix = saver.save(sess, str(root / "saver" / "model"), global_step=rep)
                r["saver_save"].append(timed(lambda: saver.save(sess, str(root / "saver" / "model"), global_step=rep)))
                r["saver_restore"].append(timed(lambda: saver.restore(sess, prefix)))
                print(f"  graph repeat {rep}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in r.items()), flush=True)
            hook.close()
    views.clear()
    floor_mm.close()
    os.unlink(floor_path)
    out = {k: median(v) for k, v in r.items()}
    out.update(params=layers * width * width, copy_threads=threads, samples=r)
    return out


def input_interleaved(args, root: Path, autotune: bool, tag: str) -> dict[str, float]:
    """One pass of ``args.records`` records through each of the plain and the elastic
    pipeline, both open in this process and consumed in alternating chunks of
    ``args.input_chunk`` batches (which one goes first alternates too), so a slowdown of
    the machine hits both alike. Records per wall second, and per CPU second of the
    consuming thread (the training thread), of each."""
    n, shard, batch, dim = args.records, args.shard_size, 64, 32
    features = tf.random.stateless_uniform([n, dim], seed=[0, 1])
    labels = tf.random.stateless_uniform([n], seed=[0, 2])

    def reader(s):
        return tf.data.Dataset.from_tensor_slices((features[s.start:s.end], labels[s.start:s.end]))

    starts = tf.data.Dataset.range(0, n, shard)
    spec = starts.map(lambda s: etf.ShardSpec(s, tf.minimum(s + shard, n), tf.zeros([0], tf.int64), "", s, 0))
    input_fn = etf.make_input_fn(reader, coordinator=f"sqlite:///{root}/input-{tag}.db", name="train", size=n,
                                 shard_size=shard, batch_size=batch, worker="bench")
    datasets = {"plain": spec.flat_map(reader).batch(batch).prefetch(tf.data.AUTOTUNE), "elastic": input_fn()}
    if not autotune:
        off = tf.data.Options()
        off.autotune.enabled = False
        datasets = {kind: dataset.with_options(off) for kind, dataset in datasets.items()}
    iterators = {kind: iter(dataset) for kind, dataset in datasets.items()}
    wall, cpu, count = dict.fromkeys(datasets, 0.0), dict.fromkeys(datasets, 0.0), dict.fromkeys(datasets, 0)
    turn = 0
    while any(count[kind] < n for kind in datasets):
        for kind in (("plain", "elastic") if turn % 2 == 0 else ("elastic", "plain")):
            start, thread_cpu = time.perf_counter(), time.thread_time()
            for x, _ in itertools.islice(iterators[kind], args.input_chunk):
                count[kind] += int(x.shape[0])
                if kind == "elastic":
                    input_fn.positions.consumed_steps(1)  # as under ShardReportHook
            wall[kind] += time.perf_counter() - start
            cpu[kind] += time.thread_time() - thread_cpu
        turn += 1
    input_fn.positions.close()
    assert count == {"plain": n, "elastic": n}, count
    return {f"{kind}_records_per_{unit}": n / spent[kind]
            for kind in datasets for unit, spent in (("s", wall), ("thread_cpu_s", cpu))}


def bench_input(args, root: Path) -> dict:
    def measure(autotune: bool, tag: str) -> dict[str, float]:
        if not args.input_fresh:
            return input_interleaved(args, root, autotune, tag)
        # a fresh process per pass, as a training job has: no state carried over from the passes before
        command = [sys.executable, __file__, "--input-run", "--records", str(args.records), "--shard-size",
                   str(args.shard_size), "--input-chunk", str(args.input_chunk), "--dir", str(root), "--tag", tag]
        command += [] if autotune else ["--autotune-off"]
        reply = subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        return json.loads(reply)

    settings = {"default": True, "autotune_off": False}
    runs: dict[str, list[dict[str, float]]] = {setting: [] for setting in settings}
    for rep in range(args.input_repeats):
        for setting, autotune in settings.items():
            runs[setting].append(measure(autotune, f"{setting}-{rep}"))
            r = runs[setting][-1]
            print(f"  input repeat {rep}, {setting}: plain {r['plain_records_per_s']:,.0f}, make_input_fn "
                  f"{r['elastic_records_per_s']:,.0f} records/s", flush=True)

    def summary(passes: list[dict[str, float]]) -> dict:
        out = {k: median([p[k] for p in passes]) for k in passes[0]}
        out["ratios"] = [p["elastic_records_per_s"] / p["plain_records_per_s"] for p in passes]
        out["ratio"] = median(out["ratios"])
        out["thread_cpu_ratio"] = median([p["elastic_records_per_thread_cpu_s"] / p["plain_records_per_thread_cpu_s"]
                                          for p in passes])
        out["samples"] = passes
        return out

    out = summary(runs["default"])
    out.update(records=args.records, shard_size=args.shard_size, batch_size=64, chunk_batches=args.input_chunk,
               fresh_processes=args.input_fresh, autotune_off=summary(runs["autotune_off"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("eager", "graph", "input"), action="append",
                        help="run only these parts (default: all)")
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=5, help="save/threaded-floor pairs per repeat (eager)")
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--input-repeats", type=int, default=8)
    parser.add_argument("--shard-size", type=int, default=1024, help="records per shard in part 3")
    parser.add_argument("--input-fresh", action="store_true",
                        help="part 3: run each pipeline pass in a fresh process (as a training job does)")
    parser.add_argument("--input-chunk", type=int, default=100,
                        help="part 3: batches taken from one pipeline before switching to the other")
    parser.add_argument("--input-run", action="store_true", help=argparse.SUPPRESS)  # one fresh pass
    parser.add_argument("--tag", default="", help=argparse.SUPPRESS)
    parser.add_argument("--autotune-off", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir under /tmp)")
    parser.add_argument("--json", default=str(REPO / "results" / "tf_save.json"))
    args = parser.parse_args()
    if args.input_run:  # a child of --input-fresh: one run, its result as JSON on the last line
        print(json.dumps(input_interleaved(args, Path(args.dir), not args.autotune_off, args.tag)))
        return
    root = Path(tempfile.mkdtemp(prefix="tfbench-", dir=args.dir))
    load_at_start = os.getloadavg()
    print(f"load average at start: {load_at_start[0]:.2f} {load_at_start[1]:.2f} {load_at_start[2]:.2f} "
          f"({os.cpu_count()} CPUs)", flush=True)
    try:
        parts = args.only or ["eager", "graph", "input"]
        eager = bench_eager(args, root) if "eager" in parts else None
        graph = bench_graph(args, root) if "graph" in parts else None
        data = bench_input(args, root) if "input" in parts else None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ratios: dict[str, float] = {}
    if eager:
        gib = eager["state_bytes"] / 2**30
        print(f"\n== eager / Keras, {eager['params'] / 1e6:.0f}M params, {gib:.2f} GiB state (medians) ==")
        threads = eager["copy_threads"]
        print(f"memcpy floor, one thread           {eager['floor']:.3f}s  ({gib / eager['floor']:.1f} GiB/s)")
        print(f"memcpy floor, {threads} threads            {eager['floor_threads']:.3f}s  "
              f"({gib / eager['floor_threads']:.1f} GiB/s; the save's copy uses {threads})")
        print(f"flashckpt save (blocking)          {eager['flash_save']:.3f}s  = {eager['flash_save'] / eager['floor']:.2f}x "
              f"the one-thread floor, {eager['flash_save'] / eager['floor_threads']:.2f}x the {threads}-thread floor "
              f"(paired, save after floor: {eager['save_over_floor_threads_paired']:.2f}x)")
        print(f"flashckpt save + wait (durable)    {eager['flash_durable']:.3f}s")
        print(f"flashckpt load from memory         {eager['flash_load_memory']:.3f}s  = "
              f"{eager['flash_load_memory'] / eager['floor']:.2f}x the one-thread floor, "
              f"{eager['flash_load_memory'] / eager['floor_threads']:.2f}x the {threads}-thread floor")
        print(f"tf.train.Checkpoint.write          {eager['tf_write']:.3f}s  -> flashckpt blocks "
              f"{eager['tf_write'] / eager['flash_save']:.1f}x less")
        print(f"  async write, blocking part       {eager['tf_async_write_blocking']:.3f}s  -> "
              f"{eager['tf_async_write_blocking'] / eager['flash_save']:.2f}x flashckpt's blocking time")
        print(f"tf.train.Checkpoint.read           {eager['tf_read']:.3f}s  -> "
              f"{eager['tf_read'] / eager['flash_load_memory']:.1f}x flashckpt's memory load")
        lost_bg = eager["flash_background_save"] + eager["step_after_flash_background"] - eager["train_step"]
        lost_async = eager["tf_async_write_blocking"] + eager["step_after_tf_async"] - eager["train_step"]
        print(f"training step (Adam, batch 8)      {eager['train_step']:.3f}s")
        print(f"background=True save, blocking     {eager['flash_background_save']:.3f}s; the next step "
              f"{eager['step_after_flash_background']:.3f}s -> {lost_bg:.3f}s lost per checkpoint")
        print(f"TF async write, blocking           {eager['tf_async_write_blocking']:.3f}s; the next step "
              f"{eager['step_after_tf_async']:.3f}s -> {lost_async:.3f}s lost per checkpoint")
        print(f"(blocking flashckpt save loses {eager['flash_save']:.3f}s; tf.train.Checkpoint.write "
              f"{eager['tf_write']:.3f}s)")
        ratios.update(flash_background_lost=lost_bg, tf_async_lost=lost_async)
        ratios.update(flash_save_over_floor=eager["flash_save"] / eager["floor"],
                      flash_save_over_floor_threads=eager["flash_save"] / eager["floor_threads"],
                      flash_save_over_floor_threads_paired=eager["save_over_floor_threads_paired"],
                      flash_load_memory_over_floor_threads=eager["flash_load_memory"] / eager["floor_threads"],
                      tf_write_over_flash_save=eager["tf_write"] / eager["flash_save"],
                      tf_async_blocking_over_flash_save=eager["tf_async_write_blocking"] / eager["flash_save"],
                      flash_load_memory_over_floor=eager["flash_load_memory"] / eager["floor"],
                      tf_read_over_flash_load_memory=eager["tf_read"] / eager["flash_load_memory"])
    if graph:
        print(f"\n== graph mode / estimator, {graph['params'] / 1e6:.0f}M params (no optimizer) ==")
        threads = graph["copy_threads"]
        print(f"memcpy floor (inside Session.run)  {graph['floor']:.3f}s one thread, {graph['floor_threads']:.3f}s "
              f"{threads} threads")
        print(f"FlashCheckpointHook save           {graph['hook_save']:.3f}s  = {graph['hook_save'] / graph['floor']:.2f}x "
              f"the one-thread floor, {graph['hook_save'] / graph['floor_threads']:.2f}x the {threads}-thread floor")
        print(f"FlashCheckpointHook save + wait    {graph['hook_durable']:.3f}s")
        print(f"Saver.save (CheckpointSaverHook)   {graph['saver_save']:.3f}s  -> "
              f"{graph['saver_save'] / graph['hook_save']:.1f}x the hook's blocking time")
        print(f"FlashCheckpointHook load (memory)  {graph['hook_load_memory']:.3f}s  = "
              f"{graph['hook_load_memory'] / graph['floor']:.2f}x the one-thread floor, "
              f"{graph['hook_load_memory'] / graph['floor_threads']:.2f}x the {threads}-thread floor")
        print(f"Saver.restore                      {graph['saver_restore']:.3f}s  -> "
              f"{graph['saver_restore'] / graph['hook_load_memory']:.1f}x the hook's load")
        ratios.update(saver_save_over_hook_save=graph["saver_save"] / graph["hook_save"],
                      hook_save_over_floor=graph["hook_save"] / graph["floor"],
                      hook_save_over_floor_threads=graph["hook_save"] / graph["floor_threads"])
    if data:
        print(f"\n== input, {data['records']:,} records, shards of {data['shard_size']}, batches of {data['batch_size']}, "
              f"pipelines alternating every {data['chunk_batches']} batches ==")
        print(f"plain tf.data.Dataset.range        {data['plain_records_per_s']:,.0f} records/s")
        print(f"make_input_fn (SQLite coordinator) {data['elastic_records_per_s']:,.0f} records/s; median of the passes' "
              f"ratios {data['ratio']:.0%} of plain (" + " ".join(f"{r:.0%}" for r in data["ratios"]) + ")")
        print(f"  per CPU-second of the consuming thread: {data['thread_cpu_ratio']:.0%} of plain")
        off = data["autotune_off"]
        print(f"both with tf.data autotune off     plain {off['plain_records_per_s']:,.0f}, make_input_fn "
              f"{off['elastic_records_per_s']:,.0f} records/s; median ratio {off['ratio']:.0%} ("
              + " ".join(f"{r:.0%}" for r in off["ratios"]) + f"); per thread CPU-s {off['thread_cpu_ratio']:.0%}")
        ratios.update(input_elastic_over_plain=data["ratio"], input_elastic_over_plain_thread_cpu=data["thread_cpu_ratio"],
                      input_elastic_over_plain_autotune_off=off["ratio"],
                      input_elastic_over_plain_autotune_off_thread_cpu=off["thread_cpu_ratio"])
    result = {"machine": {"python": platform.python_version(), "tensorflow": tf.__version__, "cpus": os.cpu_count(),
                          "platform": platform.platform(), "load_average_at_start": load_at_start,
                          "load_average_at_end": os.getloadavg()},
              "eager": eager, "graph": graph, "input": data, "ratios": ratios}
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    end = os.getloadavg()
    print(f"\nload average at end: {end[0]:.2f} {end[1]:.2f} {end[2]:.2f}; wrote {args.json}")


if __name__ == "__main__":
    main()
