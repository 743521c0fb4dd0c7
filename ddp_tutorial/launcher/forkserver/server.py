"""The fork server: import torch once, then fork ranks that behave like fresh ``bootstrap.py`` ones.

``launch`` starts this file as ``python -u forkserver/server.py CONTROL_FD LAUNCHER_PID ROOM`` in a
session of its own, tied to the launcher with the parent-death signal. It imports torch
and ``torch._dynamo``, which DDP's constructor imports (and none of the learner's code),
checks that it is still single-threaded, says so on the
control socket (an ``AF_UNIX`` ``SOCK_SEQPACKET`` socket: one JSON message per packet, file
descriptors beside it with SCM_RIGHTS), and waits.

The protocol, launcher -> server:
    ``{"spawn": id, "argv": [...], "env": {...}, "cwd": ..., "umask": n, "store": bool,
    "ignored": [signal numbers the launcher ignores now]}``
        with the rank's output pipe (write end) and, if ``store``, rank 0's listening socket;
    ``{"reap": pid}``: the launcher has recorded that rank's exit; its pid may be reused now.
server -> launcher:
    ``{"ready": true, "pid", "threads", "argv_room", "env_room"}`` or ``{"ready": false, "why"}``;
    ``{"started": id, "pid": pid}`` or ``{"started": id, "error": why}``;
    ``{"exited": pid, "code": c}`` (Popen's convention: -N for a signal). The rank stays an
        unreaped zombie until ``reap``, so the launcher can sweep its process group while
        the group id is still that rank's, as it does for ranks it started itself.

The server exits when the launcher closes the socket or dies, or after ``IDLE_S`` without
ranks or requests. A forked rank calls ``os.setsid()``, ties itself to the server (which is
tied to the launcher), takes the pipe as stdout and stderr, the environment, working
directory, umask, ignored signals and ``sys.argv`` of ``python -u bootstrap.py SCRIPT ARGS``,
fresh random seeds, and then runs ``bootstrap.run_rank`` like a cold rank.
"""

import ctypes
import gc
import importlib.util
import json
import os
import select
import signal
import socket
import sys

#: Seconds without ranks or requests after which the server exits (it costs memory only).
IDLE_S = 300.0
#: The largest message: one rank's argv and environment.
MAX_MESSAGE = 1 << 20
RANK_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "rank")
BOOTSTRAP = os.path.join(RANK_DIR, "bootstrap.py")


def _load_bootstrap():
    """bootstrap.py under a private name: a learner's own ``bootstrap`` module must stay importable."""
    spec = importlib.util.spec_from_file_location("_ddp_tutorial_bootstrap", BOOTSTRAP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def proc_areas():
    """(arg_start, arg_end, env_start, env_end): where /proc/self/cmdline and environ are read from."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return tuple(int(v) for v in fields[45:49])  # fields 48-51 of proc(5); [0] is field 3


def _fill_area(start: int, end: int, strings) -> None:
    """Write NUL-terminated ``strings`` over the memory /proc shows, NUL-padded (the caller checked the room)."""
    data = b"".join(s + b"\0" for s in strings)
    room = end - start
    if len(data) > room:  # the launcher checks first; writing on would corrupt the stack
        raise ValueError(f"{len(data)} bytes do not fit the {room} bytes of /proc's area")
    ctypes.memmove(start, data + b"\0" * (room - len(data)), room)


def _replace_environment(env) -> None:
    """Make ``env`` this process's environment, in Python, in libc and in /proc/self/environ.

    Clearing first makes libc drop every pointer into the startup environment's
    memory (setenv copies what it is given), so that memory can then be rewritten
    to show the rank's environment, as ``ps e`` and orphan checks read it.
    """
    os.environ.clear()
    os.environ.update(env)
    _, _, env_start, env_end = proc_areas()
    _fill_area(env_start, env_end, [os.fsencode(k) + b"=" + os.fsencode(v) for k, v in env.items()])


def _reseed() -> None:
    """Fresh random state, as a new process gets: forked ranks must not share a sequence."""
    import random

    random.seed()  # from os.urandom, as at interpreter start
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()  # a non-deterministic seed, as torch gives a new process
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        np_random.seed()


def reapply_import_settings() -> None:
    """Read again what ``import torch`` read from the environment that may differ per launch.

    ``torch.distributed`` reads TORCH_DISTRIBUTED_DEBUG once, when it is imported (its
    ``set_debug_level_from_env()``); a forked rank has the server's reading until it reads
    its own environment (``warmstart.REAPPLIED_PER_RANK``).
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available():
        dist.set_debug_level_from_env()


#: Signals a fresh Python ignores at start whatever it inherited (and Popen's restore_signals resets).
PYTHON_IGNORES = {getattr(signal, name) for name in ("SIGPIPE", "SIGXFZ", "SIGXFSZ") if hasattr(signal, name)}
#: The dispositions a signal can have from start-up alone: what exec passes on, and Python's SIGINT.
STARTUP_DISPOSITIONS = (signal.SIG_IGN, signal.SIG_DFL, signal.default_int_handler)


def take_ignored_signals(ignored) -> None:
    """Ignore the signals the launcher ignores now, and only those, as exec would give a cold rank.

    exec keeps SIG_IGN and resets handlers, and Python then turns a default SIGINT into
    KeyboardInterrupt. The server's own dispositions are its launcher's when it started, perhaps
    long ago: a test runner in the background (nohup) ignores SIGINT until something (asyncio's
    remove_signal_handler, in a notebook run) installs Python's default handler again.
    Handlers something else installed (none, for torch's import) are left as they are.
    """
    ignored = set(ignored)
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP) or sig in PYTHON_IGNORES:
            continue
        try:
            current = signal.getsignal(sig)
        except ValueError:
            continue
        if current not in STARTUP_DISPOSITIONS:
            continue
        if sig in ignored:
            wanted = signal.SIG_IGN
        else:
            wanted = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
        if current is not wanted:
            try:
                signal.signal(sig, wanted)
            except (OSError, ValueError):  # e.g. the signals libc keeps for itself
                pass


