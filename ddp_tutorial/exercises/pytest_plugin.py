"""The test configuration's one change to the exercises: the learner's folder is not the tests' folder.

``pyproject.toml`` loads this plugin (``-p ddp_tutorial.exercises.pytest_plugin``) for every ``pytest``
run, unit tests and nbmake alike. It points $DDP_TUTORIAL_MY_WORK at a temporary folder before any
test or notebook kernel starts (kernels inherit the environment), so ``exercises.start`` and
``check`` write there instead of ``notebooks/my_work/``. Nothing else changes: the notebooks run
exactly as a learner runs them, and the folder is removed when the session ends.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from ddp_tutorial.envvars import MY_WORK

_made = []


def pytest_configure(config) -> None:
    if os.environ.get(MY_WORK):  # set by whoever runs pytest: theirs to keep
        return
    folder = tempfile.mkdtemp(prefix="ddp-tutorial-my-work-")
    _made.append(folder)
    os.environ[MY_WORK] = folder


def pytest_unconfigure(config) -> None:
    while _made:
        os.environ.pop(MY_WORK, None)
        shutil.rmtree(_made.pop(), ignore_errors=True)
