"""One rank: ``python rank/bootstrap.py SCRIPT ARGS...`` (or ``-m MODULE``; warm: ``run_warm``).
Ties the rank's life to the launcher, then runs the script as ``__main__`` on plain torch: nothing
of torch is changed. Rank 0 also hosts the store (``rank/store.py``)."""

import atexit
import contextlib
import faulthandler
import io
import os
import runpy
import signal
import sys
import threading
import time

from ddp_tutorial import envvars, runfolder
from ddp_tutorial.rank.store import keep_store_until_peers_exit, prepare_store


def die_with_launcher() -> None:
    """Kill this rank's process group once the process that started it is gone, however it ended:
    under ``launch`` when the watch socket reads end-of-file (every POSIX system has that, where
    a parent-death signal is Linux's only); under torchrun when the parent changes."""
    fd = os.environ.pop(envvars.LAUNCHER_FD, None)  # the script's children must not see it
    parent = os.getppid()
    if fd is not None:
        os.set_inheritable(int(fd), False)  # a program the script runs does not keep the watch

    def watch() -> None:
        with contextlib.suppress(OSError):
            while fd is not None and os.read(int(fd), 1):
                pass
        while fd is None and os.getppid() == parent:
            time.sleep(0.5)  # no event announces a new parent on every OS
        if os.getpgid(0) == os.getpid():  # it leads its group (launch and torchrun start it so)
            os.killpg(0, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="ddp_tutorial-launcher-watch", daemon=True).start()


