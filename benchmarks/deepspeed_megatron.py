"""DeepSpeed and megatron-core saves: each framework's own save side by side with flashckpt.

    DS_ACCELERATOR=cpu python benchmarks/deepspeed_megatron.py [--repeats 5] [--json results/deepspeed_megatron.json]

One process, a gloo group of one, CPU. What is timed (medians over repeats; the
samples of every method are interleaved, one of each per repeat, as this machine's
speed drifts):
- floor: one ``torch._foreach_copy_`` of exactly the tensors flashckpt copies into a
  preallocated, already-touched /dev/shm mapping (the memcpy a flash save cannot beat).
- DeepSpeed (ZeRO-1, Adam): ``engine.save_checkpoint`` with DeepSpeed's default
  ``TorchCheckpointEngine`` (synchronous torch.save of every file, no fsync) vs the same
  call with flashckpt's engine installed (blocking time; then ``wait()`` until the step
  and its exported DeepSpeed tag are durable). Load: stock ``engine.load_checkpoint`` of
  the default tag vs ``DeepSpeedCheckpointer.load()`` from memory (same job id): once each
  into a new engine that never stepped (what a restarted process does: the optimizer's
  moments are new memory either way), then repeatedly into one engine. Also one unsynced ``write()`` of the
  same bytes into a new file: no save into the page cache (DeepSpeed's default is one)
  can be faster, so its ratio to the floor bounds how far a flash save can beat it.
- megatron-core GPTModel (TP=1): ``dist_checkpointing.save`` with megatron's default
  ``torch_dist`` strategy vs ``MegatronCheckpointer.save`` (blocking, then ``wait()``);
  load: ``dist_checkpointing.load`` vs ``MegatronCheckpointer.load`` from memory. The
  flash save is timed with ``model.sharded_state_dict()`` inside (as megatron's own save
  is) and, separately, given an already built one (flashckpt's own part).
  megatron's strategy calls ``torch.cuda.synchronize()``/``current_device`` unconditionally;
  here (CPU only) those are replaced by no-ops for megatron's own runs, in this script only.
Storage is the directory given by --dir (default: a temp dir on the current file system).
Every sample is printed (this machine is shared: the spread tells how noisy a run was).
A GPT-2-small-sized run: ``--ds-hidden 2048 --ds-layers 24`` (1.5 GiB of ZeRO-1 state),
``--mg-hidden 768 --mg-layers 12 --mg-vocab 50304`` (620 MiB of megatron parameters).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Floor:
    """One copy of exactly the tensors flashckpt copies, into touched /dev/shm views."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        sizes = [t.numel() * t.element_size() for t in tensors]
        self.path = f"/dev/shm/flashckpt-bench-floor-{uuid.uuid4().hex[:8]}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, max(sum(sizes), 1))
            self.mm = mmap.mmap(fd, max(sum(sizes), 1))
        finally:
            os.close(fd)
        body = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.views, at = [], 0
        for t, n in zip(tensors, sizes):
            self.views.append(body[at:at + n].view(t.dtype).view(t.shape))
            at += n
        body.fill_(1)  # touch every page

    def sample(self) -> float:
        return timed(lambda: torch._foreach_copy_(self.views, self.tensors))

    def close(self) -> None:
        self.views = []
        os.unlink(self.path)


class PageCacheWrite:
    """One unsynced ``write()`` of the same bytes into a new file: the least any save into
    the page cache costs (new page-cache pages are allocated and filled), no pickling."""

    def __init__(self, tensors: list[torch.Tensor], directory: Path) -> None:
        self.buffers = [memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()) for t in tensors]
        self.directory = directory
        self.count = 0

    def sample(self) -> float:
        path = self.directory / f"page-cache-write-{self.count}"
        self.count += 1

        def write() -> None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                for buf in self.buffers:
                    while buf:
                        buf = buf[os.write(fd, buf):]
            finally:
                os.close(fd)

        seconds = timed(write)
        path.unlink()
        return seconds


def captured_tensors(engine) -> list[torch.Tensor]:
    """The tensors of the newest flash save of ``engine`` (a flashckpt Engine)."""
    from flashckpt.memory._tree import flatten
    return [leaf.obj for leaf in flatten(engine._bench_state, allow_pickle=True).leaves]


def capture(flash_engine) -> None:
    save = flash_engine.save

    def spy(step, state, **kw):
        flash_engine._bench_state = state
        return save(step, state, **kw)

    flash_engine.save = spy


# -- DeepSpeed --------------------------------------------------------------------------

def ds_engine(hidden: int, layers: int):
    import deepspeed
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    model = torch.nn.Sequential(*mods)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 1}, "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(2, hidden)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return engine


