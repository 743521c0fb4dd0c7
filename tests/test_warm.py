"""Warm launches: ranks forked from the fork server behave like cold ones, and the server never
makes a launch fail (it dies, it refuses, it is turned off: the launch starts cold)."""

import fcntl
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

import pytest

import ddp_tutorial
from ddp_tutorial import envvars, launch, launcher
from ddp_tutorial.launcher import procinfo, warmstart
from conftest import pid_alive, processes_of_run
from test_launcher import LAUNCH_IN_CHILD, SCRIPTS, _is_rank, wait_for

PRINT_LINES = str(SCRIPTS / "print_lines.py")
FRESH_STATE = '''
import json, os, random, sys
import numpy, torch
print(json.dumps({"random": random.random(), "numpy": float(numpy.random.rand()),
                  "torch": torch.rand(1).item(), "torch_seed": torch.initial_seed()}), flush=True)
'''
PROBE = '''
import json, os, sys
import torch  # as a DDP script does: rank 0 hosts the store from here on, in both
from ddp_tutorial.launcher import procinfo
me = os.getpid()
umask = os.umask(0); os.umask(umask)
fds = procinfo.fds(me)
print(json.dumps({
    "name": __name__, "file": __file__, "argv": sys.argv, "orig_argv": sys.orig_argv,
    "path0": sys.path[0], "path": sys.path[1:], "cwd": os.getcwd(), "umask": umask, "env": dict(os.environ),
    "proc_environ": [os.fsdecode(s) for s in procinfo.environ_bytes(me).split(b"\\0") if s],
    "cmdline": procinfo.cmdline(me),
    "fds": fds, "threads": procinfo.threads(me), "pgid_is_pid": os.getpgid(0) == os.getpid(),
    "sid_is_pid": os.getsid(0) == os.getpid(), "unbuffered": sys.stdout.write_through,
    "stdin": procinfo.fd_target(me, 0), "stdout_is_pipe": procinfo.fd_target(me, 1).startswith("pipe:"),
    "same_out": procinfo.fd_target(me, 1) == procinfo.fd_target(me, 2),
    "sigint": str(__import__("signal").getsignal(2)), "sigpipe": str(__import__("signal").getsignal(13)),
}), flush=True)
'''


@pytest.fixture
def script_file(tmp_path):
    def write(text: str, name: str = "script.py") -> str:
        path = tmp_path / "scripts" / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        return str(path)
    return write


def reported(run, rank: int = 0):
    return json.loads(run.output[rank][-1])


def test_ranks_start_warm_by_default_and_the_claim_file_says_so():
    run = launch(PRINT_LINES, 2, echo="none")
    assert run.start_mode == "warm" and run.cold_reason is None
    claim = json.loads((run.run_dir / ".launch.json").read_text())
    assert claim["start_mode"] == "warm" and claim["start_modes"] == {"0": "warm"}
    assert ddp_tutorial.Run(run.run_dir).start_mode == "warm"
    assert sorted(p.name for p in run.run_dir.iterdir()) == [".launch.json"]  # no rank file format changed
    assert run.output[1] == [f"line {i} of rank 1" for i in range(3)]


def test_a_warm_rank_looks_like_a_cold_one(script_file, tmp_path, monkeypatch):
    script = script_file(PROBE)
    monkeypatch.chdir(tmp_path)
    cold = launch(script, 2, ["--flag", "x y"], echo="none", warm=False)
    warm = launch(script, 2, ["--flag", "x y"], echo="none")
    assert (cold.start_mode, warm.start_mode) == ("cold", "warm")
    for rank in (0, 1):
        c, w = reported(cold, rank), reported(warm, rank)
        # /proc shows the rank's own environment (orphan checks and `ps e` read it there)
        for r in (c, w):
            shown = {e for e in r["proc_environ"] if not e.startswith("DDP_TUTORIAL_STORE=")}
            assert shown == {f"{k}={v}" for k, v in r["env"].items()}
        stores = [[e.split("=")[1][:3] for e in r["proc_environ"] if e.startswith("DDP_TUTORIAL_STORE=")]
                  for r in (c, w)]
        assert stores[0] == stores[1] == [["fd:", "joi"][rank]]
        for run_specific in ("DDP_TUTORIAL_RUN_DIR", "MASTER_PORT"):
            assert c["env"].pop(run_specific) != w["env"].pop(run_specific)
        if rank == 0:  # the store's listening socket: passed at a descriptor number of its own
            assert c["env"].pop("DDP_TUTORIAL_STORE", None) is None is w["env"].pop("DDP_TUTORIAL_STORE", None)
        for key in ("env", "name", "file", "argv", "orig_argv", "path0", "path", "cwd", "umask",
                    "threads", "pgid_is_pid", "sid_is_pid", "unbuffered", "stdin", "stdout_is_pipe",
                    "same_out", "sigint", "sigpipe"):
            assert w[key] == c[key], key
        assert w["argv"] == [script, "--flag", "x y"] and w["cwd"] == str(tmp_path)
        assert w["cmdline"][:3] == [sys.executable, "-u", launcher.BOOTSTRAP] and w["cmdline"][3:] == w["argv"]
        assert w["cmdline"] == c["cmdline"]
        assert len(w["fds"]) == len(c["fds"]), (w["fds"], c["fds"])  # 0, 1, 2 and rank 0's store


