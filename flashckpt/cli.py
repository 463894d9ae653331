"""The ``flashckpt`` command: inspect, verify and rescue checkpoints.

    flashckpt ls DIR                 committed steps with sizes and ranks
    flashckpt verify DIR [--step N]  re-read shards and check their headers and checksums
    flashckpt gc [--dry-run] [--force]
                                     remove shared memory and scratch directories of jobs whose
                                     processes are gone
    flashckpt gc DIR... [--dry-run]  remove pending step directories of dead persists
    flashckpt persist [--job-id J]   write what a dead job left in shared memory to storage
    flashckpt convert DIR OUT --to torch|safetensors|dcp|flashckpt [--step N] [--from flashckpt|dcp]
                                     one consolidated checkpoint that stock tools load
                                     (a per-rank checkpoint: one OUT per rank, OUT.rank-R)

Every problem is printed as one line; the exit status is 0 when all is well, 1 when
a check found damage (or nothing to list), 2 on an error (``--traceback`` shows it whole).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
from typing import TYPE_CHECKING

from . import _names
from ._errors import CheckpointError, CheckpointNotFoundError
from .saver._persist import persist_slot, unpersisted_slots
from .memory._slot import Slot, SlotState, being_read, pid_alive
from .storage._scratch import remove_dead_scratch
from .storage._url import open_storage

if TYPE_CHECKING:
    from .storage._protocol import Storage

__all__ = ["main"]

log = logging.getLogger("flashckpt.cli")

_LOG_RE = re.compile(r"^(?P<job>[^.]+)-(saver|watchdog)\.log(\.\d+)?$")
_OBJECT_RE = re.compile(r"^(?P<job>[^.]+)\.(?P<rest>.+)$")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _kind(exc: Exception) -> str:
    """The exception's type as an error line's prefix; none for flashckpt's own errors."""
    return "" if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: "


def _storage(directory: str) -> Storage:
    """The storage of an existing checkpoint directory (or object-store URL), else a
    CheckpointNotFoundError."""
    storage = open_storage(directory)
    if not storage.remote and not os.path.isdir(storage.root):
        what = "no such directory" if not os.path.lexists(storage.root) else "not a directory"
        raise CheckpointNotFoundError(f"{storage.root}: {what}")
    return storage


def _memory_copies(root: str) -> list[tuple[int, int, str]]:
    """(step, storage rank, state) of complete copies on this node whose trainers
    checkpoint into ``root``; state is "in memory" or "being persisted"."""
    found = []
    for paths in _segments().values():
        for path in _slot_paths(paths):
            try:
                h = Slot.peek_header(path)
            except CheckpointError:
                continue
            if h is not None and h.state == SlotState.COMPLETE and h.info.get("directory") == root:
                state = "being persisted" if being_read(h) else "in memory"
                found.append((h.step, int(h.info.get("storage_rank", 0)), state))
    return sorted(found)


def cmd_ls(args: argparse.Namespace) -> int:
    storage = _storage(args.directory)
    steps = storage.committed_steps()
    memory = _memory_copies(storage.root)
    for step, rank, state in memory:
        print(f"step {step} rank {rank}: {state} on this node")
    if not steps:
        print(f"no committed steps in {storage.root}")
        return 0 if memory else 1
    latest = storage.latest_step()
    print(f"{'step':>10}  {'ranks':>5}  {'size':>10}  committed")
    bad = []
    for step in steps:
        try:
            meta = storage.metadata(step)
        except CheckpointError as exc:
            print(f"{step:>10}  unreadable: {_one_line(exc)}")
            bad.append(step)
            continue
        size = sum(s["size"] for s in meta["shards"].values())
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(meta["committed_at"])) \
            if "committed_at" in meta else "?"
        mark = "  (latest)" if step == latest else ""
        print(f"{step:>10}  {meta['world_size']:>5}  {_size(size):>10}  {when}{mark}")
    if bad:
        print(f"error: unreadable metadata of step {', '.join(map(str, bad))} in {storage.root}", file=sys.stderr)
    return 1 if bad else 0


def cmd_verify(args: argparse.Namespace) -> int:
    storage = _storage(args.directory)
    steps = [args.step] if args.step is not None else storage.committed_steps()
    if not steps:
        print(f"no committed steps in {storage.root}")
        return 1
    bad = 0
    for step in steps:
        try:
            problems = storage.verify(step)
        except CheckpointError as exc:
            problems = [str(exc)]
        print(f"step {step}: {'ok' if not problems else 'DAMAGED'}")
        for problem in problems:
            print(f"  {_one_line(problem)}")
        bad += bool(problems)
    return 1 if bad else 0


