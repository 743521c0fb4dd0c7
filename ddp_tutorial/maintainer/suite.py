"""The README's tests many times (``--suite``: fresh clones), with another torch (``--torch``), or
the notebooks in place (``--notebooks``); the last K runs beside a busy core, as on a shared
classroom server. The table: each run's wall time, each test's failures, each notebook's median."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import statistics
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

from ddp_tutorial.lessons.table import text_table
from ddp_tutorial.maintainer.pythons import pip, torch_in, torch_venv, venv_python

#: The README's test command (``pip install -r requirements.txt && pytest``); a test keeps them equal.
README_TEST_COMMAND = ["pytest"]
#: Lines of a failure's report shown in the table.
FAILURE_LINES = 3
#: A failure's captured output kept in ``--json``: a LaunchTimeout's stacks, to find a rare failure.
OUTPUT_CHARS = 20000
#: A Python loop that keeps one core at 100 % until it is killed (it says so first).
SPIN = "print('spinning', flush=True)\nwhile True: pass"


@contextlib.contextmanager
def busy_core() -> Iterator[int]:
    """Keep one core busy with a spinning process while the block runs; yields its pid."""
    proc = subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE)
    try:
        proc.stdout.readline()  # it spins from here on
        yield proc.pid
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()


def busy_schedule(runs: int, busy_runs: int) -> List[bool]:
    """Which of ``runs`` go beside a busy core: the last ``busy_runs`` (clamped to 0..runs)."""
    return [i >= runs - max(0, busy_runs) for i in range(runs)]


def checkout() -> Path:
    """The checkout this package runs from; SystemExit for an installed copy (it has no tests)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "requirements.txt").exists() or not (root / "tests").is_dir():
        raise SystemExit(f"error: {root} is not a checkout of ddp-tutorial (no requirements.txt or tests/): "
                         "run this from a git clone")
    return root


def junit_cases(path: Path) -> Dict[str, Dict]:
    """test -> ``outcome``, ``seconds``, ``message`` (its first lines); a failure also has
    ``report``: the whole report, then the end of what it printed (``-o junit_logging=all``)."""
    outcomes = {"failure": "failed", "error": "error", "skipped": "skipped", "passed": "passed"}
    cases = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        # pytest writes tests/test_x.py::test_y as classname "tests.test_x", name "test_y";
        # nbmake notebooks/00_overview.ipynb as "notebooks.00_overview.ipynb", "00_overview.ipynb"
        test = (classname[:-len(name)].replace(".", "/") + name if name.endswith(".ipynb")
                else f"{classname.replace('.', '/')}.py::{name}")
        marks = [child for child in case if child.tag in outcomes]  # a failure wins over a skip
        mark = next((m for m in marks if m.tag != "skipped"), (marks or [ET.Element("passed")])[-1])
        report = "\n".join(filter(None, [mark.get("message", ""), mark.text or ""]))
        lines = [line.rstrip() for line in report.splitlines() if line.strip()]
        cases[test] = {"outcome": outcomes[mark.tag], "seconds": float(case.get("time", "nan")),
                       "message": "\n".join(lines[:FAILURE_LINES])}
        if mark.tag in ("failure", "error"):
            printed = "\n".join(c.text or "" for c in case if c.tag in ("system-out", "system-err"))
            cases[test]["report"] = report + (
                "\n--- printed ---\n" + printed[-OUTPUT_CHARS:] if printed.strip() else "")
    return cases


#: A line of pytest's progress: its outcome letters, then how far the run is (``[ 49%]``).
PROGRESS_LINE = re.compile(r"\[\s*\d+%\]\s*$")


def run_tests(python: Path, cwd: Path, tests: Sequence[str] = (), timeout: float = 3600.0,
              env: Optional[Dict[str, str]] = None, echo: bool = True, progress: Optional[str] = None) -> Dict:
    """``pytest`` [TESTS] with ``python`` in ``cwd``: ``returncode``, ``seconds``, ``cases``,
    ``summary`` (pytest's last line), ``tail``. ``echo`` prints pytest's output; else ``progress``
    prefixes only its progress lines (``..F [ 49%]``), so a long run still shows how far it is."""
    with tempfile.TemporaryDirectory(prefix="ddp-maintainer-") as tmp:
        report = Path(tmp) / "junit.xml"
        cmd = [str(python), "-m", *README_TEST_COMMAND, f"--junitxml={report}", "-o", "junit_logging=all", *tests]
        t0 = time.perf_counter()
        lines: List[str] = []
        # as in an activated venv: what the tests start by name (python, torchrun) is the venv's
        bin_dir = str(Path(python).parent)
        env = {**os.environ, **(env or {}), "VIRTUAL_ENV": str(Path(bin_dir).parent),
               "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")])}
        with subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, stdin=subprocess.DEVNULL) as proc:
            deadline = threading.Timer(timeout, proc.kill)  # a hung run ends its output too
            deadline.start()
            for line in proc.stdout:
                lines.append(line.rstrip("\n"))
                if echo:
                    print(line, end="", flush=True)
                elif progress is not None and PROGRESS_LINE.search(line):
                    print(f"{progress}{line.strip()}", flush=True)
            deadline.cancel()
        returncode = proc.returncode
        seconds = time.perf_counter() - t0
        cases = junit_cases(report) if report.exists() else {}
    summary = next((line.strip("= ") for line in reversed(lines) if line.strip()), "")
    return {"returncode": returncode, "seconds": seconds, "cases": cases, "summary": summary,
            "tail": lines[-20:]}