SIGNALS = '''
import json, signal
print(json.dumps({name: str(signal.getsignal(getattr(signal, name))) for name in ("SIGINT", "SIGHUP", "SIGPIPE")}),
      flush=True)
'''


# A test runner in the background (nohup) ignores SIGINT and SIGHUP; running a notebook
# (asyncio's remove_signal_handler) gives it Python's SIGINT handler back, after its fork
# server started: a warm rank must still get what a cold rank started now gets.
@pytest.mark.parametrize("at_server_start, at_launch", [
    (signal.SIG_IGN, signal.default_int_handler), (signal.default_int_handler, signal.SIG_IGN)],
    ids=["ignored-then-handled", "handled-then-ignored"])
def test_a_warm_rank_ignores_the_signals_the_launcher_ignores_at_launch(script_file, at_server_start, at_launch):
    script = script_file(SIGNALS)
    hup = {signal.SIG_IGN: signal.SIG_IGN, signal.default_int_handler: signal.SIG_DFL}
    previous = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGHUP)
    try:
        signal.signal(signal.SIGINT, at_server_start)
        signal.signal(signal.SIGHUP, hup[at_server_start])
        warmstart._stop_server()
        warmstart._SERVER = None
        assert launcher.fork_server_ready()  # the server starts with the first dispositions
        signal.signal(signal.SIGINT, at_launch)
        signal.signal(signal.SIGHUP, hup[at_launch])
        cold = launch(script, 1, echo="none", warm=False)
        warm = launch(script, 1, echo="none")
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGHUP, previous[1])
        warmstart._stop_server()  # the next test gets a server started as usual
        warmstart._SERVER = None
    assert warm.start_mode == "warm"
    assert reported(warm) == reported(cold)
    ignored = at_launch is signal.SIG_IGN
    assert reported(cold)["SIGINT"] == str(signal.SIG_IGN if ignored else signal.default_int_handler)
    assert reported(cold)["SIGHUP"] == str(signal.SIG_IGN if ignored else signal.SIG_DFL)
    assert reported(cold)["SIGPIPE"] == str(signal.SIG_IGN)  # Python's own, whatever it inherits


def test_the_server_is_single_threaded_and_lives_in_its_own_session():
    launch(PRINT_LINES, 1, echo="none")
    server = warmstart.server_pid()
    assert server is not None
    assert procinfo.threads(server) == 1
    assert os.getsid(server) == server != os.getsid(0)


def test_an_edited_script_is_picked_up_by_the_next_warm_launch(script_file):
    script = script_file("print('version 1')\n")
    first = launch(script, 2, echo="none")
    Path(script).write_text("print('version 2')\n")
    second = launch(script, 2, echo="none")
    assert first.start_mode == second.start_mode == "warm"
    assert first.output == {0: ["version 1"], 1: ["version 1"]}
    assert second.output == {0: ["version 2"], 1: ["version 2"]}


def test_random_state_differs_across_ranks_and_warm_launches(script_file):
    script = script_file(FRESH_STATE)
    runs = [launch(script, 2, echo="none") for _ in range(2)]
    assert all(run.start_mode == "warm" for run in runs)
    states = [reported(run, rank) for run in runs for rank in (0, 1)]
    for generator in ("random", "numpy", "torch", "torch_seed"):
        assert len({s[generator] for s in states}) == 4, (generator, states)


