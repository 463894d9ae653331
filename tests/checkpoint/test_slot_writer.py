"""A copy of a step from elsewhere (a peer's replica, a node-local shard) never writes over
a slot that another process of the node claimed between the writer's choice and its write;
a save never writes over a slot whose persist began between its choice and its write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from flashckpt._placement import new_token
from flashckpt.memory._format import plan_image
from flashckpt.memory._rank_slots import RankSlots
from flashckpt.memory._slot import SlotState


class _Saver:
    """The saver as the slots see it: nothing committed, nothing held."""
    saver_pid = 0

    def covers(self, token, step) -> bool:
        return False

    def persisting(self, path, generation) -> bool:
        return False

    def drain(self) -> None:
        pass

    def revive(self) -> None:
        pass

    def saved(self, path, generation, step, info, *, persist) -> None:
        pass


_CLAIM = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from test_slot_writer import _Saver
    from flashckpt.memory._rank_slots import RankSlots
    slots = RankSlots({job!r}, 0, 2, {{}})
    index, _, _ = slots.claim(_Saver(), 5.0, 64, 9, {{}})
    print(index, flush=True)
    sys.stdin.read()  # stays alive, writing, until the test closes its stdin
""")


def test_a_slot_claimed_after_the_writers_choice_is_not_written_over(job_id):
    slots = RankSlots(job_id, 0, 2, {})
    into, _ = slots.writer(7, {"directory": "elsewhere"}, _Saver(), 5.0)
    claimer = subprocess.Popen([sys.executable, "-c", _CLAIM.format(tests=os.path.dirname(__file__), job=job_id)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        claimed = int(claimer.stdout.readline())
        into(64, {"token": "t"})
        writing = sorted((h.step, h.writer_pid) for h in slots.headers() if h.state == SlotState.WRITING)
        assert writing == sorted([(9, claimer.pid), (7, os.getpid())]), writing
        assert slots.headers()[claimed].step == 9
    finally:
        claimer.stdin.close()
        claimer.wait(30)
        slots.close(unlink=False)


def test_a_copy_from_elsewhere_keeps_the_failure_capture_mark(job_id):
    """A failure capture fetched from a peer's replica is still a capture: the restart on the node
    that fetched it says so (its ``restored ... (a failure capture)`` line and ``load`` event), as
    the node that captured it does. Seen on two nodes (benchmarks/capture_campaign.py --nodes 2):
    the killed rank's node fetched the survivor's capture of step 72 and reported a plain copy."""
    slots = RankSlots(job_id, 0, 2, {})
    try:
        for step, info in ((7, {"token": "t", "captured": True}), (8, {"token": "t"})):
            into, done = slots.writer(step, {"directory": "elsewhere"}, _Saver(), 5.0)
            into(64, info)
            done()
        assert slots.info(7).get("captured") is True and "captured" not in slots.info(8)
    finally:
        slots.close(unlink=False)


_PERSIST_SLOWLY = textwrap.dedent("""
    import json, sys, time
    from flashckpt.saver._persist import persist_slot
    from flashckpt.storage._local import LocalStorage
    path, generation, info = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    write = LocalStorage.write_shard

    def slowly(self, step, rank, token, image):  # the slot is held (its reader set) from here on
        print("reading", flush=True)
        time.sleep(1.0)
        return write(self, step, rank, token, image)

    LocalStorage.write_shard = slowly
    print(json.dumps({"committed": persist_slot(path, generation, info).committed}), flush=True)
""")


def _image(token: str, fill: int, size: int = 1 << 16) -> bytes:
    head = plan_image([("w", "U8", (size,))], {"token": token, "kinds": {"w": "numpy"}}).header
    return head + bytes([fill]) * size


def _complete(slots: RankSlots, step: int, image: bytes, info: dict) -> tuple[int, int]:
    """Save ``image`` as ``step`` the way the engine does (claim, copy, COMPLETE); (slot, generation)."""
    index, slot, header = slots.claim(_Saver(), 5.0, len(image), step, info)
    slot.image(len(image))[:] = image
    with slots.lock.held():
        header.state = SlotState.COMPLETE
        slot.write_header(header)
    return index, header.generation


def test_a_save_never_writes_over_a_slot_whose_persist_began_after_its_choice(job_id, tmp_path):
    """A saver may begin persisting a slot between a save's choice of that slot and its
    write: a job it was told of again, or a dead trainer's slot it adopted, where the slot
    names no live reader yet (the saver that was asked died). The save must not write
    into the slot while the persist reads it, else the step commits torn: bytes of the
    new save under the old step's number, its checksums taken over the torn bytes."""
    token = new_token()
    info = {"directory": str(tmp_path), "storage_rank": 0, "storage_world": 1, "persist": True, "token": token,
            "keep_last": 2, "branch": -1}
    slots = RankSlots(job_id, 0, 2, {})
    first = _image(token, 1)
    index, generation = _complete(slots, 1, first, info)
    _complete(slots, 2, _image(token, 2), info)  # the newest copy: the next save takes the other slot
    real_reserve = slots.reserve
    saver: list[subprocess.Popen] = []

    def reserve_as_the_persist_begins(i: int, size: int):
        if not saver:  # the save chose slot i; a persist of its copy begins now
            saver.append(subprocess.Popen([sys.executable, "-c", _PERSIST_SLOWLY, slots.paths[i], str(generation),
                                           json.dumps(info)], stdout=subprocess.PIPE, text=True))
            assert saver[0].stdout.readline().strip() == "reading"
        return real_reserve(i, size)

    slots.reserve = reserve_as_the_persist_begins
    try:
        third = _image(token, 3)
        claimed, slot, _ = slots.claim(_Saver(), 30.0, len(third), 3, info)
        assert saver and (tmp_path / "step-1" / "metadata.json").exists(), \
            "the save took the slot while the saver was still reading it (step 1 not committed yet)"
        assert claimed == index
        slot.image(len(third))[:] = third
        assert json.loads(saver[0].stdout.readline()) == {"committed": True}
        assert (tmp_path / "step-1" / "rank-0.safetensors").read_bytes() == first, "step 1 committed torn"
    finally:
        for proc in saver:
            proc.kill()
            proc.wait(30)
        slots.close(unlink=False)


_HOLD_PERSIST_LOCK = textwrap.dedent("""
    import sys, time
    from flashckpt.memory._slot import Slot
    slot = Slot.open(sys.argv[1], writable=True, populate=False)
    assert slot.lock_for_persist(0.0)
    print("held", flush=True)
    time.sleep(0.5)
""")


def test_a_persist_skipped_as_committed_already_lets_the_slot_go(job_id, tmp_path):
    """A second request to persist a slot whose step another process is persisting waits for
    it, then skips the step it committed: the slot names no reader afterwards (else a save
    passes it over as held for as long as the saver lives, and must wait for, or write
    over, the newest copy)."""
    from flashckpt.memory._slot import Slot
    from flashckpt.saver._persist import persist_slot

    token = new_token()
    info = {"directory": str(tmp_path), "storage_rank": 0, "storage_world": 1, "persist": True, "token": token,
            "keep_last": 2, "branch": -1}
    slots = RankSlots(job_id, 0, 2, {})
    try:
        index, generation = _complete(slots, 1, _image(token, 1), info)
        path = slots.paths[index]
        assert persist_slot(path, generation, info).committed
        with slots.lock.held():  # asked again: the trainer names the saver (this process) the slot's reader
            named = Slot.open(path, writable=True, populate=False)
            named.set_reader(os.getpid())
            named.close()
        holder = subprocess.Popen([sys.executable, "-c", _HOLD_PERSIST_LOCK, path], stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "held"
            result = persist_slot(path, generation, info)
        finally:
            holder.wait(30)
        assert result.skipped and not result.committed, result
        assert Slot.peek_header(path).reader_pid == 0, "the skipped persist left the slot held"
    finally:
        slots.close(unlink=False)