def _segments() -> dict[str, list[str]]:
    """This user's shared-memory objects (and the saver and watcher logs), by job id."""
    directory = _names.private_dir()
    jobs: dict[str, list[str]] = {}
    for name in os.listdir(directory):
        m = _LOG_RE.match(name) or _OBJECT_RE.match(name)
        if m:
            jobs.setdefault(m.group("job"), []).append(os.path.join(directory, name))
    return jobs


def _slot_paths(paths: list[str]) -> list[str]:
    return sorted(p for p in paths if ".slot" in p)


def _job_alive(job: str, paths: list[str]) -> bool:
    """A saver serves the job, or a process that wrote one of its slots still runs."""
    if os.path.exists(_names.socket_path(job)):
        import socket
        with socket.socket(socket.AF_UNIX) as s:
            try:
                with _names.unix_address(_names.socket_path(job)) as address:
                    s.connect(address)
                return True
            except OSError:
                pass
    return any(h is not None and pid_alive(h.writer_pid) for h in map(Slot.peek_header, _slot_paths(paths)))


def _storage_unreachable(paths: list[str], exc: Exception) -> str:
    """Why a dead job's slots cannot be checked against their storage, in one line."""
    try:
        where = sorted({h.info["directory"] for h in map(Slot.peek_header, _slot_paths(paths))
                        if h is not None and "directory" in h.info})
    except (CheckpointError, OSError):  # the slots changed meanwhile
        where = []
    return f"cannot tell what of it is on {', '.join(where) or 'its storage'}: {_kind(exc)}{_one_line(exc)}"


def _why_keep(job: str, paths: list[str]) -> str | None:
    """Why gc must keep a dead job's objects: steps only its memory holds, or storage
    that cannot be checked; None when they can go."""
    try:
        pending = unpersisted_slots(_slot_paths(paths))
    except (CheckpointError, OSError) as exc:
        return (f"{_storage_unreachable(paths, exc)} (run `flashckpt persist --job-id {job}` once it can be "
                "reached, or gc --force)")
    if not pending:
        return None
    steps = sorted({step for _, _, _, step in pending})
    return f"steps {steps} are in memory only (run `flashckpt persist --job-id {job}` first, or gc --force)"


def _gc_directories(directories: list[str], dry_run: bool) -> int:
    """Remove what killed persists left in checkpoint directories (``step-N.tmp-*``) and
    their newest commit supersedes; a directory a live process writes into is kept."""
    removed = kept = 0
    for directory in directories:
        storage = _storage(directory)
        if storage.remote:
            raise CheckpointError(f"{storage.root}: gc cleans local directories; an object store's stale uploads "
                                  "go at its next commit")
        dead, live = storage.remove_dead_pending(dry_run=dry_run)
        for path in dead:
            print(f"{'would remove' if dry_run else 'removing'} {path}")
        for path in live:
            print(f"keeping {path}: being written by a live process")
        removed, kept = removed + len(dead), kept + len(live)
    print(f"{removed} dead pending directories {'found' if dry_run else 'removed'}, {kept} kept")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    if args.directories:
        return _gc_directories(args.directories, args.dry_run)
    removed = kept = 0
    for job, paths in sorted(_segments().items()):
        if _job_alive(job, paths):
            continue
        keep = None if args.force else _why_keep(job, paths)
        if keep:
            print(f"job {job}: keeping {len(paths)} objects, {keep}")
            kept += len(paths)
            continue
        for path in paths:
            print(f"{'would remove' if args.dry_run else 'removing'} {path}")
            if not args.dry_run:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            removed += 1
    print(f"{removed} stale objects {'found' if args.dry_run else 'removed'}, {kept} kept")
    dead, _ = remove_dead_scratch(dry_run=args.dry_run)
    for path in dead:
        print(f"{'would remove' if args.dry_run else 'removing'} {path} (the scratch directory of a dead process)")
    return 0


def cmd_persist(args: argparse.Namespace) -> int:
    jobs = _segments()
    if args.job_id:
        jobs = {args.job_id: jobs.get(args.job_id, [])}
    done = failed = 0
    for job, paths in sorted(jobs.items()):
        if _job_alive(job, paths) and not args.job_id:
            continue  # its own saver takes care of it
        try:
            pending = unpersisted_slots(_slot_paths(paths))
        except (CheckpointError, OSError) as exc:
            print(f"error: job {job}: {_storage_unreachable(paths, exc)}", file=sys.stderr)
            failed += 1
            continue
        for path, generation, _, _ in pending:
            try:
                result = persist_slot(path, generation)
            except (CheckpointError, OSError) as exc:
                print(f"error: job {job}: {os.path.basename(path)}: {_kind(exc)}{_one_line(exc)}", file=sys.stderr)
                failed += 1
                continue
            if not result.skipped:
                print(f"job {job}: persisted step {result.step} from {os.path.basename(path)}"
                      f"{' and committed it' if result.committed else ' (other ranks still missing)'}")
                done += 1
    if not done and not failed:
        print("nothing in shared memory needed persisting")
    return 1 if failed else 0


