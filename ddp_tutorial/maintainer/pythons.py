"""The suite with another Python (``python -m ddp_tutorial.maintainer --python 3.10``): a venv of
requirements.txt as it is, built once with that interpreter, then the demo and the README's tests."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Sequence

from ddp_tutorial.maintainer.suite import checkout, pip_env, run_tests, torch_in, venv_python


def base_python(version: str) -> Path:
    """The interpreter of Python ``version`` (``3.10``, ``3.13.0``): ``pythonX.Y`` on PATH, else pyenv's
    newest.

    Each is asked its version: pyenv's ``pythonX.Y`` on PATH is a shim that runs only the Pythons pyenv
    has selected, and exits 127 for the others.

    Raises:
        SystemExit: none found.
    """
    wanted = tuple(int(part) for part in version.split("."))
    on_path = shutil.which("python" + ".".join(version.split(".")[:2]))
    pyenv = sorted(Path(os.path.expanduser("~/.pyenv/versions")).glob(f"{version}*/bin/python"), reverse=True,
                   key=lambda path: [int(part) for part in re.findall(r"\d+", path.parent.parent.name)])
    for candidate in ([Path(on_path)] if on_path else []) + pyenv:
        said = subprocess.run([str(candidate), "-c", "import sys; print(*sys.version_info[:3])"],
                              capture_output=True, text=True, timeout=60)
        if said.returncode == 0 and tuple(map(int, said.stdout.split()))[:len(wanted)] == wanted:
            return candidate
    raise SystemExit(f"error: no Python {version} found (pythonX.Y on PATH, or ~/.pyenv/versions/{version}*)")


def python_venv(version: str, root: Path, no_pip_config: bool = False, echo=print) -> Path:
    """``root/.venv-python-VERSION``: requirements.txt as it is, installed with Python ``version``, made once."""
    venv = root / f".venv-python-{version}"
    python = venv_python(venv)
    if torch_in(python):
        echo(f"using {venv}")
        return venv
    base = base_python(version)
    echo(f"building {venv}: requirements.txt with {base} ...")
    t0 = time.perf_counter()
    subprocess.run([str(base), "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"], env=pip_env(no_pip_config))
    done = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "-r", "requirements.txt"], cwd=root,
                          env=pip_env(no_pip_config)).returncode
    if done != 0 or not torch_in(python):
        raise SystemExit(f"error: installing requirements.txt with Python {version} in {venv} failed (pip exit {done})")
    echo(f"built {venv} in {time.perf_counter() - t0:.0f} s")
    return venv


def test_python(version: str, tests: Sequence[str] = (), no_pip_config: bool = False) -> int:
    """``--python``: the demo (``python -m ddp_tutorial``), then the README's tests (or ``tests``), with
    Python ``version``; 0 if both pass."""
    root = checkout()
    python = venv_python(python_venv(version, root, no_pip_config))
    t0 = time.perf_counter()
    demo = subprocess.run([str(python), "-m", "ddp_tutorial", "--world-size", "2"], cwd=root,
                          capture_output=True, text=True, timeout=600)
    print(f"$ {python} -m ddp_tutorial --world-size 2: exit {demo.returncode}, "
          f"{time.perf_counter() - t0:.1f} s wall", flush=True)
    if demo.returncode:
        print("\n".join((demo.stdout + demo.stderr).splitlines()[-20:]), flush=True)
    result = run_tests(python, root, tests)
    print(f"Python {version}, torch {torch_in(python)}: {result['summary']} (exit {result['returncode']}, "
          f"{result['seconds']:.0f} s wall)", flush=True)
    return demo.returncode or result["returncode"]
