"""Where the kit refuses to run, in one line: a Python below its floor, and native Windows
(docs/platforms.md). The import of the whole kit on a faked Windows, and pip's line on 3.9, are
tested in test_macos_standin.py."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_tutorial import platforms, torch_version
from ddp_tutorial.maintainer import pythons

ROOT = Path(__file__).resolve().parent.parent


def python_39_refusal(executable: str, version: str = "3.9.18") -> str:
    return ("ddp_tutorial needs Python 3.10 or newer (torch 2.9, the oldest it runs on, has no wheels for "
            f"older), but {executable} is Python {version}: make a venv with a newer one (docs/platforms.md)")


def test_a_python_below_the_floor_is_refused_in_one_line_naming_it_and_above_it_nothing_is_said():
    assert torch_version.python_refusal((3, 9, 18, "final", 0)) == python_39_refusal(sys.executable)
    assert torch_version.python_refusal((2, 7, 18)) is not None
    for above in [(3, 10, 0), (3, 13, 0), (3, 15, 0), (4, 0, 0)]:
        assert torch_version.python_refusal(above) is None, above
    assert torch_version.python_refusal() is None  # this one


def test_the_python_floor_is_the_one_pyproject_declares_to_pip():
    floor = ".".join(map(str, torch_version.PYTHON_FLOOR))
    declared = re.search(r'^requires-python = "(.*)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert declared == f">={floor}"
    classifiers = re.findall(r'"Programming Language :: Python :: (3\.\d+)"',
                             (ROOT / "pyproject.toml").read_text())
    assert classifiers and min(classifiers, key=lambda v: tuple(map(int, v.split(".")))) == floor


def test_a_clone_imported_by_python_3_9_says_so_in_one_line():
    """A clone on sys.path, not installed (pip would have refused it): the import's last line names
    the Python."""
    try:
        python = str(pythons.base_python("3.9"))
    except SystemExit:
        pytest.skip("no Python 3.9 on this machine (the unit test above checks the line)")
    version = subprocess.run([python, "-c", "import platform; print(platform.python_version())"],
                             capture_output=True, text=True, timeout=60).stdout.strip()
    out = subprocess.run([python, "-c", "import ddp_tutorial"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip().splitlines()[-1] == f"ImportError: {python_39_refusal(python, version)}"


def test_the_windows_check_reads_the_platform_when_called_not_when_imported():
    """The kit is imported on Linux; only then does this child say it is Windows: the check must see it."""
    code = ("import sys\nfrom ddp_tutorial import platforms\nsys.platform = 'win32'\n"
            "try:\n    platforms.refuse_native_windows()\nexcept ImportError as error:\n    print(error)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == platforms.WINDOWS_REFUSAL + "\n", out.stderr
    for posix in ["linux", "darwin"]:
        platforms.refuse_native_windows(posix)
    with pytest.raises(ImportError) as info:
        platforms.refuse_native_windows("win32")
    assert str(info.value) == platforms.WINDOWS_REFUSAL
