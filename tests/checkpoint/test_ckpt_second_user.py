"""No other local user gets in (issue 20): the trainer runs as root (as CI does), the
attacker as uid 65534 through ``setpriv``.

Shared memory lives under ``FLASHCKPT_SHM_DIR``, here a fresh world-writable sticky
directory like ``/dev/shm``, so the attacker gets exactly the rights it has on a real
node. The tests assert properties, not a layout: whatever the attacker plants at the
paths the library computes (``flashckpt._names``) is never read or written through, and
root either refuses with a flashckpt error naming the path or works in a place the
attacker cannot touch.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from flashckpt import _names
from flashckpt.memory._slot import RankLock, Slot
from flashckpt.storage._local import LocalStorage

from .test_ckpt_crash import saver_pids
from .test_ckpt_liveness import Script, cleanup

NOBODY = 65534
SETPRIV = shutil.which("setpriv")


def _attacker_python() -> str | None:
    if SETPRIV is None or os.getuid() != 0:
        return None
    for candidate in (os.path.realpath(sys.executable), "/usr/bin/python3"):
        ok = subprocess.run([SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", candidate,
                             "-c", "import json, socket, os"], capture_output=True, timeout=30)
        if ok.returncode == 0:
            return candidate
    return None


ATTACKER_PY = _attacker_python()
pytestmark = pytest.mark.skipif(ATTACKER_PY is None,
                                reason="needs root, setpriv and a python that uid 65534 can run")


def as_nobody(code: str, *args: str, timeout: float = 30) -> dict:
    """Run ``code`` as uid 65534; it prints one JSON line, returned."""
    out = subprocess.run([SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", ATTACKER_PY,
                          "-c", textwrap.dedent(code), *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"the attacker script failed: {out.stderr[-2000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def nobody_background(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", ATTACKER_PY,
                             "-c", textwrap.dedent(code), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.fixture
def shm(monkeypatch):
    """A fresh /dev/shm stand-in (mode 1777), used by this process's ``_names`` and the scripts."""
    root = tempfile.mkdtemp(prefix="fc-shm-", dir="/tmp")
    os.chmod(root, 0o1777)
    monkeypatch.setattr(_names, "SHM_DIR", root)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def attacker_dir():
    """A directory the attacker owns, outside the shm root (for hard links and its own notes)."""
    path = tempfile.mkdtemp(prefix="fc-attacker-", dir="/tmp")
    os.chown(path, NOBODY, NOBODY)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def job_paths(job: str, shm_root: str) -> dict[str, str]:
    """The paths the library uses for ``job``, computed with the shm root pristine again
    afterwards (computing them may create this user's private directory: the attacker
    was there first)."""
    slot0 = _names.slot_path(job, 0, 0)
    paths = {"slot0": slot0, "slot1": _names.slot_path(job, 0, 1), "lock": _names.lock_path(slot0),
             "sock": _names.socket_path(job)}
    for name in os.listdir(shm_root):
        full = os.path.join(shm_root, name)
        shutil.rmtree(full) if os.path.isdir(full) and not os.path.islink(full) else os.unlink(full)
    return paths


ROOT_RUN = """
    def run():
        ck = Checkpointer(directory, job_id=job, persist_every=1, keep_last=2)
        s = make_state(1.0)
        fill(s, 7)
        ck.save(7, s)
        ck.flush(timeout=15)
        ck.close()
    say("result " + json.dumps(attempt(run)))
"""


def run_as_root(directory, job: str, shm_root: str, body: str = ROOT_RUN, timeout: float = 60) -> dict:
    script = Script(body, directory, job, {"FLASHCKPT_SHM_DIR": shm_root, "FLASHCKPT_SAVER_TIMEOUT": "15"})
    try:
        return script.result("result ", timeout, "root's trainer")
    finally:
        script.kill()
        for pid in saver_pids(job):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def refused_or_worked(res: dict, directory, shm_root: str) -> None:
    """Root either refused with a flashckpt error naming a path under the shm root, or
    worked (and then step 7 is committed)."""
    outcome = res["outcome"]
    if outcome == "ok":
        assert LocalStorage(str(directory)).committed_steps()[-1:] == [7], "save/close 'worked' but nothing is stored"
        return
    assert outcome.split(":")[0] in ("UnsafeFileError", "SharedMemoryError", "SaverError", "JobConflictError"), \
        f"root's trainer failed without a clear flashckpt error: {outcome}"
    assert shm_root in outcome, f"the error does not name the unsafe path: {outcome}"


def stop_savers(job: str) -> None:
    """Savers of ``job`` killed; the ``shm`` fixture removes every object (the attacker's too)."""
    for pid in saver_pids(job):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def digest(path: str) -> tuple[int, str]:
    with open(path, "rb") as f:
        data = f.read()
    return len(data), hashlib.sha256(data).hexdigest()


# -- (a) planted slot files, lock, socket path -----------------------------------------

