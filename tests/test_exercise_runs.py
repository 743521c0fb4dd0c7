"""The exercises' plain and torchrun runs start and stop as the launch package's process groups.

Their environment is a rank's less launch's contract (``launcher.start.worker_env``), a
finished run leaves nothing of its process group, and a kernel killed while they run
takes them with it, grandchildren included (``exercises/guard.py`` and the bootstrap's
parent watch).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ddp_tutorial import envvars
from ddp_tutorial.exercises import runs
from ddp_tutorial.launcher.spec import LaunchSpec
from ddp_tutorial.launcher.start import rank_env, worker_env
from conftest import pid_alive, processes_of_run
from test_launcher import wait_for

#: A script that starts a grandchild, notes its pid in the check's folder, then ends or sleeps.
SCRIPT = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
out = os.environ["DDP_EXERCISE_OUT"]
with open(os.path.join(out, f"child-{os.getpid()}"), "w") as f:
    f.write(str(child.pid))
if os.environ.get("SLEEP") == "1":
    time.sleep(3600)
"""

KERNEL = """
import sys, time
from pathlib import Path
from ddp_tutorial.exercises import runs
script, folder = Path(sys.argv[1]), Path(sys.argv[2])
runs.start_plain("init", script, folder / "plain")
runs.start_torchrun("init", script, folder / "torchrun", 2)
print("started", flush=True)
time.sleep(3600)
"""


def _children(folder: Path) -> list:
    return [int(p.read_text()) for p in folder.glob("child-*") if p.read_text()]


def test_a_worker_environment_carries_no_outer_launchers_variables(tmp_path, monkeypatch):
    outer = {"RANK": "3", "MASTER_PORT": "1", "TORCHELASTIC_ERROR_FILE": str(tmp_path / "error.json"),
             envvars.STORE: "join", envvars.LAUNCHER_FD: "1"}
    for name, value in outer.items():
        monkeypatch.setenv(name, value)
    spec = LaunchSpec(target=("x.py",), world_size=2, run_dir=tmp_path, backend="gloo")
    env = rank_env(spec, 1, 1234, 0, "join")
    # The rank's own values replace an outer launch's; what launch does not set is dropped.
    assert (env["RANK"], env["MASTER_PORT"]) == ("1", "1234") and envvars.LAUNCHER_FD not in env
    assert "TORCHELASTIC_ERROR_FILE" not in env
    assert not set(outer) & set(worker_env())  # a plain process or torchrun: none of them


def test_a_finished_plain_run_leaves_nothing_of_its_process_group(tmp_path):
    script = tmp_path / "starts_a_child.py"
    script.write_text(SCRIPT)
    started = runs.start_plain("init", script, tmp_path / "plain")
    result = runs.finish(started, time.monotonic() + 90, 90)
    assert result.exit_codes == {0: 0}, result.failure
    [child] = _children(tmp_path / "plain")
    # finish swept the group before reaping its leader: the script's child is gone with it.
    assert not pid_alive(child)


def test_a_killed_kernel_takes_its_plain_and_torchrun_runs_with_it(tmp_path):
    script = tmp_path / "starts_a_child_and_sleeps.py"
    script.write_text(SCRIPT)
    folder = tmp_path / "check"
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL, str(script), str(folder)],
                              env={**os.environ, "SLEEP": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        # the plain process's child and each torchrun rank's: every script is running
        wait_for(lambda: len(_children(folder / "plain")) == 1 and len(_children(folder / "torchrun")) == 2,
                 120, "the scripts to start their children")
        started = processes_of_run(folder / "plain") + processes_of_run(folder / "torchrun")
        assert len(started) >= 6  # plain + its child; torchrun's agent, 2 ranks, their 2 children
    finally:
        kernel.send_signal(signal.SIGKILL)  # no Python cleanup runs in the kernel
        kernel.wait()
    wait_for(lambda: not processes_of_run(folder / "plain") and not processes_of_run(folder / "torchrun"),
             10, "every process of the check's runs to die")