def test_the_server_killed_between_two_launches_costs_the_next_one_nothing():
    first = launch(PRINT_LINES, 2, echo="none")
    server = warmstart.server_pid()
    os.kill(server, signal.SIGKILL)
    wait_for(lambda: not pid_alive(server), 5, "the server to die")
    second = launch(PRINT_LINES, 2, echo="none")
    assert first.start_mode == "warm" and second.exit_codes == {0: 0, 1: 0}
    assert second.output[1] == [f"line {i} of rank 1" for i in range(3)]
    assert second.start_mode == "warm" and warmstart.server_pid() not in (None, server)


def test_a_server_that_dies_while_starting_ranks_means_a_cold_launch(monkeypatch):
    launch(PRINT_LINES, 1, echo="none")  # a server, ready
    real_spawn = warmstart.ForkServer.spawn

    def spawn_then_die(self, *args, **kwargs):
        rank = real_spawn(self, *args, **kwargs)
        os.kill(self.pid, signal.SIGKILL)  # after the first rank: the others cannot be forked
        return rank

    monkeypatch.setattr(warmstart.ForkServer, "spawn", spawn_then_die)
    run = launch(PRINT_LINES, 3, echo="none", timeout=60)
    assert run.start_mode == "cold" and "fork server" in run.cold_reason
    assert run.exit_codes == {0: 0, 1: 0, 2: 0}
    assert not processes_of_run(run.run_dir)


