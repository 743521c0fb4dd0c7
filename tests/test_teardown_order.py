"""A script that leaves its group before dropping its DDP model meets torch as it is, under launch as under torchrun.

``launch`` changes nothing of torch (no patched ``destroy_process_group``): what such a script does
under torchrun, it does under ``launch``, cold and warm. On torch 2.13 its own code finishes on every
rank unless ``torch._dynamo`` was imported before ``init_process_group`` (docs/how-it-is-built.md),
which a warm rank does not do either. One difference is at the very end: under torchrun the
interpreter's cleanup then destroys what is left of gloo, which can abort the process ("terminate called
without an active exception", SIGABRT); ``launch`` ends a rank after its script with ``os._exit``,
skipping that cleanup (``rank/bootstrap.py``), as train.py does under both.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_tutorial import launch

SCRIPT = Path(__file__).parent / "scripts" / "leave_before_drop.py"


def test_under_torchrun_the_script_ends_as_torch_lets_it(tmp_path):
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(SCRIPT)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PET_LOG_DIR": str(tmp_path / "logs")})
    assert done.stdout.count("train() returned") == 2, done.stdout + done.stderr
    # Exit 0, or torch's abort in the interpreter's cleanup after the script ended: the only failure
    # torch showed here, always after "train() returned" (how often: docs/measured.md).
    aborted_at_exit = "terminate called without an active exception" in done.stderr
    assert done.returncode == 0 or aborted_at_exit, done.stdout + done.stderr


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_under_launch_the_same_script_ends_the_same_way(warm):
    # Cold ranks start as torchrun's do: once, as the torchrun test runs. Warm ranks were forked
    # from a process with torch imported, where this script's end once hung now and then: three.
    for _ in range(3 if warm else 1):
        run = launch(str(SCRIPT), 2, echo="none", timeout=90, warm=warm)
        assert run.exit_codes == {0: 0, 1: 0} and run.start_mode == ("warm" if warm else "cold")
        assert all(run.output[r] == ["train() returned"] for r in (0, 1))