def cmd_convert(args: argparse.Namespace) -> int:
    from ._convert import convert_all  # needs torch
    if args.source == "flashckpt":
        _storage(args.directory)
    elif not os.path.isdir(args.directory):
        raise CheckpointNotFoundError(f"{os.path.abspath(args.directory)}: no such directory")
    for out in convert_all(args.directory, args.step, args.to, args.out, source=args.source):
        print(f"wrote {out}")
    return 0


_DIRECTORY = "the checkpoint directory (the one passed to the checkpointer; it holds step-N folders)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashckpt", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--traceback", action="store_true", help="on an error, print the whole traceback")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("ls", help="list committed steps and copies in memory", description=(
        "List the committed steps of a checkpoint directory: ranks, total size, commit time, and which is the "
        "newest (latest); first, the steps that this node's shared memory holds for it (in memory, or being "
        "persisted). Exits 1 when there is nothing, or a step's metadata is unreadable."))
    p.add_argument("directory", help=_DIRECTORY)
    p.set_defaults(run=cmd_ls)
    p = sub.add_parser("verify", help="check shard headers and checksums", description=(
        "Re-read every shard of committed steps and check sizes, block checksums, safetensors headers (as strictly "
        "as safetensors itself: tensors tile the body, no gap, no overlap) and that every shard belongs "
        "to the run that committed the step. Prints 'step N: ok' or 'step N: DAMAGED' and one line per problem; "
        "exits 1 when a step is damaged."))
    p.add_argument("directory", help=_DIRECTORY)
    p.add_argument("--step", type=int, metavar="N", help="verify only step N (default: every committed step)")
    p.set_defaults(run=cmd_verify)
    p = sub.add_parser("gc", help="remove stale shared memory of dead jobs, or dead pending saves", description=(
        "Remove this user's shared-memory objects of jobs with no live process, and the local scratch "
        "directories (flashckpt-deepspeed-* in the temporary directory) dead processes left. Jobs whose memory holds steps "
        "not yet on storage, or whose storage cannot be reached to tell, are kept unless --force (run "
        "`flashckpt persist` first). Given checkpoint directories, remove instead what killed persists left "
        "there (step-N.tmp-* directories) that the newest committed step supersedes, as the next commit would; "
        "a directory a live process is writing, and pending saves newer than every commit, are kept."))
    p.add_argument("directories", nargs="*", metavar="DIR", help=_DIRECTORY)
    p.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    p.add_argument("--force", action="store_true", help="also remove steps that exist only in memory")
    p.set_defaults(run=cmd_gc)
    p = sub.add_parser("persist", help="persist what dead jobs left in shared memory", description=(
        "Write the complete steps that dead jobs left in shared memory to their checkpoint directories, "
        "and commit them when every rank's shard is there. A job that fails is reported and the others are "
        "still persisted (exit status 1)."))
    p.add_argument("--job-id", metavar="J", help="only this job (also when it still has live processes); "
                   "default: every job without a live process")
    p.set_defaults(run=cmd_persist)
    p = sub.add_parser("convert", help="write one consolidated checkpoint for stock tools", description=(
        "Convert a committed step to a format stock tools load. A sharded (FSDP, ZeRO) or replicated checkpoint "
        "gives one output; a per-rank checkpoint (each rank saved its own state) gives one output per rank, named "
        "OUT with .rank-R before its extension (model.pt -> model.rank-0.pt, model.rank-1.pt)."))
    p.add_argument("directory", help=_DIRECTORY + "; with --from dcp, a torch.distributed.checkpoint directory")
    p.add_argument("out", help="the output file (torch, safetensors) or directory (dcp, flashckpt)")
    p.add_argument("--step", type=int, metavar="N", help="the step to convert (default: the newest committed); "
                   "with --from dcp, the step to record (default: the DCP checkpoint's 'step' entry, else the "
                   "number ending its directory name)")
    p.add_argument("--to", required=True, choices=["torch", "safetensors", "dcp", "flashckpt"],
                   help="the output format: torch (torch.load), safetensors (one file), dcp (a DCP directory), "
                   "flashckpt (a one-rank step any world size can load)")
    p.add_argument("--from", dest="source", default="flashckpt", choices=["flashckpt", "dcp"],
                   help="the input format (default: flashckpt)")
    p.set_defaults(run=cmd_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # every error is one line unless --traceback
        if args.traceback:
            raise
        print(f"error: {_kind(exc)}{_one_line(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
