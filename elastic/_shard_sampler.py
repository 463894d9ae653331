"""``ShardSampler``: yield the samples of shards leased from the sharding coordinator.

Each rank pulls small shards on demand, so a fast rank takes more and a dead rank's
shards go to the others (:mod:`sharding`). The sampler keeps, per lease it holds, how
far it *yielded* and how far the training loop *received*; only what was received is
reported to the coordinator and completes a shard. Iterating the sampler directly (or
``DataLoader(num_workers=0)``) counts each yielded sample as received; under a
prefetching ``DataLoader`` wrap the loader in :class:`elastic.CountingLoader`.

One iteration is one epoch of the coordinator. A shard of the next epoch that arrives
at the end of an iteration is kept for the next one. Under ``CountingLoader`` a rank
that still holds undelivered (prefetched) samples does not wait for other ranks'
leases at the end of an epoch — it would wait for itself — it ends its iteration, and
a shard that comes back later (from a dead rank) is taken up in a later iteration.

Heartbeats: the held leases are heartbeated every ``lease_timeout / 3`` seconds through
the process's one heartbeat schedule (``elastic._heartbeat``). When the fault-tolerant
agent runs in the process (``elastic.start_agent``), its thread sends them and withholds
them while training makes no progress past its hang timeout -- so a dead, stopped *or
hung* rank's leases go back to the queue. Without an agent the schedule's own thread
sends them, and a rank that hangs keeps its leases.

Trade-offs: ranks get different numbers of samples (that is the point), so a DDP loop
must cope with uneven inputs (an all-reduce of "has data", every rank stepping; ``Join``
also works, but not with :meth:`boundary_state`'s step tags, which need every rank to take
every update).
"""

from __future__ import annotations

import copy
import logging
import os
import socket
import sys
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Union

import torch.distributed as dist
from torch.utils.data import Sampler

import sharding

from ._capture_read import capturing, read_as_of
from ._heartbeat import process_heartbeats
from ._progress import tick_agent

__all__ = ["ShardSampler"]

log = logging.getLogger(__name__)

STATE_VERSION = 1
_KIND = "ShardSampler"


@dataclass(slots=True, eq=False)
class _Lease:
    shard: sharding.Shard
    sent: int  # absolute position in the shard's order yielded so far
    done: int  # absolute position received by the training loop
    settled: int  # ``done`` as of the last step boundary under torch.distributed (see boundary_state)
    settled_before: int  # ``done`` as of the boundary before that (a shard done then may be completed)
    reported: int  # the position the coordinator holds


def default_worker() -> str:
    """``host-rankR`` under torch.distributed or torchrun (stable across restarts), else
    ``host-pidP``."""
    host = socket.gethostname()
    if dist.is_available() and dist.is_initialized():
        return f"{host}-rank{dist.get_rank()}"
    if os.environ.get("RANK", "").isdigit():
        return f"{host}-rank{os.environ['RANK']}"
    return f"{host}-pid{os.getpid()}"


