"""``flashckpt convert``: a sharded checkpoint as one consolidated model (and optimizer)
that stock tools load, and DCP checkpoints imported as flashckpt steps.

Sources:

- ``flashckpt`` -- a committed step of a flashckpt directory saved by a sharded
  checkpointer (every tensor's pieces are stitched together by global offsets: one
  output), by a replicated one (one output), or by a per-rank one (each rank saved its
  own state, world size > 1, no sharded layout): then **every rank** is written, rank R
  to :func:`rank_output` ``(out, R)`` -- ``.rank-R`` before the extension
  (``model.pt`` -> ``model.rank-0.pt``, ``model.rank-1.pt``; a directory ``out`` ->
  ``out.rank-0``, ...). Every shard's checksum is verified first.
- ``dcp`` -- a ``torch.distributed.checkpoint`` directory (consolidated with DCP's own
  ``dcp_to_torch_save``). A top-level ``model`` entry is the model and ``optim`` or
  ``optimizer`` the optimizer (nested ``{"state", "param_groups"}`` form, as
  ``get_state_dict`` gives it); without ``model`` the whole dict is the model. Its step
  is the top-level ``step`` entry, else the number ending the directory's name
  (``step-1000``, ``checkpoint-500``); with neither, pass ``step``.

Targets:

- ``torch`` -- one ``torch.save`` file: the saved tree plus ``step`` (for a sharded
  checkpointer ``{"step", "model", "optim", "extra"}``); ``torch.load(out)`` (weights
  only) reads it.
- ``safetensors`` -- one ``.safetensors`` file: model tensors under their FQNs,
  optimizer states under ``optim/<fqn>/<state>``, other tensors under their tree path;
  ``step``, ``param_groups`` and ``extra`` (where JSON holds them whole) and every plain
  value by tree path (``values``) as JSON in ``__metadata__["flashckpt"]``.
- ``dcp`` -- a DCP directory of the saved tree (``{"model", "optim", ...}``) that
  ``torch.distributed.checkpoint.load`` fills (single process, no process group).
- ``flashckpt`` -- a one-rank flashckpt step in directory ``out`` that
  :class:`flashckpt.torch.FsdpCheckpointer` loads at any world size (resharding);
  top-level entries other than ``model`` and ``optim`` go into its ``extra``.

The consolidated state is held in host memory once (plus one image for the
``flashckpt`` target); conversion is an offline tool, not a training-time path.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import re
import tempfile
from typing import TYPE_CHECKING, Any

from ._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from .restore._reshard import LAYOUT_KEY, RangeReader, full_piece, path_key, plain_value, read_sources, source_of
from .restore._shard_read import open_shard
from .storage._url import open_storage

if TYPE_CHECKING:
    from .storage._protocol import Storage

__all__ = ["Format", "convert", "convert_all", "rank_output"]

log = logging.getLogger(__name__)


class Format(str, enum.Enum):
    """Checkpoint formats ``convert`` reads or writes."""

    FLASHCKPT = "flashckpt"
    TORCH = "torch"
    SAFETENSORS = "safetensors"
    DCP = "dcp"


SOURCES = (Format.FLASHCKPT, Format.DCP)
TARGETS = {Format.FLASHCKPT: (Format.TORCH, Format.SAFETENSORS, Format.DCP, Format.FLASHCKPT),
           Format.DCP: (Format.TORCH, Format.SAFETENSORS, Format.FLASHCKPT)}


def _format(value: str | Format, allowed: tuple[Format, ...], what: str) -> Format:
    try:
        fmt = Format(value)
    except ValueError:
        fmt = None
    if fmt not in allowed:
        raise CheckpointError(f"{what} {value!r} is not one of {[f.value for f in allowed]}")
    return fmt


def convert(directory: str | os.PathLike, step: int | None, to: str | Format, out: str | os.PathLike, *,
            source: str | Format = "flashckpt") -> str:
    """Convert step ``step`` (None: the newest committed) of the checkpoint in
    ``directory`` to format ``to`` at ``out``; returns the path written (for a per-rank
    checkpoint, rank 0's: :func:`convert_all` returns every rank's).

    ``source`` is ``"flashckpt"`` or ``"dcp"`` (then ``directory`` is a DCP directory and
    ``step``, when given, overrides the step the DCP checkpoint names). Runs in one
    process; needs torch. Raises :class:`flashckpt.CheckpointError` subclasses for a
    missing or corrupt checkpoint and unsupported combinations.
    """
    return convert_all(directory, step, to, out, source=source)[0]


def convert_all(directory: str | os.PathLike, step: int | None, to: str | Format, out: str | os.PathLike, *,
                source: str | Format = "flashckpt") -> list[str]:
    """:func:`convert`, returning every path written: ``[out]``, or one per rank of a
    per-rank checkpoint (:func:`rank_output`)."""
    src = _format(source, SOURCES, "source format")
    dst = _format(to, TARGETS[src], f"target format for a {src.value} source")
    directory, out = os.fspath(directory), os.fspath(out)
    writer = {Format.TORCH: _write_torch, Format.SAFETENSORS: _write_safetensors,
              Format.DCP: _write_dcp, Format.FLASHCKPT: _write_flashckpt}[dst]
    if src is Format.FLASHCKPT:
        storage = open_storage(directory)
        step = _checked_step(storage, step)
        world = storage.metadata(step)["world_size"]
        if world > 1 and not _has_layout(storage, step):  # each rank saved its own state
            outs = [rank_output(out, rank) for rank in range(world)]
            for rank, path in enumerate(outs):
                writer(_consolidate(storage, step, rank), step, path)
            log.info("converted step %d of %s (%d ranks, each its own state) to %s at %s", step, directory, world,
                     dst.value, ", ".join(outs))
            return outs
        state = _consolidate(storage, step, 0)
    else:
        state = _read_dcp(directory)
        step = _dcp_step(directory, state) if step is None else step
    writer(state, step, out)
    log.info("converted step %d of %s (%s) to %s at %s", step, directory, src.value, dst.value, out)
    return [out]


def rank_output(out: str | os.PathLike, rank: int) -> str:
    """Where rank ``rank`` of a per-rank checkpoint is written: ``.rank-R`` before the
    extension of ``out`` (``model.pt`` -> ``model.rank-1.pt``; ``dir`` -> ``dir.rank-1``)."""
    head, ext = os.path.splitext(os.fspath(out).rstrip(os.sep) or os.sep)
    return f"{head}.rank-{rank}{ext}"


# -- reading --------------------------------------------------------------------------

def consolidate(directory: str, step: int | None, rank: int = 0) -> tuple[int, dict[str, Any]]:
    """The committed ``step`` (None: newest) as one unsharded state: the saved tree
    with every sharded tensor whole, the layout entry dropped. For a checkpoint without
    a sharded layout, rank ``rank``'s own state."""
    storage = open_storage(directory)
    step = _checked_step(storage, step)
    return step, _consolidate(storage, step, rank)