def bench_deepspeed(root: Path, repeats: int, hidden: int, layers: int, tight_rounds: int = 0) -> dict:
    from flashckpt.deepspeed import DeepSpeedCheckpointer
    engine = ds_engine(hidden, layers)
    default_dir, flash_dir = root / "ds-default", root / "ds-flash"
    job = "bench" + uuid.uuid4().hex[:8]
    ck = DeepSpeedCheckpointer(engine, flash_dir, job_id=job, keep_last=1)  # disk space
    capture(ck._flash)
    first = timed(lambda: ck.save(1))  # also reserves shared memory
    ck.wait()
    floor = Floor(captured_tensors(ck._flash))
    page_cache = PageCacheWrite(floor.tensors, root)
    nbytes = sum(t.numel() * t.element_size() for t in floor.tensors)
    floors, writes, default, blocking, durable = [], [], [], [], []
    for i in range(repeats):  # interleaved: this machine's speed drifts
        floors.append(floor.sample())
        writes.append(page_cache.sample())
        b = timed(lambda i=i: ck.save(i + 2))
        blocking.append(b)
        durable.append(b + timed(ck.wait))
        engine.checkpoint_engine = ck._previous_engine  # DeepSpeed's default TorchCheckpointEngine
        default.append(timed(lambda i=i: engine.save_checkpoint(str(default_dir), tag=f"t{i}")))
        engine.checkpoint_engine = ck.checkpoint_engine
        shutil.rmtree(default_dir / f"t{i - 1}", ignore_errors=True)  # disk space: only the last is loaded
    # tight rounds: no persist and no wait between the samples, so a round fits in this
    # shared machine's short quiet moments (the flash save is then memory only)
    tight: dict[str, list[float]] = {"floor": [], "page_cache_write": [], "flash_blocking": [], "default": []}
    for i in range(tight_rounds):
        tight["floor"].append(floor.sample())
        tight["page_cache_write"].append(page_cache.sample())
        tight["flash_blocking"].append(timed(lambda i=i: ck.save(1000 + i, persist=False)))
        engine.checkpoint_engine = ck._previous_engine
        tight["default"].append(timed(lambda i=i: engine.save_checkpoint(str(default_dir), tag=f"tight{i}")))
        engine.checkpoint_engine = ck.checkpoint_engine
        shutil.rmtree(default_dir / f"tight{i}", ignore_errors=True)
    floor.close()
    from flashckpt import _events
    sources = []
    _events.subscribe(lambda event, **info: sources.append(info.get("source")) if event == "load" else None)
    # a restart: the first load into an engine that never stepped (no optimizer moments yet)
    restarted = ds_engine(hidden, layers)
    stock_first = timed(lambda: restarted.load_checkpoint(str(default_dir), tag=f"t{repeats - 1}"))
    restarted = ds_engine(hidden, layers)
    ck_first = DeepSpeedCheckpointer(restarted, flash_dir, job_id=job)
    flash_first = timed(ck_first.load)
    ck_first._ckpt.engine.close(unlink=False)  # shares ck's memory; ck frees it
    del restarted, ck_first
    fresh = ds_engine(hidden, layers)
    stock_load = [timed(lambda: fresh.load_checkpoint(str(default_dir), tag=f"t{repeats - 1}")) for _ in range(repeats)]
    ck2 = DeepSpeedCheckpointer(fresh, flash_dir, job_id=job)
    flash_load = [timed(ck2.load) for _ in range(repeats)]
    ck2._ckpt.engine.close(unlink=False)  # shares ck's memory; ck frees it
    ck.close()
    return {"samples": {"floor": floors, "page_cache_write": writes, "flash_blocking": blocking, "default": default},
            "tight_samples": tight,
            "bytes": nbytes, "floor_s": statistics.median(floors), "page_cache_write_s": statistics.median(writes),
            "default_save_s": statistics.median(default), "flash_first_blocking_s": first,
            "flash_blocking_s": statistics.median(blocking), "flash_durable_s": statistics.median(durable),
            "default_load_s": statistics.median(stock_load), "flash_load_s": statistics.median(flash_load),
            "default_first_load_s": stock_first, "flash_first_load_s": flash_first,
            "flash_load_source": sources[-1] if sources else None}


# -- megatron-core ----------------------------------------------------------------------

def mg_model(hidden: int, layers: int, vocab: int = 8192):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=1)
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=8,
                               use_cpu_initialization=True, params_dtype=torch.float32)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                    max_sequence_length=128)


