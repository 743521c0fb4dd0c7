"""The README's test command, run in a venv with a given torch, or many times on fresh clones.

    python -m ddp_tutorial.maintainer --torch 2.15.0 [--tests notebooks tests/test_launcher.py]
    python -m ddp_tutorial.maintainer --suite 6 --busy-core 2 [--tests ...]

``--torch`` builds (once; it is kept) ``.venv-torch-VERSION`` in the checkout, with that torch
and the rest of ``requirements.txt``, and runs ``pytest`` there. ``--suite`` runs it N times,
each in a fresh ``git clone`` of the current commit (what is not committed is not tested), the
last K beside a process that keeps one core busy, and prints each test's failures and each
run's wall time. This checks the kit; it is not part of the teaching API.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ddp_tutorial.maintainer import busy_core

#: The README's test command (``pip install -r requirements.txt && pytest``); a test keeps them equal.
README_TEST_COMMAND = ["pytest"]
#: Lines of a failure's report shown in the table.
FAILURE_LINES = 3
#: A failure's captured output kept in ``--json`` (its last characters): a LaunchTimeout prints each
#: rank's stack there, the cause a rare failure of a long table needs to be found.
OUTPUT_CHARS = 20000


def checkout() -> Path:
    """The git checkout this package runs from (where requirements.txt is).

    Raises:
        SystemExit: the package is not run from a checkout (an installed copy has no tests).
    """
    root = Path(__file__).resolve().parents[2]
    if not (root / "requirements.txt").exists() or not (root / "tests").is_dir():
        raise SystemExit(f"error: {root} is not a checkout of ddp-tutorial (no requirements.txt or tests/): "
                         "run this from a git clone")
    return root


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
    return installed is not None and (installed == wanted or installed.split("+")[0] == wanted.split("+")[0])


def pip_env(no_pip_config: bool) -> Dict[str, str]:
    """The environment for pip; ``no_pip_config`` ignores pip's configuration files (a machine's
    cap on torch versions, say) while its PIP_* variables still apply."""
    env = dict(os.environ)
    if no_pip_config:
        env["PIP_CONFIG_FILE"] = os.devnull
    return env


def wheels_folder(version: str, root: Path) -> Path:
    """Where ``download_torch`` keeps the wheels for ``.venv-torch-VERSION`` (gitignored)."""
    return root / f".wheels-torch-{version}"


#: Written into the wheels folder once every wheel is there: a half-finished download is never used.
COMPLETE = "COMPLETE"


def _pip_with_requirements(python, args: Sequence[str], lines: Sequence[str], root: Path,
                           no_pip_config: bool) -> int:
    """``python -m pip ARGS -r FILE`` with ``lines`` as FILE, run in the checkout; pip's exit status."""
    with tempfile.NamedTemporaryFile("w", prefix="requirements-", suffix=".txt", delete=False) as f:
        f.write("\n".join(lines) + "\n")
    try:  # "-e ." is read relative to pip's working folder, the checkout
        return subprocess.run([str(python), "-m", "pip", *args, "-r", f.name], cwd=root,
                              env=pip_env(no_pip_config)).returncode
    finally:
        os.unlink(f.name)


def download_torch(version: str, root: Path, no_pip_config: bool = False, echo=print) -> Path:
    """Download the wheels ``torch_venv(version)`` installs into ``wheels_folder``, and install nothing.

    A CUDA build is gigabytes: CI downloads it while the pinned suite runs (mostly waiting on the
    network), and ``torch_venv`` then installs from the folder without the network.

    Raises:
        SystemExit: pip failed.
    """
    folder = wheels_folder(version, root)
    (folder / COMPLETE).unlink(missing_ok=True)
    folder.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    lines = [line for line in requirements_with_torch((root / "requirements.txt").read_text(), version)
             if not line.startswith("-e")]
    code = _pip_with_requirements(sys.executable, ["download", "--quiet", "--dest", str(folder)], lines, root,
                                  no_pip_config)
    if code != 0:
        raise SystemExit(f"error: downloading torch=={version}'s wheels into {folder} failed (pip exit {code})")
    (folder / COMPLETE).write_text("\n".join(lines) + "\n")
    echo(f"downloaded torch=={version} and the rest of requirements.txt into {folder} "
         f"in {time.perf_counter() - t0:.0f} s")
    return folder


