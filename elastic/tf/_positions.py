"""``ShardPositions``: which records of the leased shards the training step consumed.

Pure Python (no TensorFlow), shared by the tf.data source (the producer: it leases
shards and hands them to the pipeline) and the estimator hook / Keras callback (the
consumer: it says how many records each training step took). Records flow through
``flat_map(reader).batch(b)`` in the order the shards were handed out, so a count of
consumed records maps to positions in the shards, first handed out first; that holds
when the reader yields exactly one record per index of the shard and nothing reorders
records across shards (use the coordinator's ``shuffle=True``, not a shuffle buffer).

Committing to the coordinator (report positions, complete shards) happens as steps
finish shards, or — when a flash checkpointer owns the positions (``deferred``) — right
after each checkpoint, so the coordinator never runs ahead of the newest checkpoint: after a
kill and restore, the worker's leases resume exactly where its model was saved. The
checkpoint also carries the positions, so a commit lost to a kill between the save and
the report is re-applied on restore. Trade-off: with ``Rollback.WORKER`` a restore from
*storage* (memory lost with the node) cannot undo shards completed after that step; one
worker (or all workers restarting together) can use ``Rollback.DATASET`` instead, which
rolls the whole data set back to the saved coordinator state.

Cost: a shard the step finished is completed by the producer (tf.data's thread) in the
same coordinator round trip that leases the next shard (``complete_and_acquire``), so the
training thread makes no coordinator call per shard; while no pass is producing, or at
the latest every ``REPORT_SECONDS``, the consumer completes them itself.
"""

from __future__ import annotations

import enum
import logging
import os
import re
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator

import sharding

from .._errors import ElasticError
from .._heartbeat import process_heartbeats
from .._progress import tick_agent

__all__ = ["Rollback", "ShardPositions", "ShardReadError", "default_worker"]

log = logging.getLogger(__name__)

STATE_VERSION = 1
REPORT_SECONDS = 5.0


class Rollback(enum.Enum):
    """What a restore of the positions rolls back."""

    WORKER = "worker"
    """This worker's leases go back to the saved positions; other workers are untouched."""
    DATASET = "dataset"
    """The whole data set at the coordinator goes back to the saved state (one worker)."""


class ShardReadError(ElasticError):
    """Reading a shard failed; its lease went back to the coordinator's queue."""


def default_worker() -> str:
    """This worker's name: ``host-<task>`` from ``TF_CONFIG``, else ``host-rank<RANK>``
    (both stable across restarts), else ``host-pid<pid>``, which a restart changes: a
    restored checkpoint then gives back the name it was saved by (``worker=`` names a
    worker for good)."""
    import json

    host = socket.gethostname()
    try:
        task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
    except ValueError:
        task = {}
    if "type" in task and "index" in task:
        return f"{host}-{task['type']}{task['index']}"
    if os.environ.get("RANK", "").isdigit():
        return f"{host}-rank{os.environ['RANK']}"
    return f"{host}-pid{os.getpid()}"


@dataclass(slots=True, eq=False)
class _Lease:
    shard: sharding.Shard
    done: int  # absolute position in the shard's order the training step consumed
    committed: int  # absolute position the coordinator knows


