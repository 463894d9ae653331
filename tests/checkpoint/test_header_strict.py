"""A shard whose safetensors header lies about where its tensors lie (overlapping
offsets, offsets shifted, a gap, trailing bytes, a wrong length) is refused on every
path that reads a shard, as stock ``safetensors`` refuses it, even when the step's
recorded size and block checksums were recomputed to match the altered file. Every
shard flashckpt writes, and every file stock safetensors writes, still passes."""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
import uuid
from typing import Any, Callable

import numpy as np
import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file as save_torch

from flashckpt import CorruptCheckpointError
from flashckpt._engine import new_token
from flashckpt.memory._format import ALIGN, checked_entries, parse_header, plan_image
from flashckpt.memory._slot import HEADER_SIZE
from flashckpt.restore._reshard import Piece, RangeReader, chunk_pieces, path_key, read_sources
from flashckpt.restore._shard_read import ShardReader
from flashckpt.storage._checksum import block_crcs
from flashckpt.storage._object import ObjectStorage
from flashckpt.torch import Checkpointer

from ..fsdp.test_fsdp_layout import _write_step

pytestmark = pytest.mark.timeout(120)

Header = dict[str, Any]
Edit = Callable[[Header, bytes], tuple[Header, bytes]]


def _state(fill: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((64,), fill), "x": torch.full((16,), fill + 0.5),
                      "n": torch.tensor(int(fill))}}


def _split(data: bytes) -> tuple[Header, bytes]:
    (n,) = struct.unpack_from("<Q", data)
    return json.loads(data[8:8 + n]), data[8 + n:]


def _join(header: Header, body: bytes, length: int | None = None) -> bytes:
    """A file of ``header`` (padded with spaces to ``length`` where it fits, else to the
    next 64-byte boundary, as flashckpt pads) and ``body``."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    if length is None or len(raw) > length:
        length = len(raw) + (-(8 + len(raw)) % ALIGN)
    return struct.pack("<Q", length) + raw.ljust(length) + body


def _rewrite(data: bytes, edit: Edit) -> bytes:
    (n,) = struct.unpack_from("<Q", data)
    header, body = edit(*_split(data))
    return _join(header, body, n)


def _offsets(header: Header, name: str) -> list[int]:
    return header[name]["data_offsets"]


def _overlap(header: Header, body: bytes) -> tuple[Header, bytes]:
    """``model/x`` points inside ``model/w``'s bytes."""
    w0 = _offsets(header, "model/w")[0]
    header["model/x"]["data_offsets"] = [w0, w0 + 64]
    return header, body


def _shift_back(header: Header, body: bytes) -> tuple[Header, bytes]:
    """``model/w`` shifted 16 bytes back (into the tensor before it), the file unchanged."""
    header["model/w"]["data_offsets"] = [o - 16 for o in _offsets(header, "model/w")]
    return header, body


def _gap(header: Header, body: bytes) -> tuple[Header, bytes]:
    """16 bytes inserted before ``model/w``, its offsets moved past them: a gap."""
    w0, w1 = _offsets(header, "model/w")
    header["model/w"]["data_offsets"] = [w0 + 16, w1 + 16]
    return header, body[:w0] + bytes(16) + body[w0:]


def _trailing(header: Header, body: bytes) -> tuple[Header, bytes]:
    """16 bytes past the last tensor: the body is longer than the header says."""
    return header, body + bytes(16)


def _wrong_length(header: Header, body: bytes) -> tuple[Header, bytes]:
    """``model/x`` says 15 elements over the bytes of 16."""
    header["model/x"]["shape"] = [15]
    return header, body


CASES = {"overlap": _overlap, "shift_back": _shift_back, "gap": _gap, "trailing": _trailing,
         "wrong_length": _wrong_length}


def _rerecord(step_dir: str, rank: int, data: bytes) -> None:
    """Record ``data``'s size and block checksums in the step's metadata and the rank's
    marker, as a commit of that file would have."""
    for name in ("metadata.json", f"rank-{rank}.done"):
        path = os.path.join(step_dir, name)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            doc = json.load(f)
        record = doc["shards"][str(rank)] if name == "metadata.json" else doc
        record["size"] = len(data)
        record["block_crc32"] = block_crcs(memoryview(data), record["block_size"])
        with open(path, "w") as f:
            json.dump(doc, f)


def _tamper(step_dir: str, rank: int, edit: Edit) -> str:
    """Rewrite the header of a committed shard with ``edit`` and re-record its checksums."""
    path = os.path.join(step_dir, f"rank-{rank}.safetensors")
    with open(path, "rb") as f:
        data = _rewrite(f.read(), edit)
    with open(path, "wb") as f:
        f.write(data)
    _rerecord(step_dir, rank, data)
    return path


def _stock_refuses(path: str) -> None:
    with pytest.raises(SafetensorError):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                f.get_tensor(key)