def _checked_step(storage: Storage, step: int | None) -> int:
    """``step`` (None: the newest committed) once every shard of it verifies."""
    if step is None:
        step = storage.latest_step()
        if step is None:
            raise CheckpointNotFoundError(f"no committed step in {storage.root}")
    problems = storage.verify(step)
    if problems:
        raise CorruptCheckpointError(f"step {step} in {storage.root} is damaged: " + "; ".join(problems))
    return step


def _consolidate(storage: Storage, step: int, rank: int) -> dict[str, Any]:
    import torch  # noqa: F401

    from .memory._tree import merge_into
    from .torch import _tensors  # noqa: F401  (registers the torch tensor kind)
    if _has_layout(storage, step):
        sources = read_sources(storage, step)
    else:  # a plain (unsharded, replicated or per-rank) checkpoint: the rank holds its state whole
        sources = [source_of(rank, open_shard(storage, step, rank), layout=False)]
    home = sources[0]
    layout = home.layout["tensors"]
    entries = {e.name: (e.dtype, tuple(e.shape)) for e in home.image.entries}
    keys_by_name: dict[str, str] = {}
    for key, rec in layout.items():
        name = home.names[key]
        entries[name] = (entries[name][0], tuple(rec["shape"]))
        keys_by_name.setdefault(name, key)
    state: dict[str, Any] = {}
    merge = merge_into(state, home.image.meta["tree"], entries, allow_pickle=False)
    with RangeReader(sources) as reader:
        for name, obj in merge.fills:
            dst = _bytes(obj)
            if dst is None:
                continue
            key = keys_by_name.get(name)
            if key is not None:
                reader.fill(key, dst, full_piece(obj.shape), entries[name][0], tuple(obj.shape))
            else:
                reader.read_entry(home, home.entries[name], dst)
    merge.apply_plain()
    state.pop(LAYOUT_KEY, None)
    return state


