"""Worker processes forked from a server that imported torch once.

A fresh interpreter spends seconds of CPU importing torch, and more for DeepSpeed and
``torch._dynamo`` (which every torch optimizer imports on construction): on a 2-core CI
machine that was most of what several multi-process tests took. ``context()`` is a
``multiprocessing`` fork-server context whose server preloads those modules, once per
test session; each worker is still a new process, forked from that clean server (no
test code ran in it, no process group, no CUDA).

A forked worker does not inherit the caller's environment or standard streams (it gets
the server's); ``Inherit`` carries them, so a worker starts as a spawned one would.
``Forked`` runs a function in such a worker behind the part of ``subprocess.Popen``'s
interface the crash tests use; ``run_ranks`` runs one on every rank of a real gloo
process group (the suite's one spawn helper for multi-process tests).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import runpy
import signal
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from multiprocessing.reduction import DupFd
from typing import Any, Callable

from ._net import free_port

__all__ = ["context", "Inherit", "Forked", "run_script", "run_ranks"]

PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]
DEEPSPEED = ["deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer"]
"""DeepSpeed, and what ``deepspeed.initialize`` of a ZeRO engine imports the first time (its
optimizer check imports the Muon optimizer, and with it ``torch._inductor``: seconds of CPU
in every worker)."""


def context() -> Any:
    """The fork-server context (the server starts with the first worker)."""
    ctx = mp.get_context("forkserver")
    # DeepSpeed picks its accelerator on import: preloaded only where the tests chose one
    # (tests/deepspeed/conftest.py sets DS_ACCELERATOR before any test runs)
    ctx.set_forkserver_preload(PRELOAD + (DEEPSPEED if os.environ.get("DS_ACCELERATOR") else []))
    return ctx


def _same(value: Any) -> Any:
    return value


class _Fd:
    """One of this process's file descriptors, pickled for the worker being started as a
    duplicate the fork server hands over (``.detach()`` there gives the number)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _same, (DupFd(self.fd),)


class Inherit:
    """What a spawned worker would inherit from its caller: the environment, the current
    directory and the standard output and error, as they are when it is created."""

    def __init__(self, stdout: int = 1, stderr: int = 2, **env: str) -> None:
        self.env = dict(os.environ, **env)
        self.cwd = os.getcwd()
        self.stdio = (_Fd(stdout), _Fd(stderr))

    def apply(self) -> None:
        """In the worker, first thing."""
        for fd, dup in zip((1, 2), self.stdio):
            os.dup2(dup.detach(), fd)
        os.environ.clear()
        os.environ.update(self.env)
        os.chdir(self.cwd)
        config = sys.modules.get("fsspec.config")
        if config is not None:  # read at its import, while the target's arguments were unpickled: the server's environment
            config.conf.clear()
            config.set_conf_files(config.conf_dir, config.conf)
            config.set_conf_env(config.conf)


def _run(inherit: Inherit, target: Callable[..., Any], args: tuple) -> None:
    inherit.apply()
    target(*args)


def run_script(path: str, args: list[str]) -> None:
    """A ``Forked`` target: what ``python PATH ARGS...`` runs (the script's folder first on
    the path, ``__name__ == "__main__"``)."""
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(path))
    runpy.run_path(path, run_name="__main__")


class Forked:
    """``target(*args)`` in a forked worker with its stderr (and unless ``pipe_stdout`` is
    false, its stdout) piped to this process (text, ``.stderr`` / ``.stdout``) and ``env``
    added to its environment: ``pid``, ``returncode``, ``poll()``, ``wait(timeout)``,
    ``kill()`` and ``send_signal()`` behave as ``subprocess.Popen``'s (a worker ended by a
    signal returns minus its number)."""

    def __init__(self, target: Callable[..., Any], *args: Any, env: dict[str, str] | None = None,
                 pipe_stdout: bool = True) -> None:
        out_r, out_w = os.pipe() if pipe_stdout else (None, 1)
        err_r, err_w = os.pipe()
        try:
            self._proc = context().Process(target=_run, args=(Inherit(out_w, err_w, **(env or {})), target, args))
            self._proc.start()
        finally:
            if pipe_stdout:
                os.close(out_w)
            os.close(err_w)
        self.pid = self._proc.pid
        self.stdout = open(out_r, encoding="utf-8", errors="replace") if pipe_stdout else None
        self.stderr = open(err_r, encoding="utf-8", errors="replace")

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            import subprocess
            raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout)
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never a pid the worker no longer holds
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# -- N ranks of a process group -------------------------------------------------------------

