"""Start one worker: tie its life to the launcher, then run the script as ``__main__``.

``launch`` runs ``python _bootstrap.py SCRIPT ARGS...`` (or ``-m MODULE ARGS...``)
for each rank. On Linux the worker asks the kernel to SIGKILL it when the
launcher dies, so even a killed notebook kernel leaves no orphan ranks.
This file imports nothing heavy: the script pays for its own imports.
"""

import os
import runpy
import signal
import sys


def die_with_launcher() -> None:
    launcher_pid = int(os.environ.get("DDP_TUTORIAL_LAUNCHER_PID", "0"))
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if launcher_pid and os.getppid() != launcher_pid:  # it died before prctl took effect
        os._exit(1)


def main() -> None:
    die_with_launcher()
    if len(sys.argv) < 2:
        sys.exit("usage: _bootstrap.py SCRIPT [ARGS...] | -m MODULE [ARGS...]")
    if sys.argv[1] == "-m":
        module = sys.argv[2]
        sys.path[0] = os.getcwd()  # as `python -m module` would have it
        sys.argv = [module] + sys.argv[3:]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(sys.argv[1])
        sys.argv = [script] + sys.argv[2:]
        sys.path[0] = os.path.dirname(script)  # as `python script.py` would have it
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
