"""Grade a class: every learner's exercise files, each checked on real ranks in its own sandbox.

Each goes through ``exercises.check`` as the notebook runs it, in bubblewrap (``sandbox.py``;
docs/grading.md); a cache in ``--out``, beside the reports: a rerun checks only what changed."""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path
from typing import Dict, Optional, Sequence

import psutil

from ddp_tutorial.exercises import NAMES
from ddp_tutorial.launcher import procgroup
from ddp_tutorial.teacher.grade import report, sandbox
from ddp_tutorial.teacher.grade.collect import LayoutError, collect
from ddp_tutorial.teacher.grade.report import (CRASHED, FAILED, NOT_SUBMITTED, PACKAGE_ROOT, PASSED,
                                               REFUSED, TIMED_OUT, Limits, Outcome, cache_key,
                                               earlier_outcomes, kit_version)

KIT_ROOT = PACKAGE_ROOT.parent
#: The sandboxes' uids: slot n (a check running at once) runs as UID_BASE + n, a uid no one has.
UID_BASE = 2_100_000_000
#: How a run that hit its deadline is described by the check (``exercises.runs``).
DEADLINE = "did not finish within"


# -- One check in its sandbox ---------------------------------------------------------------
def wall_limit(exercise: str, timeout: float) -> float:
    """The grader's deadline for a check: its runs (teardown runs the script twice), plus starting
    Python and importing torch."""
    return (2 if exercise == "teardown" else 1) * timeout + 120.0


class _Tail(threading.Thread):
    """Reads a pipe to its end in a thread, keeping its last ``limit`` bytes (the report shows the
    end of a check's output); ``dropped``: how many bytes came before them."""

    def __init__(self, stream, limit: int):
        super().__init__(daemon=True)
        self.stream, self.limit, self.kept, self.dropped = stream, limit, b"", 0
        self.start()

    def run(self):
        with self.stream:
            for chunk in iter(lambda: self.stream.read1(1 << 16), b""):
                self.kept += chunk
                self.dropped += max(0, len(self.kept) - self.limit)
                self.kept = self.kept[-self.limit:]

    def text(self) -> str:
        self.join(5)
        dropped = f"... ({self.dropped} bytes of output left out) ...\n" if self.dropped else ""
        return dropped + self.kept.decode("utf-8", "replace")


#: The sandboxes running now: an interrupted grader stops them all at once.
_RUNNING: Dict[int, subprocess.Popen] = {}


