"""One body per behaviour, run against every backend (memory, sqlite, redis)."""

from __future__ import annotations

import json
import random
from collections import Counter
import time
import uuid

import pytest

import sharding

from sharding_fixtures import Backend


def covered(ds: sharding.Dataset, worker: str = "w") -> list[tuple[int, int, int]]:
    """Drain the data set with one worker; the (epoch, start, end) of each completed shard."""
    seen = []
    while (shard := ds.acquire(worker)) is not None:
        ds.complete(shard)
        seen.append((shard.epoch, shard.start, shard.end))
    return seen


def test_drains_every_sample_once_per_epoch(backend: Backend) -> None:
    ds = backend.connect().dataset("train", size=103, shard_size=10, num_epochs=3, shuffle=True, seed=7)
    seen = covered(ds)
    for epoch in range(3):
        samples = sorted(i for e, s, t in seen if e == epoch for i in range(s, t))
        assert samples == list(range(103))
    assert ds.acquire("w") is None
    progress = ds.progress()
    assert (progress["epoch"], progress["done"], progress["todo"], progress["leased"]) == (2, 11, 0, 0)
    assert progress["finished"] is True
    assert progress["workers"]["w"] == {"acquired": 33, "completed": 33, "leased": 0}


def test_file_based_shards_never_cross_files(backend: Backend) -> None:
    files = [("a.rec", 25), ("empty.rec", 0), ("b.rec", 10)]
    ds = backend.connect().dataset("files", files=files, shard_size=10)
    shards = []
    while (shard := ds.acquire("w")) is not None:
        shards.append((shard.file, shard.start, shard.end, list(shard.indices())))
        ds.complete(shard)
    assert sorted(shards) == [
        ("a.rec", 0, 10, list(range(10))),
        ("a.rec", 10, 20, list(range(10, 20))),
        ("a.rec", 20, 25, list(range(20, 25))),
        ("b.rec", 0, 10, list(range(10))),
    ]


def test_reopen_is_idempotent_and_rejects_another_definition(backend: Backend) -> None:
    coord = backend.connect()
    first = coord.dataset("d", size=100, shard_size=10, shuffle=True, seed=1)
    again = backend.connect().dataset("d", size=100, shard_size=10, shuffle=True, seed=1)
    assert again.definition == first.definition
    assert coord.dataset("d").definition == first.definition  # open by name alone
    with pytest.raises(sharding.InvalidArgument, match="another definition"):
        coord.dataset("d", size=100, shard_size=20, shuffle=True, seed=1)
    with pytest.raises(sharding.UnknownDataset, match="no data set 'missing'"):
        coord.dataset("missing")


def test_same_seed_same_order_on_every_backend(backend: Backend) -> None:
    ds = backend.connect().dataset("o", size=50, shard_size=5, num_epochs=2, shuffle=True, seed=11)
    got = []
    while (shard := ds.acquire("w")) is not None:
        got.append((shard.epoch, shard.index, list(shard.indices())))
        ds.complete(shard)
    expected = [
        (epoch, index, list(sharding.sample_order(index * 5, index * 5 + 5, seed=11, epoch=epoch, shard=index, shuffle=True)))
        for epoch in range(2)
        for index in sharding.shard_order(10, seed=11, epoch=epoch, shuffle=True)
    ]
    assert got == expected


def test_released_lease_goes_to_front_and_resumes_at_reported_position(backend: Backend) -> None:
    ds = backend.connect().dataset("r", size=40, shard_size=10, shuffle=True, seed=3)
    a = ds.acquire("a")
    b = ds.acquire("b")
    ds.report(a, consumed=4)
    assert ds.release("a") == 1
    again = ds.acquire("c")
    assert (again.index, again.consumed, again.lease > b.lease) == (a.index, 4, True)
    assert list(again.indices()) == list(a.indices())[4:]
    with pytest.raises(sharding.LeaseLost, match="now held by 'c'"):
        ds.complete(a)
    ds.complete(again)
    ds.complete(b)
    assert ds.progress()["done"] == 2


