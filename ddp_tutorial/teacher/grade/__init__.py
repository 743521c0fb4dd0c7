"""Grade a class: every learner's exercise files, each checked on real ranks in a sandbox of its own.

    python -m ddp_tutorial.grade SUBMISSIONS [--out grades] [--jobs 1] [--timeout 60]

SUBMISSIONS holds one folder (or one .zip) per learner, named for the learner,
with the files ``exercises.start`` writes: ``init.py``, ``wrap.py``, ``sampler.py``,
``no_sync.py``, ``teardown.py``, ``capstone.py``, ``shard.py`` (any subset). Each file
goes through ``exercises.check``, as the learner's notebook runs it, inside a sandbox
(``sandbox.py``, bubblewrap): its own PID, mount and network namespaces, its own uid, a fresh
folder, read-only everything else, and limits on time, memory, processes and output.
The results go to ``--out``: ``report.html``, ``report.csv``, ``results.json``, and a
cache that lets a second run check only what is new or changed. What the sandbox
guarantees, and what it does not: docs/grading.md.
"""

from __future__ import annotations

import functools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path
from typing import Dict, Optional, Sequence

from ddp_tutorial.exercises import NAMES
from ddp_tutorial.teacher.grade import sandbox
from ddp_tutorial.teacher.grade.collect import LayoutError, collect
from ddp_tutorial.teacher.grade.outcomes import (CRASHED, FAILED, NOT_SUBMITTED, PACKAGE_ROOT, PASSED, REFUSED,
                                                 TIMED_OUT, Cache, Limits, Outcome, cache_key, kit_version)

KIT_ROOT = PACKAGE_ROOT.parent
#: The sandboxes' uids: slot n (one per check running at once) runs as UID_BASE + n, a uid no one has.
UID_BASE = 2_100_000_000
#: How a run that hit its deadline is described by the check (``exercises.runs``).
DEADLINE = "did not finish within"


# -- One check in its sandbox ----------------------------------------------------------------------------
def runs_of(exercise: str) -> int:
    """How many deadlines a check may use one after another (teardown runs the script twice)."""
    return 2 if exercise == "teardown" else 1


def wall_limit(exercise: str, timeout: float) -> float:
    """The grader's own deadline for a whole check: its runs, plus starting Python and importing torch."""
    return runs_of(exercise) * timeout + 120.0


class _Capped:
    """Reads a pipe to its end in a thread, keeping at most ``limit`` bytes (the head and the tail)."""

    def __init__(self, stream, limit: int):
        self.stream, self.limit, self.head, self.tail, self.dropped = stream, limit, b"", b"", 0
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        half = self.limit // 2
        while True:
            chunk = self.stream.read1(1 << 16) if hasattr(self.stream, "read1") else self.stream.read(1 << 16)
            if not chunk:
                break
            if len(self.head) < half:
                take = chunk[:half - len(self.head)]
                self.head += take
                chunk = chunk[len(take):]
            self.tail = (self.tail + chunk)[-half:]
            self.dropped += max(0, len(chunk) - half)
        self.stream.close()

    def text(self) -> str:
        self.thread.join(5)
        middle = f"\n... ({self.dropped} bytes of output left out) ...\n" if self.dropped else ""
        return (self.head.decode("utf-8", "replace") + middle + self.tail.decode("utf-8", "replace"))

    def data(self) -> bytes:
        self.thread.join(5)
        return b"" if self.dropped else self.head + self.tail


#: The sandboxes running now: an interrupted grader stops them all at once.
_RUNNING: Dict[int, subprocess.Popen] = {}