def _saved(directory, job_id) -> None:
    with Checkpointer(directory, job_id=job_id, keep_last=0) as ck:
        for step in (1, 2):
            ck.save(step, _state(float(step)))
            ck.wait()


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_lying_header_is_refused_naming_the_file_and_load_falls_back(tmp_path, job_id, case, caplog):
    _saved(tmp_path, job_id)
    bad = _tamper(str(tmp_path / "step-2"), 0, CASES[case])
    _stock_refuses(bad)
    with Checkpointer(tmp_path, job_id=job_id + "b") as ck:
        with pytest.raises(CorruptCheckpointError, match=r"rank-0\.safetensors"):
            ck.load(_state(0.0), step=2)  # asked for: no fallback
        state = _state(0.0)
        with caplog.at_level(logging.WARNING, logger="flashckpt"):
            assert ck.load(state) == 1
        assert ck.last_load.source == "storage"
    assert torch.equal(state["model"]["w"], _state(1.0)["model"]["w"])
    assert torch.equal(state["model"]["x"], _state(1.0)["model"]["x"])
    assert any(bad in r.getMessage() and "older" in r.getMessage() for r in caplog.records)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashckpt.cli", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("case", ["overlap", "shift_back"])
def test_verify_and_convert_refuse_a_lying_header(tmp_path, job_id, case):
    _saved(tmp_path, job_id)
    _tamper(str(tmp_path / "step-2"), 0, CASES[case])
    out = _cli("verify", str(tmp_path), "--step", "2")
    assert out.returncode == 1 and "DAMAGED" in out.stdout and "rank-0.safetensors" in out.stdout, out
    converted = tmp_path / "out.safetensors"
    out = _cli("convert", str(tmp_path), str(converted), "--to", "safetensors", "--step", "2")
    assert out.returncode != 0 and "rank-0.safetensors" in out.stderr and not converted.exists(), out
    assert _cli("verify", str(tmp_path), "--step", "1").returncode == 0


def test_a_lying_header_in_memory_falls_back_to_storage(tmp_path, job_id, caplog):
    with Checkpointer(tmp_path, job_id=job_id, keep_last=0) as ck:
        for step in (1, 2):
            ck.save(step, _state(float(step)))
        ck.wait()
        index, _ = ck.engine.memory_steps()[2]
        slot = ck.engine.slots.paths[index]
        with open(slot, "r+b") as f:
            f.seek(HEADER_SIZE)
            head = f.read(1 << 16)
            (n,) = struct.unpack_from("<Q", head)
            new = _rewrite(head[:8 + n], _overlap)
            assert len(new) == 8 + n  # the image keeps its length: only the header lies
            f.seek(HEADER_SIZE)
            f.write(new)
        state = _state(0.0)
        with caplog.at_level(logging.WARNING, logger="flashckpt"):
            assert ck.load(state) == 2
        assert ck.last_load.source == "storage"
    assert torch.equal(state["model"]["x"], _state(2.0)["model"]["x"])
    assert any(slot in r.getMessage() for r in caplog.records)


def _sharded_step(tmp_path):
    """A step of two ranks, each holding rows of two tensors (an FSDP-style layout)."""
    shape = (8, 4)
    fulls = {k: (torch.arange(32, dtype=torch.float32) + 100 * i).reshape(shape) for i, k in enumerate("ab")}
    by_rank = {}
    for r, p in enumerate(chunk_pieces(shape, 2)):
        o, n = p.offsets[0], p.lengths[0]
        by_rank[r] = {k: (full[o:o + n].clone(), p, shape) for k, full in fulls.items()}
    return _write_step(tmp_path, by_rank), shape


@pytest.mark.parametrize("case", ["overlap_ab", "trailing"])
def test_resharding_reads_refuse_a_lying_header(tmp_path, case):
    storage, shape = _sharded_step(tmp_path)

    def overlap_ab(header: Header, body: bytes) -> tuple[Header, bytes]:
        a, b = "t/a", "t/b"
        header[b]["data_offsets"] = list(_offsets(header, a))
        return header, body

    edit = overlap_ab if case == "overlap_ab" else _trailing
    bad = _tamper(storage.step_dir(1), 1, edit)
    _stock_refuses(bad)
    for verify in (True, False):
        with pytest.raises(CorruptCheckpointError, match=r"rank-1\.safetensors"):
            with RangeReader(read_sources(storage, 1, verify_headers=verify)) as reader:
                out = torch.zeros(shape)
                reader.fill(path_key(("t", "b")), out.numpy().view(np.uint8).reshape(8, 16), Piece((0, 0), shape),
                            "F32", shape)


def test_object_store_reads_refuse_a_lying_header():
    storage = ObjectStorage(f"memory://hdr-{uuid.uuid4().hex[:8]}/run")
    storage.check_writable()
    token = new_token()
    image = plan_image([("model/w", "F32", (64,)), ("model/x", "F32", (16,))], {"token": token, "kinds": {}})
    good = image.header + bytes(image.body_size)
    for step, data in ((1, good), (2, _rewrite(good, _overlap))):
        storage.write_shard(step, 0, token, memoryview(data))  # records the checksums of these very bytes
        assert storage.try_commit(step, 1, token, keep_last=0)
    with ShardReader(*storage.open_shard(1, 0)) as reader:
        reader.verify()
    with pytest.raises(CorruptCheckpointError, match=r"step-2/rank-0\.[0-9a-f]+\.safetensors.*offset"):
        ShardReader(*storage.open_shard(2, 0))
    assert "offset" in " ".join(storage.verify(2)) and storage.verify(1) == []