class RankNotes:
    """This rank's notes for ``launch`` (formats: ``runfolder``): when it failed, on the machine's
    one monotonic clock (so ``launch`` names the rank that failed *first*), and every thread's
    stack, written by ``faulthandler`` (in C: even inside a collective) when asked or at SIGTERM."""

    #: Errors that say a peer went away first: this rank's failure is a consequence of another's.
    PEER_GONE = ("Connection closed by peer", "Connection reset by peer")

    def __init__(self, run_dir: str, rank: int, attempt: int):
        self.run_dir, self.rank, self.attempt = run_dir, rank, attempt
        path = runfolder.stacks_file(run_dir, attempt, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._stacks = open(f"{path}.starting", "w")  # faulthandler needs it before the signal
        asked = envvars.stacks_signal()
        signal.signal(asked, signal.SIG_IGN)  # what unregister puts back: asking never kills a rank
        faulthandler.register(asked, file=self._stacks, all_threads=True, chain=False)
        faulthandler.register(signal.SIGTERM, file=self._stacks, all_threads=True, chain=True)
        # A process the script forks (a DataLoader worker) does not answer: only the rank writes.
        os.register_at_fork(after_in_child=lambda: _stop_answering(signal.SIG_DFL))
        os.replace(self._stacks.name, path)  # launch asks only a rank whose file has this name
        self._stacks_path = path

    def failed(self, failed_at: float, code: int, error: BaseException) -> None:
        """Note a failure (``peer_gone``: ``error`` says a peer's connection closed); from now on
        SIGTERM does not cut the traceback's report short."""
        faulthandler.unregister(signal.SIGTERM)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        peer_gone = isinstance(error, Exception) and any(s in str(error) for s in self.PEER_GONE)
        with contextlib.suppress(OSError):
            runfolder.note_failure(self.run_dir, self.attempt, self.rank, {"failed_at": failed_at,
                                   "exit_code": code, "pid": os.getpid(), "peer_gone": peer_gone})

    def close(self) -> None:
        """At exit: stop answering, and drop the stacks file if nothing was written."""
        _stop_answering(signal.SIG_IGN)
        self._stacks.close()
        with contextlib.suppress(OSError):
            if self._stacks_path.stat().st_size == 0:
                self._stacks_path.unlink()


def _stop_answering(stacks_signal_handler) -> None:
    faulthandler.unregister(signal.SIGTERM)  # never write to a descriptor about to close
    faulthandler.unregister(envvars.stacks_signal())
    signal.signal(envvars.stacks_signal(), stacks_signal_handler)


def run_rank() -> None:
    """Host or join the store, run the script (``sys.argv[1:]``) as ``__main__``, report its
    exception as Python would, and exit skipping the interpreter's cleanup."""
    prepare_store()
    run_dir = os.environ.get(envvars.RUN_DIR)
    try:  # notes help; a rank runs without them
        rank = int(os.environ.get("RANK", 0))
        notes = RankNotes(run_dir, rank, envvars.restart_attempt()) if run_dir else None
    except (OSError, ValueError):
        notes = None
    code = 0
    try:
        run_script(sys.argv[1:])
    except BaseException as exc:
        failed_at = time.monotonic()
        code = exit_code(exc)
        if code and notes:  # first: the report below can take longer than a peer needs to fail
            notes.failed(failed_at, code, exc)
        if not isinstance(exc, (SystemExit, KeyboardInterrupt)):  # those exit without a traceback
            tb = script_frames(exc.__traceback__) or exc.__traceback__
            sys.excepthook(type(exc), exc.with_traceback(tb), tb)  # the usual, from the script on
    if notes:
        notes.close()
    exit_skipping_interpreter_cleanup(code)


def exit_skipping_interpreter_cleanup(code: int) -> None:
    """Exit with ``code`` after atexit handlers and flushed output, skipping the interpreter's
    cleanup: it garbage-collects every object torch made, slowly, and can abort destroying gloo's
    ("terminate called without an active exception"). train.py ends so under torchrun too."""
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        if code == 0:
            keep_store_until_peers_exit()
        os._exit(code)


#: A module that runs the script for the rank (the exercises' harness) sets this global to True.
RUNS_THE_SCRIPT = "_ddp_tutorial_runs_the_script"


def script_frames(tb):
    """The traceback from the script's first frame on (past this file, runpy and modules that
    set ``RUNS_THE_SCRIPT``); None if every frame is theirs."""
    own = {os.path.abspath(f) for f in (__file__, runpy.__file__)}
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if (os.path.abspath(filename) not in own and not filename.startswith("<frozen runpy")
                and not tb.tb_frame.f_globals.get(RUNS_THE_SCRIPT)):
            return tb
        tb = tb.tb_next
    return None


def exit_code(exc: BaseException) -> int:
    """The exit status Python itself gives when the script raises ``exc`` (130 for Ctrl-C)."""
    if not isinstance(exc, SystemExit):
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def run_script(argv) -> None:
    """Run ``argv`` as ``__main__``; ``sys.argv`` and ``sys.path[0]`` as ``python`` sets them."""
    if argv[0] == "-m":
        sys.path[0] = os.getcwd()
        sys.argv = [argv[1]] + argv[2:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(argv[0])
        sys.argv = [script] + argv[1:]
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")


def run_warm(argv, env, sockets) -> None:
    """A warm rank, forked with torch imported, made what a cold rank is (its own session, output on
    ``sockets["out"]``, environment ``env``), then run as one."""
    os.setsid()  # a process group of its own, as a cold rank's start_new_session gives it
    out = sockets["out"].detach()
    for fd in (1, 2):
        os.dup2(out, fd)
    os.close(out)
    for name, fd in (("stdout", 1), ("stderr", 2)):  # unbuffered, as `python -u`
        setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                                            errors="backslashreplace", write_through=True))
    env = {**env, envvars.LAUNCHER_FD: str(sockets["launcher"].detach())}
    if sockets["store"] is not None:
        env[envvars.STORE] = f"fd:{sockets['store'].detach()}"
    if sockets["peers"] is not None:
        env[envvars.PEERS_FD] = str(sockets["peers"].detach())
    os.environ.clear()
    os.environ.update(env)
    import torch

    if env.get("OMP_NUM_THREADS", "").isdigit():  # torch read the forkserver's when imported
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    # A new process draws a fresh seed (Python's `random` reseeds after a fork; torch does not).
    torch.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = [__file__, *argv]
    die_with_launcher()
    run_rank()


if __name__ == "__main__":
    die_with_launcher()
    if len(sys.argv) < 2:
        sys.exit("usage: bootstrap.py SCRIPT [ARGS...] | -m MODULE [ARGS...]")
    run_rank()
elif __name__ == "__ddp_tutorial_warm__":  # runpy.run_path in the forkserver's child
    run_warm(*WARM_RANK)  # noqa: F821  (launcher/warm.py passes it in)
