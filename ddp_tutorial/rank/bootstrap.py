"""Start one rank: tie its life to the launcher, then run the script as ``__main__``, on plain torch.

``launch`` runs ``python rank/bootstrap.py SCRIPT ARGS...`` (or ``-m MODULE ARGS...``)
for each rank, or forks it warm (``launcher/warm.py``, then ``run_warm`` here). The rank
holds the read end of a pipe that only the launching process can write to: when it reads
end-of-file the launcher is gone, however it ended (a killed notebook kernel too), and the
rank kills its process group, itself and what it started (``die_with_launcher``). That
works on every POSIX system, where Linux's parent-death signal does not.

Rank 0 also hosts the rendezvous store on loopback (``rank/store.py``). Nothing of torch is
changed: the script meets what it would meet under torchrun. Under ``launch`` a rank also
leaves notes in ``<run_dir>/.ranks/`` (``RankNotes``): when it failed, and its stacks.
"""

import atexit
import faulthandler
import io
import json
import os
import runpy
import signal
import sys
import threading
import time

from ddp_tutorial import envvars
from ddp_tutorial.rank.store import keep_store_until_peers_exit, prepare_store

def die_with_launcher() -> None:
    """Kill this rank's process group the moment the process that started it is gone.

    Under ``launch``: when the launcher's watch socket reads end-of-file (the launcher never
    writes). Started by another launcher (torchrun, which starts each rank in a session of its
    own): when the parent changes, looked at twice a second (no event announces it on every OS).
    """
    fd = os.environ.pop(envvars.LAUNCHER_FD, None)  # the script's children must not see it
    parent = os.getppid()
    if fd is not None:
        os.set_inheritable(int(fd), False)  # a program the script runs does not keep the rank's watch

    def watch() -> None:
        try:
            while fd is not None and os.read(int(fd), 1):
                pass
        except OSError:
            pass
        while fd is None and os.getppid() == parent:
            time.sleep(0.5)
        if os.getpgid(0) == os.getpid():  # it leads its group (launch and torchrun start it so)
            os.killpg(0, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="ddp_tutorial-launcher-watch", daemon=True).start()