def torch_venv(version: str, root: Path, no_pip_config: bool = False, echo=print) -> Path:
    """``root/.venv-torch-VERSION`` with ``torch==version`` and the rest of requirements.txt, made once.

    From ``wheels_folder`` without the network where ``download_torch`` filled it (the folder is
    removed once installed), else from the registry.

    Raises:
        SystemExit: pip failed, or installed another torch than asked.
    """
    venv = root / f".venv-torch-{version}"
    python = venv_python(venv)
    found = torch_in(python)
    if same_release(found, version):
        echo(f"using {venv} (torch {found})")
        return venv
    wheels = wheels_folder(version, root)
    offline = (wheels / COMPLETE).exists()
    echo(f"building {venv}: torch=={version} and the rest of requirements.txt"
         + (f", from {wheels}" if offline else "") + " ...")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    lines = requirements_with_torch((root / "requirements.txt").read_text(), version)
    if offline:
        done = _pip_with_requirements(python, ["install", "--quiet", "--no-index", "--find-links", str(wheels)],
                                      [line for line in lines if not line.startswith("-e")], root, no_pip_config)
        if done == 0:  # the kit itself last: its build backend comes from the registry as usual
            done = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "-e", str(root)],
                                  env=pip_env(no_pip_config)).returncode
        shutil.rmtree(wheels, ignore_errors=True)
        if done != 0:
            echo(f"installing from {wheels} failed (pip exit {done}): installing from the registry instead")
    if not offline or done != 0:
        done = _pip_with_requirements(python, ["install", "--quiet"], lines, root, no_pip_config)
    found = torch_in(python)
    if done != 0 or not same_release(found, version):
        raise SystemExit(f"error: installing torch=={version} in {venv} failed (pip exit {done}, "
                         f"torch found: {found}); a version above this machine's pip cap needs --no-pip-config")
    echo(f"built {venv} with torch {found} in {time.perf_counter() - t0:.0f} s")
    return venv


def junit_cases(path: Path) -> Dict[str, Dict]:
    """Each test of a junit XML report: ``{"outcome": passed|failed|error|skipped, "seconds", "message"}``.

    ``message`` is the first ``FAILURE_LINES`` non-empty lines of the failure's report
    (pytest's message first, else its text). A failure or error also has ``report``: the whole
    report, then the last ``OUTPUT_CHARS`` of what the test printed (``system-out``/``system-err``,
    present when pytest ran with ``-o junit_logging=all``, as ``run_tests`` does).
    """
    cases = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        # pytest writes tests/test_x.py::test_y as classname "tests.test_x", name "test_y";
        # nbmake's notebooks as classname "" and name "notebooks/00_overview.ipynb"
        test = f"{classname.replace('.', '/')}.py::{name}" if classname else name
        outcome, message, report = "passed", "", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                text = "\n".join(filter(None, [child.get("message", ""), child.text or ""]))
                message = "\n".join([line.rstrip() for line in text.splitlines() if line.strip()][:FAILURE_LINES])
                report = text
                if outcome != "skipped":
                    break
        cases[test] = {"outcome": outcome, "seconds": float(case.get("time", "nan")), "message": message}
        if outcome in ("failed", "error"):
            printed = "\n".join(child.text or "" for child in case if child.tag in ("system-out", "system-err"))
            cases[test]["report"] = report + ("\n--- printed ---\n" + printed[-OUTPUT_CHARS:] if printed.strip() else "")
    return cases