def stop_all_sandboxes() -> None:
    for process in list(_RUNNING.values()):
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@functools.lru_cache(maxsize=None)
def torch_address_space() -> int:
    """Bytes of address space a rank maps for torch alone (``import torch`` and what DDP imports), in a
    fresh process of this Python, rounded up to 256 MiB: about 0.7 GiB for the CPU wheel, 3.5 to 5 GiB
    for a CUDA build (its libraries are mapped whole, used or not). A fixed RLIMIT_AS would let a
    check on the CPU wheel use more than one on a CUDA build, or stop a CUDA build's ``import torch``."""
    code = "import psutil, torch, torch._dynamo, torch.distributed\nprint(psutil.Process().memory_info().vms)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(KIT_ROOT)})
    if done.returncode != 0:
        raise RuntimeError(f"could not measure what importing torch maps: {done.stderr.strip()[-500:]}")
    quantum = 256 << 20
    return -(-int(done.stdout.split()[-1]) // quantum) * quantum


def check_in_sandbox(learner: str, exercise: str, source: bytes, timeout: float, uid: int, limits: Limits,
                     hide: Sequence[str], keep: Sequence[str]) -> Outcome:
    """``exercises.check`` one file in a fresh sandbox (``sandbox.py``); never raises for what the file does."""
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
    output = _Capped(process.stdout, limits.output_bytes)
    result = _Capped(os.fdopen(read_end, "rb"), 8 << 20)
    killed = False
    try:
        process.stdin.write(source)
        process.stdin.close()
    except BrokenPipeError:
        pass
    try:
        process.wait(wall_limit(exercise, timeout))
    except subprocess.TimeoutExpired:
        killed = True
    finally:  # the deadline, or the grader interrupted: the whole sandbox goes
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        _RUNNING.pop(process.pid, None)
    log = output.text()
    seconds = time.monotonic() - t0
    try:
        data = json.loads(result.data() or b"null")
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
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    if code > 128:
        try:
            return f"killed by {signal.Signals(code - 128).name}"
        except ValueError:
            pass
    return f"exit code {code}"


def _judged(learner: str, exercise: str, data: dict, seconds: float, log: str) -> Outcome:
    criteria = [[str(c[0]), bool(c[1]), str(c[2])] for c in data["criteria"]]
    failed = [c for c in criteria if not c[1] and not c[2].startswith("not measured: ")]
    if data.get("passed") and not failed:
        return Outcome(learner, exercise, PASSED, "", criteria, seconds, log=log)
    first = failed[0] if failed else next(c for c in criteria if not c[1])
    lines = [line.strip() for line in first[2].splitlines() if line.strip()]
    summary = f"{first[0]}: {lines[0] if lines else ''}"
    if len(lines) > 1 and lines[0].endswith(":"):  # "... the end of its traceback:": the error is its last line
        summary += f" {lines[-1]}"
    if any(c[2].startswith(DEADLINE) for c in failed):
        status = TIMED_OUT
    elif criteria and not criteria[0][1]:  # every judge's first criterion: the script ran to its end
        status = CRASHED
    else:
        status = FAILED
    return Outcome(learner, exercise, status, summary[:400], criteria, seconds, log=log)


# -- The class -------------------------------------------------------------------------------------------
def sandbox_problem() -> Optional[str]:
    """Why this machine cannot run the sandbox, or None."""
    if os.geteuid() != 0:
        return ("grading runs each learner's code in a sandbox (namespaces, a uid of its own), which needs root: "
                "run it with sudo, or in a container as root (docs/grading.md)")
    return sandbox.missing()


def hidden_and_kept(submissions: Path, out: Path) -> tuple:
    """The folders a check must not see, and the paths it needs even where they lie inside one."""
    home = Path(os.path.expanduser("~")).resolve()
    hide = {str(submissions), str(out), str(home), "/root", str(KIT_ROOT / "notebooks" / "my_work")}
    hide = {p for p in hide if os.path.isdir(p)}
    keep = {str(Path(p).resolve()) for p in [sys.prefix, sys.base_prefix, KIT_ROOT, *sys.path] if p}
    keep = {p for p in keep if os.path.exists(p)}
    for needed in keep:
        for folder in (submissions, out):
            if needed == str(folder) or needed.startswith(str(folder) + os.sep):
                raise LayoutError(f"{folder} holds {needed}, which every check needs: "
                                  f"keep the submissions and --out apart from the kit and its Python")
    return sorted(hide), sorted(keep)


def grade(submissions_root, out="grades", jobs: int = 1, timeout: float = 60.0,
          limits: Optional[Limits] = None) -> Dict:
    """Check every file of every learner, and write the report; returns what was written.

    Args:
        submissions_root: the folder of learner folders (or zips).
        out: the folder for report.html, report.csv, results.json and the cache (made if missing).
        jobs: checks run at once (each in its own sandbox).
        timeout: seconds one run of a file may take (``exercises.check``'s timeout).
        limits: what one check may use (``Limits()`` by default).

    Returns:
        ``{"outcomes": [...], "submissions": [...], "report": path, "csv": path, "seconds": total}``.

    Raises:
        LayoutError: the submissions are not laid out as expected (nothing is written then).
        RuntimeError: this machine cannot run the sandbox.
    """
    from ddp_tutorial.teacher.grade import report

    t0 = time.monotonic()
    limits = limits or Limits()
    root, out = Path(submissions_root).resolve(), Path(out).resolve()
    subs = collect(root)
    problem = sandbox_problem()
    if problem:
        raise RuntimeError(problem)
    if out == root or str(out).startswith(str(root) + os.sep) or str(root).startswith(str(out) + os.sep):
        raise LayoutError(f"--out {out} and the submissions {root} must be apart")
    hide, keep = hidden_and_kept(root, out)
    out.mkdir(parents=True, exist_ok=True)
    kit = kit_version()
    cache = Cache(out)
    for sub in subs:
        for line in sub.skipped:
            print(f"skipped {sub.learner}/{line}", flush=True)
    outcomes: Dict[tuple, Outcome] = {}
    todo = []
    for sub in subs:
        for exercise in NAMES:
            if exercise in sub.refused:
                outcomes[sub.learner, exercise] = Outcome(sub.learner, exercise, REFUSED, sub.refused[exercise])
            elif exercise not in sub.files:
                outcomes[sub.learner, exercise] = Outcome(sub.learner, exercise, NOT_SUBMITTED)
            else:
                key = cache_key(exercise, sub.files[exercise], kit, timeout, limits)
                todo.append((sub.learner, exercise, sub.files[exercise], key))
    total, done = len(todo), 0
    print(f"grading {total} files of {len(subs)} learners, {jobs} at a time; results in {out}", flush=True)
    fresh = []
    for learner, exercise, source, key in todo:
        hit = cache.get(learner, exercise, key)
        if hit is not None:
            outcomes[learner, exercise] = hit
            done += 1
            print(f"[{done}/{total}] {learner} · {exercise}: {_cell_text(hit)} (unchanged: from the cache)",
                  flush=True)
        else:
            fresh.append((learner, exercise, source, key))
    slots: "queue.Queue[int]" = queue.Queue()
    for slot in range(jobs):
        slots.put(slot)

    def one(item):
        learner, exercise, source, key = item
        slot = slots.get()
        try:
            print(f"      checking {learner} · {exercise} ...", flush=True)
            return item, check_in_sandbox(learner, exercise, source, timeout, UID_BASE + slot, limits, hide, keep)
        finally:
            slots.put(slot)

    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        futures = [pool.submit(one, item) for item in fresh]
        for future in as_completed(futures):
            (learner, exercise, _, key), outcome = future.result()
            outcomes[learner, exercise] = outcome
            cache.put(outcome, key)
            done += 1
            print(f"[{done}/{total}] {learner} · {exercise}: {_cell_text(outcome)} ({outcome.seconds:.0f} s)",
                  flush=True)
        pool.shutdown()
    except BaseException:  # Ctrl-C: no check starts any more, and the running ones stop now
        pool.shutdown(wait=False, cancel_futures=True)
        stop_all_sandboxes()
        raise
    finally:  # interrupted or not: what is known so far goes into the report
        ordered = [outcomes.get((s.learner, e)) or Outcome(s.learner, e, "not checked", "grading was interrupted")
                   for s in subs for e in NAMES]
        seconds = time.monotonic() - t0
        written = report.write(out, subs, ordered, seconds, {"kit": kit, "timeout": timeout, "jobs": jobs,
                                                             "limits": asdict(limits)})
    print(report.terminal_summary(subs, ordered), flush=True)
    print(f"graded {len(subs)} learners in {seconds:.0f} s: {written['html']}, {written['csv']}", flush=True)
    return {"outcomes": ordered, "submissions": subs, "report": written["html"], "csv": written["csv"],
            "seconds": seconds}


def _cell_text(outcome: Outcome) -> str:
    if outcome.status == PASSED:
        return "✓"
    return outcome.status + (f": {outcome.summary}" if outcome.summary else "")
