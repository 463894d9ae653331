"""The agent's options: one keyword-only dataclass, checked at construction."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import signal

from elastic._errors import ElasticError

__all__ = ["AgentOptions", "ExitCode", "OnHang"]

#: the heartbeat interval when the hang timeout leaves room for it (see AgentOptions)
DEFAULT_HEARTBEAT_SECONDS = 5.0


class OnHang(str, enum.Enum):
    """What the agent does when it detects a hang."""

    DUMP = "dump"  #: dump every thread's stack, record an event, keep waiting
    EXIT = "exit"  #: dump, flush the newest checkpoint, exit with ExitCode.HANG


class ExitCode(enum.IntEnum):
    """Exit codes of a process whose agent ended it (documented contract).

    A plain uncaught exception keeps Python's own code 1 (after diagnosis and flush);
    the backstop watchdog ends a GIL-stuck process with SIGKILL (the launcher sees -9).
    ``torchrun --max-restarts`` restarts the group on any of them.
    """

    HANG = 124  #: on_hang="exit" and no progress past the timeout (as coreutils `timeout`)
    SIGTERM = 128 + signal.SIGTERM  #: 143, preempted: newest checkpoint flushed, then exit


def _seconds(name: str, value: float | datetime.timedelta) -> float:
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ElasticError(f"{name} must be seconds (float) or a timedelta, got {value!r}")
    if value <= 0:
        raise ElasticError(f"{name} must be > 0 seconds, got {value}")
    return float(value)


@dataclasses.dataclass(kw_only=True, slots=True)
class AgentOptions:
    """Everything :func:`elastic.start_agent` accepts besides the checkpointer and coordinator.

    Times are seconds (float) or ``datetime.timedelta``; they are normalised to float
    seconds. Ordering rules checked here: a ``heartbeat_interval`` the caller gives must be
    shorter than a fixed ``hang_timeout`` (else than ``hang_floor_seconds``): heartbeats
    stop once training makes no progress for the hang timeout, so a longer interval would
    not heartbeat in time. Left unset, it is derived from them and always fits.
    ``hang_floor_seconds`` <= ``warmup_timeout_seconds``.
    """

    #: "auto" (adaptive, see elastic._hang) or a fixed timeout in seconds / timedelta
    hang_timeout: float | datetime.timedelta | str = "auto"
    #: the adaptive timeout never goes below this
    hang_floor_seconds: float | datetime.timedelta = 60.0
    #: the adaptive timeout is this many times the p99 step time (plus checkpoint room)
    hang_multiplier: float = 10.0
    #: steps after a start or a restore that get ``warmup_timeout_seconds``
    warmup_steps: int = 3
    #: the hang timeout of the warm-up steps (compilation, first collectives)
    warmup_timeout_seconds: float | datetime.timedelta = 900.0
    #: how often the agent heartbeats the coordinator; default (None) derived from the
    #: hang timeout: min(DEFAULT_HEARTBEAT_SECONDS, a quarter of the fixed ``hang_timeout``,
    #: else of ``hang_floor_seconds``) -- 5 s with the defaults
    heartbeat_interval: float | datetime.timedelta | None = None
    #: what to do on a hang
    on_hang: OnHang | str = OnHang.DUMP
    #: where JSON lines, stack dumps (and TensorBoard scalars) go; None: memory only
    metrics_dir: str | None = None
    #: how often aggregated step records are written
    metrics_interval_seconds: float | datetime.timedelta = 1.0
    #: how many times agent.run(train_fn) re-runs train_fn after a recoverable failure
    max_inprocess_restarts: int = 0
    #: how long a flush-on-failure may wait for the checkpoint to reach storage
    flush_timeout_seconds: float | datetime.timedelta = 60.0
    #: "auto": on a failure that the launcher restarts on this node (oom, network -- a
    #: dead peer's collective --; not preemption, a hang or a replace_node/abort one),
    #: with a flashckpt checkpointer, hand the newest step to the node's saver and exit
    #: at once: the saver (a process that outlives this one) persists it while the
    #: launcher restarts, and the restarted process loads it from memory. "always": wait
    #: until the newest step is on storage on every failure (up to flush_timeout_seconds).
    wait_for_storage: str = "auto"
    #: extra time the out-of-process backstop waits before acting (and how stale the
    #: agent thread's beat must be, i.e. the thread cannot run)
    backstop_grace_seconds: float | datetime.timedelta = 5.0
    #: names of the coordinator's data sets to heartbeat, when ``coordinator`` is a URL or
    #: a Coordinator (a Dataset passed as ``coordinator`` is heartbeated by itself; a
    #: ShardSampler registers its own with ``agent.add_heartbeat``)
    datasets: tuple[str, ...] = ()
    #: worker name for heartbeats; default "<hostname>-rank<R>"
    worker: str | None = None
    #: job id for the backstop's progress files; default the checkpointer's, else
    #: $FLASHCKPT_JOB_ID, else one derived from the launcher's process id
    job_id: str | None = None
    #: the signal the backstop sends to make this process dump its stacks
    dump_signal: int = signal.SIGUSR2
    #: install the SIGTERM handler and sys.excepthook (flush + diagnosis on failure)
    handle_failures: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.hang_timeout, str):
            if self.hang_timeout != "auto":
                raise ElasticError(f"hang_timeout must be 'auto' or seconds, got {self.hang_timeout!r}")
        else:
            self.hang_timeout = _seconds("hang_timeout", self.hang_timeout)
        for name in ("hang_floor_seconds", "warmup_timeout_seconds",
                     "metrics_interval_seconds", "flush_timeout_seconds", "backstop_grace_seconds"):
            setattr(self, name, _seconds(name, getattr(self, name)))
        self._check_heartbeat_interval()
        try:
            self.on_hang = OnHang(self.on_hang)
        except ValueError:
            raise ElasticError(f"on_hang must be one of {[m.value for m in OnHang]}, "
                               f"got {self.on_hang!r}") from None
        if self.hang_multiplier < 1:
            raise ElasticError(f"hang_multiplier must be >= 1, got {self.hang_multiplier}")
        if self.warmup_steps < 0 or self.max_inprocess_restarts < 0:
            raise ElasticError("warmup_steps and max_inprocess_restarts must be >= 0")
        if self.hang_floor_seconds > self.warmup_timeout_seconds:
            raise ElasticError(f"hang_floor_seconds ({self.hang_floor_seconds}) must not exceed "
                               f"warmup_timeout_seconds ({self.warmup_timeout_seconds})")
        if self.backstop_grace_seconds < 1.0:
            raise ElasticError("backstop_grace_seconds must be >= 1.0 (the agent thread beats "
                               f"every 0.5 s at most), got {self.backstop_grace_seconds}")
        if self.wait_for_storage not in ("auto", "always"):
            raise ElasticError(f"wait_for_storage must be 'auto' or 'always', got {self.wait_for_storage!r}")
        if isinstance(self.datasets, str):
            self.datasets = (self.datasets,)
        self.datasets = tuple(self.datasets)
        if self.job_id is not None and ("/" in self.job_id or "." in self.job_id or not self.job_id):
            raise ElasticError(f"job_id must be a non-empty name without '/' or '.', got {self.job_id!r}")

    def _check_heartbeat_interval(self) -> None:
        """Derive an unset ``heartbeat_interval``; check one the caller gave."""
        fixed = isinstance(self.hang_timeout, float)
        name, bound = ("hang_timeout", self.hang_timeout) if fixed else ("hang_floor_seconds", self.hang_floor_seconds)
        if self.heartbeat_interval is None:
            self.heartbeat_interval = min(DEFAULT_HEARTBEAT_SECONDS, bound / 4)
            return
        self.heartbeat_interval = _seconds("heartbeat_interval", self.heartbeat_interval)
        if not self.heartbeat_interval < bound:
            raise ElasticError(f"heartbeat_interval ({self.heartbeat_interval}s) must be shorter than {name} "
                               f"({bound}s): heartbeats stop once training makes no progress for the hang "
                               "timeout; leave heartbeat_interval unset to derive it "
                               f"(min({DEFAULT_HEARTBEAT_SECONDS}s, {name} / 4))")