#: A line of pytest's progress: its outcome letters, then how far the run is (``[ 49%]``).
PROGRESS_LINE = re.compile(r"\[\s*\d+%\]\s*$")


def run_tests(python: Path, cwd: Path, tests: Sequence[str] = (), timeout: float = 3600.0,
              env: Optional[Dict[str, str]] = None, echo: bool = True, progress: Optional[str] = None) -> Dict:
    """The README's test command (``pytest`` [TESTS]) with ``python`` in ``cwd``.

    Args:
        echo: print pytest's output as it comes.
        progress: without ``echo``, print only pytest's progress lines (``....F.. [ 49%]``), each after
            this prefix: a long run of many still shows how far it is and what failed so far.

    Returns:
        ``returncode``, ``seconds`` (wall), ``cases`` (``junit_cases``), ``summary`` (pytest's
        last line), ``tail`` (the last lines of its output, for a run that left no report).
    """
    with tempfile.TemporaryDirectory(prefix="ddp-maintainer-") as tmp:
        report = Path(tmp) / "junit.xml"
        cmd = [str(python), "-m", *README_TEST_COMMAND, f"--junitxml={report}", "-o", "junit_logging=all", *tests]
        t0 = time.perf_counter()
        lines: List[str] = []
        # as in an activated venv: what the tests start by name (python, torchrun) is the venv's
        bin_dir = str(Path(python).parent)
        env = {**os.environ, **(env or {}), "VIRTUAL_ENV": str(Path(bin_dir).parent),
               "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")])}
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, stdin=subprocess.DEVNULL)
        try:
            for line in proc.stdout:
                lines.append(line.rstrip("\n"))
                if echo:
                    print(line, end="", flush=True)
                elif progress is not None and PROGRESS_LINE.search(line):
                    print(f"{progress}{line.strip()}", flush=True)
            returncode = proc.wait(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            returncode = proc.wait()
        finally:
            proc.stdout.close()
        seconds = time.perf_counter() - t0
        cases = junit_cases(report) if report.exists() else {}
    summary = next((line.strip("= ") for line in reversed(lines) if line.strip()), "")
    return {"returncode": returncode, "seconds": seconds, "cases": cases, "summary": summary,
            "tail": lines[-20:]}


def test_torch(version: str, tests: Sequence[str] = (), no_pip_config: bool = False) -> int:
    """``--torch``: the README's tests (or ``tests``) in ``.venv-torch-VERSION``; pytest's exit status."""
    root = checkout()
    venv = torch_venv(version, root, no_pip_config)
    python = venv_python(venv)
    found = torch_in(python)
    print(f"$ {python} -m {' '.join(README_TEST_COMMAND + list(tests))}   # torch {found}", flush=True)
    result = run_tests(python, root, tests)
    print(f"torch {found}: {result['summary']} (exit {result['returncode']}, {result['seconds']:.0f} s wall)",
          flush=True)
    return result["returncode"]


def clone(root: Path, into: Path) -> str:
    """A fresh clone of ``root``'s current commit in ``into``; the commit's hash."""
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    subprocess.run(["git", "clone", "--quiet", "--no-checkout", str(root), str(into)], check=True)
    subprocess.run(["git", "-C", str(into), "checkout", "--quiet", "--detach", commit], check=True)
    return commit


def suite_runs(runs: int, busy_runs: int = 0, tests: Sequence[str] = (), torch: Optional[str] = None,
               no_pip_config: bool = False, timeout: float = 3600.0, echo: bool = True) -> Dict:
    """Run the README's tests ``runs`` times, each in a fresh clone; the last ``busy_runs`` beside a busy core.

    One venv serves every run (``.venv-torch-VERSION``, by default with requirements.txt's
    torch); the package is installed from each clone (``pip install -e``) before its run, and
    from the checkout again at the end.

    Returns:
        ``runs``: per run ``busy_core``, ``seconds``, ``returncode``, ``summary``, ``cases``, ``tail``;
        ``commit``, ``torch``.
    """
    root = checkout()
    if torch is None:
        pinned = re.search(r"^torch==(\S+)", (root / "requirements.txt").read_text(), re.M)
        torch = pinned.group(1) if pinned else None
    if torch is None:
        raise SystemExit("error: requirements.txt pins no torch==VERSION: name one with --torch")
    venv = torch_venv(torch, root, no_pip_config)
    python = venv_python(venv)
    busy_runs = max(0, min(busy_runs, runs))
    done: List[Dict] = []
    commit = ""
    try:
        with tempfile.TemporaryDirectory(prefix="ddp-suite-") as tmp:
            for i in range(runs):
                where = Path(tmp) / f"run{i + 1}"
                commit = clone(root, where)
                subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "-e", str(where)],
                               check=True, env=pip_env(no_pip_config))
                busy = i >= runs - busy_runs
                with busy_core(busy):
                    result = run_tests(python, where, tests, timeout, echo=False,
                                       progress=f"run {i + 1}/{runs}: " if echo else None)
                result["busy_core"] = busy
                done.append(result)
                shutil.rmtree(where, ignore_errors=True)
                if echo:
                    print(f"run {i + 1}/{runs}{' (one core busy)' if busy else ''}: {result['summary']} "
                          f"({result['seconds']:.0f} s wall)", flush=True)
    finally:
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "-e", str(root)],
                       env=pip_env(no_pip_config))
    return {"runs": done, "commit": commit, "torch": torch_in(python), "tests": list(tests)}