def become_rank(bootstrap, server_pid: int, request, fds, close_fds) -> None:
    """In the forked child: turn into ``python -u bootstrap.py SCRIPT ARGS`` and run it; never returns."""
    try:
        os.setsid()  # its own process group, as start_new_session gives a cold rank
        bootstrap.die_with_parent(server_pid)
        for fd in close_fds:  # the server's: the control socket, other ranks' pipes, pidfds
            os.close(fd)
        os.dup2(fds[0], 1)
        os.dup2(fds[0], 2)
        os.close(fds[0])
        env = dict(request["env"])
        if request["store"]:
            env[bootstrap.envvars.STORE] = f"fd:{fds[1]}"
            os.set_inheritable(fds[1], True)  # as pass_fds leaves it for a cold rank
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        take_ignored_signals(request.get("ignored", ()))
        argv = request["argv"]  # [python, -u, bootstrap.py, SCRIPT, ARGS...]
        _replace_environment(env)
        arg_start, arg_end, _, _ = proc_areas()
        _fill_area(arg_start, arg_end, [os.fsencode(a) for a in argv])
        sys.argv = list(argv[2:])
        sys.orig_argv = list(argv)
        sys.path[0] = RANK_DIR  # as `python bootstrap.py` has it; run_script sets the script's
        _reseed()
        reapply_import_settings()
    except BaseException as exc:  # told on the rank's output, as a cold rank's startup error would be
        try:
            os.write(2, f"error: the fork server could not start this rank: {exc!r}\n".encode())
        finally:
            os._exit(1)
    bootstrap.run_rank()
    os._exit(1)  # run_rank exits itself


def run_child(body) -> None:
    """Run ``body`` in a forked child and exit; never returns into the server's code.

    Whatever ``body`` raises, before the rank's script runs or after (the bootstrap,
    the store, the exit path), ends as that rank's exit with status 1 and the
    traceback on its output (the pipe, once ``become_rank`` has made it fd 2), as a
    cold rank's startup error would. Unwinding further would run the server's request
    loop in the child: closing descriptors the child no longer has, and forking again.
    """
    code = 1
    try:
        body()
    except SystemExit as exc:  # sys.exit() in the bootstrap: its status, as Python gives it
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        try:
            import traceback

            report = "".join(traceback.format_exc())
            os.write(2, f"error: this rank failed outside its script (in the fork server's child)\n"
                        f"{report}".encode(errors="replace"))
        except BaseException:
            pass
    finally:
        os._exit(code)


