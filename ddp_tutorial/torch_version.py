"""Which torch the kit runs on. Importing ``ddp_tutorial`` refuses in one line, with the fix, a
Python older than ``PYTHON_FLOOR`` (a clone imported uninstalled) and a torch older than ``FLOOR``
or none; a torch newer than ``NEWEST_TESTED`` gets a line on stderr (docs/torch-versions.md).
Nothing here imports torch: it reads the ``torch/version.py`` that ``import torch`` would load.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import sys
from pathlib import Path
from typing import Optional, Tuple

#: The oldest torch: the first whose FSDP2 (``fully_shard``) runs on CPU with gloo and averages the
#: gradients there, as notebook 10 measures (docs/torch-versions.md).
FLOOR = (2, 9)
#: The newest torch the kit's tests have passed on.
NEWEST_TESTED = (2, 15)
#: The oldest Python with wheels of torch 2.9 (docs/platforms.md); pyproject.toml says it to pip.
PYTHON_FLOOR = (3, 10)


def _dotted(version: Tuple[int, ...]) -> str:
    return ".".join(map(str, version))


#: The command that installs a torch inside the tested range.
FIX = f"pip install 'torch>={_dotted(FLOOR)},<{NEWEST_TESTED[0]}.{NEWEST_TESTED[1] + 1}'"


def parse(version: str) -> Optional[Tuple[int, int]]:
    """(major, minor) of a version string (``"2.13.0+cpu"`` -> (2, 13)); None if unreadable."""
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def installed() -> Tuple[Optional[str], Optional[str], Optional[str]]:
    """(version, folder, CUDA version) of the torch ``import torch`` would load; Nones if none."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return None, None, None
    folder = os.path.dirname(spec.origin)
    try:
        text = Path(folder, "version.py").read_text()
    except OSError:
        text = ""  # a torch without its version file: "unknown", refused below
    found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    cuda = re.search(r"^cuda\s*(?::\s*\S+\s*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return (found.group(1) if found else "unknown"), folder, (cuda.group(1) if cuda else None)


def refusal(version: Optional[str], folder: Optional[str]) -> Optional[str]:
    """The line that refuses ``version`` (found in ``folder``), or None if the kit can use it."""
    parsed = parse(version or "")
    if parsed is None or parsed < FLOOR:
        found = (f"found torch {version} in {folder}" if version
                 else f"none is installed for {sys.executable}")
        return f"ddp_tutorial needs torch >= {_dotted(FLOOR)}, but {found}: {FIX}"
    return None


def python_refusal(version_info: Optional[Tuple[int, ...]] = None) -> Optional[str]:
    """The line that refuses a Python (``version_info``, else this one) below the floor, or None."""
    found = tuple(sys.version_info if version_info is None else version_info)
    if found[:2] >= PYTHON_FLOOR:
        return None
    return (f"ddp_tutorial needs Python {_dotted(PYTHON_FLOOR)} or newer (torch {_dotted(FLOOR)}, "
            f"the oldest it runs on, has no wheels for older), but {sys.executable} is Python "
            f"{_dotted(found[:3])}: make a venv with a newer one (docs/platforms.md)")


def check() -> None:
    """At import: ImportError for an old Python, no torch or an old one; a line for a newer one."""
    version, folder, _ = installed()
    refused = python_refusal() or refusal(version, folder)
    if refused:
        raise ImportError(refused)
    if parse(version) > NEWEST_TESTED and os.environ.get("RANK", "0") == "0":  # once per job
        print(f"ddp_tutorial: torch {version} is newer than the newest tested "
              f"({_dotted(NEWEST_TESTED)}); it should work, and `python -m ddp_tutorial.maintainer "
              f"--torch {version.split('+')[0]}` tests it (or: {FIX})", file=sys.stderr, flush=True)


def versions_line() -> str:
    """``torch 2.13.0+cpu (CPU only), Python 3.11.2``: what a notebook runs on."""
    version, _, cuda = installed()
    build = f"CUDA {cuda} build" if cuda else "CPU only"
    return f"torch {version} ({build}), Python {platform.python_version()}"


def print_versions() -> None:
    """Print the torch and Python this notebook runs on."""
    print(f"Running on {versions_line()}.")
