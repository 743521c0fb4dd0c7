"""procinfo, the one reader of /proc: about a process that exits while it is asked about, every
answer is right or "gone" (None, False, left out), never an exception."""

import os
import shutil
import subprocess
import sys
import threading
import time
import traceback

import pytest

from ddp_tutorial.launcher import procinfo
from test_launcher import wait_for

pytestmark = pytest.mark.skipif(not procinfo.has_proc(), reason="Linux's /proc only")

TRUE = shutil.which("true")
CHILDREN = 300
MARK = "DDP_TUTORIAL_PROCINFO_TEST"
STATES = set("RSDZTtIKWP")  # X (dead, being reaped) reads as gone


def ask_everything(pid: int, token: str) -> dict:
    """Every question procinfo answers about ``pid``, asked once each."""
    return {"stat": procinfo.stat(pid), "state": procinfo.state(pid), "parent": procinfo.parent(pid),
            "group": procinfo.group(pid), "alive": procinfo.alive(pid), "cmdline": procinfo.cmdline(pid),
            "environ": procinfo.environ(pid), "environ_bytes": procinfo.environ_bytes(pid),
            "threads": procinfo.threads(pid), "fds": procinfo.fds(pid), "fd_count": procinfo.fd_count(pid),
            "fd_target": procinfo.fd_target(pid, 0), "memory_kb": procinfo.memory_kb(pid),
            "uid": procinfo.uid(pid)}


def check(a: dict, token: str) -> None:
    """Each answer about a child ``true <token>`` of this process is right, or says it is gone."""
    me, my_group = os.getpid(), os.getpgid(0)
    assert a["stat"] is None or (a["stat"].state in STATES and (a["stat"].ppid, a["stat"].pgrp) == (me, my_group))
    assert a["state"] is None or a["state"] in STATES
    assert a["parent"] in (None, me) and a["group"] in (None, my_group)
    assert a["alive"] in (True, False)
    assert a["cmdline"] in (None, ["true", token])
    assert a["environ"] is None or a["environ"][MARK] == token
    assert a["environ_bytes"] is None or f"{MARK}={token}".encode() in a["environ_bytes"].split(b"\0")
    assert a["threads"] in (None, 1)
    # Its fds: what it inherited, and what the dynamic loader opens for a moment at its start.
    assert a["fds"] is None or (a["fds"] == sorted(a["fds"]) and all(fd >= 0 for fd in a["fds"]))
    assert a["fd_count"] is None or a["fd_count"] >= 0
    assert a["fd_target"] is None or isinstance(a["fd_target"], str)
    assert a["memory_kb"] is None or a["memory_kb"]["rss"] >= 0
    assert a["uid"] in (None, os.getuid())


def test_answers_about_processes_that_exit_while_asked_are_right_or_gone():
    """A few hundred children that exit at once, each reaped as soon as it exits, while two
    threads ask every question about the newest one and a third scans every process."""
    token = f"{os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, MARK: token}
    spawned, latest, found_by_env, errors = [], [0], set(), []
    seen = {"running": 0, "zombie": 0, "gone": 0}
    done = threading.Event()

    def spawn_and_reap():
        try:
            for _ in range(CHILDREN):
                pid = os.posix_spawn(TRUE, ["true", token], env)
                spawned.append(pid)
                latest[0] = pid
                os.waitpid(pid, 0)  # reaped at once: its /proc files vanish while they are read
        finally:
            done.set()

    def ask():
        while not done.is_set():
            pid = latest[0]
            if pid:
                answers = ask_everything(pid, token)
                check(answers, token)
                state = answers["state"]
                seen["gone" if state is None else "zombie" if state == "Z" else "running"] += 1

    def scan():  # the scans race too: a process listed, then gone before its files are read
        while not done.is_set():
            found_by_env.update(procinfo.pids_with_env(MARK, token))
            assert all(isinstance(pid, int) for pid in procinfo.group_members(os.getpgid(0)))
            assert procinfo.listening_sockets([latest[0]]) == []

    def recording_errors(work):
        try:
            work()
        except BaseException:
            errors.append(traceback.format_exc())
            done.set()

    askers = [threading.Thread(target=recording_errors, args=(work,)) for work in (ask, ask, scan)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # the spawning thread gets the interpreter back sooner: a faster loop
    try:
        for t in askers:
            t.start()
        spawn_and_reap()
        for t in askers:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert errors == [], errors[0]
    assert len(spawned) == CHILDREN and found_by_env <= set(spawned)
    # The loop did meet processes that were there and processes gone: it asked during exits.
    assert seen["running"] + seen["zombie"] > 0 and seen["gone"] > 0, seen
    assert not procinfo.pids_with_env(MARK, token)  # every one of them reaped


@pytest.fixture
def reaped_between_open_and_read(monkeypatch):
    """Start a child; each /proc file procinfo opens for it is opened, then the child is killed
    and reaped, then procinfo reads: a process that exited mid-read, every time."""
    child = subprocess.Popen(["sleep", "60"])
    real_open = open

    def open_then_reap(path, *args, **kwargs):
        f = real_open(path, *args, **kwargs)
        if str(path).startswith(procinfo.path(child.pid) + "/") and child.returncode is None:
            child.kill()
            child.wait()
        return f

    monkeypatch.setattr(procinfo, "open", open_then_reap, raising=False)
    yield child
    child.kill()
    child.wait()


def test_a_read_of_a_reaped_process_fails_with_esrch_as_the_race_does():
    # What the fixture stages is the race itself: the open succeeds, the read fails.
    child = subprocess.Popen(["sleep", "60"])
    with open(procinfo.path(child.pid, "stat"), "rb") as f:
        child.kill()
        child.wait()
        with pytest.raises(ProcessLookupError):
            f.read()


@pytest.mark.parametrize("question", ["stat", "state", "parent", "group", "alive", "cmdline", "environ",
                                      "environ_bytes", "memory_kb"])
def test_a_process_reaped_between_open_and_read_reads_as_gone(reaped_between_open_and_read, question):
    pid = reaped_between_open_and_read.pid
    assert getattr(procinfo, question)(pid) in (None, False)
    assert reaped_between_open_and_read.returncode is not None  # the read did meet a reaped process


def test_alive_tells_a_running_process_from_a_zombie_and_a_reaped_one():
    assert procinfo.alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_for(lambda: os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT), 30, "the child to exit")
    assert not procinfo.alive(child.pid) and procinfo.state(child.pid) == "Z"  # exited, not reaped
    assert procinfo.cmdline(child.pid) is None and procinfo.parent(child.pid) == os.getpid()
    child.wait()
    assert not procinfo.alive(child.pid) and procinfo.stat(child.pid) is None