def test_expired_lease_is_reclaimed_and_late_complete_refused(backend: Backend) -> None:
    ds = backend.connect(poll_interval_seconds=0.01).dataset("x", size=20, shard_size=10, lease_timeout=0.3)
    slow = ds.acquire("slow")
    ds.report(slow, consumed=3)
    other = ds.acquire("other")
    ds.complete(other)
    # the only shard left is leased to "slow": acquire waits until that lease expires
    taken = ds.acquire("fast", timeout=30)
    assert (taken.index, taken.consumed) == (slow.index, 3)
    with pytest.raises(sharding.LeaseLost, match="expired and the shard is now held by 'fast'"):
        ds.complete(slow)
    with pytest.raises(sharding.LeaseLost):
        ds.report(slow, consumed=5)
    ds.complete(taken)
    assert ds.acquire("fast") is None
    counts = {w: (c["acquired"], c["completed"], c["leased"]) for w, c in ds.progress()["workers"].items()}
    assert counts == {"slow": (1, 0, 0), "other": (1, 1, 0), "fast": (1, 1, 0)}  # the lost lease still counts


def test_expired_lease_waiting_in_queue_refuses_complete(backend: Backend) -> None:
    ds = backend.connect().dataset("q", size=30, shard_size=10, lease_timeout=0.2)
    lost = ds.acquire("lost")
    time.sleep(0.3)
    other = ds.acquire("other")  # reclaims "lost"'s lease to the front, then takes it
    assert other.index == lost.index
    ds.release("other")
    with pytest.raises(sharding.LeaseLost, match="waits to be handed out again"):
        ds.complete(lost)


def test_heartbeat_keeps_leases(backend: Backend) -> None:
    ds = backend.connect().dataset("h", size=10, shard_size=10, lease_timeout=0.5)
    assert ds.heartbeat("agent-before-first-shard") == 0
    shard = ds.acquire("w")
    for _ in range(4):
        time.sleep(0.2)
        assert ds.heartbeat("w") == 1
    ds.complete(shard)  # 0.8 s after acquire, alive only by heartbeats
    assert ds.progress()["workers"]["agent-before-first-shard"]["acquired"] == 0


def test_bad_input(backend: Backend) -> None:
    coord = backend.connect()
    for kwargs, pattern in [
        (dict(size=-1, shard_size=10), "size must be >= 1"),
        (dict(size=10, shard_size=0), "shard_size must be >= 1"),
        (dict(size=10, shard_size=-5), "shard_size must be >= 1"),
        (dict(files=[("a", -3)], shard_size=2), "num_records of a must be >= 0"),
        (dict(size=10, files=[("a", 3)], shard_size=2), "exactly one of"),
        (dict(size=10, shard_size=2, num_epochs=0), "num_epochs"),
        (dict(size=10, shard_size=2, lease_timeout=-1), "lease_timeout"),
        (dict(size=10.5, shard_size=2), "size must be an int"),
    ]:
        with pytest.raises(sharding.InvalidArgument, match=pattern):
            coord.dataset("bad", **kwargs)
    ds = coord.dataset("ok", size=10, shard_size=5)
    with pytest.raises(sharding.UnknownWorker, match="'nobody' never acquired"):
        ds.release("nobody")
    with pytest.raises(sharding.InvalidArgument, match="worker"):
        ds.acquire("")
    shard = ds.acquire("w")
    with pytest.raises(sharding.InvalidArgument, match="consumed must be"):
        ds.report(shard, consumed=6)
    ds.complete(shard)
    with pytest.raises(sharding.AlreadyCompleted, match="already completed"):
        ds.complete(shard)
    with pytest.raises(sharding.AlreadyCompleted):
        ds.report(shard, consumed=1)
    with pytest.raises(sharding.InvalidArgument, match="data set 'ok' given to data set 'other'"):
        coord.dataset("other", size=10, shard_size=5).complete(shard)


