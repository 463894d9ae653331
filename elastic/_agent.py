"""The fault-tolerant agent: two daemon threads per training process.

What it does, and on which thread:

- training thread, per step (``agent.step()``, or a checkpoint save): a lock, a few
  additions, one ``struct.pack_into`` into the backstop's progress file -- a few
  microseconds, so the agent costs well under 1% of a 10 ms step;
- agent thread, a few times a second: checks the adaptive hang timeout (dump stacks,
  record, and with ``on_hang="exit"`` flush and exit with ``ExitCode.HANG``), writes
  aggregated step records, beats the progress file;
- coordinator thread: heartbeats the coordinator for this worker (only while training
  makes progress, so a hung worker's shard leases expire like a dead one's) and
  publishes the events queued since (``elastic._publish``) to the coordinator's
  job-wide log; its calls may block while the coordinator is unreachable, which is why
  they are not the agent thread's;
- on SIGTERM (preemption, or the launcher stopping the group): the agent thread is woken
  through ``signal.set_wakeup_fd`` -- even while the main thread sits in a C call --
  records a ``preempted`` diagnosis, flushes the newest checkpoint to storage and exits
  with ``ExitCode.SIGTERM`` (143);
- on an uncaught exception (``sys.excepthook``): records the diagnosis, flushes, and lets
  Python exit with 1; a SIGTERM that comes meanwhile (torchrun stops the survivors when
  a peer died) lets that flush finish, then the process exits with 143. A failure the
  launcher restarts on this node (oom, network) with a flashckpt checkpointer does not
  wait for storage: the node's saver persists the newest step after the process exited,
  overlapping the restart (``AgentOptions.wait_for_storage``);
- outside the process: ``flashckpt._watchdog`` (the saver's poll, or the agent's own
  watcher process when there is no checkpointer) handles a hang that holds the GIL.

Restart stays with the launcher (``torchrun --max-restarts`` restarts on any of these
codes) unless the user asks for in-process restart with :meth:`Agent.run`.
"""

from __future__ import annotations

import atexit
import dataclasses
import faulthandler
import logging
import os
import select
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import Any, Callable, TypeVar

from flashckpt import _events, _watchdog
from flashckpt._names import default_job_id
from elastic._diagnosis import Action, Diagnosis, Kind, diagnose
from elastic._errors import ElasticError
from elastic._goodput import MetricsLog, read_records, summarize
from elastic._hang import HangTimeout, format_stacks
from elastic._heartbeat import Heartbeats
from elastic._publish import EventPublisher, as_record, coordinator_of
from elastic._resume import before_start, forget as forget_resume
from elastic._options import AgentOptions, ExitCode, OnHang

__all__ = ["Agent", "current_agent", "start_agent"]

log = logging.getLogger("elastic.agent")
T = TypeVar("T")

#: how long a process about to exit waits for its last events to reach the coordinator
EXIT_PUBLISH_SECONDS = 3.0
_HANG_STACKS_CHARS = 16_000  # the end of the stack dump goes into the hang event

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


