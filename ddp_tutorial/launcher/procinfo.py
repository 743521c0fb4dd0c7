"""What Linux's /proc says about a process: the one place the kit (and its tests) asks.

A process can exit at any moment while it is asked about: between listing /proc and
opening its files, between ``open`` and ``read`` (the read then fails with ESRCH,
``ProcessLookupError``), or halfway through a listing. Each reader here answers None
(or leaves the process out) then, never raises: a process that is gone, a zombie's
empty files, a file not ours to read, torn or unparsable content all read as "gone".
An answer is a moment's truth; a pid can be reused once its process is reaped.

Standard library only, and nothing of the package: rank-side scripts may import it too.
Where there is no /proc (e.g. macOS), ``alive`` asks the kernel and the rest answer None.
"""

from __future__ import annotations

import ipaddress
import os
from typing import Dict, Iterable, List, NamedTuple, Optional, Tuple, Union

Pid = Union[int, str]  # an int, or "self"

#: Every error reading a process's files can raise while it exits or is not ours.
_GONE = (OSError, ValueError, IndexError, UnicodeError)


class Stat(NamedTuple):
    """The fields of /proc/<pid>/stat the kit reads."""

    state: str  # R running, S sleeping, D in the kernel, Z zombie (exited, not reaped), ... (never X: dead)
    ppid: int
    pgrp: int


def has_proc() -> bool:
    """Whether this machine has Linux's /proc."""
    return os.path.isdir("/proc/self")


def path(pid: Pid, name: str = "") -> str:
    """The path of /proc/<pid>/<name>: for what must name the file itself (a bind mount's source, a test
    that stages a read racing an exit), not read it."""
    return f"/proc/{pid}/{name}" if name else f"/proc/{pid}"


def mountinfo() -> List[List[str]]:
    """This process's mount table (/proc/self/mountinfo), one list of fields per mount; [] without /proc."""
    return [line.split() for line in (_read("self", "mountinfo") or b"").decode(errors="replace").splitlines()]


def _read(pid: Pid, name: str) -> Optional[bytes]:
    """The bytes of /proc/<pid>/<name>, or None if the process is gone or not ours."""
    try:
        with open(path(pid, name), "rb") as f:
            return f.read()
    except _GONE:
        return None


def _listdir(path: str) -> Optional[List[str]]:
    try:
        return os.listdir(path)
    except _GONE:
        return None


def pids() -> List[int]:
    """Every process's pid now ([] without /proc)."""
    return [int(entry) for entry in _listdir("/proc") or () if entry.isdigit()]


def stat(pid: Pid) -> Optional[Stat]:
    """State, parent and process group of ``pid``, or None if it is gone."""
    data = _read(pid, "stat")
    try:
        # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
        state, ppid, pgrp = data.rsplit(b")", 1)[1].split()[:3]
        found = Stat(state.decode("ascii"), int(ppid), int(pgrp))
    except (AttributeError, *_GONE):  # None (gone), or torn content
        return None
    # Being reaped at this moment: state X, or a read the reap tore. The kernel reads the state first,
    # then the parent and group under the process's signal lock; once the reap has released that,
    # they keep their defaults, 0 and -1 (a live process's group is never -1: at worst 0, outside
    # this PID namespace). So "Z 0 -1" is a zombie that was reaped during the read: gone.
    return None if found.state in ("X", "x") or found.pgrp == -1 else found


def state(pid: Pid) -> Optional[str]:
    """One letter (``"R"``, ``"S"``, ``"Z"`` for a zombie, ...), or None once it is reaped."""
    s = stat(pid)
    return s.state if s else None


def parent(pid: Pid) -> Optional[int]:
    s = stat(pid)
    return s.ppid if s else None


def group(pid: Pid) -> Optional[int]:
    """The process group of ``pid``."""
    s = stat(pid)
    return s.pgrp if s else None


def alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie, exited but not yet reaped, is not)."""
    if not has_proc():  # ask the kernel: a zombie then counts as alive
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    s = stat(pid)
    return s is not None and s.state != "Z"


def _strings(data: Optional[bytes]) -> Optional[List[str]]:
    """NUL-separated strings (empty ones dropped: the fork server pads with NULs), None if there are none."""
    words = [os.fsdecode(w) for w in data.split(b"\0") if w] if data else []
    return words or None


def cmdline(pid: Pid) -> Optional[List[str]]:
    """The argv of ``pid``; None if it is gone (a zombie's, or a kernel thread's, is empty: None too)."""
    return _strings(_read(pid, "cmdline"))


def environ_bytes(pid: Pid) -> Optional[bytes]:
    """/proc/<pid>/environ as it is: ``KEY=VALUE`` entries, each ended by a NUL (the fork server's
    rewritten area NUL-padded); None if it is gone, exiting (it reads empty then) or not ours."""
    return _read(pid, "environ") or None


def environ(pid: Pid) -> Optional[Dict[str, str]]:
    """The environment ``pid`` started with (or a forked rank's, as the fork server rewrote it); None if unreadable."""
    return _env_dict(environ_bytes(pid))


def _env_dict(data: Optional[bytes]) -> Optional[Dict[str, str]]:
    words = _strings(data)
    return None if words is None else dict(w.split("=", 1) for w in words if "=" in w)


def pids_with_env(name: str, value: str, prefix: bool = False) -> List[int]:
    """Live processes (not zombies), this one aside, whose variable ``name`` is ``value``
    (``prefix=True``: starts with ``value``). Finds descendants of any depth, and processes
    that left their group or session, as long as they kept the variable."""
    me, key, found = os.getpid(), os.fsencode(name) + b"=", []
    for pid in pids():
        data = environ_bytes(pid) if pid != me else None
        env = _env_dict(data) if data and key in data else None  # most processes: no dict built
        got = env.get(name) if env else None
        if got is not None and (got.startswith(value) if prefix else got == value) and alive(pid):
            found.append(pid)
    return found


def uid(pid: Pid) -> Optional[int]:
    """The real user id ``pid`` runs as."""
    for line in (_read(pid, "status") or b"").splitlines():
        if line.startswith(b"Uid:"):
            try:
                return int(line.split()[1])
            except _GONE:
                return None
    return None


def threads(pid: Pid) -> Optional[int]:
    """How many OS threads ``pid`` has."""
    tasks = _listdir(f"/proc/{pid}/task")
    return len(tasks) if tasks else None  # a live process has at least one


def fds(pid: Pid) -> Optional[List[int]]:
    """The open file descriptors of ``pid``, sorted (a zombie has none)."""
    entries = _listdir(f"/proc/{pid}/fd")
    try:
        return None if entries is None else sorted(int(fd) for fd in entries)
    except ValueError:
        return None


def fd_count(pid: Pid) -> Optional[int]:
    found = fds(pid)
    return None if found is None else len(found)


def fd_target(pid: Pid, fd: int) -> Optional[str]:
    """What descriptor ``fd`` of ``pid`` is: a path, ``"pipe:[N]"``, ``"socket:[N]"``; None if closed or gone."""
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except _GONE:
        return None


def memory_kb(pid: Pid) -> Optional[Dict[str, Optional[int]]]:
    """``{"rss": kB, "pss": kB or None, "address_space_peak": kB}``: resident memory of ``pid``, its
    proportional share (None where the kernel has no smaps_rollup), and the most address space it has
    mapped (VmPeak, what RLIMIT_AS bounds); None if it is gone."""
    def field(data: Optional[bytes], key: bytes) -> Optional[int]:
        for line in (data or b"").splitlines():
            if line.startswith(key):
                try:
                    return int(line.split()[1])
                except _GONE:
                    return None
        return None

    status = _read(pid, "status")
    rss = field(status, b"VmRSS:")
    return None if rss is None else {"rss": rss, "pss": field(_read(pid, "smaps_rollup"), b"Pss:"),
                                      "address_space_peak": field(status, b"VmPeak:")}


def proc_net_address(text: str) -> ipaddress._BaseAddress:
    """An address as /proc/net/tcp{,6} prints it: host-order 32-bit words in hex (IPv4-mapped IPv6 as IPv4)."""
    raw = bytes.fromhex(text)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(words)
    return getattr(address, "ipv4_mapped", None) or address


def listening_sockets(of: Iterable[int]) -> List[Tuple[ipaddress._BaseAddress, int, int]]:
    """(address, port, pid) of every listening TCP socket the processes ``of`` hold.

    Each process's socket inodes (its fds), matched against the LISTEN rows (state 0A)
    of /proc/net/tcp and /proc/net/tcp6. A process gone meanwhile holds none.
    """
    owner = {}
    for pid in of:
        for fd in fds(pid) or ():
            target = fd_target(pid, fd)
            if target and target.startswith("socket:["):
                owner[target[8:-1]] = pid
    found = []
    for table in ("tcp", "tcp6"):
        data = _read("net", table) or b""  # /proc/net is this process's network namespace
        for row in data.decode("ascii", "replace").splitlines()[1:]:
            fields = row.split()
            try:
                if fields[3] == "0A" and fields[9] in owner:
                    address, port = fields[1].split(":")
                    found.append((proc_net_address(address), int(port, 16), owner[fields[9]]))
            except _GONE:  # a torn row
                continue
    return found


def group_members(pgid: int) -> List[int]:
    """Processes of group ``pgid`` still running (not zombies), its leader aside; [] without /proc."""
    members = []
    for pid in pids():
        s = stat(pid) if pid != pgid else None
        if s is not None and s.pgrp == pgid and s.state != "Z":
            members.append(pid)
    return members


def ephemeral_port_range() -> Tuple[int, int]:
    """The range the OS picks outgoing connections' ports from, ``(low, high)`` inclusive (Linux's default
    where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", "rb") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except _GONE:
        return 32768, 60999