class ShardSampler(Sampler[int]):
    """Yield sample indices of shards leased from a :mod:`sharding` coordinator.

    ``coordinator`` is a URL (``memory://``, ``sqlite:///path``, ``redis://...``) or a
    ``sharding.Coordinator``; every rank names the same data set ``name`` with the same
    definition. ``worker`` names this rank at the coordinator (default
    :func:`default_worker`); a restarted rank with the same name takes back its leases.

    ``wait``: when no shard is left but other ranks still hold leases, wait for them
    (they may come back) or end the iteration. Default: wait only without
    torch.distributed — ranks in lock-step collectives must not wait for each other's
    leases (a rank blocked in ``acquire`` while its peer waits in an all-reduce is a
    deadlock); a dead rank restarts the whole group there, which rolls back anyway.

    ``state_dict()`` / ``load_state_dict()`` carry the coordinator's state: under
    torch.distributed both are collectives (all ranks must call them); load rolls the
    shared coordinator back once, on rank 0. :meth:`boundary_state` is the state as of a
    step boundary for a failure capture (``save_on_failure(boundary_state=...)``).
    """

    def __init__(
        self,
        num_samples: int,
        *,
        coordinator: Union[str, "sharding.Coordinator"],
        name: str,
        shard_size: int,
        shuffle: bool = False,
        seed: int = 0,
        num_epochs: Optional[int] = 1,
        worker: Optional[str] = None,
        lease_timeout: float = 60.0,
        wait: Optional[bool] = None,
    ) -> None:
        if isinstance(coordinator, str):
            coordinator = sharding.connect(coordinator)
        elif not isinstance(coordinator, sharding.Coordinator):
            raise TypeError(
                f"coordinator must be a URL or a sharding.Coordinator, got {type(coordinator).__name__}"
            )
        self._coord = coordinator
        self._ds = coordinator.dataset(
            name,
            size=num_samples,
            shard_size=shard_size,
            num_epochs=num_epochs,
            shuffle=shuffle,
            seed=seed,
            lease_timeout=lease_timeout,
        )
        self.name = name
        self.worker = default_worker() if worker is None else worker
        self._wait = not _default_sync(None) if wait is None else bool(wait)
        self.epoch = 0
        self._held: deque[_Lease] = deque()  # leases with samples not yet received
        self._unreceived: deque[list[Any]] = deque()  # [lease, count] in yield order
        self._pending: Optional[sharding.Shard] = None  # next epoch's first shard
        self._track_delivery = False
        self._iter_received = 0
        self._boundary: Optional[tuple[int, Optional[dict[str, Any]]]] = None
        """(thread, state) of the last ``boundary_state()``; state None under torch.distributed,
        where a capture reads the coordinator itself."""
        self._boundaries = 0
        """Boundaries since construction or the last load: the step that positions reported under
        torch.distributed are tagged with (lock-step ranks count alike)."""
        self._settled_step = 0
        """The step whose positions ``settled`` holds (see :meth:`_report_step`)."""
        self._first_update: Optional[int] = None
        """The thread that iterates, until its first update began (reported as step 1)."""
        try:
            if self._ds.release(self.worker):
                log.info("%s: took back the leases of an earlier %s", name, self.worker)
        except sharding.UnknownWorker:
            pass

    def __repr__(self) -> str:
        return f"ShardSampler({self.name!r}, worker={self.worker!r}, {self._coord.url})"

    def progress(self) -> dict[str, Any]:
        """Where the data set stands at the coordinator (``sharding.Dataset.progress``)."""
        return self._ds.progress()

    def set_epoch(self, epoch: int) -> None:
        """Accepted for DataLoader loops; the coordinator decides the epoch."""
        self.epoch = epoch

    def close(self) -> None:
        """Stop heartbeating and give back held leases at their received positions."""
        process_heartbeats().remove(self._ds, self.worker)
        self._report_positions()
        try:
            self._ds.release(self.worker)
        except sharding.UnknownWorker:
            pass
        self._held.clear()
        self._unreceived.clear()
        self._pending = None

    # -- iteration ----------------------------------------------------------------------
    def __iter__(self) -> Iterator[int]:
        self._iter_received = 0
        self._unreceived.clear()
        for lease in self._held:  # prefetched but never received: yield again
            lease.sent = lease.done
        if self._stepped():
            self._complete_received()
        elif self._boundary is None and self._boundaries == 0 and _default_sync(None):
            self._await_first_update()
        self._finish_done()
        return self._generate()

    def _await_first_update(self) -> None:
        """Under failure capture, report as the first update begins too, before any boundary
        (its own registration comes at the first boundary): a rank that dies inside its first
        update is then at step 1 in a peer's capture of it."""
        capture = sys.modules.get("flashckpt._capture")
        if capture is not None and self._first_update is None:
            self._first_update = threading.get_ident()
            capture.on_update_begins(self._update_begins)

    def _complete_received(self) -> None:
        """An iteration begins after the last one's steps: complete what it received entirely,
        though its completion would wait for the next boundary (a peer's capture may be of the
        step before) and though no boundary may have come after its last batch (a loop that
        skips the update). Each completion is tagged with the step it was received whole at,
        so that a capture as of the step before still finds the shard."""
        for lease in [x for x in self._held if x.done >= len(x.shard)]:
            self._held.remove(lease)
            step = self._settled_step if lease.settled >= len(lease.shard) else self._boundaries + 1
            self._call("complete", lease, lambda: self._ds.complete(lease.shard, step=step))

    def _generate(self) -> Iterator[int]:
        carried = list(self._held)
        epoch: Optional[int] = carried[0].shard.epoch if carried else None
        while True:
            lease = carried.pop(0) if carried else self._next_lease(epoch)
            if lease is None:
                return
            epoch = lease.shard.epoch if epoch is None else epoch
            shard = lease.shard
            order = sharding.sample_order(
                shard.start, shard.end, seed=shard.seed, epoch=shard.epoch, shard=shard.index,
                shuffle=shard.shuffle,
            )
            for pos in range(lease.sent, len(order)):
                lease.sent = pos + 1
                if self._unreceived and self._unreceived[-1][0] is lease:
                    self._unreceived[-1][1] += 1
                else:
                    self._unreceived.append([lease, 1])
                if not self._track_delivery:
                    self._receive(1)
                tick_agent()
                yield int(order[pos])
            self.epoch = shard.epoch

    def _next_lease(self, epoch: Optional[int]) -> Optional[_Lease]:
        shard = self._pending
        self._pending = None
        if shard is None:
            shard = self._finish_done(then_acquire=True)
        else:
            self._finish_done()
        if shard is None:
            return None
        self._start_heartbeat()
        if epoch is not None and shard.epoch != epoch:
            self._pending = shard
            return None
        lease = _Lease(shard, sent=shard.consumed, done=shard.consumed, settled=shard.consumed,
                       settled_before=shard.consumed, reported=shard.consumed)
        self._held.append(lease)
        return lease

    def _acquire(self, after: Optional[_Lease] = None) -> Optional[sharding.Shard]:
        """Lease the next shard; with ``after``, complete that lease in the same round trip."""
        # wait for other ranks' leases only if we hold no prefetched samples (we could wait
        # for our own) and no lock-step peer could be waiting for us in a collective
        timeout = None if self._wait and not self._held else 0
        try:
            if after is not None:
                try:
                    return self._ds.complete_and_acquire(after.shard, timeout=timeout)
                except sharding.LeaseLost as e:  # refused: nothing was acquired
                    log.warning("%s: could not complete shard %d: %s", self.name, after.shard.index, e)
            return self._ds.acquire(self.worker, timeout=timeout)
        except sharding.AcquireTimeout:
            log.debug("%s: no shard free for %s now; ends this iteration", self.name, self.worker)
            return None

    def _start_heartbeat(self) -> None:
        """Have our leases in the process's heartbeat schedule (called whenever a lease is
        taken; cheap when they are)."""
        process_heartbeats().add(self._ds, self.worker, owner=self,
                                 interval_seconds=self._ds.definition.lease_timeout / 3)

    # -- what the loop received -----------------------------------------------------------
    def _receive(self, n: int) -> None:
        """The loop received ``n`` more samples, in yield order."""
        self._iter_received += n
        while n and self._unreceived:
            entry = self._unreceived[0]
            take = min(n, entry[1])
            entry[0].done += take
            entry[1] -= take
            n -= take
            if entry[1] == 0:
                self._unreceived.popleft()

    def _delivered(self, n: Optional[int]) -> None:
        """CountingLoader: the loop received ``n`` samples of this iteration (None: all
        that were yielded)."""
        if n is None:
            n = self._iter_received + sum(entry[1] for entry in self._unreceived)
        if n > self._iter_received:
            self._receive(n - self._iter_received)
        self._finish_done()

    def _finish_done(self, *, then_acquire: bool = False) -> Optional[sharding.Shard]:
        """Complete every held shard the loop received entirely (under torch.distributed
        with boundaries, entirely as of the boundary before the last: see :meth:`boundary_state`);
        with ``then_acquire``, lease the next shard too, completing the last of them in the
        same round trip (``Dataset.complete_and_acquire``)."""
        done = [x for x in self._held if (x.settled_before if self._stepped() else x.done) >= len(x.shard)]
        for lease in done:
            self._held.remove(lease)
        last = done.pop() if then_acquire and done else None
        for lease in done:
            self._call("complete", lease, lambda: self._ds.complete(lease.shard))
        return self._acquire(after=last) if then_acquire else None

    def _report_positions(self) -> None:
        """Report where the loop stands now (``close``'s, a save's without step boundaries):
        complete what it received entirely, report the rest."""
        for lease in self._held:
            lease.settled = lease.settled_before = lease.done
        self._report(self._boundaries if self._stepped() else None)

    def _report_step(self, step: int) -> None:
        """Under torch.distributed: report where the loop stands now as the positions of
        ``step``, completing only what it had received entirely at the step before (a peer's
        capture may be of that step)."""
        if step != self._settled_step:
            for lease in self._held:
                lease.settled_before = lease.settled
            self._settled_step = step
        for lease in self._held:
            lease.settled = lease.done
        self._report(step)

    def _report(self, step: Optional[int]) -> None:
        self._finish_done()
        for lease in [x for x in self._held if x.done != x.reported]:
            self._call("report", lease, lambda: self._ds.report(lease.shard, lease.done, step=step))
            lease.reported = lease.done

    def _update_begins(self) -> None:
        """An optimizer update begins (flashckpt's hook, see :meth:`boundary_state`)."""
        if self._stepped() and threading.get_ident() == self._boundary[0]:
            self._report_step(self._boundaries + 1)
        elif self._first_update == threading.get_ident() and self._boundaries == 0 and _default_sync(None):
            self._first_update = 0  # once: a loop without boundaries reports at its saves, as before
            self._report_step(1)

    def _stepped(self) -> bool:
        """Boundaries under torch.distributed: positions go to the coordinator by step."""
        return self._boundary is not None and self._boundary[1] is None

    def _call(self, what: str, lease: _Lease, fn: Callable[[], None]) -> None:
        try:
            fn()
        except sharding.LeaseLost as e:
            # the lease expired and went to another worker: its samples may be trained twice
            log.warning("%s: could not %s shard %d: %s", self.name, what, lease.shard.index, e)
            if lease in self._held:
                self._held.remove(lease)

    # -- state ----------------------------------------------------------------------------
    def state_dict(self, sync: Optional[bool] = None) -> dict[str, Any]:
        """Report received positions and return the coordinator's state (JSON-able).

        ``sync`` (default: whether torch.distributed is initialised) brackets the snapshot
        with barriers so it holds every rank's position: all ranks must call this.

        A call by a failure capture (``flashckpt``'s call of ``state_fn``, on any thread)
        makes no collective (a peer may be dead). Once :meth:`boundary_state` was called,
        such a call, or one from another thread than the one that called it last, does not
        report either (the training thread may be inside the next step): it returns that
        boundary's state, copied, or under torch.distributed the coordinator's state as of
        this rank's last boundary's step, where every rank's boundary reported (one read,
        which may wait behind other processes' writes to the store).
        """
        boundary = self._boundary
        if boundary is not None and (boundary[0] != threading.get_ident() or capturing()):
            if boundary[1] is not None:
                return copy.deepcopy(boundary[1])
            return self._state(read_as_of(self._ds, self._boundaries, boundary[0]))
        sync = _default_sync(sync) and not capturing()  # a capture makes no collective: a peer may be dead
        if self._stepped():  # as a boundary's report: a peer may still capture the step before
            self._report_step(self._boundaries)
        else:
            self._report_positions()
        if sync:
            dist.barrier()
        coordinator = self._ds.state_dict()
        if sync:
            dist.barrier()
        return self._state(coordinator)

    def boundary_state(self) -> dict[str, Any]:
        """The state as of a step boundary, for ``save_on_failure(boundary_state=...)``; call
        it at the end of each update on the training thread (the boundary hook does). It
        makes no collective.

        One process: the coordinator's state with this rank's received positions in place
        of the reported ones, in :meth:`state_dict`'s format (one read, no write).

        Under torch.distributed: this rank reports its received positions tagged with the
        boundary's step (the boundaries since construction or load, alike on lock-step
        ranks), and completes the shards it had received entirely at its boundary before (a
        write). Under flashckpt's failure capture that report is made as the optimizer
        update begins (``flashckpt._capture.on_update_begins``; the first update's from the
        first iteration, where ``flashckpt._capture`` was imported by then), so that it holds for a rank that dies inside the update; the boundary then writes
        only what changed since. It returns the state's identity without the coordinator's part, which a
        capture's ``state_dict()`` reads itself, as of the capturing rank's last boundary:
        every rank's positions as of that step, also for a rank that went through the next
        step's boundary meanwhile (the coordinator keeps each lease's position of the step
        before too, and a shard finished at the next boundary is not yet completed). Exact
        when each rank's last boundary is the captured step's or the next, or it died inside
        the captured step's update under failure capture, and every rank takes every update (the steps are
        counted per rank: a rank that sits out updates, as under ``Join``, counts apart). A
        rank a step ahead that begins a new iteration completes the shards it received
        entirely at once, tagged with their step, which a capture of the step before reads
        as unfinished (``Dataset.complete(step=)``).
        """
        if _default_sync(None):
            self._boundary = (threading.get_ident(), None)
            self._boundaries += 1
            self._report_step(self._boundaries)
            capture = sys.modules.get("flashckpt._capture")
            if capture is not None:
                capture.on_update_begins(self._update_begins)
            return self._state(None)
        positions = {lease.shard: lease.done for lease in self._held}
        state = self._state(self._ds.state_dict(positions))
        self._boundary = (threading.get_ident(), state)
        return state

    def _state(self, coordinator: Optional[dict[str, Any]]) -> dict[str, Any]:
        """The sampler's state around the coordinator's (left out where None)."""
        state: dict[str, Any] = {"version": STATE_VERSION, "kind": _KIND, "name": self.name}
        if coordinator is not None:
            state["coordinator"] = coordinator
        return state

    def reset(self, sync: Optional[bool] = None) -> None:
        """Start the data set over (epoch 0, every shard to do, no lease held): what a job
        with no checkpoint to load calls, so that shards a failed attempt completed before
        its first checkpoint are trained again. Like :meth:`load_state_dict` (a collective
        under torch.distributed), and like it, it rolls back every worker of the data set."""
        self.load_state_dict(self._state(self._ds.initial_state()), sync)

    def load_state_dict(self, state: Mapping[str, Any], sync: Optional[bool] = None) -> None:
        """Roll the coordinator back to ``state`` (every lease is dropped; partly consumed
        shards resume at their saved positions). Under torch.distributed all ranks must
        call this; rank 0 restores, the others wait for it."""
        if not isinstance(state, Mapping):
            raise TypeError(f"sampler state must be a dict, got {type(state).__name__}")
        if state.get("kind") != _KIND or state.get("version") != STATE_VERSION:
            raise ValueError(
                f"not a {_KIND} state of version {STATE_VERSION}: "
                f"kind={state.get('kind')!r} version={state.get('version')!r}"
            )
        if state.get("name") != self.name:
            raise ValueError(f"sampler state is of data set {state.get('name')!r}, not {self.name!r}")
        try:  # checked on every rank, so that all ranks fail alike
            saved = sharding.Definition.from_json(state["coordinator"]["definition"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed {_KIND} state: {e!r}") from e
        mine = self._ds.definition
        if saved.canonical() != mine.canonical():
            diff = {k: (v, mine.to_json()[k]) for k, v in saved.to_json().items() if mine.to_json()[k] != v}
            raise ValueError(
                f"sampler state of {self.name!r} was taken for another data set: "
                + ", ".join(f"{k}={a!r} in the state but {b!r} here" for k, (a, b) in diff.items())
            )
        sync = _default_sync(sync)
        if sync:
            dist.barrier()
        try:
            if not sync or dist.get_rank() == 0:
                self._ds.load_state_dict(state["coordinator"])
        finally:
            if sync:
                dist.barrier()
        self._held.clear()
        self._unreceived.clear()
        self._pending = None
        self._boundary = None  # of the state replaced
        self._boundaries = self._settled_step = 0
        self._first_update = None


def _default_sync(sync: Optional[bool]) -> bool:
    if sync is None:
        return dist.is_available() and dist.is_initialized()
    return bool(sync)
