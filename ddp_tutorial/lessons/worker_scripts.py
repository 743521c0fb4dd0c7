"""Finding the kit's worker scripts: each lesson's in its own ``workers/`` folder."""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent


def worker_script(package_file: str, name: str) -> str:
    """A lesson's worker script: ``worker_script(__file__, "sampler_demo.py")``."""
    path = Path(package_file).resolve().parent / "workers" / name
    if not path.is_file():
        raise FileNotFoundError(f"no worker script {path}")
    return str(path)


def scripts_path(name: str) -> str:
    """Any of the kit's worker scripts by file name, e.g. ``scripts_path("hello.py")``."""
    found = sorted(PACKAGE_DIR.glob(f"**/workers/{name}"))
    if len(found) != 1:
        raise FileNotFoundError(f"{len(found)} worker scripts named {name!r} in {PACKAGE_DIR}")
    return str(found[0])