class RankNotes:
    """This rank's notes for ``launch`` in ``<run_dir>/.ranks/`` (read back by ``runfolder``).

    ``failure-attempt<A>-rank<R>.json``: ``{"failed_at": time.monotonic(), "exit_code": ...}``,
    written the moment the script's exception reaches the bootstrap, before the slow report.
    CLOCK_MONOTONIC is one clock for the whole machine, so ``launch`` names the rank that
    failed *first* even when a later failure exits sooner.

    ``stacks-attempt<A>-rank<R>.txt``: every thread's Python stack, which ``faulthandler`` (in C,
    so even inside a collective) writes when ``launch`` asks at a deadline, or at SIGTERM. The file
    exists under its name only once the rank can answer; it is removed at exit if never written.
    """

    FOLDER = ".ranks"

    def __init__(self, run_dir: str, rank: int, attempt: int):
        folder = os.path.join(run_dir, self.FOLDER)
        os.makedirs(folder, exist_ok=True)
        self.failure_path = os.path.join(folder, f"failure-attempt{attempt}-rank{rank}.json")
        self.stacks_path = os.path.join(folder, f"stacks-attempt{attempt}-rank{rank}.txt")
        # faulthandler needs the file before the signal; it gets its name once the rank can answer.
        self._stacks = open(self.stacks_path + ".starting", "w")

    @classmethod
    def for_this_rank(cls) -> "RankNotes | None":
        """The notes of a rank started by ``launch`` (which sets the run folder), else None."""
        run_dir = os.environ.get(envvars.RUN_DIR)
        if not run_dir:
            return None
        try:
            return cls(run_dir, int(os.environ.get("RANK", 0)), envvars.restart_attempt())
        except (OSError, ValueError):  # notes help; a rank runs without them
            return None

    def write_stacks_when_asked(self) -> None:
        """Answer ``envvars.stacks_signal()`` by writing every thread's stack and carrying on;
        on SIGTERM write them, then die of SIGTERM (``chain``) as before.

        Before and after (``close``) the stacks signal is ignored, so asking never kills a rank.
        A process the script forks (a DataLoader worker) drops the handlers: only the rank writes.
        """
        asked = envvars.stacks_signal()
        signal.signal(asked, signal.SIG_IGN)  # what unregister puts back: a late request is ignored
        faulthandler.register(asked, file=self._stacks, all_threads=True, chain=False)
        faulthandler.register(signal.SIGTERM, file=self._stacks, all_threads=True, chain=True)
        os.register_at_fork(after_in_child=_drop_stack_handlers_in_child)
        try:  # from now on launch may ask: it asks only a rank whose file has this name
            os.replace(self.stacks_path + ".starting", self.stacks_path)
        except OSError:
            self.stacks_path += ".starting"

    #: Errors that say a peer went away first: this rank's failure is a consequence of another's.
    PEER_GONE = ("Connection closed by peer", "Connection reset by peer")

    def failed(self, failed_at: float, code: int, error: "BaseException | None" = None) -> None:
        """Record a failure at ``failed_at``; a SIGTERM from here on no longer cuts the report short.

        ``peer_gone`` marks an error that says a peer's connection closed: such a failure follows
        another's, even if noted first, and ``launch`` orders it after the others.
        """
        # launch stops the other ranks as soon as it sees one fail: this rank's traceback
        # is worth the grace period it gets before SIGKILL.
        faulthandler.unregister(signal.SIGTERM)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        record = {"failed_at": failed_at, "exit_code": code, "pid": os.getpid(),
                  "peer_gone": isinstance(error, Exception) and any(s in str(error) for s in self.PEER_GONE)}
        try:
            with open(self.failure_path + ".tmp", "w") as f:
                f.write(json.dumps(record))
            os.replace(self.failure_path + ".tmp", self.failure_path)
        except OSError:
            pass

    def close(self) -> None:
        """At exit: stop answering (a late ask is ignored), and drop the stacks file if nothing was written."""
        faulthandler.unregister(signal.SIGTERM)  # never write to a descriptor about to close
        faulthandler.unregister(envvars.stacks_signal())
        try:
            self._stacks.close()
            if os.path.getsize(self.stacks_path) == 0:
                os.remove(self.stacks_path)
        except OSError:
            pass


def _drop_stack_handlers_in_child() -> None:
    faulthandler.unregister(signal.SIGTERM)
    faulthandler.unregister(envvars.stacks_signal())
    signal.signal(envvars.stacks_signal(), signal.SIG_DFL)  # as any new process has it


def main() -> None:
    die_with_launcher()
    if len(sys.argv) < 2:
        sys.exit("usage: bootstrap.py SCRIPT [ARGS...] | -m MODULE [ARGS...]")
    run_rank()


def run_rank() -> None:
    """What every rank does once it exists, started cold or forked warm.

    Hosts or joins the store, runs the script (``sys.argv[1:]``) as ``__main__``,
    reports its exception as Python would, and exits skipping the interpreter's cleanup.
    """
    prepare_store()
    notes = RankNotes.for_this_rank()
    if notes:
        notes.write_stacks_when_asked()
    code = 0
    try:
        run_script()
    except BaseException as exc:
        failed_at = time.monotonic()
        code = exit_code(exc)
        if code and notes:  # first: the report below can take longer than a peer needs to fail and exit
            notes.failed(failed_at, code, exc)
        if not isinstance(exc, (SystemExit, KeyboardInterrupt)):  # those exit without a traceback
            tb = script_frames(exc.__traceback__) or exc.__traceback__
            sys.excepthook(type(exc), exc.with_traceback(tb), tb)  # the usual report, from the script on
    if notes:
        notes.close()
    exit_skipping_interpreter_cleanup(code)


