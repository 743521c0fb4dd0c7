"""Run one check of one learner's file in a sandbox of its own, and bring back its result.

The grader (outside) starts::

    unshare --pid --fork --kill-child --mount --net --mount-proc -- python -m ddp_tutorial.teacher.grade.sandbox

and writes a JSON spec (the exercise, the file's bytes, the limits, the paths to hide) to
its stdin. This module, running as root and as pid 1 of the new PID namespace, then:

1. makes every mount it inherited read-only (its own copies: the grader's are untouched);
2. mounts a fresh, size-limited tmpfs on /tmp (the check's only writable place), and empty
   read-only tmpfs over the folders to hide (the submissions, the grades folder, ...);
3. brings up the loopback of its new network namespace (the only interface there is);
4. writes the file into /tmp/check/, owned by the sandbox's own uid;
5. starts ``python -m ddp_tutorial.teacher.grade.checkone`` as that uid, with no capabilities,
   ``no_new_privs`` and rlimits on memory, processes, file size and CPU time;
6. waits for it, then exits: the kernel kills whatever is left in the PID namespace
   (daemons, ``setsid()`` children, a fork loop).

The result comes back on a pipe (``result_fd``) only ``checkone`` holds; the ranks do not inherit it.
Standard library only: nothing here imports torch.
"""

from __future__ import annotations

import base64
import ctypes
import fcntl
import json
import os
import resource
import socket
import struct
import sys
from typing import List, Sequence


MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS = 38
#: The folder the check runs in, inside the sandbox's own /tmp.
CHECK_DIR = "/tmp/check"
#: Mounts left as they are: the sandbox's own /proc, and device nodes (/dev/null must stay writable).
KEEP_WRITABLE = ("/proc", "/dev")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]


def _mount(source, target: str, fstype, flags: int, data=None) -> None:
    def enc(s):
        return None if s is None else os.fsencode(s)
    if _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _fd_path(fd: int) -> str:
    """This process's descriptor ``fd`` as a path (Linux's /proc: the sandbox is Linux-only by purpose)."""
    return f"/proc/self/fd/{fd}"


def _mount_points() -> List[tuple]:
    """(mount point, its per-mount flags) of every mount this namespace has (Linux's mountinfo)."""
    points = []
    with open("/proc/self/mountinfo") as f:
        table = [line.split() for line in f]
    for fields in table:
        point = fields[4].encode().decode("unicode_escape")  # "\040" is a space
        options = fields[5].split(",")
        flags = ((MS_NOSUID if "nosuid" in options else 0) | (MS_NODEV if "nodev" in options else 0)
                 | (MS_NOEXEC if "noexec" in options else 0))
        points.append((point, flags))
    return points


def make_everything_read_only() -> None:
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we do here reaches the grader's mounts
    for point, flags in _mount_points():
        if any(point == keep or point.startswith(keep + "/") for keep in KEEP_WRITABLE):
            continue
        try:
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
        except OSError:
            if os.path.isdir(point) or os.path.isfile(point):
                raise  # a mount we can see but not protect: refuse to run the check
            # a mount point hidden under another mount: nothing can reach it


def hide(folder: str, keep: Sequence[str]) -> None:
    """An empty, read-only tmpfs over ``folder``, with only the paths in ``keep`` under it bound back, read-only.

    The teacher's home is hidden this way, although Python, the venv or the kit may live in it: those
    come back, nothing else does.
    """
    cover(folder, keep, "size=64k,mode=0755", read_only=True)


