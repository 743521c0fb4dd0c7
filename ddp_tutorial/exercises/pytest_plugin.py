"""The tests' one change to the exercises: $DDP_TUTORIAL_MY_WORK points at a temporary folder.

``pyproject.toml`` loads this plugin for every ``pytest`` run; kernels inherit the environment, so
``exercises.start`` and ``check`` write there, not into ``notebooks/my_work/``, until the run ends.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from ddp_tutorial.envvars import MY_WORK

_made = []


def pytest_configure(config) -> None:
    if not os.environ.get(MY_WORK):  # one set by whoever runs pytest is theirs to keep
        _made.append(tempfile.mkdtemp(prefix="ddp-tutorial-my-work-"))
        os.environ[MY_WORK] = _made[-1]


def pytest_unconfigure(config) -> None:
    while _made:
        os.environ.pop(MY_WORK, None)
        shutil.rmtree(_made.pop(), ignore_errors=True)