@dataclasses.dataclass(slots=True)
class _Steps:
    """Steps since the last ``steps`` record."""

    first: int | None = None
    last: int | None = None
    t_begin: float = 0.0
    t_end: float = 0.0
    busy: float = 0.0
    ckpt: float = 0.0
    saves: int = 0
    samples: int = 0


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
        self._hang = HangTimeout(fixed_seconds=fixed, floor_seconds=options.hang_floor_seconds,
                                 multiplier=options.hang_multiplier, warmup_steps=options.warmup_steps,
                                 warmup_seconds=max(options.warmup_timeout_seconds, fixed or 0.0))
        self._lock = threading.Lock()
        self._step = 0
        self._explicit = False  # the user calls agent.step(): saves no longer count steps
        now = time.monotonic()
        self._wall = time.time() - now
        self._last_tick = self._last_progress = now
        self._acc = _Steps()
        self._handled = -1
        self._failing = threading.Lock()
        self._failing_thread: int | None = None  # who holds _failing
        self._failed = threading.Event()
        self._exiting = threading.Lock()  # set once a failure is recorded and flushed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._io_thread: threading.Thread | None = None
        self._heartbeats = Heartbeats(worker=self.worker, max_interval=options.heartbeat_interval,
                                      coordinator=coordinator, datasets=options.datasets,
                                      on_pause=self._on_heartbeat_pause)
        self._publisher = EventPublisher(self.worker)
        self._reader: Any = None  # a Coordinator opened by events() before the agent thread did
        self._log = MetricsLog(options.metrics_dir, rank=self.rank, worker=self.worker,
                               on_event=self._publisher.put if _publishes(coordinator) else None)
        self._stack_path = os.path.join(
            options.metrics_dir or tempfile.gettempdir(),
            f"stacks.rank{self.rank}.txt" if options.metrics_dir
            else f"flashckpt-stacks.{self.job_id}.rank{self.rank}.{self._pid}.txt")
        self._stack_file = None
        self._pub: _watchdog.ProgressPublisher | None = None
        self._watcher = None
        self._prev: dict[str, Any] = {}
        self._wake_r = self._wake_w = self._stop_r = self._stop_w = None

    # ---------------------------------------------------------------- public
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    @property
    def current_step(self) -> int:
        return self._step

    def step(self, n: int = 1, *, samples: int | None = None) -> None:
        """Mark ``n`` training steps done (``samples`` optional, for samples/s). Cheap."""
        self._explicit = True
        self._advance(n, samples)

    def tick(self) -> None:
        """Mark progress without a step (a long evaluation, a data loader batch)."""
        now = time.monotonic()
        self._last_progress = now
        if self._pub is not None:
            self._pub.progress(self._step, now)

    def add_heartbeat(self, dataset: Any, worker: str | None = None, *,
                      interval_seconds: float | None = None) -> None:
        """Heartbeat ``dataset`` (anything with ``.heartbeat(worker)``, e.g. a
        ``sharding.Dataset``) for ``worker`` (default :attr:`worker`) from the agent thread.

        Every ``interval_seconds`` (default, and at most, ``heartbeat_interval``; give
        ``lease_timeout / 3`` for shard leases), starting at once. Heartbeats stop while
        the process makes no progress for longer than the hang timeout (and, of course,
        while it is stopped or stuck with the GIL held), so its leases expire and go back
        to the queue (see ``elastic._heartbeat``). A ``ShardSampler`` registers itself
        here when an agent runs. Adding the same (dataset, worker) again only updates the
        interval.
        """
        self._heartbeats.add(dataset, worker, interval_seconds=interval_seconds)

    def remove_heartbeat(self, dataset: Any, worker: str | None = None) -> bool:
        """Stop heartbeating ``dataset`` for ``worker``; False if it was not registered."""
        return self._heartbeats.remove(dataset, worker)

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
        if not local and self._heartbeats.coordinator is not None:
            remote = self._coordinator_events()
            if remote is not None:
                seen = {_event_key(r) for r in remote}
                remote += [r for r in self._publisher.pending() if _event_key(r) not in seen]
                return sorted(remote, key=lambda r: r.get("time") or 0.0)
        return [r for r in self._records() if r.get("type") != "steps"]

    def record(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Record an event of your own (``kind`` must not be "steps"): a JSON line in
        ``metrics_dir`` and, with a coordinator, in its job-wide log. Cheap: no I/O but
        the metrics file's line."""
        if not isinstance(kind, str) or not kind or kind == "steps":
            raise ElasticError(f"event kind must be a non-empty str other than 'steps', got {kind!r}")
        return self._log.write(kind, step=self._step, **fields)

    def metrics(self) -> dict[str, Any]:
        """The goodput summary (job and per rank), see ``elastic._goodput.summarize``."""
        self._write_steps()
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
                    self._fail(diag, exc=exc, inprocess=True)
                    raise
                attempt += 1
                self.restarts += 1
                log.warning("rank %d: %s; in-process restart %d of %d", self.rank, diag.reason,
                            attempt, self.options.max_inprocess_restarts)
                self._write_steps()
                self._log.write("failure", step=self._step, diagnosis=diag.to_json(),
                                inprocess=True, retry=True)
                self._log.write("restart", step=self._step, attempt=attempt, inprocess=True)
                self._restarted()
                _reinit_process_group(attempt)

    def stop(self) -> None:
        """Stop the thread, write the last records, remove the progress file. Idempotent."""
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
        self._write_steps()
        self._log.write("stop", step=self._step)
        self._publish_before_exit()
        self._teardown()
        with _current_lock:
            if _current is self:
                _current = None

    # ---------------------------------------------------------------- start / stop
    def _start(self) -> None:
        opts = self.options
        resume = before_start(self._ckpt)  # a load (or save) before the agent started
        if resume is not None and resume.step is not None:
            self._step = resume.step
        self._stack_file = open(self._stack_path, "a", encoding="utf-8")
        faulthandler.register(opts.dump_signal, file=self._stack_file, all_threads=True)
        policy = _watchdog.Policy.EXIT if opts.on_hang is OnHang.EXIT else _watchdog.Policy.DUMP
        try:
            self._pub = _watchdog.ProgressPublisher(
                self.job_id, rank=self.rank, policy=policy, dump_signal=opts.dump_signal,
                timeout_seconds=self._hang.current(), grace_seconds=opts.backstop_grace_seconds,
                stack_path=os.path.abspath(self._stack_path),
                events_path=os.path.abspath(self._log.path) if self._log.path else None)
        except OSError as err:
            log.warning("no hang backstop (cannot create the progress file): %s", err)
        if self._pub is not None and self._ckpt is None:
            try:  # no saver process to poll the progress files: run our own watcher
                self._watcher = _watchdog.ensure_watcher(self.job_id, log_path=(
                    os.path.join(opts.metrics_dir, "watchdog.log") if opts.metrics_dir else None))
            except OSError as err:
                log.warning("cannot start the hang watcher: %s", err)
        self._stop_r, self._stop_w = os.pipe()
        if opts.handle_failures:
            self._install_failure_handlers()
        _events.subscribe(self._on_checkpoint_event)
        self._log.write("start", job_id=self.job_id, worker=self.worker, step=self._step,
                        hang_timeout=opts.hang_timeout, on_hang=opts.on_hang.value)
        if resume is not None and resume.event == "load":
            self._log.write("load", step=resume.step, source=resume.source, seconds=resume.seconds,
                            before_agent=True)
        self._thread = threading.Thread(target=self._loop, name="elastic-agent", daemon=True)
        self._thread.start()
        self._io_thread = threading.Thread(target=self._coordinator_loop, name="elastic-agent-coordinator",
                                           daemon=True)
        self._io_thread.start()
        atexit.register(self.stop)

    def _install_failure_handlers(self) -> None:
        self._prev["excepthook"] = sys.excepthook
        sys.excepthook = self._excepthook
        if threading.current_thread() is not threading.main_thread():
            log.warning("start_agent was called off the main thread: no SIGTERM handling")
            return
        self._prev["sigterm"] = signal.signal(signal.SIGTERM, self._on_sigterm)
        r, w = socket.socketpair()
        r.setblocking(False)
        w.setblocking(False)
        try:
            previous = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        except ValueError:
            previous = -2
        if previous != -1:  # someone (asyncio) owns the wakeup fd: leave it to them
            if previous >= 0:
                signal.set_wakeup_fd(previous)
            r.close()
            w.close()
            return
        self._wake_r, self._wake_w = r, w

    def _teardown(self) -> None:
        _events.unsubscribe(self._on_checkpoint_event)
        forget_resume()
        main = threading.current_thread() is threading.main_thread()
        if sys.excepthook == self._excepthook and "excepthook" in self._prev:
            sys.excepthook = self._prev.pop("excepthook")
        if main and "sigterm" in self._prev:
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, self._prev["sigterm"])
            if self._wake_w is not None:
                signal.set_wakeup_fd(-1)
        if self._pub is not None:
            self._pub.close()
            self._pub = None
        try:
            faulthandler.unregister(self.options.dump_signal)
        except (ValueError, RuntimeError):
            pass
        if self._stack_file is not None:
            self._stack_file.close()
            self._stack_file = None
        self._log.close()
        atexit.unregister(self.stop)

    # ---------------------------------------------------------------- progress
    def _advance(self, n: int, samples: int | None = None, ckpt: float = 0.0) -> None:
        now = time.monotonic()
        with self._lock:
            dt = now - self._last_tick
            self._last_tick = self._last_progress = now
            acc = self._acc
            if acc.first is None:
                acc.first = self._step + 1
                acc.t_begin = now - dt + self._wall
            self._step += n
            acc.last = self._step
            acc.t_end = now + self._wall
            acc.busy += dt
            if samples:
                acc.samples += samples
        warmed_up = self._hang.observe_step(dt / max(1, n))
        if self._pub is not None:
            if warmed_up:  # do not wait for the agent thread: it may not run again (GIL)
                self._pub.set_timeout(self._hang.current())
            self._pub.progress(self._step, now)

    def _on_checkpoint_event(self, event: str, **info: Any) -> None:
        if event == "save":
            blocking = float(info.get("blocking_seconds") or 0.0)
            self._hang.observe_checkpoint(blocking)
            with self._lock:
                self._acc.ckpt += blocking
                self._acc.saves += 1
            step = info.get("step")
            if not self._explicit and isinstance(step, int) and step > self._step:
                self._advance(step - self._step)
            else:
                self.tick()
        elif event == "load":
            self._write_steps()
            step = info.get("step")
            with self._lock:
                self._step = int(step) if step is not None else 0
            self._restarted()
            self._log.write("load", step=step, source=info.get("source"),
                            seconds=info.get("seconds"))

    def _restarted(self) -> None:
        """A restore or an in-process restart: the next steps get warm-up room again."""
        now = time.monotonic()
        with self._lock:
            self._last_tick = self._last_progress = now
        self._hang.restart()
        if self._pub is not None:
            self._pub.progress(self._step, now)

    def _write_steps(self) -> None:
        with self._lock:
            acc, self._acc = self._acc, _Steps()
        if acc.first is not None:
            self._log.write("steps", first=acc.first, last=acc.last, t_begin=acc.t_begin,
                            t_end=acc.t_end, busy_seconds=acc.busy, ckpt_seconds=acc.ckpt,
                            saves=acc.saves, samples=acc.samples)
        elif acc.saves:  # saves without steps: keep their blocking time
            with self._lock:
                self._acc.ckpt += acc.ckpt
                self._acc.saves += acc.saves

    def _records(self) -> list[dict[str, Any]]:
        if self.options.metrics_dir is not None:
            return read_records(self.options.metrics_dir)
        return self._log.records()

    def _coordinator_events(self) -> list[dict[str, Any]] | None:
        given = self._heartbeats.coordinator
        target = coordinator_of(given)
        if target is None and isinstance(given, str):  # the agent thread has not connected yet
            if self._reader is None:
                import sharding

                try:
                    self._reader = sharding.connect(given)
                except Exception as err:
                    log.warning("events: cannot connect to the coordinator: %s", err)
                    return None
            target = self._reader
        if target is None:
            return None
        try:
            return [as_record(e) for e in target.events()]
        except Exception as err:
            log.warning("events: cannot read the coordinator's event log: %s", err)
            return None

    def _publish_before_exit(self) -> None:
        try:
            self._publisher.flush(self._heartbeats.coordinator, timeout=EXIT_PUBLISH_SECONDS)
        except Exception:  # the agent must never die of its own bug
            log.exception("elastic agent: publishing the last events failed")

    # ---------------------------------------------------------------- the thread
    def _loop(self) -> None:
        """The watch thread: hang checks, the backstop's progress, metrics. It never
        waits on the coordinator (that is :meth:`_coordinator_loop`'s), so an unreachable
        coordinator cannot delay finding a hang."""
        opts = self.options
        next_metrics = time.monotonic()
        published = -1.0
        waitables = [fd for fd in (self._stop_r, self._wake_r) if fd is not None]
        while not self._stop.is_set():
            now = time.monotonic()
            timeout = self._hang.current()
            if self._pub is not None:
                self._pub.beat(now)
                if timeout != published:
                    self._pub.set_timeout(timeout)
                    published = timeout
            try:
                self._check_hang(now, timeout)
                if now >= next_metrics:
                    next_metrics = now + opts.metrics_interval_seconds
                    self._write_steps()
            except Exception:  # the agent must never die of its own bug
                log.exception("elastic agent iteration failed")
            wait = min(0.5, opts.metrics_interval_seconds, max(0.05, timeout / 10))
            ready, _, _ = select.select(waitables, [], [], wait)
            if self._wake_r is not None and self._wake_r in ready:
                self._on_wakeup()

    def _coordinator_loop(self) -> None:
        """The coordinator thread: lease heartbeats (withheld while hung) and events.
        Its calls may block for the coordinator's whole retry budget."""
        opts = self.options
        next_connect = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if now >= next_connect:
                    next_connect = now + opts.heartbeat_interval
                    self._heartbeats.connect()
                self._heartbeats.beat(now, hung=now - self._last_progress > self._hang.current())
                self._publisher.publish(self._heartbeats.coordinator)
            except Exception:  # the agent must never die of its own bug
                log.exception("elastic agent coordinator iteration failed")
            self._stop.wait(min(0.5, opts.heartbeat_interval, self._heartbeats.shortest_interval()))

    def _on_wakeup(self) -> None:
        try:
            data = self._wake_r.recv(512)
        except (BlockingIOError, InterruptedError):
            return
        if signal.SIGTERM in data:
            self._on_sigterm(signal.SIGTERM, None)

    def _check_hang(self, now: float, timeout: float) -> None:
        stalled = now - self._last_progress
        step = self._step
        if stalled <= timeout or self._handled == step:
            return
        self._handled = step
        if self._pub is not None:
            self._pub.mark_handled(step)
        exit_ = self.options.on_hang is OnHang.EXIT
        text = self._dump_stacks(f"hang on rank {self.rank} at step {step}: no progress for "
                                 f"{stalled:.1f}s (timeout {timeout:.1f}s)")
        diag = Diagnosis.of(Kind.HANG, f"no progress for {stalled:.1f}s (timeout {timeout:.1f}s)")
        self._log.write("hang", source="agent", step=step, stalled_seconds=stalled,
                        timeout_seconds=timeout, action="exit" if exit_ else "dump",
                        stack_file=os.path.abspath(self._stack_path), diagnosis=diag.to_json(),
                        stacks=text[-_HANG_STACKS_CHARS:])
        if exit_:
            if self._failing.acquire(blocking=False):
                self._failing_thread = threading.get_ident()
                self._flush_checkpoint()
                self._write_steps()
            self._exit(ExitCode.HANG)

    def _dump_stacks(self, what: str) -> str:
        """Log every thread's stack and append it to the rank's stack file."""
        text = format_stacks(f"elastic agent: {what}")
        log.error("%s", text)
        if self._stack_file is not None:
            self._stack_file.write(text + "\n")
            self._stack_file.flush()
        return text

    def _dump_stacks_if_stalled(self, why: str) -> None:
        """A launcher stops every rank when one fails: where this rank had made no progress
        for half its hang timeout, its stacks say where it waited (the hung rank, when a
        peer's agent found the hang first)."""
        stalled = time.monotonic() - self._last_progress
        timeout = self._hang.current()
        if stalled >= timeout / 2:
            self._dump_stacks(f"{why} on rank {self.rank} at step {self._step} after "
                              f"{stalled:.1f}s without progress (hang timeout {timeout:.1f}s)")

    def _on_heartbeat_pause(self, paused: bool, targets: int) -> None:
        log.warning("rank %d: %s heartbeats (%d targets)", self.rank,
                    "no progress past the hang timeout: withholding" if paused
                    else "progress again: resuming", targets)
        self._log.write("heartbeats", step=self._step, paused=paused)

    # ---------------------------------------------------------------- failures
    def _fail(self, diag: Diagnosis, *, exc: BaseException | None = None, **extra: Any) -> bool:
        """Record a failure and flush the newest checkpoint, once per process.

        False when called again on the thread that is recording one: a signal handler
        (SIGTERM from the launcher, which stops the survivors when a peer died) that
        interrupted the main thread's own flush. Waiting there would wait for itself.
        """
        if not self._failing.acquire(blocking=False):
            if self._failing_thread == threading.get_ident():
                return False
            # another thread is already recording and flushing: wait for it to finish
            self._failed.wait(self.options.flush_timeout_seconds + 5.0)
            return True
        self._failing_thread = threading.get_ident()
        try:
            self._record_failure(diag, exc, extra)
        finally:
            self._failed.set()
        return True

    def _record_failure(self, diag: Diagnosis, exc: BaseException | None, extra: dict) -> None:
        if exc is not None:
            extra.setdefault("exception", f"{type(exc).__name__}: {exc}"[:1000])
            exc.__elastic_recorded__ = True  # type: ignore[attr-defined]
        log.error("rank %d failed at step %d: %s (%s -> %s)", self.rank, self._step, diag.reason,
                  diag.kind.value, diag.action.value)
        if diag.kind is Kind.PREEMPTED:
            self._dump_stacks_if_stalled(diag.reason)
        self._write_steps()
        self._log.write("failure", step=self._step, diagnosis=diag.to_json(), **extra)
        self._flush_checkpoint(handoff=self._hands_off(diag))

    def _hands_off(self, diag: Diagnosis) -> bool:
        """Leave the flush to the node's saver (see ``AgentOptions.wait_for_storage``)? It
        persists the newest slots of a trainer that exits without closing; the restarted
        process's load waits for that, where it is not done by then."""
        if self.options.wait_for_storage != "auto" or diag.action is not Action.RESTART_PROCESS \
                or diag.kind in (Kind.PREEMPTED, Kind.HANG):
            return False
        base = sys.modules.get("flashckpt._base")
        return base is not None and isinstance(self._ckpt, base.EngineCheckpointer)

    def _flush_checkpoint(self, *, handoff: bool = False) -> None:
        ckpt = self._ckpt
        if ckpt is None or not hasattr(ckpt, "flush"):
            return
        if handoff:
            log.warning("rank %d: the node's saver persists the newest checkpoint after this "
                        "process exits (wait_for_storage='auto')", self.rank)
            self._log.write("flush", ok=True, handoff=True, seconds=0.0)
            return
        began = time.monotonic()
        try:
            ckpt.flush(timeout=self.options.flush_timeout_seconds)
            latest = ckpt.latest_step() if hasattr(ckpt, "latest_step") else None
            self._log.write("flush", ok=True, step=latest, seconds=time.monotonic() - began)
        except Exception as err:
            log.error("flush of the newest checkpoint failed: %s", err)
            self._log.write("flush", ok=False, error=str(err), seconds=time.monotonic() - began)

    def _excepthook(self, etype: type, value: BaseException, tb: Any) -> None:
        if not issubclass(etype, SystemExit) and not getattr(value, "__elastic_recorded__", False):
            try:
                self._fail(diagnose(value), exception=f"{etype.__name__}: {value}"[:1000])
            except Exception:
                log.exception("elastic agent: recording the failure failed")
        self._prev.get("excepthook", sys.__excepthook__)(etype, value, tb)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # Runs on the agent thread (woken by the wakeup fd) or on the main thread,
        # whichever comes first; the other finds _failing taken and returns.
        if os.getpid() != self._pid:
            return
        prev = self._prev.get("sigterm")
        if not self._fail(Diagnosis.of(Kind.PREEMPTED, "SIGTERM received"), signal=int(signum)):
            # this (main) thread was flushing for another failure when SIGTERM came: let
            # the flush finish; the process then exits with that failure's code (or the
            # agent thread, woken by the same signal, exits it with 143)
            log.warning("rank %d: SIGTERM while flushing for a failure; the flush finishes first",
                        self.rank)
            return
        if callable(prev) and threading.current_thread() is threading.main_thread():
            prev(signum, frame)  # the user's own handler decides what happens next
            return
        if callable(prev):
            return  # the main thread will call the user's handler
        self._exit(ExitCode.SIGTERM)

    def _exit(self, code: int) -> None:
        if self._exiting.acquire(blocking=False):  # one record, whichever thread comes first
            self._log.write("exit", code=int(code), step=self._step)
            self._publish_before_exit()
        if self._pub is not None:
            self._pub.close()
        for handler in logging.getLogger().handlers:
            try:
                handler.flush()
            except Exception:
                pass
        os._exit(int(code))


def _publishes(coordinator: Any) -> bool:
    """A URL, a Coordinator or a Dataset (through its coordinator) gets the events."""
    return isinstance(coordinator, str) or coordinator_of(coordinator) is not None


def _event_key(record: dict[str, Any]) -> tuple:
    return (record.get("worker"), record.get("pid"), record.get("type"), record.get("time"))


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