def _has_layout(storage: Storage, step: int) -> bool:
    with open_shard(storage, step, 0) as reader:
        return plain_value(reader.image.meta.get("tree", {}), LAYOUT_KEY) is not None


_STEP_NAME = re.compile(r"(?:^|[-_.])(\d+)$")


def _dcp_step(directory: str, state: dict[str, Any]) -> int:
    """The step a DCP checkpoint names: its top-level ``step`` entry, else the number
    ending its directory's name (``step-1000``, ``checkpoint-500``)."""
    value = (state.get("extra") or {}).get("step")
    if hasattr(value, "numel") and value.numel() == 1 and not value.is_floating_point():
        value = int(value.item())
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    m = _STEP_NAME.search(os.path.basename(os.path.normpath(directory)))
    if m:
        return int(m.group(1))
    raise CheckpointError(f"{directory} names no step (no top-level 'step' entry, no number ending its name); "
                          "pass the step to write (--step N)")


def _bytes(t: Any):
    if t.numel() == 0:
        return None
    flat = t.reshape(1) if t.dim() == 0 else t
    import torch
    return flat.view(torch.uint8).numpy()


def _read_dcp(directory: str) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    if not os.path.exists(os.path.join(directory, ".metadata")):
        raise CheckpointNotFoundError(f"{directory} is not a torch.distributed.checkpoint directory (no .metadata)")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "consolidated.pt")
        dcp_to_torch_save(directory, path)
        raw = torch.load(path, weights_only=True)
    if "model" not in raw:
        return {"model": raw}
    state = {"model": raw["model"]}
    optim = raw.get("optim", raw.get("optimizer"))
    if optim is not None:
        if not (isinstance(optim, dict) and "state" in optim):
            raise CheckpointError(f"{directory}: the optimizer entry is not in the nested "
                                  "{'state', 'param_groups'} form of get_state_dict")
        state["optim"] = optim
    extra = {k: v for k, v in raw.items() if k not in ("model", "optim", "optimizer")}
    if extra:
        state["extra"] = extra
    return state


# -- writing --------------------------------------------------------------------------

def _replace_atomically(out: str, write: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _write_torch(state: dict[str, Any], step: int, out: str) -> None:
    import torch
    payload = {"step": step, **state}  # a saved "step" entry wins
    _replace_atomically(out, lambda tmp: torch.save(payload, tmp))


def _safetensors_name(parts: tuple) -> str:
    """Model tensors by FQN, optimizer states as ``optim/<fqn>/<state>``, others by tree path
    (never the header's own key ``__metadata__``)."""
    if len(parts) == 2 and parts[0] == "model":
        name = str(parts[1])
    elif len(parts) == 4 and parts[:2] == ("optim", "state"):
        name = path_key(("optim", parts[2], parts[3]))
    else:
        name = path_key(parts)
    return name + "#" if name == "__metadata__" else name


def _write_safetensors(state: dict[str, Any], step: int, out: str) -> None:
    import numpy as np
    import torch
    tensors: dict[str, Any] = {}
    values: dict[str, Any] = {}

    def walk(obj: Any, parts: tuple) -> None:
        if isinstance(obj, (torch.Tensor, np.ndarray, np.generic)):
            tensors[_safetensors_name(parts)] = torch.as_tensor(obj)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, parts + (k,))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, parts + (i,))
        else:  # every plain leaf by its path: a subtree that also holds tensors is not JSON whole
            values[path_key(parts)] = _jsonable(obj)
    walk(state, ())
    optim = state.get("optim") or {}
    meta = {"format": "flashckpt-convert/1", "step": step, "param_groups": _jsonable(optim.get("param_groups")),
            "extra": _jsonable(state.get("extra")), "values": values}
    _write_image(out, tensors, meta)