def queued_bytes(sock) -> int:
    """Bytes of every packet waiting on ``sock`` (SIOCINQ sums the whole queue of a SEQPACKET socket)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


def test_a_rank_that_exits_before_the_launcher_reads_its_start_fails_the_launch_at_once(script_file, monkeypatch):
    """A rank that fails at once (rank 0 on a taken port) can exit before the launcher reads the server's
    "started": both that and "exited" then come in one read, before the launcher knows the pid as a rank's.
    Made certain here: after sending the spawn, the launcher reads nothing until both are queued."""
    script = script_file("import sys\nsys.exit(3)\n", "exit_at_once.py")
    launch(PRINT_LINES, 1, echo="none")  # a server, ready
    real_send = warmstart.ForkServer.send
    held = []

    def send_then_read_nothing_until_the_exit_is_queued(self, message, fds=()):
        real_send(self, message, fds)
        if "spawn" not in message:
            return
        select.select([self.sock], [], [], 10)  # the server's "started"
        started = self.sock.recv(warmstart.MAX_MESSAGE, socket.MSG_PEEK)
        pidfd = os.pidfd_open(json.loads(started)["pid"])
        try:
            held.append(bool(select.select([pidfd], [], [], 10)[0]))  # the rank has exited
        finally:
            os.close(pidfd)
        wait_for(lambda: queued_bytes(self.sock) > len(started), 10, 'the server\'s "exited" behind its "started"')

    monkeypatch.setattr(warmstart.ForkServer, "send", send_then_read_nothing_until_the_exit_is_queued)
    t0 = time.monotonic()
    with pytest.raises(launcher.WorkerError) as info:
        launch(script, 1, echo="none", timeout=10)
    assert held == [True] and info.value.run.start_mode == "warm"
    assert (info.value.rank, info.value.exit_code) == (0, 3)
    assert time.monotonic() - t0 < 5  # its exit was seen, not its deadline (10 s)


def test_warm_false_and_the_environment_variable_give_cold_launches(monkeypatch):
    assert launch(PRINT_LINES, 1, echo="none", warm=False).start_mode == "cold"
    monkeypatch.setenv("DDP_TUTORIAL_WARM", "0")
    run = launch(PRINT_LINES, 1, echo="none")
    assert run.start_mode == "cold" and "turned off" in run.cold_reason
    assert json.loads((run.run_dir / ".launch.json").read_text())["start_mode"] == "cold"
    with pytest.raises(ddp_tutorial.LaunchConfigError, match="warm must be"):
        launch(PRINT_LINES, 1, warm="yes")


def test_a_nccl_launch_starts_cold(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # faked, as the launcher tests do
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    run = launch(PRINT_LINES, 2, backend="nccl", echo="none")  # the script needs no GPU
    assert run.start_mode == "cold" and "nccl" in run.cold_reason
    assert run.exit_codes == {0: 0, 1: 0}


def test_a_server_that_would_fork_with_threads_refuses_and_the_launch_starts_cold():
    # Two OpenBLAS threads start when torch imports numpy: no safe fork.
    run = launch(PRINT_LINES, 1, echo="none", env={"OMP_NUM_THREADS": "2"})
    assert run.start_mode == "cold" and "threads" in run.cold_reason
    assert run.exit_codes == {0: 0}
    assert launch(PRINT_LINES, 1, echo="none").start_mode == "warm"  # the usual environment: warm again


def test_the_server_and_its_ranks_die_with_a_killed_launcher(runs_root):
    run_dir = runs_root / "killed-warm"
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH_IN_CHILD, str(SCRIPTS / "sleep_forever.py"),
                             str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        def two_ranks():
            ranks = [p for p in processes_of_run(run_dir) if _is_rank(p)]
            return ranks if len(ranks) == 2 else None

        ranks = wait_for(two_ranks, 60, "2 ranks")
        wait_for(lambda: len(processes_of_run(run_dir)) == 4, 10, "2 ranks and 2 grandchildren")
        servers = {procinfo.parent(p) for p in ranks}
        assert len(servers) == 1  # both forked by one server, the launcher's child
        server = servers.pop()
        assert procinfo.parent(server) == proc.pid and warmstart.SERVER_SCRIPT in (procinfo.cmdline(server) or ())
    finally:
        proc.kill()  # SIGKILL: no Python cleanup runs in the launcher
        proc.wait()
    wait_for(lambda: not pid_alive(server), 5, "the fork server to die")
    wait_for(lambda: not any(pid_alive(p) for p in ranks), 5, "the ranks to die")
    wait_for(lambda: not processes_of_run(run_dir), 5, "what the ranks started to die")


def test_the_server_has_what_ddp_imports_so_a_warm_rank_builds_ddp_without_importing(script_file):
    # DDP's constructor imports torch._dynamo (about 1.2 s of CPU per cold rank).
    script = script_file("import sys\nprint('torch._dynamo' in sys.modules, flush=True)\n")
    warm = launch(script, 1, echo="none")
    cold = launch(script, 1, echo="none", warm=False)
    assert (warm.start_mode, warm.output[0]) == ("warm", ["True"])  # on every torch: see the next test
    assert (cold.start_mode, cold.output[0]) == ("cold", ["False"])
    assert procinfo.threads(warmstart.server_pid()) == 1


DDP_THEN_DYNAMO = """import sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
before = 'torch._dynamo' in sys.modules
dist.init_process_group('gloo')
model = DistributedDataParallel(torch.nn.Linear(2, 1))
model(torch.ones(1, 2)).sum().backward()
print(before, 'torch._dynamo' in sys.modules, model.module.weight.grad.tolist(), flush=True)
dist.destroy_process_group()
"""


def test_a_server_told_its_ranks_build_no_ddp_skips_dynamo_and_a_rank_that_builds_one_still_does(script_file):
    lean_env = {envvars.FORK_SERVER_DYNAMO: "0"}
    default = launch(script_file(DDP_THEN_DYNAMO), 2, echo="none", timeout=60)
    server = warmstart.server_pid()
    lean = launch(script_file(DDP_THEN_DYNAMO), 2, echo="none", env=lean_env, timeout=60)
    assert (default.start_mode, lean.start_mode) == ("warm", "warm"), lean.cold_reason
    assert warmstart.server_pid() != server  # a server of its own: what it imported is a startup setting
    assert default.output[0][-1].startswith("True True")  # preimported by the server
    assert lean.output[0][-1].startswith("False True")  # not preimported; DDP's constructor imported it
    assert lean.output[0][-1] == default.output[0][-1].replace("True", "False", 1)  # the same gradient
    again = launch(script_file(DDP_THEN_DYNAMO), 2, echo="none", env=lean_env, timeout=60)
    assert again.start_mode == "warm" and again.output[0][-1] == lean.output[0][-1]  # the lean one serves on
    assert procinfo.threads(warmstart.server_pid()) == 1


KERNEL_CODE = '''
import json, os, ddp_tutorial
from ddp_tutorial import warmstart
at_import = warmstart.server_pid()
run = ddp_tutorial.launch(ddp_tutorial.scripts_path("hello.py"), 2, echo="none")
print(json.dumps({"at_import": at_import, "mode": run.start_mode, "after": warmstart.server_pid()}))
'''


def run_in_kernel(code: str, env: dict) -> dict:
    """Run ``code`` in a new Jupyter kernel (as a notebook cell) and return the JSON it printed."""
    from jupyter_client.manager import start_new_kernel

    messages = []
    km, kc = start_new_kernel(kernel_name="python3", env={**os.environ, **env})
    try:
        reply = kc.execute_interactive(code, timeout=120, output_hook=messages.append)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert reply["content"]["status"] == "ok", [m["content"] for m in messages]
    [line] = [m["content"]["text"] for m in messages if m["msg_type"] == "stream"]
    return json.loads(line)


def test_importing_the_package_in_a_kernel_starts_the_server_for_the_first_launch():
    got = run_in_kernel(KERNEL_CODE, {})
    assert got["at_import"] is not None and got["mode"] == "warm" and got["after"] == got["at_import"]
    off = run_in_kernel(KERNEL_CODE, {envvars.WARM: "0"})
    assert off == {"at_import": None, "mode": "cold", "after": None}


def test_importing_the_package_outside_a_kernel_starts_nothing():
    code = "import ddp_tutorial; from ddp_tutorial import warmstart; print(warmstart.server_pid())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["None"], out.stderr


def test_a_group_left_just_before_its_ddp_model_is_dropped_never_hangs_the_rank():
    # torch 2.13 destroys a gloo group when its last reference goes: here the DDP model,
    # dropped with the GIL held when main() returns, while a gloo thread still needs the
    # GIL to free all_gather_object's tensors. Without bootstrap.keep_groups_until_exit one
    # of the first 6 launches of this script hung in ~ProcessGroupGloo (measured 3 times).
    from ddp_tutorial.lessons.sampler_accumulation import SCHEDULE_SCRIPT

    for i in range(20):
        run = launch(SCHEDULE_SCRIPT, 2, ["--micro", "6", "--accum-steps", "4"], echo="none", timeout=30)
        assert run.exit_codes == {0: 0, 1: 0}, i


def test_the_distributed_debug_level_is_each_launchs_own_without_a_server_of_its_own(script_file):
    # torch.distributed reads TORCH_DISTRIBUTED_DEBUG at import: a forked rank reads it again.
    script = script_file("import torch.distributed as dist\nprint(dist.get_debug_level(), flush=True)\n")
    plain = launch(script, 1, echo="none")
    server = warmstart.server_pid()
    detail = launch(script, 1, echo="none", env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    again = launch(script, 1, echo="none")
    cold = launch(script, 1, echo="none", env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, warm=False)
    assert [r.start_mode for r in (plain, detail, again)] == ["warm"] * 3
    assert warmstart.server_pid() == server  # no new server for the debug level, and none after it
    assert plain.output[0] == again.output[0] == ["DebugLevel.OFF"]
    assert detail.output[0] == cold.output[0] == ["DebugLevel.DETAIL"]


def test_a_restart_and_another_max_restarts_keep_the_server(tmp_path):
    """TORCHELASTIC_RESTART_COUNT and _MAX_RESTARTS change per attempt and per launch; torch reads them at
    run time, not at import. Every attempt is forked by the same server, and each rank reads its own."""
    first = launch(PRINT_LINES, 1, echo="none")
    server = warmstart.server_pid()
    restarted = launch(str(SCRIPTS / "restart_records.py"), 2, run_dir=tmp_path / "run", echo="none",
                       max_restarts=1, timeout=60)
    claim = json.loads((restarted.run_dir / ".launch.json").read_text())
    assert claim["start_modes"] == {"0": "warm", "1": "warm"}, claim.get("cold_reason")
    assert restarted.result(0, "attempt") == restarted.result(1, "attempt") == 1  # attempt 1 read its count
    env_script = tmp_path / "env.py"
    env_script.write_text("import json, os\nprint(json.dumps({k: v for k, v in os.environ.items()"
                          " if k.startswith('TORCHELASTIC_')}), flush=True)\n")
    again = launch(str(env_script), 1, echo="none", max_restarts=0)
    assert first.start_mode == again.start_mode == "warm"
    assert warmstart.server_pid() == server  # one server for all of it
    assert json.loads(again.output[0][0])["TORCHELASTIC_MAX_RESTARTS"] == "0"
    assert json.loads(again.output[0][0])["TORCHELASTIC_RESTART_COUNT"] == "0"


def test_a_script_that_sets_the_environment_before_importing_torch_starts_cold(tmp_path):
    run = launch(str(SCRIPTS / "threads_before_torch.py"), 2, echo="none")
    assert run.start_mode == "cold"
    assert "threads_before_torch.py sets environment variables before importing torch (line 5)" in run.cold_reason
    assert [run.result(r, "threads") for r in (0, 1)] == [2, 2]  # the setting took effect
    after = tmp_path / "after.py"
    after.write_text("import os\nimport torch\nos.environ['OMP_NUM_THREADS'] = '2'\n")
    assert launch(str(after), 1, echo="none").start_mode == "warm"


@pytest.mark.parametrize("source, cold", [
    ("import os\nos.environ['A'] = '1'\nimport torch\n", True),
    ("import os\nos.environ.update(A='1')\nimport torch.distributed as dist\n", True),
    ("from os import environ\nenviron.setdefault('A', '1')\nfrom torch import nn\n", True),
    ("import os\nos.putenv('A', '1')\n", True),
    ("import os\ndel os.environ['A']\nimport torch\n", True),
    ("import os\nx = os.environ.get('A')\nimport torch\n", False),
    ("import os\ndef f():\n    os.environ['A'] = '1'\nimport torch\n", False),
    ("import torch\nimport os\nos.environ['A'] = '1'\n", False),
])
def test_environment_before_torch_is_read_from_the_source(tmp_path, source, cold):
    path = tmp_path / "s.py"
    path.write_text(source)
    assert (launcher.start.environment_before_torch([str(path)]) is not None) == cold


#: The real fork server, with a bootstrap that fails where $FAULT says: hosting the store
#: (before the script, as torch 2.4-2.7's libuv store did) or on the way out (after it).
FAULTY_SERVER = '''
import importlib.util, os
spec = importlib.util.spec_from_file_location("_fork_server_under_test", {server!r})
server = importlib.util.module_from_spec(spec)
spec.loader.exec_module(server)
load_bootstrap = server._load_bootstrap

def load_faulty_bootstrap():
    bootstrap = load_bootstrap()
    host_store, leave = bootstrap.host_store, bootstrap.exit_skipping_interpreter_cleanup

    def faulty_host_store(fd, port):
        if os.environ.get("FAULT") == "store":
            raise NotImplementedError("the store cannot start (injected)")
        host_store(fd, port)

    def faulty_exit(code):
        if os.environ.get("FAULT") == "exit":
            raise RuntimeError("the way out failed (injected)")
        leave(code)

    bootstrap.host_store, bootstrap.exit_skipping_interpreter_cleanup = faulty_host_store, faulty_exit
    return bootstrap

server._load_bootstrap = load_faulty_bootstrap
server.main()
'''


@pytest.fixture
def faulty_fork_server(tmp_path, monkeypatch):
    """This process's next fork server runs FAULTY_SERVER; stopped afterwards."""
    path = tmp_path / "faulty_server.py"
    path.write_text(FAULTY_SERVER.format(server=warmstart.SERVER_SCRIPT))
    warmstart._stop_server()
    monkeypatch.setattr(warmstart, "_SERVER", None)
    monkeypatch.setattr(warmstart, "SERVER_SCRIPT", str(path))
    yield
    warmstart._stop_server()  # the next test gets a real server again
    warmstart._SERVER = None