def bench_megatron(root: Path, repeats: int, hidden: int, layers: int, vocab: int) -> dict:
    from megatron.core import dist_checkpointing
    from flashckpt.megatron import MegatronCheckpointer
    model = mg_model(hidden, layers, vocab)
    job = "bench" + uuid.uuid4().hex[:8]
    ck = MegatronCheckpointer(root / "mg-flash", job_id=job, keep_last=2)
    capture(ck.engine)
    first = timed(lambda: ck.save(1, model.sharded_state_dict()))
    ck.wait()
    floor = Floor(captured_tensors(ck.engine))
    nbytes = sum(t.numel() * t.element_size() for t in floor.tensors)
    cuda_sync, cuda_dev = torch.cuda.synchronize, torch.cuda.current_device
    floors, default, blocking, durable, building, prebuilt = [], [], [], [], [], []
    for i in range(repeats):  # interleaved: this machine's speed drifts
        floors.append(floor.sample())
        b = timed(lambda i=i: ck.save(i + 2, model.sharded_state_dict()))
        blocking.append(b)
        durable.append(b + timed(ck.wait))
        box = []
        building.append(timed(lambda: box.append(model.sharded_state_dict())))  # megatron's part of a save
        prebuilt.append(timed(lambda i=i: ck.save(repeats + i + 2, box[0])))  # flashckpt's part
        ck.wait()
        target = root / "mg-default" / f"iter_{i:07d}"
        target.mkdir(parents=True)
        shutil.rmtree(root / "mg-default" / f"iter_{i - 1:07d}", ignore_errors=True)
        try:
            torch.cuda.synchronize = lambda *a, **k: None  # megatron's own strategy only (see module doc)
            torch.cuda.current_device = lambda: "cpu"  # it places a flag tensor there for an all-reduce
            default.append(timed(lambda: dist_checkpointing.save(model.sharded_state_dict(), str(target))))
        finally:
            torch.cuda.synchronize, torch.cuda.current_device = cuda_sync, cuda_dev
    floor.close()
    try:
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_device = lambda: "cpu"
        default_load = [timed(lambda: dist_checkpointing.load(model.sharded_state_dict(), str(target)))
                        for _ in range(repeats)]
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = cuda_sync, cuda_dev
    ck2 = MegatronCheckpointer(root / "mg-flash", job_id=job)
    from flashckpt import _events
    sources = []
    _events.subscribe(lambda event, **info: sources.append(info.get("source")) if event == "load" else None)
    flash_load = [timed(lambda: ck2.load(model.sharded_state_dict())) for _ in range(repeats)]
    ck2._ckpt.engine.close(unlink=False)  # shares ck's memory; ck frees it
    ck.close()
    return {"samples": {"floor": floors, "flash_blocking": blocking, "flash_blocking_prebuilt": prebuilt,
                        "sharded_state_dict": building, "default": default},
            "bytes": nbytes, "floor_s": statistics.median(floors), "default_save_s": statistics.median(default),
            "flash_first_blocking_s": first,
            "flash_blocking_s": statistics.median(blocking), "flash_durable_s": statistics.median(durable),
            "sharded_state_dict_s": statistics.median(building),
            "flash_blocking_prebuilt_s": statistics.median(prebuilt),
            "default_load_s": statistics.median(default_load), "flash_load_s": statistics.median(flash_load),
            "flash_load_source": sources[-1] if sources else None}