def test_state_dict_round_trip_mid_epoch(backend: Backend) -> None:
    ds = backend.connect().dataset("s", size=100, shard_size=10, num_epochs=2, shuffle=True, seed=5)
    for _ in range(13):  # into epoch 1
        ds.complete(ds.acquire("w"))
    held = ds.acquire("w")
    ds.report(held, consumed=6)
    state = ds.state_dict()
    assert json.loads(json.dumps(state)) == state and len(json.dumps(state)) < 1000
    after_save = [ds.acquire("w") for _ in range(3)]  # work that the rollback undoes
    ds.complete(after_save[0])
    ds.load_state_dict(state)
    with pytest.raises(sharding.LeaseLost):
        ds.complete(after_save[1])
    first = ds.acquire("w2")
    assert (first.epoch, first.index, first.consumed) == (1, held.index, 6)
    ds.complete(first)
    rest = [first.index]
    while (shard := ds.acquire("w2")) is not None and shard.epoch == 1:
        rest.append(shard.index)
        ds.complete(shard)
    # epoch 1 holds exactly the 7 shards not completed before the save
    done_before = list(sharding.shard_order(10, seed=5, epoch=1, shuffle=True))[:3]
    assert sorted(rest) == sorted(set(range(10)) - set(done_before))
    assert shard is None
    assert ds.progress()["finished"]


def test_state_dict_with_positions_writes_them_without_reporting(backend: Backend) -> None:
    """``state_dict(positions)``: the caller's unreported positions in place of the stored
    ones, for leases that token still holds; the store keeps what was reported."""
    ds = backend.connect().dataset("p", size=40, shard_size=10)
    mine, other = ds.acquire("w"), ds.acquire("v")
    ds.report(mine, consumed=2)
    stale = ds.acquire("w")
    ds.release("w")  # both of w's leases go back to the queue: their tokens hold nothing now
    again = ds.acquire("w")
    assert again.slot == mine.slot and again.consumed == 2
    state = ds.state_dict({again: 7, other: 4, stale: 9})
    held = {again.slot: 7, other.slot: 4}
    assert state["queue"][:2] == [[slot, held[slot]] for slot in sorted(held)]
    assert [stale.slot, 0] in state["queue"]  # released, not held by that token: as stored
    assert ds.state_dict()["queue"][:2] == [[slot, 2 if slot == mine.slot else 0] for slot in sorted(held)]


def test_state_dict_as_of_a_step_takes_each_lease_at_or_before_it(backend: Backend) -> None:
    """Reports tagged with a step keep a lease's position at its last two steps: the state as
    of step 1 holds a worker that already reported step 2 at its step-1 position, a lease
    taken after step 1 where it was handed out, and a shard consumed whole only at step 2
    unfinished; an untagged report is the position at every step."""
    ds = backend.connect().dataset("as-of", size=40, shard_size=10)
    a, b = ds.acquire("w"), ds.acquire("v")
    ds.report(a, consumed=3, step=1)
    ds.report(b, consumed=2, step=1)
    ds.report(b, consumed=5, step=1)  # the same step again: replaces
    ds.report(a, consumed=7, step=2)
    c = ds.acquire("w")
    ds.report(c, consumed=4, step=2)
    d = ds.acquire("u")
    ds.report(d, consumed=6, step=1)
    ds.report(d, consumed=1)  # untagged
    as_of = {step: ds.state_dict(as_of=step)["queue"] for step in (1, 2)}
    assert as_of[1] == sorted([[a.slot, 3], [b.slot, 5], [c.slot, 0], [d.slot, 1]])
    assert as_of[2] == ds.state_dict()["queue"] == sorted([[a.slot, 7], [b.slot, 5], [c.slot, 4], [d.slot, 1]])
    ds.report(a, consumed=10, step=2)  # consumed whole at step 2: done as of 2, not as of 1
    assert [a.slot, 3] in ds.state_dict(as_of=1)["queue"]
    assert a.slot not in [slot for slot, _ in ds.state_dict(as_of=2)["queue"]]
    state = ds.state_dict(as_of=1)
    ds.complete(a)
    ds.load_state_dict(state)
    again = ds.acquire("w")
    assert (again.slot, again.consumed) == (a.slot, 3)
    with pytest.raises(sharding.InvalidArgument, match="step"):
        ds.report(again, consumed=4, step=-1)