class Server:
    def __init__(self, control: socket.socket, launcher_pid: int, bootstrap):
        self.control, self.launcher_pid, self.bootstrap = control, launcher_pid, bootstrap
        self.pid = os.getpid()
        self.pidfds = {}  # pidfd -> pid of a rank that has not exited yet
        self.zombies = {}  # pid -> its pidfd, exited and reported, until the launcher says reap
        self.poll = select.poll()
        self.poll.register(control.fileno(), select.POLLIN)

    def send(self, message) -> None:
        self.control.send(json.dumps(message).encode())

    def serve(self) -> None:
        while True:
            events = self.poll.poll(None if self.pidfds or self.zombies else int(IDLE_S * 1000))
            if not events:
                return  # idle: nothing runs and nobody asked
            for fd, _ in events:
                if fd == self.control.fileno():
                    if not self.handle_request():
                        return
                elif fd in self.pidfds:
                    self.report_exit(fd)

    def handle_request(self) -> bool:
        try:
            data, fds, _, _ = socket.recv_fds(self.control, MAX_MESSAGE, 2)
        except OSError:
            return False
        if not data:
            return False  # the launcher closed its end
        request = json.loads(data)
        if "spawn" in request:
            try:
                self.spawn(request, fds)
            finally:
                for fd in fds:
                    os.close(fd)
        elif "reap" in request:
            pidfd = self.zombies.pop(request["reap"], None)
            if pidfd is not None:
                os.waitpid(request["reap"], 0)
                os.close(pidfd)
        return True

    def spawn(self, request, fds) -> None:
        threads = os_threads()
        if threads != 1 or "torch.cuda" in sys.modules and sys.modules["torch"].cuda.is_initialized():
            # forking a threaded process can leave locks held in the child: refuse
            self.send({"started": request["spawn"], "error": f"the server has {threads} threads"})
            return
        close_fds = [self.control.fileno(), *self.pidfds, *self.zombies.values()]
        try:
            pid = os.fork()
        except OSError as exc:  # e.g. EAGAIN: out of processes
            self.send({"started": request["spawn"], "error": f"fork failed: {exc}"})
            return
        if pid == 0:  # the child: it leaves only through os._exit, never back into this loop
            run_child(lambda: become_rank(self.bootstrap, self.pid, request, fds, close_fds))
        pidfd = os.pidfd_open(pid)
        self.pidfds[pidfd] = pid
        self.poll.register(pidfd, select.POLLIN)
        self.send({"started": request["spawn"], "pid": pid})

    def report_exit(self, pidfd: int) -> None:
        pid = self.pidfds.pop(pidfd)
        self.poll.unregister(pidfd)
        # WNOWAIT: it stays a zombie, so its pid and group id stay its own until "reap".
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        code = -info.si_status if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else info.si_status
        self.zombies[pid] = pidfd
        self.send({"exited": pid, "code": code})

#: Imported by torch._dynamo; in torch 2.9 and older (not 2.13 or 2.15) it makes a temporary folder when
#: imported and appends it to sys.path (for RemoteModule's generated templates).
DYNAMO_PATH_CHANGER = "torch.distributed.nn.jit.instantiator"


def import_keeping_sys_path(module: str) -> list:
    """Import ``module``, then put ``sys.path`` back as it was: a warm rank starts with the
    ``sys.path`` a cold one has. Returns the entries the import added (and this took out)."""
    before = list(sys.path)
    importlib.import_module(module)
    added = [entry for entry in sys.path if entry not in before]
    sys.path[:] = before
    return added


def preimport_dynamo() -> list:
    """Import ``torch._dynamo`` (DDP's constructor imports it) without leaving a trace a cold rank lacks.

    On torch 2.9 and older the import changes sys.path: ``DYNAMO_PATH_CHANGER`` makes a temporary folder and
    appends it, and pkg_resources (imported on the way) appends the folder of an editable install.
    The entries are taken out, and the temporary folder removed now: left, every warm
    rank would inherit its clean-up at exit, and the server would leave it behind. The cost, there
    only: a warm rank cannot use ``torch.distributed.nn.RemoteModule`` (RPC, which the kit never
    uses); a cold rank can. Returns the sys.path entries taken out.
    """
    added = import_keeping_sys_path("torch._dynamo")
    template_dir = getattr(sys.modules.get(DYNAMO_PATH_CHANGER), "_TEMP_DIR", None)
    if added and hasattr(template_dir, "cleanup") and getattr(template_dir, "name", None) in added:
        template_dir.cleanup()
    return added


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    launcher_pid = int(sys.argv[2])
    bootstrap = _load_bootstrap()
    bootstrap.die_with_parent(launcher_pid)
    try:
        importlib.import_module("torch")  # the point of the server: ranks start with it imported
    except BaseException as exc:
        control.send(json.dumps({"ready": False, "why": f"import torch failed: {exc!r}"}).encode())
        return
    try:
        # DDP's constructor imports torch._dynamo: about 2 s of CPU per rank, paid by every
        # rank that wraps a model. Imported here once, a rank's DDP(model) takes milliseconds.
        # It starts no thread (checked below, with the rest). Not when the launcher says its
        # ranks build no DDP model: then the import would be the server's whole extra cost.
        if os.environ.get(bootstrap.envvars.FORK_SERVER_DYNAMO) != "0":
            preimport_dynamo()
    except Exception:  # ranks import it themselves, as cold ones do
        pass
    gc.freeze()  # what torch made stays shared with the ranks: the collector would touch (copy) it
    threads = os_threads()
    arg_start, arg_end, env_start, env_end = proc_areas()
    if threads != 1:
        message = {"ready": False, "why": f"the server has {threads} threads after import torch "
                                          "(a thread pool started, e.g. OpenBLAS without OMP_NUM_THREADS=1)"}
    elif not hasattr(os, "pidfd_open"):
        message = {"ready": False, "why": "no os.pidfd_open (Linux >= 5.3 and Python >= 3.9)"}
    else:
        message = {"ready": True, "pid": os.getpid(), "threads": threads,
                   "argv_room": arg_end - arg_start, "env_room": env_end - env_start}
    control.send(json.dumps(message).encode())
    if message["ready"]:
        Server(control, launcher_pid, bootstrap).serve()


if __name__ == "__main__":
    main()
