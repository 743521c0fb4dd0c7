"""The suite's own guard: a process a test leaves running for a run folder fails the session."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

LEAVES_ONE = '''
import os, subprocess, sys

def test_leaves_a_process(tmp_path):
    env = dict(os.environ, DDP_TUTORIAL_RUN_DIR=str(tmp_path / "run"))
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env)
'''


# In one process, and with pytest-xdist workers as the README's `pytest` runs (the
# controller checks, after the worker that started the process has exited).
@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_process_left_behind_fails_the_session(tmp_path, workers):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_leaves.py").write_text(LEAVES_ONE)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:nbmake", "-p", "no:cacheprovider",
                           "-n", workers, "--rootdir", str(tmp_path), "-c", "/dev/null", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, DDP_TUTORIAL_TEST_LEFTOVER_WAIT_S="1"))
    assert "1 passed" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 1 and "processes the tests started and left running" in done.stdout