def test_the_answers_about_this_process():
    me = os.getpid()
    assert procinfo.stat(me) == (("R", os.getppid(), os.getpgid(0)))
    assert procinfo.cmdline(me)[0] == sys.orig_argv[0]
    assert procinfo.environ(me)["PATH"] == os.environ["PATH"]  # set before this process started
    assert procinfo.uid(me) == os.getuid()
    assert "/" in [fields[4] for fields in procinfo.mountinfo()]  # the root mount, as the sandbox reads it
    assert procinfo.threads(me) >= threading.active_count()  # and torch's own, if it started any
    read, write = os.pipe()
    try:
        assert {read, write} <= set(procinfo.fds(me))
        assert procinfo.fd_target(me, read) == procinfo.fd_target(me, write) and \
            procinfo.fd_target(me, read).startswith("pipe:")
    finally:
        os.close(read)
        os.close(write)
    assert procinfo.fd_target(me, read) is None


def test_listening_sockets_find_a_listener_and_its_address():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        found = procinfo.listening_sockets([os.getpid()])
        assert [(str(a), p) for a, p, pid in found if p == port and pid == os.getpid()] == [("127.0.0.1", port)]
    assert port not in {p for _, p, _ in procinfo.listening_sockets([os.getpid()])}


def test_proc_net_addresses_parse():
    assert str(procinfo.proc_net_address("0100007F")) == "127.0.0.1"
    assert str(procinfo.proc_net_address("00000000")) == "0.0.0.0"
    assert str(procinfo.proc_net_address("00000000000000000000000000000000")) == "::"
    assert str(procinfo.proc_net_address("0000000000000000FFFF00000100007F")) == "127.0.0.1"
    assert str(procinfo.proc_net_address("00000000000000000000000001000000")) == "::1"


@pytest.mark.parametrize("record, expected", [
    # The reap tore the read: the kernel read the state (Z) first, then found the signal lock released,
    # and left the parent and group at their defaults. Met by the loop above, about once in a dozen suites.
    (b"4242 (true) Z 0 -1 -1 0 -1 4194560", None),
    (b"4242 (true) X 0 -1 -1 0 -1 4194560", None),
    # pid 1 of a PID namespace: no parent in it, its group leader outside it (0). Alive, as is.
    (b"1 (python3) S 0 0 0 0 -1 4194560", procinfo.Stat("S", 0, 0)),
    (b"4242 (a) b) Z 17 4242 17 0 -1 4194560", procinfo.Stat("Z", 17, 4242)),
])
def test_a_stat_record_torn_by_the_reap_reads_as_gone(monkeypatch, record, expected):
    monkeypatch.setattr(procinfo, "_read", lambda pid, name: record if name == "stat" else None)
    assert procinfo.stat(4242) == expected
    assert procinfo.alive(4242) is (expected is not None and expected.state != "Z")
