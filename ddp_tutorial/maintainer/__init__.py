"""The maintainer's tools, the kit's checks of itself (no notebook imports them). Here: run the
notebook suite several times and count passes per notebook.

A claim a notebook asserts must hold on every run, on a quiet machine and on a
busy one (a shared classroom server), so one green run proves little::

    python -m ddp_tutorial.bench --notebooks 5 --busy-core 2

runs ``pytest --nbmake`` over every notebook 5 times, the last 2 rounds with one
core kept busy by a spinning process, and prints how often each notebook passed,
with its median time. This is not part of the teaching API: it checks the kit.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

from ddp_tutorial import envvars

#: A Python loop that keeps one core at 100 % until it is killed (it says so first).
SPIN = "print('spinning', flush=True)\nwhile True: pass"


@contextlib.contextmanager
def busy_core(enabled: bool = True) -> Iterator[Optional[int]]:
    """Keep one core busy with a spinning process while the block runs; yields its pid."""
    if not enabled:
        yield None
        return
    proc = subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    try:
        proc.stdout.readline()  # it spins from here on
        yield proc.pid
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()


def notebook_round(notebooks: Sequence[Path], timeout: float = 900.0,
                   env: Optional[Dict[str, str]] = None) -> Dict[str, Dict]:
    """One ``pytest --nbmake`` over ``notebooks``; per notebook ``passed`` and ``seconds``.

    A notebook that did not run at all (pytest crashed, the round timed out) counts as failed.

    Args:
        env: extra environment variables for pytest and the notebook kernels
            (``{"DDP_TUTORIAL_WARM": "0"}``: every launch starts cold).
    """
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "--nbmake", "-q", "-p", "no:cacheprovider",
               f"--junitxml={report}", *map(str, notebooks)]
        try:
            subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           env=None if env is None else {**os.environ, **env})
        except subprocess.TimeoutExpired:
            pass
        results = {nb.name: {"passed": False, "seconds": float("nan"), "error": "did not run"}
                   for nb in notebooks}
        if report.exists():
            for case in ET.parse(report).getroot().iter("testcase"):
                name = case.get("name", "").split("::")[0]
                if name in results:
                    problems = [child for child in case if child.tag in ("failure", "error")]
                    results[name] = {"passed": not problems, "seconds": float(case.get("time", "nan"))}
                    if problems:  # the end of nbmake's report names the failing cell's error
                        results[name]["error"] = (problems[0].text or problems[0].get("message", ""))[-600:]
    return results


def busy_schedule(rounds: int, busy_rounds: int) -> List[bool]:
    """Which of ``rounds`` run beside a busy core: the last ``busy_rounds`` (clamped to 0..rounds)."""
    busy_rounds = max(0, min(busy_rounds, rounds))
    return [i >= rounds - busy_rounds for i in range(rounds)]


def notebook_rounds(rounds: int = 1, busy_rounds: int = 0, folder: str = "notebooks",
                    timeout: float = 900.0, echo: bool = True) -> Dict:
    """Run the notebook suite ``rounds`` times; the last ``busy_rounds`` with one core kept busy.

    Args:
        rounds: how many times to run every notebook.
        busy_rounds: how many of them (the last ones) run beside a spinning process.
        folder: where the notebooks are.
        timeout: seconds per round.
        echo: print one line per round as it finishes.

    Returns:
        ``per_notebook`` (name -> passes, runs, median seconds), ``rounds`` (each round's
        results, seconds and whether a core was busy), ``passed``/``runs`` in all.
    """
    notebooks = sorted(Path(folder).glob("*.ipynb"))
    if not notebooks:
        return {"skipped": f"no notebooks in {folder!r}"}
    done: List[Dict] = []
    for i, busy in enumerate(busy_schedule(rounds, busy_rounds)):
        with busy_core(busy):
            t0 = time.perf_counter()
            results = notebook_round(notebooks, timeout)
            seconds = time.perf_counter() - t0
        done.append({"busy_core": busy, "seconds": seconds, "results": results})
        if echo:
            ok = sum(r["passed"] for r in results.values())
            failed = [n for n, r in results.items() if not r["passed"]]
            print(f"round {i + 1}/{rounds}{' (one core busy)' if busy else ''}: {ok}/{len(results)} "
                  f"passed in {seconds:.0f} s" + (f"; failed: {', '.join(failed)}" if failed else ""),
                  flush=True)
    per_notebook = {}
    for nb in notebooks:
        runs = [r["results"][nb.name] for r in done]
        times = [r["seconds"] for r in runs if r["seconds"] == r["seconds"]]
        per_notebook[nb.name] = {"passes": sum(r["passed"] for r in runs), "runs": len(runs),
                                 "median_seconds": statistics.median(times) if times else float("nan")}
    return {"per_notebook": per_notebook, "rounds": done,
            "passed": sum(p["passes"] for p in per_notebook.values()),
            "runs": sum(p["runs"] for p in per_notebook.values())}


def format_rounds(result: Dict) -> str:
    """The pass counts per notebook as a small table."""
    if "skipped" in result:
        return f"notebook rounds: skipped, {result['skipped']}"
    rounds = result["rounds"]
    busy = sum(r["busy_core"] for r in rounds)
    lines = [f"notebook suite: {len(rounds)} rounds ({busy} with one core kept busy), "
             f"{result['passed']}/{result['runs']} notebook runs passed",
             f"  {'notebook':<32} {'passed':>7} {'median s':>9}"]
    for name, p in result["per_notebook"].items():
        lines.append(f"  {name:<32} {p['passes']:>3}/{p['runs']:<3} {p['median_seconds']:>9.1f}")
    lines.append("  round times: " + ", ".join(
        f"{r['seconds']:.0f} s" + (" (busy)" if r["busy_core"] else "") for r in rounds))
    for i, r in enumerate(rounds):
        for name, res in r["results"].items():
            if not res["passed"]:
                tail = " ".join(res.get("error", "").split())[-300:]
                lines.append(f"  round {i + 1}, {name}: {tail}")
    return "\n".join(lines)


def notebook_suite(folder: str = "notebooks", timeout: float = 600.0, warm: bool = True) -> Dict:
    """Wall seconds of one ``pytest --nbmake`` round over ``folder`` (target: under 180 s on 2 cores).

    Args:
        warm: False runs every launch of the notebooks cold (``DDP_TUTORIAL_WARM=0``).
    """
    notebooks = sorted(Path(folder).glob("*.ipynb"))
    if not notebooks:
        return {"skipped": f"no notebooks in {folder!r}"}
    t0 = time.perf_counter()
    results = notebook_round(notebooks, timeout, None if warm else {envvars.WARM: "0"})
    seconds = time.perf_counter() - t0
    failed = [name for name, r in results.items() if not r["passed"]]
    return {"seconds": seconds, "ratio": seconds / 180.0, "notebooks": [n.name for n in notebooks],
            "per_notebook": {name: r["seconds"] for name, r in results.items()},
            "passed": not failed, "failed": failed,
            "summary": f"{len(results) - len(failed)} of {len(results)} notebooks passed"}