def _brief(error: BaseException) -> str:
    """The cause line of a long TF error ("OSError: ..."), else its first line."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    causes = [line for line in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b.*:", line)]
    return (causes[-1] if causes else lines[0] if lines else "")[:500]


class ShardPositions:
    """Leases of one worker and how far the training step consumed each.

    Producer side: :meth:`shards` (a generator, one call per pass of the pipeline).
    Consumer side: :meth:`consumed` after each training step, :meth:`commit` after each
    checkpoint when ``deferred``. Checkpoint side: :meth:`state` / :meth:`restore`.
    Thread-safe (tf.data runs the producer on its own threads). ``lease_process``: a
    :class:`sharding.LeaseProcess` of ``dataset`` that runs the producer's round trips
    outside this process's GIL (closed by :meth:`close`).
    """

    def __init__(self, dataset: sharding.Dataset, worker: str | None = None, *,
                 lease_process: sharding.LeaseProcess | None = None) -> None:
        self.dataset = dataset
        self._leases: Any = lease_process or dataset  # who runs the producer's round trips
        self.worker = default_worker() if worker is None else worker
        self._named = worker is not None  # else a restore takes the checkpoint's name
        self.deferred = False
        """True while a flash checkpointer commits the positions at its saves."""
        self.batch_size: int | None = None
        """Records per training step, when the pipeline's batch size is known."""
        self._lock = threading.RLock()
        self._held: list[_Lease] = []
        self._fifo: deque[list[Any]] = deque()  # [lease, records handed out, not consumed]
        self._ready: deque[_Lease] = deque()  # leased (held), not handed out yet
        self._pass = 0
        self._started = False
        self._over_consumed = False
        self._finished = False  # a shard was finished since the last completion
        self._producing = False  # a pass is running: its next lease completes finished shards
        self._last_report = time.monotonic()

    def __repr__(self) -> str:
        return f"ShardPositions({self.dataset.name!r}, worker={self.worker!r})"

    # -- producer -----------------------------------------------------------------
    def shards(self, batch: int = 1) -> Iterator[tuple[sharding.Shard, int]]:
        """Yield ``(shard, position)`` to read from, leasing ``batch`` shards per round trip
        to the coordinator. A new pass first re-yields what an abandoned pass handed out
        but the step never consumed."""
        with self._lock:
            self._pass += 1
            me = self._pass
            if not self._started:
                self._take_back()
            self._fifo.clear()
            self._ready.clear()  # the replay below covers them
            replay = [lease for lease in self._held if lease.done < len(lease.shard)]
            self._producing = True
        try:
            yield from self._produce(me, replay, batch)
        finally:
            with self._lock:
                if me == self._pass:
                    self._producing = False

    def _produce(self, me: int, replay: list[_Lease], batch: int) -> Iterator[tuple[sharding.Shard, int]]:
        for lease in replay:
            with self._lock:
                if me != self._pass:
                    return
                self._fifo.append([lease, len(lease.shard) - lease.done])
            yield lease.shard, lease.done
        while True:
            with self._lock:
                lease = self._ready.popleft() if self._ready else None
            if lease is None:
                if not self._lease(batch):
                    return
                continue
            with self._lock:
                if me != self._pass:  # the current pass reads it
                    self._ready.appendleft(lease)
                    return
                if lease.done >= len(lease.shard):
                    self._commit_lease(lease)
                    continue
                self._fifo.append([lease, len(lease.shard) - lease.done])
            tick_agent()
            yield lease.shard, lease.done

    def _lease(self, count: int) -> bool:
        """Lease up to ``count`` shards into ``_ready`` (held from now on, so a pass that
        ends before handing them out leaves them to the next), completing the shards the
        step finished in the same round trip. False when none came. Waits for other
        workers' leases only while none of ours is in flight (else it could wait for
        ourselves: the pass ends instead)."""
        with self._lock:
            in_flight = any(lease.done < len(lease.shard) for lease in self._held)
            # completions ride with the leases (they come at the same rate); before a
            # wait, all of them go (else we could wait for ourselves)
            finished = self._take_finished(limit=count if in_flight else None)
            timeout = 0 if self._held else None
        try:
            shards, refused = self._leases.complete_and_acquire_many(
                [lease.shard for lease in finished], self.worker, count, timeout=timeout)
            for exc in refused:
                self._lost(exc)
            if refused:  # the others stand; nothing was leased
                shards, _ = self._leases.complete_and_acquire_many([], self.worker, count, timeout=timeout)
        except sharding.AcquireTimeout:  # the completions stand
            log.debug("%s: no shard free for %s now; this pass ends", self.dataset.name, self.worker)
            return False
        except BaseException:  # maybe not completed: again later (a repeat is harmless)
            self._keep(finished)
            raise
        with self._lock:
            for shard in shards:
                lease = _Lease(shard, done=shard.consumed, committed=shard.consumed)
                self._held.append(lease)
                self._ready.append(lease)
            if shards:
                self._start_heartbeat()
        return bool(shards)

    def _finish(self, leases: list[_Lease]) -> None:
        """Complete finished leases taken from ``_held``; on a coordinator error the rest
        go back, to be completed later."""
        for i, lease in enumerate(leases):
            try:
                self._complete(lease)
            except BaseException:
                self._keep(leases[i:])
                raise

    def _keep(self, leases: list[_Lease]) -> None:
        with self._lock:
            self._held[:0] = leases
            self._finished = True

    def _take_finished(self, limit: int | None = None) -> list[_Lease]:
        """Without a checkpointer: remove and return the finished leases, oldest first, at
        most ``limit`` (lock held)."""
        if self.deferred or not self._finished:
            return []
        finished = [lease for lease in self._held if lease.done >= len(lease.shard)]
        if limit is not None and len(finished) > limit:
            finished = finished[:limit]
        else:
            self._finished = False
        taken = set(map(id, finished))
        self._held = [lease for lease in self._held if id(lease) not in taken]
        return finished

    def _complete(self, lease: _Lease) -> None:
        """Complete a finished lease already taken from ``_held``."""
        try:
            self.dataset.complete(lease.shard)
        except sharding.LeaseLost as exc:
            self._lost(exc)

    def _complete_finished(self) -> None:
        """Before leases go back to the queue: complete what the step finished (no
        checkpointer), else those records would be read again."""
        try:
            self._finish(self._take_finished())
        except sharding.CoordinatorError as exc:
            log.warning("%s: could not complete the shards %s finished: %s", self.dataset.name, self.worker, exc)

    def _lost(self, exc: sharding.LeaseLost) -> None:
        if isinstance(exc, sharding.AlreadyCompleted):  # a commit re-applied on restore
            log.debug("%s: %s", self.dataset.name, exc)
        else:  # expired and re-leased: its records may train twice
            log.warning("%s: %s", self.dataset.name, exc)

    def _take_back(self) -> None:
        self._started = True
        try:
            if self.dataset.release(self.worker):
                log.info("%s: took back the leases of an earlier %s", self.dataset.name, self.worker)
        except sharding.UnknownWorker:
            pass

    def _start_heartbeat(self) -> None:
        """Have our leases in the process's heartbeat schedule (``elastic._heartbeat``: the
        agent's thread while one runs, which withholds them while training hangs)."""
        process_heartbeats().add(self.dataset, self.worker, owner=self,
                                 interval_seconds=self.dataset.definition.lease_timeout / 3)

    def _stop_heartbeat(self) -> None:
        process_heartbeats().remove(self.dataset, self.worker)

    # -- consumer -----------------------------------------------------------------
    def consumed(self, records: int) -> None:
        """The training step took ``records`` more records (in hand-out order)."""
        with self._lock:
            self._take(records)
            self._commit_some()

    def consumed_steps(self, steps: int) -> None:
        """``steps`` training steps of ``batch_size`` records (the last may be short:
        a step takes what is left when less than a batch is in flight)."""
        if self.batch_size is None:
            raise ElasticError(f"{self}: batch_size is unknown; pass batch_size= to the hook or callback")
        with self._lock:
            if steps == 1 and self._fifo and self.batch_size < self._fifo[0][1]:  # inside a shard: the hot path
                entry = self._fifo[0]
                entry[0].done += self.batch_size
                entry[1] -= self.batch_size
                if not self.deferred and time.monotonic() - self._last_report >= REPORT_SECONDS:
                    self._commit_some()
                return
            for _ in range(steps):
                self._take(self.batch_size)
            self._commit_some()

    def _take(self, records: int) -> None:
        left = records
        while left and self._fifo:
            entry = self._fifo[0]
            take = min(left, entry[1])
            entry[0].done += take
            entry[1] -= take
            left -= take
            if entry[1] == 0:
                self._fifo.popleft()
                if entry[0].done >= len(entry[0].shard):
                    self._finished = True
        if records and left == records and not self._over_consumed:  # a short last batch takes some
            self._over_consumed = True
            log.warning("%s: a step consumed records beyond the shards handed out; the reader must "
                        "yield one record per index of the shard", self.dataset.name)

    def _commit_some(self) -> None:
        """Without a checkpointer: finished shards complete with the producer's next lease,
        or now when no pass is producing; positions inside shards are reported at most
        every ``REPORT_SECONDS`` (a report per step would cost a coordinator write per
        batch; a crash re-trains at most that much)."""
        if self.deferred:
            return
        now = time.monotonic()
        if now - self._last_report >= REPORT_SECONDS:
            self._last_report = now
            self.commit()
        elif self._finished and not self._producing:
            self._finish(self._take_finished())

    def mark(self) -> list[tuple[_Lease, int]]:
        """The consumed positions now, for a later :meth:`commit` of exactly these (a
        checkpoint taken now but written in the background commits what it holds)."""
        with self._lock:
            return [(lease, lease.done) for lease in self._held]

    def commit(self, mark: list[tuple[_Lease, int]] | None = None) -> None:
        """Tell the coordinator the consumed positions (default: now; else those of
        ``mark``); complete the finished shards."""
        with self._lock:
            if mark is None:
                self._finished = False
                mark = [(lease, lease.done) for lease in self._held]
            for lease, done in mark:
                if lease in self._held:
                    self._commit_lease(lease, done)

    def _commit_lease(self, lease: _Lease, done: int | None = None) -> None:
        done = lease.done if done is None else done
        try:
            if done >= len(lease.shard):
                self.dataset.complete(lease.shard)
                self._held.remove(lease)
            elif done > lease.committed:
                self.dataset.report(lease.shard, done)
            lease.committed = max(lease.committed, done)
        except sharding.LeaseLost as exc:
            self._lost(exc)
            if lease in self._held:
                self._held.remove(lease)
            self._fifo = deque(e for e in self._fifo if e[0] is not lease)

    def fail(self, error: BaseException) -> ShardReadError:
        """Reading stopped with ``error``: give every lease back to the queue (at the
        committed positions) and return the error naming the shards being read.

        The pipeline reads ahead, so the failing shard is one of those handed out and not
        trained through yet (a reader's own message can say which)."""
        with self._lock:
            pending = [entry[0].shard for entry in self._fifo]
            self._complete_finished()
            self._fifo.clear()
            self._held.clear()
            self._ready.clear()
            self._stop_heartbeat()
            try:
                self.dataset.release(self.worker)
            except sharding.CoordinatorError as exc:
                log.warning("%s: could not give back the leases of %s: %s", self.dataset.name, self.worker, exc)
        where = "; ".join(f"shard {s.index} of epoch {s.epoch} (records {s.start}..{s.end}"
                          + (f" of {s.file}" if s.file else "") + ")" for s in pending) or "no shard"
        message = (f"data set {self.dataset.name!r}, worker {self.worker!r}: reading failed in one of the "
                   f"shards being read ({where}); they went back to the queue: {type(error).__name__}: {_brief(error)}")
        log.error(message)
        return ShardReadError(message)

    def report_hook(self) -> Any:
        """A :class:`elastic.tf.ShardReportHook` of these positions (imports TensorFlow)."""
        from ._report_hook import ShardReportHook

        return ShardReportHook(self)

    def finished(self) -> bool:
        """Every shard of every epoch completed at the coordinator (by any worker): train
        or fit again until this is true."""
        return bool(self.dataset.progress()["finished"])

    # -- checkpoint ---------------------------------------------------------------
    def state(self, rollback: Rollback | None = None) -> dict[str, Any]:
        """The positions as a small JSON-able dict (taken right before a checkpoint);
        ``rollback`` default: ``Rollback.WORKER``."""
        rollback = Rollback.WORKER if rollback is None else rollback
        with self._lock:
            if rollback is Rollback.DATASET:
                self.commit()  # the snapshot restores the coordinator itself
            leases = [[l.shard.epoch, l.shard.slot, l.shard.index, l.shard.lease, l.done] for l in self._held]
            state: dict[str, Any] = {"version": STATE_VERSION, "dataset": self.dataset.name,
                                     "worker": self.worker, "rollback": rollback.value, "leases": leases}
            if rollback is Rollback.DATASET:
                state["coordinator"] = self.dataset.state_dict()
            return state

    def restore(self, state: dict[str, Any]) -> None:
        """Go back to ``state`` (from :meth:`state`): re-apply this worker's saved
        positions, or roll the whole data set back; then lease anew. A worker named by
        default (host and pid, which a restart changes) that has not leased yet takes the
        name the checkpoint was saved under, so it takes that worker's leases back at once
        instead of waiting for them to expire."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ElasticError(f"{self}: not a ShardPositions state of version {STATE_VERSION}: {state!r:.200}")
        if state.get("dataset") != self.dataset.name:
            raise ElasticError(f"{self}: the checkpoint holds positions of data set {state.get('dataset')!r}")
        with self._lock:
            saved_worker = state.get("worker")
            if not self._named and not self._started and isinstance(saved_worker, str) and saved_worker != self.worker:
                log.info("%s: worker %s goes on as %s, the worker its checkpoint was saved by", self.dataset.name,
                         self.worker, saved_worker)
                self.worker = saved_worker
            self._fifo.clear()
            self._held.clear()
            self._ready.clear()
            if state.get("rollback") == Rollback.DATASET.value:
                self.dataset.load_state_dict(state["coordinator"])
            else:
                for epoch, slot, index, token, done in state["leases"]:
                    lease = _Lease(self._shard(epoch, slot, index, token), done=done, committed=-1)
                    self._held.append(lease)
                    self._commit_lease(lease)
                self._held.clear()
            self._take_back()

    def _shard(self, epoch: int, slot: int, index: int, token: int) -> sharding.Shard:
        d = self.dataset.definition
        file, start, end = d.bounds(index)
        return sharding.Shard(dataset=self.dataset.name, epoch=epoch, index=index, start=start, end=end, file=file,
                              consumed=0, worker=self.worker, lease=token, slot=slot, seed=d.seed, shuffle=d.shuffle)

    def close(self) -> None:
        """Stop heartbeating and give the leases back at their committed positions."""
        self._stop_heartbeat()
        if self._leases is not self.dataset:
            self._leases.close()
            self._leases = self.dataset  # a later pass (after a close) leases in this process
        with self._lock:
            self._complete_finished()
            self._fifo.clear()
            self._held.clear()
            self._ready.clear()
            try:
                self.dataset.release(self.worker)
            except sharding.UnknownWorker:
                pass