def test_a_completion_tagged_with_a_step_is_unfinished_as_of_the_step_before(backend: Backend) -> None:
    """A shard completed at step 2 (a rank that received it whole begins a new iteration) is,
    as of step 1, at its position of step 1, even once the epoch moved on (nothing of the next
    epoch was taken by step 1); a report of a later step forgets it, and so does a load."""
    ds = backend.connect().dataset("done-at", size=20, shard_size=10, num_epochs=2)
    a, b = ds.acquire("w"), ds.acquire("v")
    ds.report(a, consumed=4, step=1)
    ds.complete(a, step=2)  # whole at step 2, never reported so: before it, at 4
    ds.report(b, consumed=2, step=1)
    ds.report(b, consumed=10, step=2)
    ds.complete(b, step=2)
    before = ds.state_dict(as_of=1)
    assert (before["epoch"], before["cursor"], before["queue"]) == (0, 2, sorted([[a.slot, 4], [b.slot, 2]]))
    assert ds.state_dict(as_of=2) == ds.state_dict()
    assert (ds.state_dict()["epoch"], ds.state_dict()["queue"]) == (0, [])
    c = ds.acquire("w")  # the next epoch
    ds.report(c, consumed=3, step=2)
    assert ds.state_dict(as_of=1)["queue"] == before["queue"] and ds.state_dict(as_of=1)["epoch"] == 0
    assert (ds.state_dict(as_of=2)["epoch"], ds.state_dict(as_of=2)["queue"]) == (1, [[c.slot, 3]])
    ds.report(c, consumed=5, step=3)  # every rank is past step 1 now
    assert ds.state_dict(as_of=1)["epoch"] == 1
    ds.load_state_dict(before)
    assert ds.state_dict(as_of=0) == ds.state_dict() == {**before, "workers": ds.state_dict()["workers"]}
    again = ds.acquire("w")
    with pytest.raises(sharding.InvalidArgument, match="step"):
        ds.complete(again, step=-1)


def test_a_completion_after_the_last_boundary_keeps_both_positions_and_forgets_nothing(backend: Backend) -> None:
    """A shard received whole after its rank's boundary of step 5 (no update followed: tagged
    6) is, as of step 4 (a peer that had not passed step 5's boundary), at its position of step
    4, not of step 5; and its completion does not forget a shard completed at step 5, which that
    read needs too."""
    ds = backend.connect().dataset("after-last", size=30, shard_size=10)
    x, y = ds.acquire("w"), ds.acquire("w")
    ds.report(x, consumed=3, step=4)
    ds.report(y, consumed=2, step=4)
    ds.report(x, consumed=10, step=5)
    ds.report(y, consumed=6, step=5)
    ds.complete(x, step=5)
    ds.complete(y, step=6)
    assert ds.state_dict(as_of=4)["queue"] == sorted([[x.slot, 3], [y.slot, 2]])
    assert ds.state_dict(as_of=5)["queue"] == [[y.slot, 6]]
    assert ds.state_dict(as_of=6)["queue"] == ds.state_dict()["queue"] == []


def test_completions_of_one_shard_in_two_epochs_are_both_kept(backend: Backend) -> None:
    """One shard an epoch: completed at step 2 in epoch 0 and at step 3 in epoch 1 (a rank
    that began a new iteration after its boundary of step 2), the state as of step 1 is still
    epoch 0's, with the shard at its position of step 1."""
    ds = backend.connect().dataset("one-shard", size=10, shard_size=10, num_epochs=3)
    a = ds.acquire("w")
    ds.report(a, consumed=4, step=1)
    ds.complete(a, step=2)
    b = ds.acquire("w")
    ds.report(b, consumed=3, step=2)
    ds.complete(b, step=3)
    before = ds.state_dict(as_of=1)
    assert (before["epoch"], before["queue"]) == (0, [[0, 4]])
    assert (ds.state_dict(as_of=2)["epoch"], ds.state_dict(as_of=2)["queue"]) == (1, [[0, 3]])


def test_load_state_dict_rejects_bad_state(backend: Backend) -> None:
    ds = backend.connect().dataset("bad-state", size=100, shard_size=10)
    good = ds.state_dict()
    other = backend.connect().dataset("other", size=100, shard_size=20)
    with pytest.raises(sharding.InvalidArgument, match="another definition"):
        other.load_state_dict(good)
    for broken in [{}, {**good, "version": 99}, {**good, "cursor": 11}, {**good, "cursor": 1, "queue": [[0, 0], [0, 1]]},
                   {**good, "cursor": 2, "queue": [[1, 11]]}, {**good, "queue": "nope"}]:
        with pytest.raises(sharding.InvalidArgument):
            ds.load_state_dict(broken)