_INIT_FAILED = "init-failed"
_INIT_TRIES = 3


@dataclass
class _Outcome:
    """What the ranks of one try reported."""

    results: dict[int, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    unformed: bool = False
    """A rank failed to join the process group (the others wait for a group that will not form)."""


def _rank_entry(fn: Callable, rank: int, world: int, port: int, args: tuple, out: Any, backend: str,
                inherit: Inherit) -> None:
    inherit.apply()
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    try:
        dist.init_process_group(backend, rank=rank, world_size=world)
    except BaseException:
        out.put((rank, _INIT_FAILED, traceback.format_exc()))
        return
    try:
        # pickled here, by value: a queue would pass tensors as file descriptors that this
        # process serves, and it may exit before the parent takes them (FileNotFoundError there)
        out.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(out: Any, procs: list[Any], timeout: float) -> _Outcome:
    """Each rank's result or failure: a traceback it sent, an exit without a result (a
    signal, ``os._exit``), or silence for ``timeout`` seconds after the last report; none
    waited for once a rank failed to join the process group."""
    outcome = _Outcome()
    results, errors = outcome.results, outcome.errors
    pending = set(range(len(procs)))

    def take(item: tuple[int, str, Any]) -> None:
        rank, status, value = item
        pending.discard(rank)
        if status == "ok":
            results[rank] = pickle.loads(value)
            return
        outcome.unformed |= status == _INIT_FAILED
        errors.append(f"rank {rank}{' (joining the process group)' if status == _INIT_FAILED else ''}:\n{value}")

    deadline = time.monotonic() + timeout
    while pending and not outcome.unformed:
        try:
            take(out.get(timeout=min(1.0, max(0.01, deadline - time.monotonic()))))
        except queue.Empty:
            pass
        else:
            deadline = time.monotonic() + timeout
            continue
        exited = [r for r in pending if procs[r].exitcode is not None]
        try:  # an exited worker's report is in the pipe already (its queue flushed before it exited)
            while True:
                take(out.get_nowait())
        except queue.Empty:
            pass
        for r in (r for r in exited if r in pending):
            errors.append(f"rank {r}: exited with code {procs[r].exitcode} and no result")
            pending.discard(r)
        if pending and time.monotonic() > deadline:
            errors += [f"rank {r}: no result within {timeout:g}s" for r in sorted(pending)]
            break
    return outcome


def run_ranks(fn: Callable, world: int, *args: Any, timeout: float = 120.0, backend: str = "gloo") -> list[Any]:
    """``fn(rank, world, *args)`` on every rank of a ``backend`` process group, each rank a
    forked worker (``Forked``'s server, the caller's environment); returns the results by
    rank, or raises AssertionError with every failing rank's traceback (or exit code, or
    silence for ``timeout`` seconds). ``fn`` and its results must pickle."""
    attempt = 1
    while True:
        outcome = _run_once(fn, world, args, timeout, backend)
        if not outcome.errors:
            return [outcome.results[r] for r in range(world)]
        if attempt == _INIT_TRIES or not outcome.unformed:
            raise AssertionError("\n".join(outcome.errors))
        # gloo's full mesh over loopback, with other tests' ranks connecting and dying on the
        # same ports, now and then fails before fn ran ("Connection closed by peer"): nothing
        # of the test happened yet, so it starts over on a new port
        warnings.warn(f"process group of {world} failed to form (attempt {attempt}), retrying:\n"
                      + "\n".join(outcome.errors))
        attempt += 1


def _run_once(fn: Callable, world: int, args: tuple, timeout: float, backend: str) -> _Outcome:
    ctx = context()
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_entry, args=(fn, r, world, port, args, out, backend, Inherit()))
             for r in range(world)]
    for p in procs:
        p.start()
    outcome = _Outcome()
    try:
        outcome = _collect(out, procs, timeout)
    finally:
        for p in procs:
            p.join(timeout=0 if outcome.unformed else 10)
            if p.is_alive():
                p.kill()
                p.join()
    return outcome
