"""The fault-tolerant agent: two daemon threads per training process, and what it owns.

One concept per module; this one starts the agent, holds its parts together and is its
public face (:class:`Agent`):

- ``elastic._steps``: the training thread's side -- ``agent.step()`` or a checkpoint
  save costs a few microseconds (a lock, a few additions, one ``struct.pack_into``);
- ``elastic._watch``: the watch thread (``elastic-agent``), a few times a second: the
  adaptive hang timeout and the one hang rule (dump stacks, record, and with
  ``on_hang="exit"`` flush and exit with ``ExitCode.HANG``), step records, the progress
  record's beat;
- ``elastic._coordinator_link``: the coordinator thread (``elastic-agent-coordinator``):
  it connects, drives the process's heartbeat schedule (``elastic._heartbeat``, withheld
  while training is hung, so a hung worker's shard leases expire like a dead one's) and
  publishes the queued events (``elastic._publish``) to the coordinator's job-wide log;
- ``elastic._failures``: SIGTERM, an uncaught exception, a hang with ``on_hang="exit"``:
  diagnosis, flush of the newest checkpoint, the exit code;
- outside the process: ``flashckpt._watchdog`` (the saver's poll, or the agent's own
  watcher process when there is no checkpointer) handles a hang that holds the GIL, by
  the same rule; each hang is handled once, by whichever side claims it first.

Restart stays with the launcher (``torchrun --max-restarts`` restarts on any of the exit
codes) unless the user asks for in-process restart with :meth:`Agent.run`.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import tempfile
import threading
from typing import Any, Callable, TypeVar

from flashckpt import _events, _watchdog
from flashckpt._names import default_job_id
from elastic._coordinator_link import CoordinatorLink, publishes
from elastic._diagnosis import diagnose
from elastic._errors import ElasticError
from elastic._failures import Failures
from elastic._goodput import MetricsLog, read_records, summarize
from elastic._hang import HangTimeout, StackFile
from elastic._heartbeat import process_heartbeats
from elastic._options import AgentOptions, OnHang
from elastic._publish import EventPublisher
from elastic._resume import before_start, forget as forget_resume
from elastic._steps import StepClock
from elastic._watch import Watch

__all__ = ["Agent", "current_agent", "start_agent"]

log = logging.getLogger("elastic.agent")
T = TypeVar("T")

_current: "Agent | None" = None
_current_lock = threading.Lock()


def start_agent(*, checkpointer: Any = None, coordinator: Any = None,
                hang_timeout: float | str = "auto", heartbeat_interval: float | None = None,
                on_hang: str = "dump", metrics_dir: str | None = None,
                max_inprocess_restarts: int = 0, **options: Any) -> "Agent":
    """Start this process's agent, or return the one already running (idempotent).

    ``checkpointer``: a ``flashckpt`` checkpointer (its saves tick the agent; failures
    flush it). ``coordinator``: a ``sharding`` URL, Coordinator or Dataset to heartbeat;
    a URL or Coordinator also gets the agent's events (its job-wide event log), so
    :meth:`Agent.events` of every rank shows every rank's.
    Further keyword options are the fields of :class:`AgentOptions`. Call it from the
    main thread (SIGTERM handling needs it; from another thread that part is skipped).
    """
    global _current
    with _current_lock:
        agent = _current
        if agent is not None and agent._pid == os.getpid() and agent.running:
            if checkpointer is not None and agent._ckpt is None:
                agent._ckpt = checkpointer
            return agent
        try:
            opts = AgentOptions(hang_timeout=hang_timeout, heartbeat_interval=heartbeat_interval,
                                on_hang=on_hang, metrics_dir=metrics_dir,
                                max_inprocess_restarts=max_inprocess_restarts, **options)
        except TypeError as err:
            raise ElasticError(f"start_agent: {err}") from None
        agent = Agent(opts, checkpointer=checkpointer, coordinator=coordinator)
        agent._start()
        _current = agent
        return agent


def current_agent() -> "Agent | None":
    """The running agent of this process, or None."""
    agent = _current
    return agent if agent is not None and agent.running and agent._pid == os.getpid() else None


def _rank() -> int:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _job_id(opts: AgentOptions, checkpointer: Any) -> str:
    if opts.job_id:
        return opts.job_id
    if checkpointer is not None and getattr(checkpointer, "job_id", None):
        return str(checkpointer.job_id)
    if os.environ.get("FLASHCKPT_JOB_ID"):
        return os.environ["FLASHCKPT_JOB_ID"]
    if opts.metrics_dir:
        return default_job_id(opts.metrics_dir)
    return f"ppid{os.getppid()}"  # all local ranks under one launcher share it


class Agent:
    """Use :func:`start_agent`; see the module docstring for what runs where."""

    def __init__(self, options: AgentOptions, *, checkpointer: Any = None,
                 coordinator: Any = None) -> None:
        self.options = options
        self._ckpt = checkpointer
        self._pid = os.getpid()
        self.rank = _rank()
        self.worker = options.worker or f"{socket.gethostname()}-rank{self.rank}"
        self.job_id = _job_id(options, checkpointer)
        self.restarts = 0
        fixed = options.hang_timeout if isinstance(options.hang_timeout, float) else None
        hang = HangTimeout(fixed_seconds=fixed, floor_seconds=options.hang_floor_seconds,
                           multiplier=options.hang_multiplier, warmup_steps=options.warmup_steps,
                           warmup_seconds=max(options.warmup_timeout_seconds, fixed or 0.0))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._io_thread: threading.Thread | None = None
        self._stop_r = self._stop_w = None
        self._heartbeats = process_heartbeats()
        self._publisher = EventPublisher(self.worker)
        self._log = MetricsLog(options.metrics_dir, rank=self.rank, worker=self.worker,
                               on_event=self._publisher.put if publishes(coordinator) else None)
        self._clock = StepClock(hang=hang, log=self._log)
        self._link = CoordinatorLink(coordinator, worker=self.worker, owner=self,
                                     heartbeats=self._heartbeats, publisher=self._publisher,
                                     datasets=options.datasets, interval=options.heartbeat_interval)
        self._stacks = StackFile(os.path.join(
            options.metrics_dir or tempfile.gettempdir(),
            f"stacks.rank{self.rank}.txt" if options.metrics_dir
            else f"flashckpt-stacks.{self.job_id}.rank{self.rank}.{self._pid}.txt"))
        self._failures = Failures(options, rank=self.rank, log_=self._log, clock=self._clock,
                                  stacks=self._stacks, link=self._link, checkpointer=lambda: self._ckpt)
        self._watch = Watch(options, rank=self.rank, clock=self._clock, log_=self._log,
                            stacks=self._stacks, failures=self._failures)
        self._watcher = None

    # ---------------------------------------------------------------- public
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    @property
    def current_step(self) -> int:
        return self._clock.step

    def step(self, n: int = 1, *, samples: int | None = None) -> None:
        """Mark ``n`` training steps done (``samples`` optional, for samples/s). Cheap."""
        self._clock.explicit = True
        self._clock.advance(n, samples)

    def tick(self) -> None:
        """Mark progress without a step (a long evaluation, a data loader batch)."""
        self._clock.tick()

    def add_heartbeat(self, dataset: Any, worker: str | None = None, *,
                      interval_seconds: float | None = None) -> None:
        """Heartbeat ``dataset`` (anything with ``.heartbeat(worker)``, e.g. a
        ``sharding.Dataset``) for ``worker`` (default :attr:`worker`) from the agent thread.

        Every ``interval_seconds`` (default, and at most, ``heartbeat_interval``; give
        ``lease_timeout / 3`` for shard leases), starting at once. Heartbeats stop while
        the process makes no progress for longer than the hang timeout (and, of course,
        while it is stopped or stuck with the GIL held), so its leases expire and go back
        to the queue (see ``elastic._heartbeat``: samplers' leases go the same way). Adding
        the same (dataset, worker) again only updates the interval. The agent's stop
        removes it.
        """
        interval = self.options.heartbeat_interval if interval_seconds is None else interval_seconds
        self._heartbeats.add(dataset, worker or self.worker, interval_seconds=interval, owner=self)

    def remove_heartbeat(self, dataset: Any, worker: str | None = None) -> bool:
        """Stop heartbeating ``dataset`` for ``worker``; False if it was not registered."""
        return self._heartbeats.remove(dataset, worker or self.worker)

    def events(self, *, local: bool = False) -> list[dict[str, Any]]:
        """Events (every record but the step aggregates), oldest first; each has ``type``,
        ``time``, ``rank``, ``pid`` and ``worker`` (the worker name of the agent that
        recorded it: the ``source`` of its event in the coordinator's log; a record's own
        ``source`` field, where it has one, says what found a hang or where a load read).

        Job-wide: with a coordinator (a URL or Coordinator), every rank's events from the
        coordinator's log -- across process restarts, with ``seq`` -- plus this process's
        own not published yet; it reads the coordinator (a blocking call: not in the hot
        loop). If the coordinator cannot be read (logged), or without one, or with
        ``local=True``: every rank's from ``metrics_dir`` when the ranks share it (one
        file per rank there), else this process's own.
        """
        if not local and self._link.coordinator is not None:
            remote = self._link.events()
            if remote is not None:
                return remote
        return [r for r in self._records() if r.get("type") != "steps"]

    def record(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Record an event of your own (``kind`` must not be "steps"): a JSON line in
        ``metrics_dir`` and, with a coordinator, in its job-wide log. Cheap: no I/O but
        the metrics file's line."""
        if not isinstance(kind, str) or not kind or kind == "steps":
            raise ElasticError(f"event kind must be a non-empty str other than 'steps', got {kind!r}")
        return self._log.write(kind, step=self._clock.step, **fields)

    def metrics(self) -> dict[str, Any]:
        """The goodput summary (job and per rank), see ``elastic._goodput.summarize``."""
        self._clock.write_steps()
        return summarize(self._records())

    def goodput(self) -> float:
        """Useful step time / wall time of the job so far (across restarts with metrics_dir)."""
        return self.metrics()["job"].get("goodput", 0.0)

    def run(self, train_fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Call ``train_fn(*args, **kwargs)``; re-run it after a recoverable failure.

        Up to ``max_inprocess_restarts`` times, for failures whose diagnosis is
        ``restart_process`` (oom, network, ...), without a new process: ``train_fn``
        restores itself (``ckpt.load(state)`` at its start reads the in-memory copy).
        Under torch.distributed the process group is re-created first; every rank must
        fail and re-run alike (a collective error reaches the others as a network error).
        Other failures, and the last one, are flushed, recorded and re-raised.
        """
        attempt = 0
        while True:
            try:
                return train_fn(*args, **kwargs)
            except Exception as exc:
                diag = diagnose(exc)
                retry = diag.retryable and attempt < self.options.max_inprocess_restarts
                if not retry:
                    self._failures.fail(diag, exc=exc, inprocess=True)
                    raise
                attempt += 1
                self.restarts += 1
                log.warning("rank %d: %s; in-process restart %d of %d", self.rank, diag.reason,
                            attempt, self.options.max_inprocess_restarts)
                self._clock.write_steps()
                self._log.write("failure", step=self._clock.step, diagnosis=diag.to_json(),
                                inprocess=True, retry=True)
                self._log.write("restart", step=self._clock.step, attempt=attempt, inprocess=True)
                self._clock.restarted()
                _reinit_process_group(attempt)

    def stop(self) -> None:
        """Stop the threads, write the last records, remove the progress file. Idempotent."""
        global _current
        if self._stop.is_set() or os.getpid() != self._pid:
            return
        self._stop.set()
        if self._stop_w is not None:
            os.write(self._stop_w, b"x")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        if self._io_thread is not None and self._io_thread is not threading.current_thread():
            self._io_thread.join(timeout=1.0)  # a call stuck on the coordinator: the exit publish copes
        self._heartbeats.detach(self)
        self._clock.write_steps()
        self._log.write("stop", step=self._clock.step)
        self._link.publish_before_exit()
        self._teardown()
        with _current_lock:
            if _current is self:
                _current = None

    # ---------------------------------------------------------------- start / stop
    def _start(self) -> None:
        opts = self.options
        resume = before_start(self._ckpt)  # a load (or save) before the agent started
        if resume is not None and resume.step is not None:
            self._clock.step = resume.step
        self._stacks.open(opts.dump_signal)
        self._clock.progress = self._open_progress()
        if self._clock.progress.path is not None and self._ckpt is None:
            try:  # no saver process to poll the progress files: run our own watcher
                self._watcher = _watchdog.ensure_watcher(self.job_id, log_path=(
                    os.path.join(opts.metrics_dir, "watchdog.log") if opts.metrics_dir else None))
            except OSError as err:
                log.warning("cannot start the hang watcher: %s", err)
        self._stop_r, self._stop_w = os.pipe()
        if opts.handle_failures:
            self._failures.install()
        _events.subscribe(self._on_checkpoint_event)
        self._log.write("start", job_id=self.job_id, worker=self.worker, step=self._clock.step,
                        hang_timeout=opts.hang_timeout, on_hang=opts.on_hang.value)
        if resume is not None and resume.event == "load":
            self._log.write("load", step=resume.step, source=resume.source, seconds=resume.seconds,
                            before_agent=True)
        self._heartbeats.attach(self, max_interval=opts.heartbeat_interval, on_pause=self._on_heartbeat_pause)
        self._thread = threading.Thread(target=self._watch.run, args=(self._stop, self._stop_r),
                                        name="elastic-agent", daemon=True)
        self._thread.start()
        self._io_thread = threading.Thread(target=self._link.run, args=(self._stop, self._clock.hung),
                                           name="elastic-agent-coordinator", daemon=True)
        self._io_thread.start()
        atexit.register(self.stop)

    def _open_progress(self) -> _watchdog.ProgressPublisher:
        """The progress record: a file the backstop watches, else (no file could be made)
        one in this process's memory, for the agent's own watch."""
        opts = self.options
        policy = _watchdog.Policy.EXIT if opts.on_hang is OnHang.EXIT else _watchdog.Policy.DUMP
        record = dict(rank=self.rank, policy=policy, dump_signal=opts.dump_signal,
                      timeout_seconds=self._clock.hang.current(),
                      grace_seconds=opts.backstop_grace_seconds,
                      stack_path=os.path.abspath(self._stacks.path),
                      events_path=os.path.abspath(self._log.path) if self._log.path else None)
        try:
            return _watchdog.ProgressPublisher(self.job_id, **record)
        except OSError as err:
            log.warning("no hang backstop (cannot create the progress file): %s", err)
            return _watchdog.ProgressPublisher(self.job_id, shared=False, **record)

    def _teardown(self) -> None:
        _events.unsubscribe(self._on_checkpoint_event)
        forget_resume()
        self._failures.uninstall()
        progress, self._clock.progress = self._clock.progress, None
        if progress is not None:
            progress.close()
        self._stacks.close()
        self._log.close()
        atexit.unregister(self.stop)

    # ---------------------------------------------------------------- events
    def _on_checkpoint_event(self, event: str, **info: Any) -> None:
        if event == "save":
            self._clock.saved(info.get("step"), float(info.get("blocking_seconds") or 0.0))
        elif event == "load":
            step = info.get("step")
            self._clock.loaded(step)
            self._log.write("load", step=step, source=info.get("source"),
                            seconds=info.get("seconds"))

    def _on_heartbeat_pause(self, paused: bool, targets: int) -> None:
        log.warning("rank %d: %s heartbeats (%d targets)", self.rank,
                    "no progress past the hang timeout: withholding" if paused
                    else "progress again: resuming", targets)
        self._log.write("heartbeats", step=self._clock.step, paused=paused)

    def _records(self) -> list[dict[str, Any]]:
        if self.options.metrics_dir is not None:
            return read_records(self.options.metrics_dir)
        return self._log.records()


def _reinit_process_group(attempt: int) -> None:
    """Re-create the default process group after an in-process restart (best effort)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    backend, rank, world = dist.get_backend(), dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    dist.init_process_group(backend, store=dist.PrefixStore(f"elastic/restart{attempt}", store),
                            rank=rank, world_size=world)
