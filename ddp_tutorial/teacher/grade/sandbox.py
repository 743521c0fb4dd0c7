"""The command that checks one learner's file in a sandbox of its own: ``bwrap`` (as root) gives it
its own PID, mount, network and IPC namespaces (all read-only, hidden folders under empty tmpfs, a
fresh /tmp and /dev/shm), ``prlimit`` the limits, ``setpriv`` a uid without capabilities. When
``checkone`` ends, bwrap (pid 1 there) exits and the kernel kills the rest."""

from __future__ import annotations

import shutil
import sys
from pathlib import PurePath
from typing import Dict, List, Optional, Sequence

#: The folder the check runs in, inside the sandbox's own /tmp.
CHECK_DIR = "/tmp/check"
#: The programs the sandbox is built from, and where each comes from.
PROGRAMS = {"bwrap": "Debian's bubblewrap: apt-get install bubblewrap", "prlimit": "util-linux",
            "setpriv": "util-linux"}


def missing() -> Optional[str]:
    """One line naming the first program the sandbox needs that is not installed, or None."""
    return next((f"the grader's sandbox needs {program} ({package}), which is not installed"
                 for program, package in PROGRAMS.items() if shutil.which(program) is None), None)


def _under(path: str, folder: str) -> bool:
    return path != folder and PurePath(path).is_relative_to(folder)


def _mounts(hide: Sequence[str], keep: Sequence[str], tmp_bytes: int, shm_bytes: int) -> List[str]:
    """bwrap's mount options: each tmpfs, then the folders (0755) and paths bound back into it."""
    covered = [*hide, "/tmp", "/dev/shm"]
    ops = {c: ["--size", str(64 << 10), "--tmpfs", c] for c in hide}
    ops["/tmp"] = ["--perms", "1777", "--size", str(tmp_bytes), "--tmpfs", "/tmp"]
    ops["/dev/shm"] = ["--perms", "1777", "--size", str(shm_bytes), "--tmpfs", "/dev/shm"]
    for path in keep:
        inside = [c for c in covered if _under(path, c)]
        if path in covered or not inside or any(_under(path, k) for k in keep):
            continue  # not hidden, or inside another path bound back whole
        ops[path] = ["--ro-bind", path, path]
        # the folders between: bwrap would make them 0700, closed to the sandbox's uid
        for parent in map(str, PurePath(path).parents):
            if parent in covered or not any(_under(parent, c) for c in inside):
                break
            ops.setdefault(parent, ["--perms", "0755", "--dir", parent])
    options = ["--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]
    for path in sorted(ops, key=lambda p: len(PurePath(p).parts)):  # a folder, then what is in it
        options += ops[path]
    for folder in hide:  # last: the binds need their mount points made in it
        options += ["--remount-ro", folder]
    return options


def command(exercise: str, timeout: float, uid: int, result_fd: int, limits: Dict[str, int],
            hide: Sequence[str], keep: Sequence[str]) -> List[str]:
    """The argv that runs ``checkone`` in a fresh sandbox (the file's bytes on its stdin), with
    ``limits`` as in ``Limits``."""
    return [shutil.which("bwrap"), "--die-with-parent", "--new-session", "--unshare-pid",
            "--unshare-net", "--unshare-ipc",
            *_mounts(hide, keep, limits["tmp_bytes"], limits["shm_bytes"]), "--chdir", "/tmp",
            shutil.which("prlimit"), f"--as={limits['memory_bytes']}",
            f"--nproc={limits['processes']}", f"--fsize={limits['file_bytes']}",
            f"--cpu={limits['cpu_seconds']}", "--core=0", "--nofile=1024", "--",
            shutil.which("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--",
            sys.executable, "-m", "ddp_tutorial.teacher.grade.checkone", exercise, str(timeout),
            str(result_fd)]