def test_a_fault_outside_the_script_ends_that_rank_with_a_report_and_the_server_serves_on(faulty_fork_server):
    with pytest.raises(ddp_tutorial.WorkerError) as before:
        launch(PRINT_LINES, 2, echo="none", env={"FAULT": "store"})
    server = warmstart.server_pid()
    assert server is not None and before.value.run.start_mode == "warm"
    assert (before.value.rank, before.value.exit_code) == (0, 1)
    report = "\n".join(before.value.run.output[0])
    assert "NotImplementedError: the store cannot start (injected)" in report, report
    # the child left through os._exit, never back into the server's request loop
    assert "handle_request" not in report and "Bad file descriptor" not in report, report

    with pytest.raises(ddp_tutorial.WorkerError) as after:
        launch(PRINT_LINES, 2, echo="none", env={"FAULT": "exit"})
    assert after.value.exit_code == 1
    output = after.value.run.output[after.value.rank]
    assert output[:3] == [f"line {i} of rank {after.value.rank}" for i in range(3)]  # the script ran
    assert "RuntimeError: the way out failed (injected)" in "\n".join(output), output

    fine = launch(PRINT_LINES, 2, echo="none")
    assert fine.start_mode == "warm" and fine.exit_codes == {0: 0, 1: 0}
    assert warmstart.server_pid() == server  # the same server served all three
    assert procinfo.threads(server) == 1