def failures_per_test(runs: Sequence[Dict]) -> Dict[str, List[tuple]]:
    """test -> [(run number, first lines of its failure), ...] over ``runs``, for failed or errored tests."""
    failed: Dict[str, List[tuple]] = {}
    for number, run in enumerate(runs, 1):
        for test, case in run["cases"].items():
            if case["outcome"] in ("failed", "error"):
                failed.setdefault(test, []).append((number, case["message"]))
    return dict(sorted(failed.items(), key=lambda item: (-len(item[1]), item[0])))


def format_suite(result: Dict) -> str:
    """The runs as a table (one line a run), then each failing test with its count and first lines."""
    runs = result["runs"]
    busy = sum(r["busy_core"] for r in runs)
    command = " ".join(README_TEST_COMMAND + list(result.get("tests", [])))
    lines = [f"`{command}` {len(runs)} times on fresh clones of {result.get('commit', '')[:10]} "
             f"({busy} beside a busy core), torch {result.get('torch')}",
             f"  {'run':>3}  {'busy core':<9} {'passed':>6} {'failed':>6} {'errors':>6} {'skipped':>7} "
             f"{'wall s':>7}  exit"]
    for number, run in enumerate(runs, 1):
        counts = {k: sum(c["outcome"] == k for c in run["cases"].values())
                  for k in ("passed", "failed", "error", "skipped")}
        lines.append(f"  {number:>3}  {'yes' if run['busy_core'] else 'no':<9} {counts['passed']:>6} "
                     f"{counts['failed']:>6} {counts['error']:>6} {counts['skipped']:>7} "
                     f"{run['seconds']:>7.0f}  {run['returncode']}")
    failed = failures_per_test(runs)
    no_report = [n for n, r in enumerate(runs, 1) if not r["cases"]]
    if not failed and not no_report:
        lines.append(f"no test failed in {len(runs)} runs")
    for test, where in failed.items():
        lines.append(f"{test}: failed in {len(where)} of {len(runs)} runs")
        for number, message in where:
            first, *rest = (message or "(no message)").splitlines()
            lines.append(f"    run {number}: {first}")
            lines.extend(f"           {line}" for line in rest)
    for number in no_report:
        lines.append(f"run {number} left no report (exit {runs[number - 1]['returncode']}); its last lines:")
        lines.extend(f"    {line}" for line in runs[number - 1]["tail"][-5:])
    return "\n".join(lines)