PLANT = """
    import json, os, sys
    paths, mode, keep, victims = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    made = []
    for name, path in paths.items():
        d = os.path.dirname(path)
        if not os.path.isdir(d):
            os.makedirs(d)
            os.chmod(d, 0o777)
            made.append(d)
        if mode == "symlinks":
            os.symlink(victims[name], path)
        elif name != "sock":
            with open(path, "wb") as f:
                f.write(b"\\0" * 8192)
            os.chmod(path, 0o666)
            os.link(path, os.path.join(keep, name))  # sees the inode even if root unlinks the name
    print(json.dumps({"made": made}))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["files", "symlinks"])
def test_objects_planted_by_another_user_are_refused_never_used(tmp_path, job_id, shm, attacker_dir, mode):
    paths = job_paths(job_id, shm)
    victim_dir = tmp_path / "victims"
    victim_dir.mkdir(mode=0o700)
    victims = {}
    for name in paths:
        victims[name] = str(victim_dir / f"victim-{name}")
        with open(victims[name], "wb") as f:
            f.write(b"VICTIM " + name.encode())
    before = {name: digest(path) for name, path in victims.items()}
    as_nobody(PLANT, json.dumps(paths), mode, attacker_dir, json.dumps(victims))
    try:
        res = run_as_root(tmp_path / "ckpt", job_id, shm)
        refused_or_worked(res, tmp_path / "ckpt", shm)
        for name, path in victims.items():
            assert digest(path) == before[name], f"root wrote through the planted symlink {paths[name]} into {path}"
        for name in ("slot0", "slot1", "lock"):
            kept = os.path.join(attacker_dir, name)
            if os.path.exists(kept):
                assert digest(kept) == (8192, hashlib.sha256(b"\0" * 8192).hexdigest()), \
                    f"root wrote into the attacker's file {paths[name]}: its bytes are readable by uid {NOBODY}"
    finally:
        stop_savers(job_id)


# -- (b) root's objects: not readable, not connectable --------------------------------

SNOOP = """
    import json, os, socket, sys
    paths, root = json.loads(sys.argv[1]), sys.argv[2]
    found = list(paths.values())
    for d, _, files in os.walk(root):
        found += [os.path.join(d, f) for f in files]
    read, connected = [], []
    for path in sorted(set(found)):
        try:
            with open(path, "rb") as f:
                if f.read(64):
                    read.append(path)
        except OSError:
            pass
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            connected.append(path)
        except OSError:
            pass
        finally:
            s.close()
    print(json.dumps({"read": read, "connected": connected, "seen": sorted(set(found))}))
"""


@pytest.mark.timeout(120)
def test_another_user_cannot_read_the_slots_or_connect_to_the_saver(tmp_path, job_id, shm):
    body = """
        ck = Checkpointer(directory, job_id=job, persist_every=1, keep_last=2)
        s = make_state(1.0)
        fill(s, 3)
        ck.save(3, s)
        ck.wait(timeout=30)
        say("ready")
        time.sleep(600)
    """
    script = Script(body, tmp_path / "ckpt", job_id, {"FLASHCKPT_SHM_DIR": shm})
    try:
        script.expect("ready", 60, "root's trainer saving")
        paths = {"slot0": _names.slot_path(job_id, 0, 0), "slot1": _names.slot_path(job_id, 0, 1),
                 "lock": _names.lock_path(_names.slot_path(job_id, 0, 0)), "sock": _names.socket_path(job_id)}
        assert os.path.exists(paths["slot0"]) and os.path.exists(paths["sock"]), "the test looks in the wrong place"
        res = as_nobody(SNOOP, json.dumps(paths), shm)
        assert res["read"] == [], f"uid {NOBODY} read root's shared-memory objects: {res['read']}"
        assert res["connected"] == [], f"uid {NOBODY} connected to root's saver: {res['connected']}"
    finally:
        script.kill()
        cleanup(job_id)


# -- (c) a fake saver on the socket path ----------------------------------------------

FAKE_SAVER = """
    import json, os, socket, sys, threading, time
    path, note = sys.argv[1], sys.argv[2]
    d = os.path.dirname(path)
    if not os.path.isdir(d):
        os.makedirs(d)
        os.chmod(d, 0o777)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    os.chmod(path, 0o777)
    srv.listen(16)
    srv.settimeout(60)
    print("listening", flush=True)

    def serve(conn):
        buf = b""
        while True:
            data = conn.recv(65536)
            if not data:
                return
            buf += data
            while b"\\n" in buf:
                line, buf = buf.split(b"\\n", 1)
                msg = json.loads(line)
                with open(note, "a") as f:
                    f.write(json.dumps(msg)[:200] + "\\n")
                op = msg.get("op")
                if op == "hello":
                    reply = {"op": "welcome", "pid": os.getpid(), "v": msg.get("v")}
                elif "id" in msg:
                    reply = {"op": {"flush": "flushed", "wait": "waited"}.get(op, op), "id": msg["id"]}
                else:
                    continue
                conn.sendall(json.dumps(reply).encode() + b"\\n")

    start = time.time()
    while time.time() - start < 60:
        try:
            conn, _ = srv.accept()
        except OSError:
            break
        threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""