#: The real fork server, which starts importing only once the FIFO $GO is opened for writing:
#: a server that is still importing torch for as long as the test wants.
SLOW_SERVER = '''
import importlib.util, os
with open(os.environ["GO"]) as go:  # blocks until the test opens the FIFO's other end
    go.read()
spec = importlib.util.spec_from_file_location("_fork_server_under_test", {server!r})
server = importlib.util.module_from_spec(spec)
spec.loader.exec_module(server)
server.main()
'''


def test_a_launch_too_short_to_wait_for_an_importing_server_starts_cold_and_leaves_it_importing(
        tmp_path, monkeypatch):
    go = tmp_path / "go"
    os.mkfifo(go)
    path = tmp_path / "slow_server.py"
    path.write_text(SLOW_SERVER.format(server=warmstart.SERVER_SCRIPT))
    warmstart._stop_server()
    monkeypatch.setattr(warmstart, "_SERVER", None)
    monkeypatch.setattr(warmstart, "SERVER_SCRIPT", str(path))
    monkeypatch.setenv("GO", str(go))
    try:
        short = launch(PRINT_LINES, 2, echo="none", timeout=2)
        assert short.start_mode == "cold" and "still importing" in short.cold_reason, short.cold_reason
        assert short.exit_codes == {0: 0, 1: 0}
        server = warmstart.server_pid()
        assert server is not None and pid_alive(server)  # not stopped: the next launch may use it
        with open(go, "w"):  # the server goes on to import
            pass
        assert launcher.fork_server_ready()
        later = launch(PRINT_LINES, 2, echo="none")
        assert later.start_mode == "warm" and warmstart.server_pid() == server
    finally:
        warmstart._stop_server()  # the next test gets a real server again
        warmstart._SERVER = None