def clone(root: Path, into: Path) -> str:
    """A fresh clone of ``root``'s current commit in ``into``; the commit's hash."""
    subprocess.run(["git", "clone", "--quiet", str(root), str(into)], check=True)
    return subprocess.run(["git", "-C", str(into), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()


def pinned_torch(requirements: str) -> Optional[str]:
    """The version in ``torch==VERSION`` (before any ``; marker``), or None."""
    pinned = re.search(r"^torch==([\w.+]+)", requirements, re.M)
    return pinned.group(1) if pinned else None


def suite_runs(runs: int, busy_runs: int = 0, tests: Sequence[str] = (), torch: Optional[str] = None,
               no_pip_config: bool = False, timeout: float = 3600.0, echo: bool = True,
               in_place: bool = False, env: Optional[Dict[str, str]] = None) -> Dict:
    """The README's tests ``runs`` times, the last ``busy_runs`` beside a busy core: each in a fresh
    clone with ``.venv-torch-VERSION`` (the package installed from the clone, then the checkout
    again), or ``in_place`` with this Python; ``runs`` holds ``run_tests``' rows."""
    python, root = Path(sys.executable), Path.cwd()
    if not in_place:
        root = checkout()
        if torch is None:
            torch = pinned_torch((root / "requirements.txt").read_text())
        if torch is None:
            raise SystemExit("error: requirements.txt pins no torch==VERSION: name one (--torch)")
        python = venv_python(torch_venv(torch, root, no_pip_config))

    def install(where: Path) -> None:
        code = pip(python, where, no_pip_config, "install", "--quiet", "--no-deps", "-e",
                   str(where))
        if code and where != root:
            raise SystemExit(f"error: installing {where} into {python} failed (pip exit {code})")

    done: List[Dict] = []
    commit = ""
    try:
        with tempfile.TemporaryDirectory(prefix="ddp-suite-") as tmp:
            for i, busy in enumerate(busy_schedule(runs, busy_runs)):
                where = root if in_place else Path(tmp) / f"run{i + 1}"
                if not in_place:
                    commit = clone(root, where)
                    install(where)
                with busy_core() if busy else contextlib.nullcontext():
                    result = run_tests(python, where, tests, timeout, env=env, echo=False,
                                       progress=f"run {i + 1}/{runs}: " if echo else None)
                result["busy_core"] = busy
                done.append(result)
                if not in_place:
                    shutil.rmtree(where, ignore_errors=True)
                if echo:
                    print(f"run {i + 1}/{runs}{' (one core busy)' if busy else ''}: {result['summary']} "
                          f"({result['seconds']:.0f} s wall)", flush=True)
    finally:
        if not in_place:
            install(root)
    return {"runs": done, "commit": commit, "torch": torch_in(python), "tests": list(tests),
            "in_place": in_place}


def notebook_rounds(rounds: int = 1, busy_rounds: int = 0, folder: str = "notebooks",
                    timeout: float = 900.0, echo: bool = True,
                    env: Optional[Dict[str, str]] = None) -> Dict:
    """Every notebook in ``folder``, ``rounds`` times, one at a time (each notebook's time is its
    own, as a learner runs it): ``suite_runs`` in place, ``-n 0 --nbmake``."""
    return suite_runs(rounds, busy_rounds, ["-n", "0", "--nbmake", folder], timeout=timeout,
                      echo=echo, in_place=True, env=env)


def describe_notebook_suite(warm: Optional[Dict], cold: Optional[Dict]) -> List[str]:
    """The bench's lines on its rounds of the notebooks (``notebook_rounds``, one each, with warm
    starts and all launches cold): each round, then each notebook's time cold and warm."""
    if warm is None:
        return ["notebook suite: not timed (quick mode; run the full bench)"]
    lines, medians = [], {}
    for label, result in (("all launches cold", cold), ("warm", warm)):
        if result is not None:
            run, times = result["runs"][0], notebook_times(result["runs"])
            medians[label] = {name: median for name, (_, _, median) in times.items()}
            failed = [name for name, (passes, _, _) in times.items() if not passes]
            n, passed = len(times), times and not failed and run["returncode"] == 0
            lines.append(f"notebook suite, {label}: {run['seconds']:.0f} s for {n} notebooks one at "
                         f"a time, ratio {run['seconds'] / 180:.2f} of 180 s "
                         f"({'passed' if passed else 'FAILED'}: {n - len(failed)} of {n} passed"
                         + (f"; failed: {', '.join(failed)})" if failed else ")"))
    if cold:
        warm_s = medians["warm"]
        lines.append(text_table(["notebook", "cold s", "warm s", "warm/cold"], [
            (name, f"{c:.1f}", f"{warm_s.get(name, math.nan):.1f}",
             f"{warm_s.get(name, math.nan) / c:.2f}")
            for name, c in medians["all launches cold"].items()]))
    return lines


def notebook_times(runs: Sequence[Dict]) -> Dict[str, tuple]:
    """notebook -> (runs it passed, runs it ran in, median seconds), from the runs' reports."""
    seen: Dict[str, List[Dict]] = {}
    for run in runs:
        for test, case in run["cases"].items():
            if test.endswith(".ipynb"):
                seen.setdefault(test, []).append(case)
    return {test: (sum(c["outcome"] == "passed" for c in cases), len(cases),
                   statistics.median(c["seconds"] for c in cases))
            for test, cases in sorted(seen.items())}


def report(result: Dict, json_path: Optional[str] = None) -> int:
    """Print ``format_suite``'s table (and write ``json_path``); 0 if every run passed."""
    print(format_suite(result), flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1))
    runs = result.get("runs", [])
    return 1 if not runs or failures_per_test(runs) or any(r["returncode"] for r in runs) else 0


def failures_per_test(runs: Sequence[Dict]) -> Dict[str, List[tuple]]:
    """test -> [(run number, first lines of its failure), ...], for failed or errored tests."""
    failed: Dict[str, List[tuple]] = {}
    for number, run in enumerate(runs, 1):
        for test, case in run["cases"].items():
            if case["outcome"] in ("failed", "error"):
                failed.setdefault(test, []).append((number, case["message"]))
    return dict(sorted(failed.items(), key=lambda item: (-len(item[1]), item[0])))


def format_suite(result: Dict) -> str:
    """One line a run, each notebook's passes and median, each failing test with its first lines."""
    runs = result["runs"]
    busy = sum(r["busy_core"] for r in runs)
    command = " ".join(README_TEST_COMMAND + list(result.get("tests", [])))
    where = ("in place" if result.get("in_place")
             else f"on fresh clones of {result.get('commit', '')[:10]}")
    kinds = ("passed", "failed", "error", "skipped")
    rows = [(number, "yes" if run["busy_core"] else "no",
             *(sum(c["outcome"] == k for c in run["cases"].values()) for k in kinds),
             f"{run['seconds']:.0f}", run["returncode"]) for number, run in enumerate(runs, 1)]
    title = (f"`{command}` {len(runs)} times {where} ({busy} beside a busy core), "
             f"torch {result.get('torch')}")
    header = ["run", "busy core", "passed", "failed", "errors", "skipped", "wall s", "exit"]
    lines = [text_table(header, rows, title)]
    for test, (passes, ran, median) in notebook_times(runs).items():
        lines.append(f"  {test:<44} passed {passes}/{ran}, median {median:.1f} s")
    failed = failures_per_test(runs)
    no_report = [n for n, r in enumerate(runs, 1) if not r["cases"]]
    if not failed and not no_report:
        lines.append(f"no test failed in {len(runs)} runs")
    for test, where in failed.items():
        lines.append(f"{test}: failed in {len(where)} of {len(runs)} runs")
        lines += [f"    run {number}: " + (message or "(no message)").replace("\n", "\n" + " " * 11)
                  for number, message in where]
    for number in no_report:
        lines.append(f"run {number} left no report (exit {runs[number - 1]['returncode']}); "
                     "its last lines:")
        lines.extend(f"    {line}" for line in runs[number - 1]["tail"][-5:])
    return "\n".join(lines)


def check_venv(venv: Path, tests: Sequence[str] = (), demo: bool = False) -> int:
    """``--torch``, ``--python``: the README's tests (``demo``: after the demo) with ``venv``."""
    root, python = checkout(), venv_python(venv)
    code = 0
    if demo:  # its output as it comes
        print(f"$ {python} -m ddp_tutorial --world-size 2", flush=True)
        code = subprocess.run([str(python), "-m", "ddp_tutorial", "--world-size", "2"], cwd=root,
                              timeout=600).returncode
    print(f"$ {python} -m {' '.join(README_TEST_COMMAND + list(tests))}", flush=True)
    result = run_tests(python, root, tests)
    print(f"{venv.name}, torch {torch_in(python)}: {result['summary']} "
          f"(exit {result['returncode']}, {result['seconds']:.0f} s wall)", flush=True)
    return code or result["returncode"]