@functools.lru_cache(maxsize=None)
def torch_address_space() -> int:
    """Bytes of address space importing torch (and what DDP imports) maps here, rounded up to 256 MiB:
    a CUDA build maps its libraries whole, so a fixed RLIMIT_AS would fit only one kind of wheel."""
    code = "import psutil, torch, torch._dynamo, torch.distributed\nprint(psutil.Process().memory_info().vms)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(KIT_ROOT)})
    if done.returncode != 0:
        raise RuntimeError(f"could not measure what importing torch maps: {done.stderr.strip()[-500:]}")
    quantum = 256 << 20
    return -(-int(done.stdout.split()[-1]) // quantum) * quantum


def _empty(uid: int, timeout: float = 10.0) -> None:
    """Wait until no process of ``uid`` is left, killing any: the sandbox's processes die with its
    pid namespace, but not at once (a fork loop's hundreds take a while on a busy machine), and the
    next check with this uid must start alone."""
    def gone() -> bool:  # kills what is left; True once nothing was
        alive = [p for p in psutil.process_iter(["uids", "status"]) if p.info["uids"] is not None
                 and p.info["uids"].real == uid and p.info["status"] != psutil.STATUS_ZOMBIE]
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        return not alive

    procgroup.wait_until(gone, timeout)


def check_in_sandbox(learner: str, exercise: str, source: bytes, timeout: float, uid: int, limits: Limits,
                     hide: Sequence[str], keep: Sequence[str]) -> Outcome:
    """``exercises.check`` one file in a fresh sandbox; never raises for what the file does."""
    t0 = time.monotonic()
    read_end, write_end = os.pipe()
    # RLIMIT_AS: what importing torch maps, plus what the check may use beyond it
    argv = sandbox.command(exercise, timeout, uid, write_end, {
        **asdict(limits), "memory_bytes": torch_address_space() + limits.memory_bytes}, hide, keep)
    home, check = f"{sandbox.CHECK_DIR}/home", sandbox.CHECK_DIR
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, "LANG": "C.UTF-8",
           "TMPDIR": "/tmp", "MPLCONFIGDIR": home, "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": str(KIT_ROOT), "DDP_TUTORIAL_RUNS": f"{check}/runs",
           "DDP_TUTORIAL_MY_WORK": check}
    process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, pass_fds=(write_end,), start_new_session=True,
                               cwd="/", env=env)
    _RUNNING[process.pid] = process
    os.close(write_end)
    output = _Tail(process.stdout, limits.output_bytes)
    result = _Tail(os.fdopen(read_end, "rb"), 8 << 20)
    killed = False
    with contextlib.suppress(BrokenPipeError):
        process.stdin.write(source)
        process.stdin.close()
    try:
        process.wait(wall_limit(exercise, timeout))
    except subprocess.TimeoutExpired:
        killed = True
    finally:  # the deadline, or the grader interrupted: the whole sandbox goes
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        _RUNNING.pop(process.pid, None)
        _empty(uid)
    log = output.text()[-4000:]  # its end: what the report shows, and keeps in results.json
    seconds = time.monotonic() - t0
    result.join(5)
    try:
        data = None if result.dropped else json.loads(result.kept or b"null")
    except ValueError:
        data = None
    if killed:
        return Outcome(learner, exercise, TIMED_OUT, f"the check did not end within the grader's "
                       f"{wall_limit(exercise, timeout):.0f} s, and was stopped with everything it started",
                       seconds=seconds, log=log)
    if not isinstance(data, dict) or "criteria" not in data:
        last = next((line.strip() for line in reversed(log.splitlines()) if line.strip()), "no output")
        return Outcome(learner, exercise, CRASHED, f"the check itself stopped ({_exit(process.returncode)}), "
                       f"with no result: {last}"[:400], seconds=seconds, log=log)
    return _judged(learner, exercise, data, seconds, log)


def _exit(code: int) -> str:
    try:  # bwrap exits 128 + the signal that killed the check
        return f"killed by {signal.Signals(-code if code < 0 else code - 128).name}"
    except ValueError:
        return f"exit code {code}"


def _judged(learner: str, exercise: str, data: dict, seconds: float, log: str) -> Outcome:
    criteria = [[str(c[0]), bool(c[1]), str(c[2])] for c in data["criteria"]]
    failed = [c for c in criteria if not c[1] and not c[2].startswith("not measured: ")]
    if data.get("passed") and not failed:
        return Outcome(learner, exercise, PASSED, "", criteria, seconds, log=log)
    first = failed[0] if failed else next(c for c in criteria if not c[1])
    lines = [line.strip() for line in first[2].splitlines() if line.strip()]
    summary = f"{first[0]}: {lines[0] if lines else ''}"
    if len(lines) > 1 and lines[0].endswith(":"):  # "... its traceback:": the error is the last line
        summary += f" {lines[-1]}"
    # every judge's first criterion: the script ran to the end
    status = (TIMED_OUT if any(c[2].startswith(DEADLINE) for c in failed)
              else CRASHED if criteria and not criteria[0][1] else FAILED)
    return Outcome(learner, exercise, status, summary[:400], criteria, seconds, log=log)


# -- The class ---------------------------------------------------------------------------------
def sandbox_problem() -> Optional[str]:
    """Why this machine cannot run the sandbox, or None."""
    if os.geteuid() != 0:
        return ("grading runs each learner's code in a sandbox (namespaces, a uid of its own), which "
                "needs root: run it with sudo, or in a container as root (docs/grading.md)")
    return sandbox.missing()


def hidden_and_kept(submissions: Path, out: Path) -> tuple:
    """The folders a check must not see, and the paths it needs even where they lie inside one."""
    home = Path(os.path.expanduser("~")).resolve()
    hide = {str(submissions), str(out), str(home), "/root", str(KIT_ROOT / "notebooks" / "my_work")}
    hide = {p for p in hide if os.path.isdir(p)}
    keep = {str(Path(p).resolve()) for p in [sys.prefix, sys.base_prefix, KIT_ROOT, *sys.path] if p}
    keep = {p for p in keep if os.path.exists(p)}
    for needed, folder in itertools.product(keep, (submissions, out)):
        if Path(needed).is_relative_to(folder):
            raise LayoutError(f"{folder} holds {needed}, which every check needs: keep the "
                              "submissions and --out apart from the kit and its Python")
    return sorted(hide), sorted(keep)