def _server_module():
    """forkserver/server.py loaded by path, as the launcher starts it (no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ddp_fork_server_under_test", warmstart.SERVER_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_servers_preimport_leaves_sys_path_as_a_cold_rank_has_it(tmp_path, monkeypatch):
    server = _server_module()
    pkg = tmp_path / "pathprobe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "appends.py").write_text("import sys\nsys.path.append('/nowhere/appended')\n")
    (pkg / "inserts.py").write_text("import sys\nif True:\n    sys.path.insert(0, '/nowhere/inserted')\n")
    (pkg / "plain.py").write_text("import sys\nPATH = list(sys.path)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = list(sys.path)
    assert server.import_keeping_sys_path("pathprobe.appends") == ["/nowhere/appended"]
    assert server.import_keeping_sys_path("pathprobe.inserts") == ["/nowhere/inserted"]
    assert server.import_keeping_sys_path("pathprobe.plain") == []
    assert sys.path == before and {"pathprobe.appends", "pathprobe.inserts"} <= set(sys.modules)
    with pytest.raises(ModuleNotFoundError):
        server.import_keeping_sys_path("pathprobe.missing")
    # This torch, in a fresh process: what importing the module that changes sys.path (torch 2.6) really
    # does, and what the server's pre-import leaves (sys.path as before; no temporary folder behind).
    probe = ("import importlib.util, json, os, sys\nbefore = list(sys.path)\n"
             f"spec = importlib.util.spec_from_file_location('server', {warmstart.SERVER_SCRIPT!r})\n"
             "server = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(server)\n"
             "if sys.argv[1] == 'plain':\n    import torch._dynamo\n"
             "    print(json.dumps([e for e in sys.path if e not in before]))\nelse:\n"
             "    added = server.preimport_dynamo()\n"
             "    print(json.dumps([added, sys.path == before, 'torch._dynamo' in sys.modules,\n"
             "                      [os.path.exists(e) for e in added]]))\n")
    run = lambda how: json.loads(subprocess.run([sys.executable, "-c", probe, how], capture_output=True,  # noqa: E731
                                                text=True, check=True).stdout)
    really = run("plain")
    added, path_kept, imported, left = run("server")
    assert sorted(map(os.path.dirname, added)) == sorted(map(os.path.dirname, really))  # temp names differ
    assert path_kept and imported
    template_dirs = [gone for entry, gone in zip(added, left) if entry.startswith(tempfile.gettempdir() + os.sep)]
    assert not any(template_dirs)  # 2.6's template folder is removed, not left behind by the server
