"""The coordinator: data sets, shards as leases, epochs and checkpointable state.

All shard logic lives here once: validating definitions, mapping a store's slots to
shards through the deterministic order, waiting while leases are out, turning store
status codes into errors, and the ``state_dict`` format. Backends (``Store``) only run
the atomic lease operations.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Mapping, Sequence

from ._definition import Definition
from ._errors import (
    AcquireTimeout,
    AlreadyCompleted,
    CoordinatorError,
    InvalidArgument,
    LeaseLost,
    UnknownDataset,
    UnknownWorker,
)
from ._options import Options
from ._shard import Shard
from ._store import Ask, Grant, Lease, Status, Store, Wait

__all__ = ["Coordinator", "Dataset", "Shard", "STATE_VERSION"]

log = logging.getLogger(__name__)

#: version of the ``state_dict`` format
STATE_VERSION = 1


def _lease(shard: Shard) -> Lease:
    return shard.epoch, shard.slot, shard.lease


def _position(step: int, consumed: int, before: list[int] | None, as_of: int | None) -> int:
    """A lease's position as of ``as_of``, from its last report (of ``step``) and the one
    before it at an earlier step."""
    return before[1] if as_of is not None and step > as_of and before is not None else consumed


def _check_step(step: Any) -> None:
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise InvalidArgument(f"step must be None or an int >= 0, got {step!r}")


def _check_worker(worker: Any) -> str:
    if not isinstance(worker, str) or not worker or not worker.isprintable():
        raise InvalidArgument(f"worker must be a non-empty printable str, got {worker!r}")
    return worker


class Dataset:
    """A data set's shard queue. Obtain from :meth:`Coordinator.dataset`; thread-safe.

    Call protocol per worker: ``acquire`` -> (``report``)* -> ``complete``, repeated until
    ``acquire`` returns None (or ``acquire`` once, then ``complete_and_acquire`` per shard:
    half the round trips); ``heartbeat`` at least every ``lease_timeout / 3`` seconds
    while holding a lease (``report`` also counts); ``release`` on a clean exit or when a
    restarted worker reuses its name.
    """

    def __init__(self, coordinator: "Coordinator", name: str, definition: Definition) -> None:
        self._coordinator, self._store, self.name, self.definition = coordinator, coordinator._store, name, definition
        self._asks: dict[tuple[str, int], Ask] = {}

    def __repr__(self) -> str:
        return f"Dataset({self.name!r}, {self.definition!r}, at {self._coordinator.url})"

    @property
    def coordinator(self) -> "Coordinator":
        """The coordinator this data set lives in (its event log, its other data sets)."""
        return self._coordinator

    # -- leases ----------------------------------------------------------------------

    def acquire(self, worker: str, *, timeout: float | None = None) -> Shard | None:
        """Lease the next shard for ``worker``; None once every epoch is done.

        While other workers hold leases that may still come back, waits (polling every
        ``poll_interval_seconds``, at most ``timeout`` seconds in all: then raises
        :class:`AcquireTimeout`; ``timeout=0`` never waits).
        """
        _check_worker(worker)
        began = time.monotonic()
        return self._settle(self._store_acquire(worker), worker, timeout, began)

    def complete_and_acquire(self, shard: Shard, *, timeout: float | None = None) -> Shard | None:
        """``complete(shard)`` then ``acquire(shard.worker, timeout=timeout)`` in one round
        trip to the store (one Lua script on Redis, one transaction on SQLite).

        If the completion is refused, it raises as :meth:`complete` does and acquires
        nothing. Once the completion is done it stands, even if the acquire then waits
        and raises :class:`AcquireTimeout` (only the waiting costs more round trips).
        """
        self._own(shard)
        began = time.monotonic()
        statuses, answers = self._store.complete_and_acquire(self.name, done=(_lease(shard),), ask=self._ask(shard.worker, 1))
        self._refuse(shard, *statuses[0], action="complete")
        return self._settle(answers[0], shard.worker, timeout, began)

    def complete_and_acquire_many(
        self, done: Sequence[Shard], worker: str, count: int, *, timeout: float | None = None
    ) -> tuple[list[Shard], list[LeaseLost]]:
        """Complete each shard of ``done`` and lease up to ``count`` shards for ``worker``,
        in one round trip (a worker that reads shards ahead pays one per batch).

        Returns the shards leased and one :class:`LeaseLost` (or :class:`AlreadyCompleted`)
        per refused completion; the accepted ones stand, and when any is refused nothing
        is leased. Fewer than ``count`` shards come back when no more are free now, none
        once every epoch is done; while none is free but other workers hold leases, it
        waits as :meth:`acquire` does (and then leases one).
        """
        _check_worker(worker)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise InvalidArgument(f"count must be an int >= 1, got {count!r}")
        for shard in done:
            self._own(shard)
        began = time.monotonic()
        statuses, answers = self._store.complete_and_acquire(
            self.name, done=[_lease(shard) for shard in done], ask=self._ask(worker, count))
        refused: list[LeaseLost] = []
        for shard, status in zip(done, statuses):
            try:
                self._refuse(shard, *status, action="complete")
            except LeaseLost as exc:
                refused.append(exc)
        grants = [self._shard(got, worker) for got in answers if isinstance(got, Grant)]
        if not grants and answers:  # none free now: wait as acquire does
            shard = self._settle(answers[-1], worker, timeout, began)
            grants = [] if shard is None else [shard]
        return grants, refused

    def _ask(self, worker: str, count: int) -> Ask:
        ask = self._asks.get((worker, count))
        if ask is None:
            if len(self._asks) > 1024:
                self._asks.clear()
            d = self.definition
            ask = self._asks[worker, count] = Ask(worker, d.lease_timeout, d.num_shards, d.num_epochs, count)
        return ask

    def _store_acquire(self, worker: str) -> Grant | Wait | None:
        return self._store.complete_and_acquire(self.name, done=(), ask=self._ask(worker, 1))[1][0]

    def _settle(self, got: Grant | Wait | None, worker: str, timeout: float | None, began: float) -> Shard | None:
        """The shard of a store's acquire answer, waiting and asking again while told to."""
        while True:
            if isinstance(got, Grant):
                return self._shard(got, worker)
            if got is None:
                return None
            pause = min(self._coordinator.options.poll_interval_seconds, max(got.seconds, 0.001))
            if timeout is not None and time.monotonic() - began + pause > timeout:
                raise AcquireTimeout(
                    f"{self.name}: no shard for {worker!r} within {timeout}s; workers (maybe {worker!r}) "
                    "still hold leases that may come back"
                )
            time.sleep(pause)
            got = self._store_acquire(worker)

    def _shard(self, grant: Grant, worker: str) -> Shard:
        d = self.definition
        epoch, slot, consumed, token = grant
        index, file, start, end = d.at_slot(epoch, slot)
        # positional: the hot path of every acquire (dataset, epoch, index, start, end, file,
        # consumed, worker, lease, slot, seed, shuffle)
        return Shard(self.name, epoch, index, start, end, file, consumed, worker, token, slot, d.seed, d.shuffle)

    def report(self, shard: Shard, consumed: int, *, step: int | None = None) -> None:
        """Record that the first ``consumed`` samples of ``shard.indices()`` order are done
        (an absolute position in the shard) and extend the lease.

        ``step``: the training step this position is that of (a step boundary's report). The
        lease then also keeps its last position of an earlier step, so that
        ``state_dict(as_of=...)`` can give the position as of that step while its holder is
        a step further (see :meth:`state_dict`). Without it, the position holds for every step."""
        self._own(shard)
        if isinstance(consumed, bool) or not isinstance(consumed, int) or not 0 <= consumed <= len(shard):
            raise InvalidArgument(f"consumed must be an int in 0..{len(shard)}, got {consumed!r}")
        _check_step(step)
        status = self._store.report(
            self.name,
            epoch=shard.epoch,
            slot=shard.slot,
            token=shard.lease,
            consumed=consumed,
            lease_timeout=self.definition.lease_timeout,
            step=step,
        )
        self._refuse(shard, *status, action="report on")

    def complete(self, shard: Shard, *, step: int | None = None) -> None:
        """Mark ``shard`` done for its epoch. Raises :class:`LeaseLost` if the lease expired
        and was handed to another worker, :class:`AlreadyCompleted` if done before.

        ``step``: the training step the shard was consumed whole at (as :meth:`report`'s): a
        read as of an earlier step still holds it at its position then (from its last two
        reports, as a held lease), also once the epoch moved on, until a report two steps later."""
        self._own(shard)
        _check_step(step)
        status = self._store.complete(self.name, epoch=shard.epoch, slot=shard.slot, token=shard.lease, step=step)
        self._refuse(shard, *status, action="complete")

    def heartbeat(self, worker: str) -> int:
        """Extend every lease ``worker`` holds by ``lease_timeout``; returns how many.
        Also makes the worker known, so it may heartbeat before its first shard."""
        return self._store.heartbeat(self.name, _check_worker(worker), lease_timeout=self.definition.lease_timeout)

    def release(self, worker: str) -> int:
        """Return all of ``worker``'s leases to the front of the queue now (they resume at
        their last reported position); returns how many."""
        count = self._store.release(self.name, _check_worker(worker))
        if count is None:
            raise UnknownWorker(f"{self.name}: worker {worker!r} never acquired a shard nor heartbeated")
        return count

    def _own(self, shard: Any) -> None:
        if not isinstance(shard, Shard):
            raise InvalidArgument(f"expected a Shard, got {type(shard).__name__}")
        if shard.dataset != self.name:
            raise InvalidArgument(f"shard of data set {shard.dataset!r} given to data set {self.name!r}")

    def _refuse(self, shard: Shard, status: Status, holder: str | None, *, action: str) -> None:
        if status is Status.OK:
            return
        what = f"{self.name}: cannot {action} shard {shard.index} of epoch {shard.epoch} (lease {shard.lease} of {shard.worker!r})"
        if status is Status.DONE:
            raise AlreadyCompleted(f"{what}: it was already completed")
        if status is Status.HELD:
            raise LeaseLost(f"{what}: the lease expired and the shard is now held by {holder!r}")
        if status is Status.RETURNED:
            raise LeaseLost(f"{what}: the lease expired or was released; the shard waits to be handed out again")
        raise LeaseLost(f"{what}: no such lease was handed out")

    # -- state -----------------------------------------------------------------------

    def progress(self) -> dict[str, Any]:
        """Where the data set stands: ``epoch``, ``num_epochs``, ``num_shards``, ``todo``,
        ``leased``, ``expired`` (leased, past deadline), ``done`` (this epoch),
        ``finished``, and ``workers`` (name -> acquired, completed, leased)."""
        snap = self._store.snapshot(self.name)
        d = self.definition
        leased = len(snap["leases"])
        done = snap["cursor"] - len(snap["queue"]) - leased
        workers = {w: {"acquired": a, "completed": c, "leased": 0} for w, (a, c) in snap["workers"].items()}
        for lease in snap["leases"].values():
            workers.setdefault(lease["worker"], {"acquired": 0, "completed": 0, "leased": 0})["leased"] += 1
        return {
            "dataset": self.name,
            "epoch": snap["epoch"],
            "num_epochs": d.num_epochs,
            "num_shards": d.num_shards,
            "todo": d.num_shards - snap["cursor"] + len(snap["queue"]),
            "leased": leased,
            "expired": sum(1 for lease in snap["leases"].values() if lease["expires_in"] <= 0),
            "done": done,
            "finished": done == d.num_shards and d.num_epochs is not None and snap["epoch"] + 1 >= d.num_epochs,
            "workers": workers,
        }

    def state_dict(self, positions: Mapping[Shard, int] | None = None, *, as_of: int | None = None) -> dict[str, Any]:
        """The data set's position as a small JSON-able dict: epoch, cursor into the
        epoch's shard order, and the queue of unfinished positions ``[slot, consumed]``
        (leases held now come first: after a restore they resume where last reported; a
        lease reported consumed whole counts as done).

        ``positions``: where the caller stands in leases it holds (absolute positions, as
        :meth:`report` takes), written in place of the last reported ones without
        reporting them (one read of the store, no write); a lease that token no longer
        holds keeps its stored position.

        ``as_of``: the state as of that step, for leases reported with steps: a lease whose
        last report is of a later step counts at its report before (the step before; where
        none, as handed out), and a shard completed at a later step (``complete(step=)``) at
        its position of the step before, in its epoch (the epoch before, if the data set
        moved on since: nothing of the next was taken by then). Exact while every holder is
        at most one step past ``as_of``."""
        if as_of is not None and (isinstance(as_of, bool) or not isinstance(as_of, int)):
            raise InvalidArgument(f"as_of must be None or an int (a step), got {as_of!r}")
        snap = self._store.snapshot(self.name)
        epoch, cursor, queue, leases = snap["epoch"], snap["cursor"], snap["queue"], snap["leases"]
        later = [] if as_of is None else [(int(key.split(":")[1]), entry) for key, entry in snap["completed_at"].items()
                                          if entry[1] > as_of]
        if later and min(entry[0] for _, entry in later) < epoch:  # an epoch that ended after as_of
            epoch, cursor, queue, leases = min(entry[0] for _, entry in later), self.definition.num_shards, [], {}
        mine = {(shard.epoch, shard.slot, shard.lease): consumed for shard, consumed in (positions or {}).items()}
        held = [(slot, _position(at, consumed, before, as_of)) for slot, (e, _, at, consumed, before) in later
                if e == epoch]
        for slot, lease in leases.items():
            consumed = _position(lease["step"], lease["consumed"], lease["before"], as_of)
            held.append((int(slot), mine.get((epoch, int(slot), lease["token"]), consumed)))
        unfinished = []
        for slot, consumed in held:
            _, _, start, end = self.definition.at_slot(epoch, slot)
            if consumed < end - start:
                unfinished.append([slot, consumed])
        return {
            "version": STATE_VERSION,
            "dataset": self.name,
            "definition": self.definition.to_json(),
            "epoch": epoch,
            "cursor": cursor,
            "queue": sorted(unfinished) + queue,
            "workers": snap["workers"],
        }

    def initial_state(self) -> dict[str, Any]:
        """The state before any shard was leased (epoch 0, every shard to do): loading it
        starts the data set over."""
        return {"version": STATE_VERSION, "dataset": self.name, "definition": self.definition.to_json(),
                "epoch": 0, "cursor": 0, "queue": [], "workers": {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Roll the data set back (or forward) to exactly ``state``: every lease held now
        is dropped, the queue, cursor and epoch become the saved ones."""
        self._store.restore(self.name, self._checked_state(state))

    def _checked_state(self, state: Any) -> dict[str, Any]:
        try:
            if state["version"] != STATE_VERSION:
                raise InvalidArgument(f"state version {state['version']!r} is not {STATE_VERSION}")
            saved = Definition.from_json(state["definition"])
            if saved.canonical() != self.definition.canonical():
                raise InvalidArgument(
                    f"state of data set {state.get('dataset')!r} has another definition: {saved} != {self.definition}"
                )
            epoch, cursor = int(state["epoch"]), int(state["cursor"])
            queue = [[int(slot), int(consumed)] for slot, consumed in state["queue"]]
            workers = {str(w): [int(a), int(c)] for w, (a, c) in state["workers"].items()}
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, CoordinatorError):
                raise
            raise InvalidArgument(f"{self.name}: malformed state_dict: {exc!r}") from exc
        n = self.definition.num_shards
        slots = [slot for slot, _ in queue]
        if not 0 <= cursor <= n or epoch < 0 or (self.definition.num_epochs is not None and epoch >= self.definition.num_epochs):
            raise InvalidArgument(f"{self.name}: state epoch {epoch} / cursor {cursor} out of range")
        if len(set(slots)) != len(slots) or any(not 0 <= slot < cursor for slot in slots):
            raise InvalidArgument(f"{self.name}: state queue {queue} is not distinct slots below the cursor")
        for slot, consumed in queue:
            _, _, start, end = self.definition.at_slot(epoch, slot)
            if not 0 <= consumed <= end - start:
                raise InvalidArgument(f"{self.name}: state position {consumed} outside shard at slot {slot}")
        return {"epoch": epoch, "cursor": cursor, "queue": queue, "workers": workers}


#: largest payload of one event, as JSON text
MAX_EVENT_BYTES = 65_536


class Coordinator:
    """Entry point to the data sets of one store. Obtain from :func:`sharding.connect`.

    Besides data sets, a coordinator keeps one job-wide event log (:meth:`publish`,
    :meth:`events`) that every process connected to the same store sees.
    """

    def __init__(self, store: Store, *, url: str, options: Options, shared_url: str | None = None) -> None:
        self._store, self.url, self.options = store, url, options
        self._shared_url = shared_url  # how another process opens this store (password included); None: it cannot

    def __repr__(self) -> str:
        return f"Coordinator({self.url!r})"

    def __enter__(self) -> "Coordinator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release connections."""
        self._store.close()

    def dataset(
        self,
        name: str,
        *,
        size: int | None = None,
        files: list[tuple[str, int]] | None = None,
        shard_size: int | None = None,
        num_epochs: int | None = 1,
        shuffle: bool = False,
        seed: int = 0,
        lease_timeout: float = 60.0,
    ) -> Dataset:
        """Create the data set ``name``, or open it if it exists with the same definition.

        With only ``name``, opens an existing data set (:class:`UnknownDataset` if none).
        Safe to call from every process at once; a different definition raises
        :class:`InvalidArgument`.
        """
        if not isinstance(name, str) or not name or not name.isprintable() or "{" in name or "}" in name:
            raise InvalidArgument(f"data set name must be a non-empty printable str without braces, got {name!r}")
        if size is None and files is None and shard_size is None:
            stored = self._store.define(name, None)
            if stored is None:
                raise UnknownDataset(f"{self.url}: no data set {name!r}; create it with size= or files= and shard_size=")
            return Dataset(self, name, Definition.from_json(_loads(stored, name, self.url)))
        if shard_size is None:
            raise InvalidArgument("shard_size is required to define a data set")
        wanted = Definition(
            size=size,
            files=tuple(files) if files is not None else None,  # type: ignore[arg-type]
            shard_size=shard_size,
            num_epochs=num_epochs,
            shuffle=shuffle,
            seed=seed,
            lease_timeout=lease_timeout,
        )
        stored = self._store.define(name, wanted.canonical())
        if stored != wanted.canonical():
            existing = Definition.from_json(_loads(stored or "null", name, self.url))
            raise InvalidArgument(
                f"{self.url}: data set {name!r} exists with another definition: {existing} (asked for {wanted})"
            )
        return Dataset(self, name, wanted)


    # -- events --------------------------------------------------------------------------

    def publish(self, kind: str, payload: dict[str, Any], *, source: str) -> int:
        """Append an event to the job-wide log; returns its sequence number.

        Sequence numbers start at 1 and increase by one per event across every process
        of the store (never reused). ``payload`` must be a JSON-serialisable dict of at
        most ``MAX_EVENT_BYTES`` as JSON. The log keeps the newest ``max_events`` events
        (an option of :func:`sharding.connect`, default 10,000); older ones are dropped.
        """
        for what, value in (("kind", kind), ("source", source)):
            if not isinstance(value, str) or not value or not value.isprintable():
                raise InvalidArgument(f"event {what} must be a non-empty printable str, got {value!r}")
        if not isinstance(payload, dict):
            raise InvalidArgument(f"event payload must be a dict, got {type(payload).__name__}")
        try:
            text = json.dumps(payload, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"event payload is not JSON-serialisable: {exc}") from exc
        if len(text.encode()) > MAX_EVENT_BYTES:
            raise InvalidArgument(f"event payload is {len(text.encode())} bytes as JSON; at most {MAX_EVENT_BYTES}")
        return self._store.publish(kind, source, text, keep=self.options.max_events)

    def events(self, *, since: int = 0, limit: int | None = None) -> list[dict[str, Any]]:
        """Events with ``seq > since``, oldest first (at most ``limit``), each a dict
        ``{"seq", "time", "source", "kind", "payload"}``. ``time`` is seconds since the
        epoch on the server's clock (Redis) or the publisher's (SQLite, memory).

        Poll with ``since`` set to the last ``seq`` seen; a gap between that and the first
        returned ``seq`` means events were dropped from the bounded log meanwhile.
        """
        if isinstance(since, bool) or not isinstance(since, int) or since < 0:
            raise InvalidArgument(f"since must be an int >= 0, got {since!r}")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise InvalidArgument(f"limit must be None or an int >= 0, got {limit!r}")
        if limit == 0:
            return []
        return [
            {"seq": seq, "time": at, "source": source, "kind": kind, "payload": json.loads(payload)}
            for seq, at, source, kind, payload in self._store.events(since, limit)
        ]


def _loads(text: str, name: str, url: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not an object")
        return data
    except ValueError as exc:
        raise CoordinatorError(f"{url}: stored definition of {name!r} is unreadable: {exc}") from exc