def cover(folder: str, keep: Sequence[str], options: str, read_only: bool) -> None:
    """A fresh tmpfs (mount ``options``) over ``folder``, with the paths in ``keep`` under it bound back, read-only.

    A path kept is opened before the tmpfs covers it, and bound from its fd. The check's own /tmp is
    made this way too: a kit or venv that lives under /tmp (a clone in a temporary folder) stays visible.
    """
    if not os.path.isdir(folder):
        return
    inside = [p for p in keep if p != folder and p.startswith(folder.rstrip("/") + "/") and os.path.exists(p)]
    fds = [os.open(p, os.O_PATH | os.O_CLOEXEC) for p in inside]
    _mount("tmpfs", folder, "tmpfs", MS_NOSUID | MS_NODEV, options)
    for path, fd in zip(inside, fds):
        if os.path.isdir(_fd_path(fd)):
            os.makedirs(path, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "a").close()
        _mount(_fd_path(fd), path, None, MS_BIND | MS_REC)
        _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
        os.close(fd)
    if read_only:
        _mount(None, folder, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, options)


def loopback_up() -> None:
    """``ip link set lo up`` by ioctl: a new network namespace's only interface starts down."""
    SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s, SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | IFF_UP))


def prepare(spec: dict) -> str:
    """Mounts, loopback, the check's folder and the file in it; returns the file's path."""
    make_everything_read_only()
    for folder in sorted(spec["hide"], key=len, reverse=True):  # the deepest first: an outer one covers it
        hide(folder, spec["keep"])
    cover("/tmp", spec["keep"], f"size={spec['tmp_bytes']},mode=1777", read_only=False)
    if os.path.isdir("/dev/shm"):
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['shm_bytes']},mode=1777")
    loopback_up()
    uid = spec["uid"]
    for folder in (CHECK_DIR, f"{CHECK_DIR}/home", f"{CHECK_DIR}/runs"):
        os.mkdir(folder, 0o700)
        os.chown(folder, uid, uid)
    path = f"{CHECK_DIR}/{spec['exercise']}.py"
    with open(path, "wb") as f:
        f.write(base64.b64decode(spec["source"]))
    os.chown(path, uid, uid)
    return path


def become_the_learner(spec: dict) -> None:
    """In the child, before exec: the sandbox uid, no capabilities, no new privileges, the limits."""
    limits = spec["limits"]
    for name, value in (("RLIMIT_AS", limits["memory_bytes"]), ("RLIMIT_NPROC", limits["processes"]),
                        ("RLIMIT_FSIZE", limits["file_bytes"]), ("RLIMIT_CPU", limits["cpu_seconds"]),
                        ("RLIMIT_CORE", 0), ("RLIMIT_NOFILE", 1024)):
        resource.setrlimit(getattr(resource, name), (value, value))  # as root: a hard limit may go up
    uid = spec["uid"]
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # from root to another uid: every capability goes
    _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # setuid programs cannot give them back
    os.setsid()


def main() -> int:
    spec = json.loads(sys.stdin.buffer.read(64 << 20))
    path = prepare(spec)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": f"{CHECK_DIR}/home", "LANG": "C.UTF-8",
           "TMPDIR": "/tmp", "MPLCONFIGDIR": f"{CHECK_DIR}/home", "PYTHONDONTWRITEBYTECODE": "1",
           "DDP_TUTORIAL_RUNS": f"{CHECK_DIR}/runs", "DDP_TUTORIAL_MY_WORK": CHECK_DIR,
           "PYTHONPATH": spec["pythonpath"]}
    result_fd = spec["result_fd"]
    cmd = [sys.executable, "-m", "ddp_tutorial.teacher.grade.checkone", spec["exercise"], path, str(spec["timeout"]),
           str(result_fd)]
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        try:
            os.chdir(CHECK_DIR)
            become_the_learner(spec)
            os.set_inheritable(result_fd, True)
            os.execve(cmd[0], cmd, env)
        except BaseException as exc:  # the check could not start: say why on the grader's log
            print(f"sandbox: cannot start the check: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        finally:
            os._exit(127)
    os.close(result_fd)  # only checkone writes the result
    while True:  # pid 1: reap every orphan until checkone is done
        try:
            done, status = os.wait()
        except ChildProcessError:
            return 0
        if done == pid:
            return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


if __name__ == "__main__":
    sys.exit(main())