def _jsonable(obj: Any) -> Any:
    try:
        json.dumps(obj)
        return obj
    except (TypeError, ValueError):
        return None


def _write_image(out: str, tensors: dict[str, Any], meta: dict[str, Any]) -> None:
    from .memory._format import plan_image
    from .torch._tensors import DTYPE_NAMES
    contiguous = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    image = plan_image([(n, DTYPE_NAMES[t.dtype], tuple(t.shape)) for n, t in contiguous.items()], meta)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(image.header)
            for entry in image.entries:  # in body order
                data = _bytes(contiguous[entry.name])
                if data is not None:
                    f.write(memoryview(data.reshape(-1)))
            f.flush()
            os.fsync(f.fileno())
    _replace_atomically(out, write)


def _write_dcp(state: dict[str, Any], step: int, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    if os.path.isdir(out) and os.listdir(out):
        raise CheckpointError(f"{out} exists and is not empty; DCP output needs a new directory")
    dcp.save({k: v for k, v in state.items() if v is not None}, checkpoint_id=out, no_dist=True)


def _write_flashckpt(state: dict[str, Any], step: int, out: str) -> None:
    """A committed one-rank step whose layout marks every model and optimizer tensor as
    one whole piece, so a sharded checkpointer reshards it onto any world size."""
    import torch

    if "model" not in state:
        raise CheckpointError(f"a flashckpt output needs a 'model' entry; this state has {sorted(state)}")
    from ._engine import new_token
    from .memory._format import plan_image
    from .memory._tree import flatten
    from .torch import _tensors  # noqa: F401  (registers the torch tensor kind)
    records: dict[str, Any] = {}

    def mark(obj: Any, parts: tuple) -> None:
        if isinstance(obj, torch.Tensor):
            shape = list(obj.shape)
            records[path_key(parts)] = {"shape": shape, "offsets": [0] * len(shape), "lengths": shape}
        elif isinstance(obj, dict):
            for k, v in obj.items():
                mark(v, parts + (k,))
    tree: dict[str, Any] = {"model": state.get("model", {})}
    mark(tree["model"], ("model",))
    if state.get("optim") is not None:
        tree["optim"] = state["optim"]
        mark(tree["optim"].get("state", {}), ("optim", "state"))
    rest = {k: v for k, v in state.items() if k not in ("model", "optim", "extra")}
    if rest and state.get("extra") is not None:
        raise CheckpointError(f"a flashckpt output holds model, optim and extra; this state has {sorted(map(str, rest))} "
                              "beside its 'extra' entry (convert it --to torch, or move them into 'extra')")
    tree["extra"] = rest or state.get("extra")  # a plain Checkpointer's other entries, as --from dcp does
    tree[LAYOUT_KEY] = json.dumps({"version": 1, "rank": 0, "world_size": 1, "optimizer": "optim" in tree,
                                   "tensors": records}, separators=(",", ":"))
    flat = flatten(tree)
    token = new_token()
    meta = {"format": "flashckpt/1", "step": step, "tree": flat.skeleton, "rank": 0, "world_size": 1,
            "kinds": {leaf.name: leaf.kind.name for leaf in flat.leaves}, "token": token}
    image = plan_image([(leaf.name, leaf.dtype, leaf.shape) for leaf in flat.leaves], meta)
    buf = bytearray(image.size)
    buf[:len(image.header)] = image.header
    by_name = {leaf.name: leaf.obj for leaf in flat.leaves}
    for entry in image.entries:
        data = _bytes(by_name[entry.name].detach().cpu().contiguous())
        if data is not None:
            at = len(image.header) + entry.offset
            buf[at:at + entry.nbytes] = memoryview(data.reshape(-1))
    storage = open_storage(out)
    storage.check_writable()
    storage.write_shard(step, 0, token, memoryview(buf))
    if not storage.try_commit(step, 1, token, keep_last=0, branch=step - 1):
        raise CheckpointError(f"could not commit step {step} in {storage.root}")