def test_complete_and_acquire_walks_the_same_order(backend: Backend) -> None:
    ds = backend.connect().dataset("ca", size=30, shard_size=10, num_epochs=2, shuffle=True, seed=9)
    got = []
    shard = ds.acquire("w")
    while shard is not None:
        got.append((shard.epoch, shard.index, shard.worker))
        shard = ds.complete_and_acquire(shard)
    assert got == [(e, i, "w") for e in range(2) for i in sharding.shard_order(3, seed=9, epoch=e, shuffle=True)]
    assert ds.progress()["workers"]["w"] == {"acquired": 6, "completed": 6, "leased": 0}
    assert ds.progress()["finished"]


def test_complete_and_acquire_refused_acquires_nothing_and_a_done_completion_stands(backend: Backend) -> None:
    ds = backend.connect().dataset("cr", size=30, shard_size=10)
    a, b, c = ds.acquire("a"), ds.acquire("b"), ds.acquire("c")
    ds.complete(a)
    with pytest.raises(sharding.AlreadyCompleted, match="already completed"):
        ds.complete_and_acquire(a)
    ds.release("b")
    d = ds.acquire("d")  # b's shard again
    with pytest.raises(sharding.LeaseLost, match="now held by 'd'"):
        ds.complete_and_acquire(b)
    progress = ds.progress()
    assert (progress["workers"]["a"]["acquired"], progress["workers"]["b"]["acquired"], progress["done"]) == (1, 1, 1)
    # the completion lands; no shard is free while c holds the last one
    with pytest.raises(sharding.AcquireTimeout):
        ds.complete_and_acquire(d, timeout=0)
    assert ds.progress()["done"] == 2 and ds.progress()["workers"]["d"] == {"acquired": 1, "completed": 1, "leased": 0}
    assert ds.complete_and_acquire(c) is None
    assert ds.progress()["finished"]
    with pytest.raises(sharding.InvalidArgument, match="expected a Shard"):
        ds.complete_and_acquire("not a shard")  # type: ignore[arg-type]


def test_complete_and_acquire_many_leases_in_batches_and_names_refusals(backend: Backend) -> None:
    ds = backend.connect().dataset("cm", size=50, shard_size=10, num_epochs=2)
    first, refused = ds.complete_and_acquire_many([], "w", 3)
    assert [s.index for s in first] == [0, 1, 2] and refused == []
    other = ds.acquire("x")  # shard 3
    ds.complete(first[0])
    more, refused = ds.complete_and_acquire_many(first, "w", 3)  # one refused: the others stand, nothing leased
    assert more == [] and [type(e) for e in refused] == [sharding.AlreadyCompleted], refused
    assert ds.progress()["done"] == 3 and ds.progress()["workers"]["w"]["leased"] == 0
    more, refused = ds.complete_and_acquire_many([], "w", 3)  # only shard 4 is free now
    assert [s.index for s in more] == [4] and refused == []
    with pytest.raises(sharding.AcquireTimeout):  # the completion stands; none free while x holds 3
        ds.complete_and_acquire_many(more, "w", 2, timeout=0)
    assert ds.progress()["done"] == 4
    nxt, _ = ds.complete_and_acquire_many([other], "x", 10)  # epoch 0 ends: all of epoch 1, no more
    assert [(s.epoch, s.index, s.worker) for s in nxt] == [(1, i, "x") for i in range(5)]
    assert ds.complete_and_acquire_many(nxt, "x", 2) == ([], [])  # every epoch done
    assert ds.progress()["finished"]
    with pytest.raises(sharding.InvalidArgument, match="count"):
        ds.complete_and_acquire_many([], "w", 0)


