"""Start one worker: tie its life to the launcher, then run the script as ``__main__``.

``launch`` runs ``python _bootstrap.py SCRIPT ARGS...`` (or ``-m MODULE ARGS...``)
for each rank. On Linux the worker asks the kernel to SIGKILL it when the
launcher dies, so even a killed notebook kernel leaves no orphan ranks.
This file imports nothing heavy: the script pays for its own imports. When the
script ends, the worker runs its atexit handlers, flushes stdout and stderr, and
exits at once (see ``main``): close your own files before the script ends.
"""

import atexit
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
    code = 0
    try:
        run_script()
    except SystemExit as exc:
        code = exit_code(exc)
    except KeyboardInterrupt:
        code = 130
    except BaseException:
        exc_type, exc, tb = sys.exc_info()
        tb = script_frames(tb) or tb
        sys.excepthook(exc_type, exc.with_traceback(tb), tb)  # the usual report, from the script on
        code = 1
    exit_without_teardown(code)


def exit_without_teardown(code: int) -> None:
    """Exit with ``code`` after atexit handlers and flushed output, skipping the interpreter's teardown.

    The teardown would garbage-collect every object torch made (0.3-0.5 s per
    rank), and destroying gloo's objects that late can abort the process
    ("terminate called without an active exception", seen with torch 2.13 after
    destroy_process_group had returned). ``train.py`` leaves this way too, so
    it exits cleanly under torchrun as well.
    """
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def script_frames(tb):
    """The traceback without this file's and runpy's frames: it starts in the script."""
    own = {os.path.abspath(__file__), os.path.abspath(runpy.__file__)}
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if os.path.abspath(filename) not in own and not filename.startswith("<frozen runpy"):
            return tb
        tb = tb.tb_next
    return None


def exit_code(exc: SystemExit) -> int:
    """The exit status Python itself would give for ``sys.exit(exc.code)``."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def run_script() -> None:
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
