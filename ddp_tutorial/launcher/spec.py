"""``LaunchSpec``, built once from ``launch()``'s arguments, each checked: like torchrun's
``WorkerSpec``, the rest of the launcher reads the spec, never a raw argument."""

from __future__ import annotations

import importlib.util
import math
import numbers
import os
import sys
from collections.abc import Mapping, Sequence as SequenceABC
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ddp_tutorial import runfolder
from ddp_tutorial.backend import BACKENDS
from ddp_tutorial.launcher.errors import LaunchConfigError

PACKAGE_DIR = Path(__file__).resolve().parent.parent
#: What every rank runs first (``python -u BOOTSTRAP SCRIPT ARGS``); it then runs the script.
BOOTSTRAP = str(PACKAGE_DIR / "rank" / "bootstrap.py")
#: More ranks than this on one machine is a typo, not a plan.
MAX_WORLD_SIZE = 1024
#: ``tuple(target) -> check`` (``check_args_with``).
_ARG_CHECKS: Dict[Tuple[str, ...], Callable] = {}


@dataclass(frozen=True)
class LaunchSpec:
    """``launch()``'s arguments, checked; ``target``: ``(path,)`` or ``("-m", module)``;
    ``run_dir``: the claimed run folder."""

    target: Tuple[str, ...]
    world_size: int
    run_dir: Path
    args: Tuple[str, ...] = ()
    backend: str = "auto"
    env: Mapping = field(default_factory=lambda: MappingProxyType({}))
    timeout: float = 120.0
    grace: float = 1.0
    echo: str = "all"
    max_restarts: int = 0
    master_port: Optional[int] = None
    warm: Optional[bool] = None

    @property
    def cmd(self) -> List[str]:
        """Every rank's command line: the bootstrap, then the script and its arguments."""
        return [sys.executable, "-u", BOOTSTRAP, *self.target, *self.args]

    @classmethod
    def build(cls, script, world_size, args=(), *, timeout, backend, run_dir, env, echo,
              max_restarts, master_port, grace, warm) -> "LaunchSpec":
        """Refuse the first bad argument (``LaunchConfigError``), then claim the run folder."""
        world_size = _number("world_size", world_size, 1, MAX_WORLD_SIZE, integer=True)
        timeout = _number("timeout", timeout, 0, above=True)
        grace = _number("grace", grace, 0)
        backend = _choice("backend", backend, BACKENDS)
        echo = _choice("echo", echo, ("all", "rank0", "none"))
        max_restarts = _number("max_restarts", max_restarts, 0, integer=True)
        warm = _choice("warm", warm, (True, False, None))
        if master_port is not None:
            master_port = _number("master_port", master_port, 1, 65535, integer=True)
        args, env, target = _args_param(args), _env_param(env), _resolve_script(script)
        stem = Path(target[-1]).stem if target[0] != "-m" else target[1].rsplit(".", 1)[-1]
        run_dir_name, check = "run_dir", _ARG_CHECKS.get(tuple(target))
        try:
            if check is not None:
                backend, run_dir, run_dir_name = check(args, world_size, backend, run_dir)
            if backend == "nccl":
                check_nccl(world_size)
            if run_dir is not None:  # as given: train.py does not expand ~ either
                run_dir = _path_text(run_dir_name, run_dir)
            run_dir = runfolder.claim(run_dir, stem, run_dir_name,
                                      {"script": target, "world_size": world_size, "args": args})
        except ValueError as exc:  # the script's check, or the run folder's (RunFolderError)
            raise LaunchConfigError(str(exc)) from None
        return cls(tuple(target), world_size, run_dir, tuple(args), backend, MappingProxyType(env),
                   timeout, grace, echo, max_restarts, master_port, warm)


def check_args_with(targets: Sequence[Sequence[str]], check: Callable) -> None:
    """Register ``check(args, world_size, backend, run_dir) -> (backend, run_dir, run_dir_name)``
    for a script (each of ``targets``: ``[path]``, ``["-m", module]``), run before anything starts:
    it raises ``ValueError`` for bad arguments and may take the backend or run folder from them."""
    for target in targets:
        _ARG_CHECKS[tuple(target)] = check


