"""What the kit does where macOS differs from Linux, tested on Linux with what macOS lacks taken away.

In the main suite, a child Python loads ``tests/macos_standin/sitecustomize.py`` (no real-time signals,
no ``os.sched_getaffinity``, pidfds or ``os.waitid``); ``bash .ci/macos-standin`` runs this file, and
more, with /proc hidden too (docs/platforms.md says what a stand-in cannot show).
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_tutorial import LaunchTimeout, launch
from ddp_tutorial.launcher import net, warm

HERE = Path(__file__).parent
STANDIN = os.environ.get("DDP_TUTORIAL_STANDIN") == "inside"
SCRIPTS = HERE / "scripts"

LAUNCH_WITHOUT_LINUX = """
import signal, sys, ddp_tutorial
assert not hasattr(signal, "SIGRTMIN"), "the stand-in's sitecustomize did not load"
run = ddp_tutorial.launch(ddp_tutorial.scripts_path("hello.py"), 2, echo="none", timeout=120, warm=False)
print("SUM", run.result(0, "all_reduce_sum"), run.result(1, "all_reduce_sum"), run.start_mode)
try:
    ddp_tutorial.launch(sys.argv[1], 2, echo="none", timeout=15, warm=False)
except ddp_tutorial.LaunchTimeout as err:
    print("STACKS", sorted(err.stacks), "skip_allreduce.py" in err.stacks[0])
"""


def test_a_launch_and_its_deadline_stacks_work_without_real_time_signals(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE / "macos_standin"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", LAUNCH_WITHOUT_LINUX, str(SCRIPTS / "skip_allreduce.py")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUM 3.0 3.0 cold" in done.stdout
    assert "STACKS [0, 1] True" in done.stdout  # each rank answered the stacks signal (SIGUSR2)


def test_the_stacks_signal_exists_on_every_posix_system():
    from ddp_tutorial import envvars

    assert envvars.stacks_signal() == signal.SIGUSR2


def test_ranks_start_cold_off_linux_unless_asked(monkeypatch):
    monkeypatch.delenv("DDP_TUTORIAL_WARM", raising=False)
    monkeypatch.setattr(sys, "platform", "darwin")  # only warm.use_warm reads it here
    assert "ranks start cold on darwin" in warm.use_warm(None, "gloo")
    assert warm.use_warm(True, "gloo") is None  # the switch
    monkeypatch.setenv("DDP_TUTORIAL_WARM", "1")
    assert warm.use_warm(None, "gloo") is None
    monkeypatch.setenv("DDP_TUTORIAL_WARM", "0")
    monkeypatch.setattr(sys, "platform", "linux")
    assert "turned off" in warm.use_warm(None, "gloo")


def test_gloo_is_pinned_to_the_loopback_interface():
    name = net.loopback_interface()
    assert name in ("lo", "lo0")
    from ddp_tutorial.launcher.start import worker_env

    assert worker_env()["GLOO_SOCKET_IFNAME"] == name


@pytest.mark.skipif(not STANDIN, reason="only inside bash .ci/macos-standin (root, a private mount namespace)")
def test_inside_the_standin_proc_is_hidden_and_launches_start_cold():
    assert not Path("/proc/self").exists() and not hasattr(signal, "SIGRTMIN")
    run = launch(str(SCRIPTS / "print_lines.py"), 2, echo="none", timeout=120)
    assert run.start_mode == "cold" and run.exit_codes == {0: 0, 1: 0}
    with pytest.raises(LaunchTimeout) as info:
        launch(str(SCRIPTS / "skip_allreduce.py"), 2, echo="none", timeout=15)
    assert set(info.value.stacks) == {0, 1}


WINDOWS = """
import sys
sys.platform = "win32"  # what native Windows' Python says; set only in this child, before the import
import ddp_tutorial
"""


def test_native_windows_is_refused_at_import_in_one_line_naming_wsl2():
    from ddp_tutorial.platforms import WINDOWS_REFUSAL

    out = subprocess.run([sys.executable, "-c", WINDOWS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stdout == ""
    last = out.stderr.strip().splitlines()[-1]
    assert last == f"ImportError: {WINDOWS_REFUSAL}"
    assert "\n" not in WINDOWS_REFUSAL and "WSL2" in WINDOWS_REFUSAL and "wsl --install" in WINDOWS_REFUSAL
    assert 'ddp_tutorial/platforms.py", line' in out.stderr  # the first thing the import does, not a deeper failure


def test_below_python_3_10_pip_reaches_the_kit_s_own_one_line_refusal():
    """pip checks the kit's requires-python only if no other line fails first: every other requirement
    carries the same floor as a marker (docs/platforms.md shows the line pip prints on 3.9)."""
    import re

    root = HERE.parent
    assert re.search(r'^requires-python = ">=3.10"$', (root / "pyproject.toml").read_text(), re.M)
    lines = [line.split("#")[0].strip() for line in (root / "requirements.txt").read_text().splitlines()]
    requirements = [line for line in lines if line]
    assert requirements[0] == "-e ."
    assert all(line.endswith('; python_version >= "3.10"') for line in requirements[1:]), requirements