@pytest.mark.timeout(150)
def test_a_fake_saver_of_another_user_is_refused(tmp_path, job_id, shm, attacker_dir):
    """A saver that answers everything, listening where root's saver would: root's save and
    close must not 'succeed' with nothing stored."""
    paths = job_paths(job_id, shm)
    note = os.path.join(attacker_dir, "fake.log")
    fake = nobody_background(FAKE_SAVER, paths["sock"], note)
    try:
        assert fake.stdout.readline().strip() == "listening", fake.stderr.read()
        res = run_as_root(tmp_path / "ckpt", job_id, shm, timeout=90)
        refused_or_worked(res, tmp_path / "ckpt", shm)
    finally:
        fake.kill()
        fake.wait(timeout=10)
        stop_savers(job_id)


# -- (d) a rewritten slot header cannot steer the root saver --------------------------

@pytest.mark.timeout(150)
def test_a_rewritten_slot_header_does_not_steer_the_saver_outside_its_directory(tmp_path, job_id):
    """Whoever can write a slot (simulated as root) rewrites its header's ``directory`` to
    another checkpoint directory of root's and ``keep_last`` to 1, then the trainer dies so
    the saver persists that slot: nothing may be written to or deleted from that directory."""
    from flashckpt.torch import Checkpointer
    import torch
    victim = tmp_path / "victim"
    other_job = job_id + "v"
    with Checkpointer(victim, job_id=other_job, persist_every=1, keep_last=0) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"w": torch.full((100,), float(step))})
    (victim / "sentinel").write_text("keep me")
    before = sorted(os.path.relpath(os.path.join(d, f), victim) for d, _, fs in os.walk(victim) for f in fs)
    ckpt = tmp_path / "ckpt"
    script = Script("""
        ck = Checkpointer(directory, job_id=job, persist_every=1000, keep_last=3)
        ck.save(5, st(5))
        say("ready")
        time.sleep(600)
    """, ckpt, job_id)
    try:
        script.expect("ready", 60, "the trainer's save(5)")
        rewritten = 0
        for i in (0, 1):
            path = _names.slot_path(job_id, 0, i)
            if not os.path.exists(path):
                continue
            slot = Slot.open(path, writable=True, populate=False)
            lock = RankLock(_names.lock_path(path))
            try:
                with lock.held():
                    h = slot.read_header()
                    if h.step == 5:
                        h.info = dict(h.info, directory=str(victim), keep_last=1)
                        slot.write_header(h)
                        rewritten += 1
            finally:
                slot.close()
                lock.close()
        assert rewritten == 1, "found no slot holding step 5 to rewrite"
        script.kill()  # the saver now persists the dead trainer's newest copy
        deadline = time.monotonic() + 40
        while saver_pids(job_id) and time.monotonic() < deadline:
            time.sleep(0.2)
        after = sorted(os.path.relpath(os.path.join(d, f), victim) for d, _, fs in os.walk(victim) for f in fs)
        assert after == before, (f"the saver wrote or deleted in {victim} as a rewritten header said: "
                                 f"new {sorted(set(after) - set(before))}, gone {sorted(set(before) - set(after))}")
        assert LocalStorage(str(victim)).committed_steps() == [1, 2, 3]
    finally:
        cleanup(job_id, script)
        cleanup(other_job)


# -- (e) the saver's log ----------------------------------------------------------------

@pytest.mark.timeout(150)
def test_the_saver_log_is_not_a_predictable_tmp_file_and_never_follows_a_symlink(tmp_path, job_id, shm):
    """uid 65534 plants symlinks at the predictable /tmp log names (the old
    ``/tmp/flashckpt.<job>.saver.log`` among them) pointing at a file of root's: root's run
    must neither write there nor create any file named after the job in /tmp."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"VICTIM")
    tmp = tempfile.gettempdir()
    planted = [os.path.join(tmp, f"flashckpt.{job_id}.saver.log"), os.path.join(tmp, f"flashckpt-{job_id}-saver.log")]
    as_nobody("""
        import json, os, sys
        for p in json.loads(sys.argv[1]):
            os.symlink(sys.argv[2], p)
        print("{}")
    """, json.dumps(planted), str(victim))
    try:
        before = set(glob.glob(os.path.join(tmp, f"*{job_id}*")))
        res = run_as_root(tmp_path / "ckpt", job_id, shm)
        assert victim.read_bytes() == b"VICTIM", f"the saver wrote its log through a planted symlink into {victim}"
        assert res["outcome"] == "ok", f"root's run failed with symlinks planted at /tmp log names: {res}"
        new = set(glob.glob(os.path.join(tmp, f"*{job_id}*"))) - before
        assert not new, f"files named after the job appeared in {tmp} (predictable names): {sorted(new)}"
    finally:
        for p in planted:
            if os.path.islink(p):
                os.unlink(p)
        stop_savers(job_id)