def check_nccl(world_size: int) -> None:
    """Refuse nccl unless every rank can have a GPU of its own (imports torch, only for nccl)."""
    from ddp_tutorial.backend import choose_backend, gpu_count

    try:
        choose_backend("nccl", gpu_count(), world_size)
    except ValueError as exc:
        raise LaunchConfigError(str(exc)) from None


def _refuse(name: str, allowed: str, value) -> LaunchConfigError:
    return LaunchConfigError(f"{name} must be {allowed}, got {value!r}")


def _number(name: str, value, low, high=None, integer: bool = False, above: bool = False):
    """``value`` as an int from ``low`` to ``high`` (``integer``), else as finite seconds >= ``low``
    (> with ``above``); bools and strings are refused."""
    if integer:
        allowed = f"an integer >= {low}" + (f" and <= {high}" if high is not None else "")
    else:
        allowed = f"a finite number of seconds {'>' if above else '>='} {low}"
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise _refuse(name, allowed, value)
    value = int(value) if integer else float(value)
    high = math.inf if high is None else high
    if not (math.isfinite(value) and low <= value <= high) or (above and value == low):
        raise _refuse(name, allowed, value)
    return value


def _choice(name: str, value, choices: Sequence):
    """``value`` if it is one of ``choices`` and of the same type (``1`` is not ``True``)."""
    if not any(type(value) is type(c) and value == c for c in choices):
        allowed = ", ".join(repr(c) for c in choices[:-1]) + f" or {choices[-1]!r}"
        raise _refuse(name, allowed, value)
    return value


def _no_nul(name: str, text: str) -> str:
    if "\0" in text:
        raise LaunchConfigError(f"{name} must not contain a NUL character, got {text!r}")
    return text


def _path_text(name: str, value) -> str:
    """A path given as str or os.PathLike, non-empty and without NUL."""
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(text, str) or not text.strip():
        raise _refuse(name, "a non-empty path (str or os.PathLike)", value)
    return _no_nul(name, text)


def _args_param(args) -> List[str]:
    """The argument list: strings, numbers or paths, each one argument."""
    if isinstance(args, (str, bytes)) or not isinstance(args, SequenceABC):  # not split into chars
        raise _refuse("args", "a list of arguments such as ['--epochs', '2'] "
                      "(strings, numbers or paths)", args)
    out = []
    for i, arg in enumerate(args):
        text = None
        if isinstance(arg, (str, numbers.Real, os.PathLike)) and not isinstance(arg, bool):
            text = os.fspath(arg) if isinstance(arg, os.PathLike) else str(arg)
        if not isinstance(text, str):
            raise _refuse(f"args[{i}]", "a string, a number or a path", arg)
        out.append(_no_nul(f"args[{i}]", text))
    return out


def _env_param(env) -> Dict[str, str]:
    """Extra environment variables: names and values are strings, names without '='."""
    if env is not None and not isinstance(env, Mapping):
        raise _refuse("env", "None or a dict of str -> str", env)
    for key, value in (env or {}).items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise _refuse("env key", "a non-empty string without '=' or NUL", key)
        if not isinstance(value, str):
            raise _refuse(f"env[{key!r}]", "a string (environment values are text)", value)
        _no_nul(f"env[{key!r}]", value)
    return dict(env or {})


def _resolve_script(script) -> List[str]:
    """``[path]`` or ``["-m", module]``, checked to exist."""
    text = _path_text("script", script).strip()
    if text.startswith("-m "):
        module = text[3:].strip()
        if not all(part.isidentifier() for part in module.split(".")):
            raise LaunchConfigError(f"script '-m {module}' does not name a module: "
                                    "give '-m package.module'")
        try:
            found = importlib.util.find_spec(module) is not None
        except Exception:  # a parent package that fails to import: not runnable either
            found = False
        if not found:
            raise LaunchConfigError(f"module {module!r} not found: cannot run `-m {module}`")
        return ["-m", module]
    path, how = Path(text).expanduser(), "give a .py file path, or '-m module'"
    if path.is_dir():
        raise LaunchConfigError(f"script {str(path)!r} is a folder: {how}")
    if not path.is_file():
        raise LaunchConfigError(f"script not found: {str(path)!r} ({how})")
    return [str(path.resolve())]