def exit_skipping_interpreter_cleanup(code: int) -> None:
    """Exit with ``code`` after atexit handlers and flushed output, skipping the interpreter's cleanup.

    The script's own teardown (``destroy_process_group``) has run by then. The interpreter's
    cleanup would garbage-collect every object torch made, slowly, and destroying gloo's objects
    that late can abort the process ("terminate called without an active exception").
    ``train.py`` leaves this way too, so it exits cleanly under torchrun as well.
    """
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        if code == 0:
            keep_store_until_peers_exit()
        os._exit(code)


#: A module that runs the script for the rank (the exercises' harness) sets this global to True.
RUNS_THE_SCRIPT = "_ddp_tutorial_runs_the_script"


def script_frames(tb):
    """The traceback without this file's, runpy's and the frames of modules that set
    ``RUNS_THE_SCRIPT``: it starts in the script. None if every frame is theirs."""
    own = {os.path.abspath(f) for f in (__file__, runpy.__file__)}
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if (os.path.abspath(filename) not in own and not filename.startswith("<frozen runpy")
                and not tb.tb_frame.f_globals.get(RUNS_THE_SCRIPT)):
            return tb
        tb = tb.tb_next
    return None


def exit_code(exc: BaseException) -> int:
    """The exit status Python itself gives when the script raises ``exc`` (130 for Ctrl-C, as a shell says)."""
    if not isinstance(exc, SystemExit):
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def run_script(argv=None) -> None:
    """Run ``argv`` (``SCRIPT ARGS...`` or ``-m MODULE ARGS...``; by default this process's
    ``sys.argv[1:]``) as ``__main__``, with ``sys.argv`` and ``sys.path[0]`` as ``python`` sets them."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[0] == "-m":
        module = argv[1]
        sys.path[0] = os.getcwd()  # as `python -m module` would have it
        sys.argv = [module] + argv[2:]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(argv[0])
        sys.argv = [script] + argv[1:]
        sys.path[0] = os.path.dirname(script)  # as `python script.py` would have it
        runpy.run_path(script, run_name="__main__")


def run_warm(argv, env, sockets) -> None:
    """A warm rank (``launcher/warm.py``): forked by the forkserver with torch imported; made what a
    cold rank is, then run as one.

    Args:
        argv: ``SCRIPT ARGS...`` or ``-m MODULE ARGS...``. env: the rank's whole environment.
        sockets: this process's ends of its output ("out"), of the launcher's watch ("launcher"),
            and rank 0's store socket ("store") and peers socket ("peers"), else None.
    """
    os.setsid()  # a process group of its own, as a cold rank's start_new_session gives it
    out = sockets["out"].detach()
    for fd in (1, 2):
        os.dup2(out, fd)
    os.close(out)
    for name, fd in (("stdout", 1), ("stderr", 2)):  # unbuffered, as `python -u`
        setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                                            errors="backslashreplace", write_through=True))
    env = dict(env)
    env[envvars.LAUNCHER_FD] = str(sockets["launcher"].detach())
    if sockets["store"] is not None:
        env[envvars.STORE] = f"fd:{sockets['store'].detach()}"
    if sockets.get("peers") is not None:
        env[envvars.PEERS_FD] = str(sockets["peers"].detach())
    os.environ.clear()
    os.environ.update(env)
    import torch

    if env.get("OMP_NUM_THREADS", "").isdigit():  # torch read the forkserver's environment when imported
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    # A new process draws a fresh seed for torch's generator (Python's `random` reseeds itself after a
    # fork); a forked rank would share the forkserver's: per-rank random data must differ as it does cold.
    torch.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = [__file__, *argv]
    main()


if __name__ == "__main__":
    main()
elif __name__ == "__ddp_tutorial_warm__":  # runpy.run_path in the forkserver's child
    run_warm(*WARM_RANK)  # noqa: F821  (launcher/warm.py passes it in)
