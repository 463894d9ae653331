"""A copy of a step from elsewhere (a peer's replica, a node-local shard) never writes over
a slot that another process of the node claimed between the writer's choice and its write."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from flashckpt.memory._rank_slots import RankSlots
from flashckpt.memory._slot import SlotState


class _Saver:
    """The saver as the slots see it: nothing committed, nothing held."""
    last_committed = None
    saver_pid = 0

    def drain(self) -> None:
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