def grade(submissions_root, out="grades", jobs: int = 1, timeout: float = 60.0) -> Dict:
    """Check every file of every learner, ``jobs`` at once, write the report into ``out``; returns
    ``outcomes``, ``submissions``. LayoutError (nothing written): a layout it does not read."""
    t0, limits = time.monotonic(), Limits()
    root, out = Path(submissions_root).resolve(), Path(out).resolve()
    subs = collect(root)
    if problem := sandbox_problem():
        raise RuntimeError(problem)
    if out == root or root in out.parents or out in root.parents:
        raise LayoutError(f"--out {out} and the submissions {root} must be apart")
    hide, keep = hidden_and_kept(root, out)
    out.mkdir(parents=True, exist_ok=True)
    kit = kit_version()
    earlier = earlier_outcomes(out)
    print(*(f"skipped {s.learner}/{line}\n" for s in subs for line in s.skipped), sep="", end="")
    total = sum(e in s.files and e not in s.refused for s in subs for e in NAMES)
    print(f"grading {total} files of {len(subs)} learners, {jobs} at a time, into {out}", flush=True)
    outcomes: Dict[tuple, Outcome] = {}
    fresh, done = [], 0

    def said(outcome: Outcome, how: str) -> None:
        nonlocal done
        done += 1
        mark = "✓" if outcome.status == PASSED else report.cell(outcome)
        print(f"[{done}/{total}] {outcome.learner} · {outcome.exercise}: {mark} ({how})",
              flush=True)

    for sub, exercise in itertools.product(subs, NAMES):
        learner = sub.learner
        if exercise in sub.refused:
            outcomes[learner, exercise] = Outcome(learner, exercise, REFUSED, sub.refused[exercise])
        elif exercise not in sub.files:
            outcomes[learner, exercise] = Outcome(learner, exercise, NOT_SUBMITTED)
        else:
            key = cache_key(exercise, sub.files[exercise], kit, timeout, limits)
            saved = earlier.get((learner, exercise), {})
            if saved.get("key") == key:
                outcomes[learner, exercise] = Outcome(**{**saved, "cached": True})
                said(outcomes[learner, exercise], "unchanged: from the cache")
            else:
                fresh.append((learner, exercise, sub.files[exercise], key))
    slots, worker = itertools.count(), threading.local()  # a uid per worker thread: per check at once

    def one(learner, exercise, source, key) -> Outcome:
        print(f"      checking {learner} · {exercise} ...", flush=True)
        outcome = check_in_sandbox(learner, exercise, source, timeout, worker.uid, limits, hide,
                                   keep)
        outcome.key = key
        return outcome

    pool = ThreadPoolExecutor(jobs, initializer=lambda: setattr(worker, "uid", UID_BASE + next(slots)))
    try:
        for future in as_completed([pool.submit(one, *item) for item in fresh]):
            outcome = future.result()
            outcomes[outcome.learner, outcome.exercise] = outcome
            said(outcome, f"{outcome.seconds:.0f} s")
        pool.shutdown()
    except BaseException:  # Ctrl-C: no check starts any more, and the running ones stop now
        pool.shutdown(wait=False, cancel_futures=True)
        for process in list(_RUNNING.values()):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        raise
    finally:  # interrupted or not: what is known so far goes into the report
        ordered = [outcomes.get((s.learner, e)) or Outcome(s.learner, e, "not checked", "grading was interrupted")
                   for s in subs for e in NAMES]
        seconds = time.monotonic() - t0
        written = report.write(out, subs, ordered, seconds, {"kit": kit, "timeout": timeout, "jobs": jobs,
                                                             "limits": asdict(limits)})
    print("\nper exercise:", *("  " + line for line in report.per_exercise_lines(subs, ordered)),
          sep="\n", flush=True)
    print(f"graded {len(subs)} learners in {seconds:.0f} s: {written['html']}, {written['csv']}",
          flush=True)
    return {"outcomes": ordered, "submissions": subs}