# ---- the good-file guard: what flashckpt and stock safetensors write passes both checks


def _stock_opens(path: str) -> dict[str, torch.Tensor]:
    with safe_open(path, framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}


def test_every_shard_flashckpt_writes_opens_in_stock_safetensors(tmp_path, job_id):
    state = {"model": {"w": torch.randn(33, 7), "h": torch.randn(5).to(torch.bfloat16), "e": torch.empty(0),
                       "z": torch.zeros(0, 3, dtype=torch.int64), "m": torch.tensor([True, False, True]),
                       "i": torch.arange(7, dtype=torch.int16), "big": torch.randn(20000)},
             "step": 7, "lr": [0.1, 0.2]}
    with Checkpointer(tmp_path, job_id=job_id) as ck:
        ck.save(1, state)
        ck.wait()
    path = str(tmp_path / "step-1" / "rank-0.safetensors")
    tensors = _stock_opens(path)
    assert torch.equal(tensors["model/w"], state["model"]["w"]) and tensors["model/z"].shape == (0, 3)
    storage, _ = _sharded_step(tmp_path / "sharded")
    for rank in (0, 1):
        _stock_opens(os.path.join(storage.step_dir(1), f"rank-{rank}.safetensors"))


@pytest.mark.parametrize("seed", range(20))
def test_every_planned_image_passes_both_checks(tmp_path, seed):
    rng = np.random.default_rng(seed)
    dtypes = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL"]
    tensors = [(f"t{i}", str(rng.choice(dtypes)), tuple(int(d) for d in rng.integers(0, 40, rng.integers(0, 3))))
               for i in range(int(rng.integers(1, 12)))]
    image = plan_image(tensors, {"kinds": {}})
    data = image.header + bytes(image.body_size)
    parsed = parse_header(data, "planned", len(data))
    assert sorted((e.name, e.offset, e.nbytes) for e in parsed.entries) == \
        sorted((e.name, e.offset, e.nbytes) for e in image.entries)
    path = tmp_path / "planned.safetensors"
    path.write_bytes(data)
    assert sorted(_stock_opens(str(path))) == sorted(name for name, _, _ in tensors)


def test_files_stock_safetensors_writes_pass_the_layout_check(tmp_path):
    files = {"torch": lambda p: save_torch({"b": torch.ones(3, dtype=torch.bfloat16), "a": torch.zeros(2, 2),
                                            "e": torch.empty(0), "c": torch.arange(5)}, p, metadata={"k": "v"}),
             "numpy": lambda p: save_numpy({"x": np.ones((2, 3), np.float16), "y": np.arange(3, dtype=np.int8),
                                            "z": np.zeros(0, np.float64)}, p)}
    for name, write in files.items():
        path = str(tmp_path / f"{name}.safetensors")
        write(path)
        with open(path, "rb") as f:
            data = f.read()
        header, _ = _split(data)
        header.pop("__metadata__", None)
        (n,) = struct.unpack_from("<Q", data)
        entries = checked_entries(header, path)
        assert 8 + n + max(e.offset + e.nbytes for e in entries) == len(data)
        assert {e.name for e in entries} == set(header)


def _set(name: str, field: str, value: Any) -> Edit:
    def edit(header: Header, body: bytes) -> tuple[Header, bytes]:
        header[name][field] = value
        return header, body
    return edit


def _metadata_number(header: Header, body: bytes) -> tuple[Header, bytes]:
    header["__metadata__"]["count"] = 1
    return header, body


FIELDS = {"float_offsets": _set("model/x", "data_offsets", [0.0, 64.0]), "bool_dim": _set("model/n", "shape", [True]),
          "unknown_dtype": _set("model/n", "dtype", "F128"), "negative_dim": _set("model/x", "shape", [-16]),
          "metadata_number": _metadata_number}


@pytest.mark.parametrize("case", sorted(CASES) + sorted(FIELDS))
def test_the_header_check_refuses_what_stock_safetensors_refuses(tmp_path, case):
    """Layouts (``CASES``) and field types (``FIELDS``: a header safetensors cannot decode)."""
    image = plan_image([("model/w", "F32", (64,)), ("model/x", "F32", (16,)), ("model/n", "I64", ())], {"kinds": {}})
    data = _rewrite(image.header + bytes(image.body_size), {**CASES, **FIELDS}[case])
    path = tmp_path / "bad.safetensors"
    path.write_bytes(data)
    _stock_refuses(str(path))
    with pytest.raises(CorruptCheckpointError, match="bad.safetensors"):
        parse_header(data, str(path), len(data))