def report(name: str, r: dict) -> None:
    mb = r["bytes"] / 2**20
    print(f"\n{name}: {mb:.0f} MiB of tensors copied per save")
    for what, samples in r["samples"].items():
        print(f"  samples {what:24s} " + " ".join(f"{x * 1e3:7.1f}" for x in samples) + " ms")
    print(f"  floor (one copy into /dev/shm)   {r['floor_s'] * 1e3:9.1f} ms")
    print(f"  flash save, blocking              {r['flash_blocking_s'] * 1e3:9.1f} ms   "
          f"{r['flash_blocking_s'] / r['floor_s']:.2f}x floor")
    print(f"  flash save, first (maps memory)  {r['flash_first_blocking_s'] * 1e3:9.1f} ms")
    print(f"  flash save + wait (durable)       {r['flash_durable_s'] * 1e3:9.1f} ms")
    if "sharded_state_dict_s" in r:
        print(f"    of which model.sharded_state_dict() {r['sharded_state_dict_s'] * 1e3:7.1f} ms; the save given "
              f"it: {r['flash_blocking_prebuilt_s'] * 1e3:.1f} ms = "
              f"{r['flash_blocking_prebuilt_s'] / r['floor_s']:.2f}x floor")
    print(f"  framework's own save              {r['default_save_s'] * 1e3:9.1f} ms   "
          f"{r['default_save_s'] / r['flash_blocking_s']:.1f}x the flash blocking time")
    if "page_cache_write_s" in r:
        gbs = lambda sec: r["bytes"] / sec / 1e9  # noqa: E731
        print(f"  one write() of the bytes to page cache {r['page_cache_write_s'] * 1e3:6.1f} ms   "
              f"{r['page_cache_write_s'] / r['floor_s']:.1f}x floor: the most any save into the page cache "
              f"can gain over a flash save")
        print(f"  bandwidth: memcpy {gbs(r['floor_s']):.2f} GB/s, page-cache write "
              f"{gbs(r['page_cache_write_s']):.2f} GB/s, framework's save {gbs(r['default_save_s']):.2f} GB/s")
    best = {what: min(samples) for what, samples in r["samples"].items()}
    line = (f"  best samples (quietest moments): floor {best['floor'] * 1e3:.1f} ms, flash blocking "
            f"{best['flash_blocking'] * 1e3:.1f} ms ({best['flash_blocking'] / best['floor']:.2f}x floor), "
            f"framework {best['default'] * 1e3:.1f} ms ({best['default'] / best['flash_blocking']:.1f}x flash)")
    if "page_cache_write" in best:
        line += f", page-cache write {best['page_cache_write'] / best['floor']:.1f}x floor"
    print(line)
    if r.get("tight_samples", {}).get("floor"):
        t = {what: statistics.median(samples) for what, samples in r["tight_samples"].items()}
        low = {what: min(samples) for what, samples in r["tight_samples"].items()}
        print(f"  tight rounds ({len(r['tight_samples']['floor'])}, no persist), median / best: floor "
              f"{t['floor'] * 1e3:.1f} / {low['floor'] * 1e3:.1f} ms, flash {t['flash_blocking'] * 1e3:.1f} / "
              f"{low['flash_blocking'] * 1e3:.1f} ms, page-cache write {t['page_cache_write'] * 1e3:.1f} / "
              f"{low['page_cache_write'] * 1e3:.1f} ms, framework {t['default'] * 1e3:.1f} / "
              f"{low['default'] * 1e3:.1f} ms")
        print(f"    flash / floor {t['flash_blocking'] / t['floor']:.2f}x / {low['flash_blocking'] / low['floor']:.2f}x; "
              f"framework / flash {t['default'] / t['flash_blocking']:.1f}x / "
              f"{low['default'] / low['flash_blocking']:.1f}x; framework / floor {t['default'] / t['floor']:.1f}x / "
              f"{low['default'] / low['floor']:.1f}x (a flash save at the floor could gain no more)")
    if "default_first_load_s" in r:
        print(f"  first load into a new engine (a restart): framework's own {r['default_first_load_s'] * 1e3:.1f} ms, "
              f"flash ({r['flash_load_source']}) {r['flash_first_load_s'] * 1e3:.1f} ms   "
              f"{r['default_first_load_s'] / r['flash_first_load_s']:.1f}x faster")
    print(f"  framework's own load              {r['default_load_s'] * 1e3:9.1f} ms")
    print(f"  flash load ({r['flash_load_source']})            {r['flash_load_s'] * 1e3:9.1f} ms   "
          f"{r['default_load_s'] / r['flash_load_s']:.1f}x faster")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--ds-hidden", type=int, default=1024)
    parser.add_argument("--ds-layers", type=int, default=16)
    parser.add_argument("--mg-hidden", type=int, default=512)
    parser.add_argument("--mg-layers", type=int, default=8)
    parser.add_argument("--mg-vocab", type=int, default=8192)
    parser.add_argument("--only", choices=("deepspeed", "megatron"), default=None)
    parser.add_argument("--tight", type=int, default=15, help="DeepSpeed rounds without persist or wait")
    parser.add_argument("--json", default=str(ROOT / "results" / "deepspeed_megatron.json"))
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from tests._net import free_port
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    import deepspeed
    deepspeed.init_distributed("gloo")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        results = {}
        if args.only in (None, "deepspeed"):
            results["deepspeed_zero1"] = bench_deepspeed(root, args.repeats, args.ds_hidden, args.ds_layers,
                                                          args.tight)
            report("DeepSpeed ZeRO-1 + Adam, engine.save_checkpoint", results["deepspeed_zero1"])
        if args.only in (None, "megatron"):
            results["megatron_gpt"] = bench_megatron(root, args.repeats, args.mg_hidden, args.mg_layers,
                                                     args.mg_vocab)
            report("megatron-core GPTModel, dist_checkpointing.save (torch_dist)", results["megatron_gpt"])
    results["env"] = {"python": platform.python_version(), "torch": torch.__version__,
                      "deepspeed": deepspeed.__version__, "cpus": os.cpu_count(), "repeats": args.repeats,
                      "argv": sys.argv[1:]}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"\nwrote {args.json}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