def test_random_calls_give_the_same_answers_as_memory(backend: Backend) -> None:
    """The Redis transitions are Lua, the others Python: same calls, same answers, same state."""
    reference = sharding.connect(f"memory://ref-{uuid.uuid4().hex}")
    pair = [b.dataset("diff", size=200, shard_size=7, num_epochs=8, shuffle=True, seed=2) for b in (reference, backend.connect())]
    rng = random.Random(1234)
    held: list[list[sharding.Shard]] = [[], []]
    workers = [f"w{i}" for i in range(5)]
    seen: Counter[tuple[str, str, bool]] = Counter()

    def outcome(call):  # type: ignore[no-untyped-def]
        try:
            result = call()
            return ("ok", result)
        except sharding.CoordinatorError as exc:
            return (type(exc).__name__, None)

    for step in range(600):
        op = rng.choice(["acquire", "acquire", "report", "complete", "complete", "release", "heartbeat", "stale",
                         "complete_and_acquire", "complete_and_acquire", "many"])
        worker = rng.choice(workers)
        pick = rng.randrange(1_000_000)
        answers = []
        for side, ds in enumerate(pair):
            mine = held[side]
            if op == "acquire":
                try:
                    shard = ds.acquire(worker, timeout=0.01)
                    answers.append(("ok", shard and (shard.epoch, shard.index, shard.consumed)))
                    if shard is not None:
                        mine.append(shard)
                except sharding.CoordinatorError as exc:
                    answers.append((type(exc).__name__, None))
            elif op == "complete_and_acquire" and mine:
                shard = mine.pop(pick % len(mine))
                try:
                    got = ds.complete_and_acquire(shard, timeout=0.01)
                    answers.append(("ok", got and (got.epoch, got.index, got.consumed, got.worker)))
                    if got is not None:
                        mine.append(got)
                except sharding.CoordinatorError as exc:
                    answers.append((type(exc).__name__, None))
            elif op == "many":  # a random few of the held shards, one of them maybe stale
                done = [shard for i, shard in enumerate(mine) if (pick >> i) & 1][:3]
                try:
                    got, refused = ds.complete_and_acquire_many(done, worker, 1 + pick % 4, timeout=0.01)
                    answers.append(("ok", [(g.epoch, g.index, g.consumed) for g in got], [type(e) for e in refused]))
                    mine[:] = [shard for shard in mine if shard not in done or pick % 5 == 0] + got
                except sharding.CoordinatorError as exc:
                    answers.append((type(exc).__name__, None))
            elif op in ("report", "complete", "stale") and mine:
                shard = mine[pick % len(mine)]
                if op == "report":
                    step_tag = None if pick % 4 == 0 else pick % 6
                    answers.append(outcome(lambda: ds.report(shard, consumed=pick % (len(shard) + 1), step=step_tag)))
                else:
                    answers.append(outcome(lambda: ds.complete(shard, step=None if pick % 2 else pick % 6)))
                    if op == "complete":
                        mine.remove(shard)
            elif op == "release":
                answers.append(outcome(lambda: ds.release(worker)))
            elif op == "heartbeat":
                answers.append(outcome(lambda: ds.heartbeat(worker)))
        assert answers[:1] == answers[1:], f"step {step}: {op} by {worker}"
        assert pair[0].state_dict() == pair[1].state_dict(), f"step {step}"
        for as_of in (1, 3):
            assert pair[0].state_dict(as_of=as_of) == pair[1].state_dict(as_of=as_of), f"step {step}"
        if answers:
            seen[op, answers[0][0], answers[0][1] is not None] += 1
    # the combined call was seen granting, finding nothing free, and refused
    assert seen["complete_and_acquire", "ok", True] >= 20, seen
    assert seen["complete_and_acquire", "AcquireTimeout", False] + seen["complete_and_acquire", "ok", False] >= 1, seen
    assert seen["complete_and_acquire", "LeaseLost", False] + seen["complete_and_acquire", "AlreadyCompleted", False] >= 5, seen
    assert seen["many", "ok", True] >= 20, seen


def test_acquire_timeout_while_leases_are_out(backend: Backend) -> None:
    ds = backend.connect().dataset("t", size=10, shard_size=10)
    ds.acquire("a")
    with pytest.raises(sharding.AcquireTimeout, match="still hold leases") as info:
        ds.acquire("b", timeout=0)
    assert info.value.retryable
