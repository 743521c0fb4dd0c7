"""The venvs the suite runs in, each built once and kept in the checkout: ``.venv-torch-VERSION``
(``--torch``: that torch and the rest of requirements.txt) and ``.venv-python-X.Y`` (``--python``:
requirements.txt as it is, with that Python)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence


def requirements_with_torch(text: str, version: str) -> List[str]:
    """``requirements.txt``'s lines with its torch line replaced by ``torch==version``."""
    lines = [line.strip() for line in text.splitlines()]
    kept = [line for line in lines if line and not line.startswith("#")
            and not re.match(r"torch\s*([=<>!~;\[]|$)", line)]
    return [f"torch=={version}", *kept]


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def torch_in(python: Path) -> Optional[str]:
    """The torch version ``python`` imports, or None."""
    if not python.exists():
        return None
    out = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"],
                         capture_output=True, text=True)
    return out.stdout.strip() or None if out.returncode == 0 else None


def same_release(installed: Optional[str], wanted: str) -> bool:
    """Whether ``installed`` (``2.13.0+cpu``) is the release ``wanted`` (``2.13.0``) names."""
    return installed is not None and installed.split("+")[0] == wanted.split("+")[0]


def pip(python, root: Path, no_pip_config: bool, *args: str, lines: Sequence[str] = ()) -> int:
    """``python -m pip ARGS`` in the checkout (``-e .`` is read relative to it), ``lines`` given as
    requirements on stdin; pip's exit status. ``no_pip_config``: without pip's configuration files
    (a machine's cap on torch versions, say), its PIP_* variables still applying."""
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull} if no_pip_config else None
    stdin = ["-r", "/dev/stdin"] if lines else []
    return subprocess.run([str(python), "-m", "pip", *args, *stdin], cwd=root, env=env, text=True,
                          input="\n".join(lines) + "\n" if lines else None).returncode


def wheels_folder(version: str, root: Path) -> Path:
    """Where ``download_torch`` keeps the wheels for ``.venv-torch-VERSION``."""
    return root / f".wheels-torch-{version}"


#: Written into the wheels folder once every wheel is there: a half-finished download is never used.
COMPLETE = "COMPLETE"


def download_torch(version: str, root: Path, no_pip_config: bool = False, echo=print) -> Path:
    """Download the wheels ``torch_venv(version)`` installs into ``wheels_folder``, install nothing:
    a CUDA build's gigabytes come while another suite runs, ``torch_venv`` installs them offline."""
    folder = wheels_folder(version, root)
    (folder / COMPLETE).unlink(missing_ok=True)
    folder.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    lines = [line for line in requirements_with_torch((root / "requirements.txt").read_text(), version)
             if not line.startswith("-e")]
    code = pip(sys.executable, root, no_pip_config, "download", "--quiet", "--dest", str(folder),
               lines=lines)
    if code != 0:
        raise SystemExit(f"error: downloading torch=={version}'s wheels into {folder} failed "
                         f"(pip exit {code})")
    (folder / COMPLETE).write_text("\n".join(lines) + "\n")
    echo(f"downloaded torch=={version} and the rest of requirements.txt into {folder} "
         f"in {time.perf_counter() - t0:.0f} s")
    return folder


def _made_once(venv: Path, ready, base, what: str, install, echo) -> Path:
    """``venv`` as it is if ``ready(the torch it imports)``; else made anew with the Python
    ``base()``, then ``install(its python)`` (pip's exit status) fills it."""
    python = venv_python(venv)
    if ready(found := torch_in(python)):
        echo(f"using {venv} (torch {found})")
        return venv
    echo(f"building {venv}: {what} ...")
    t0 = time.perf_counter()
    subprocess.run([str(base()), "-m", "venv", "--clear", str(venv)], check=True)
    done = install(python)
    if done != 0 or not ready(found := torch_in(python)):
        raise SystemExit(f"error: installing {what} in {venv} failed (pip exit {done}, torch "
                         f"found: {found}); a torch above this machine's pip cap needs "
                         "--no-pip-config")
    echo(f"built {venv} with torch {found} in {time.perf_counter() - t0:.0f} s")
    return venv


def torch_venv(version: str, root: Path, no_pip_config: bool = False, echo=print) -> Path:
    """``root/.venv-torch-VERSION`` with ``torch==version`` and the rest of requirements.txt, made
    once: from ``download_torch``'s wheels (removed then) if complete, else from the registry."""
    wheels = wheels_folder(version, root)
    lines = requirements_with_torch((root / "requirements.txt").read_text(), version)

    def install(python: Path) -> int:
        if (wheels / COMPLETE).exists():
            done = pip(python, root, no_pip_config, "install", "--quiet", "--no-index",
                       "--find-links", str(wheels),
                       lines=[line for line in lines if not line.startswith("-e")])
            if done == 0:  # the kit itself last: its build backend comes from the registry as usual
                done = pip(python, root, no_pip_config, "install", "--quiet", "--no-deps", "-e",
                           str(root))
            shutil.rmtree(wheels, ignore_errors=True)
            if done == 0:
                return 0
            echo(f"installing from {wheels} failed (pip exit {done}): installing from the registry")
        return pip(python, root, no_pip_config, "install", "--quiet", lines=lines)

    return _made_once(root / f".venv-torch-{version}", lambda found: same_release(found, version),
                      lambda: sys.executable, f"torch=={version} and the rest of requirements.txt",
                      install, echo)


def base_python(version: str) -> Path:
    """Python ``version`` (``3.10``, ``3.13.0``): ``pythonX.Y`` on PATH, else pyenv's newest. Each is
    asked its version: pyenv's shim on PATH exits 127 for a Python pyenv has not selected."""
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
    """``root/.venv-python-VERSION``: requirements.txt with Python ``version``, made once."""
    def install(python: Path) -> int:
        pip(python, root, no_pip_config, "install", "--quiet", "--upgrade", "pip")
        return pip(python, root, no_pip_config, "install", "--quiet",
                   lines=(root / "requirements.txt").read_text().splitlines())

    return _made_once(root / f".venv-python-{version}", bool, lambda: base_python(version),
                      f"requirements.txt with Python {version}", install, echo)
