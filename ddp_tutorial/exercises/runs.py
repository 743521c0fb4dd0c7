"""Run the harness over a learner's script: under ``launch``, under ``torchrun``, or as one process.

Each way gives a ``HarnessRun``: the ranks' harness records, exit codes, and what went wrong if
something did. Nothing here raises for a learner's mistake (the judge describes it). No torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional

import ddp_tutorial
from ddp_tutorial import envvars
from ddp_tutorial.exercises.settings import FAIL_RANK
from ddp_tutorial.launcher import BOOTSTRAP, describe_exit, procgroup, procinfo
from ddp_tutorial.launcher.start import launcher_watch, worker_env

WORKERS = Path(__file__).resolve().parent / "workers"
HARNESS = WORKERS / "harness.py"
GUARD = Path(__file__).resolve().with_name("guard.py")
TRACEBACK = "Traceback (most recent call last)"
#: Where, in a torchrun run's folder, torchrun keeps its own files (``--log-dir``).
TORCHRUN_LOG_DIR = "torchrun-logs"


@dataclass
class HarnessRun:
    """One run of the harness over the learner's script ("launch", "torchrun" or "plain")."""

    mode: str
    world_size: int
    timeout: float
    records: Dict[int, List[dict]] = field(default_factory=dict)  # per rank, its reports in order
    exit_codes: Dict[int, Optional[int]] = field(default_factory=dict)  # None: stopped, or unknown
    pids: List[int] = field(default_factory=list)  # every process started (torchrun's agent too)
    port: Optional[int] = None  # the rendezvous port (launch only)
    failed_rank: Optional[int] = None
    failure: Optional[str] = None  # one line on what went wrong; None when every rank exited 0
    traceback: List[str] = field(default_factory=list)  # the failed rank's, its last lines
    timed_out: bool = False
    still_running: List[int] = field(default_factory=list)  # the ranks running at the deadline
    seconds: float = 0.0

    @property
    def ranks(self) -> List[int]:
        return list(range(self.world_size))

    @property
    def finished(self) -> bool:
        """Every rank ran to the end and exited 0."""
        return self.failure is None

    def events(self, rank: int, event: str) -> List[dict]:
        return [r for r in self.records.get(rank, []) if r.get("event") == event]

    def final(self, rank: int, event: str = "final", after: str = "references") -> Optional[dict]:
        """The rank's last ``event`` record (None if none), merged with its ``after`` record."""
        finals, references = self.events(rank, event), self.events(rank, after)
        if not finals:
            return None
        return {**finals[-1], **{k: v for k, v in (references or [{}])[-1].items() if k != "event"}}

    def finals(self, event: str = "final", after: str = "references") -> Dict[int, dict]:
        """``final`` (or ``event``) records of the ranks that wrote one."""
        return {r: f for r in self.ranks if (f := self.final(r, event, after)) is not None}


def _records(run_dir: Path, world_size: int) -> Dict[int, List[dict]]:
    run = ddp_tutorial.Run(run_dir, world_size)
    return {rank: run.results(rank) for rank in range(world_size)}


def _failure(run: HarnessRun, rank: int) -> str:
    """One line on how ``rank`` failed (where in the script, if known), then its last lines."""
    error, exit_code = (run.final(rank) or {}).get("error"), run.exit_codes[rank]
    if error and error["type"] == "LauncherMismatch":  # the harness stopped it; the judge explains
        return f"rank {rank} was stopped in init_process_group: {error['message']}"
    head = f"rank {rank} failed" + (f" ({describe_exit(exit_code)})" if exit_code is not None else "")
    if error and error.get("where"):
        head += f" at {error['where']}"
    lines = error["traceback"] if error and error.get("traceback") else run.traceback
    if not lines:
        return head + (f": {error['type']}: {error['message']}" if error else "")
    what = "traceback" if error or any(TRACEBACK in line for line in lines) else "output"
    return head + f"; the end of its {what}:\n" + "\n".join(lines[-4:])


def run_launch(exercise: str, script: Path, run_dir: Path, timeout: float, world_size: int = 2,
               env: Optional[Dict[str, str]] = None, echo: str = "none",
               harness: Path = HARNESS) -> HarnessRun:
    """``harness`` on ``world_size`` ranks under ``ddp_tutorial.launch``; ``echo`` as launch's."""
    result = HarnessRun("launch", world_size, timeout)
    run_dir = run_dir.resolve()
    t0 = time.monotonic()
    run = None
    try:
        run = ddp_tutorial.launch(str(harness), world_size, args=[exercise, str(script)],
                                  timeout=timeout, echo=echo, run_dir=str(run_dir),
                                  env={envvars.EXERCISE_OUT: str(run_dir), **(env or {})})
        result.exit_codes = dict(run.exit_codes)
    except ddp_tutorial.WorkerError as exc:
        run = exc.run
        result.failed_rank = exc.rank
        result.exit_codes = {exc.rank: exc.exit_code}
        result.traceback = (exc.traceback or "").splitlines()[-8:]
    except ddp_tutorial.LaunchTimeout as exc:
        run = exc.run
        result.timed_out = True
        result.still_running = sorted(exc.still_running)
    result.seconds = time.monotonic() - t0
    if run is not None:
        result.pids = list(run.pids)
        result.port = run.master_port
    result.records = _records(run_dir, world_size)
    if result.failed_rank is not None:
        result.failure = _failure(result, result.failed_rank)
    elif result.timed_out:
        result.failure = f"did not finish within {timeout:g} s"
    return result


@dataclass
class Started:
    """A plain process or torchrun, started and not yet waited for (``finish``)."""

    mode: str
    world_size: int
    out_dir: Path
    process: subprocess.Popen
    t0: float


def _start(mode: str, cmd: List[str], world_size: int, out_dir: Path) -> Started:
    out_dir = out_dir.resolve()  # the process runs in it: relative paths would point further down
    out_dir.mkdir(parents=True, exist_ok=True)
    # A rank's environment less launch's contract: our folder is where the harness's report() writes.
    env = {**worker_env(), envvars.RUN_DIR: str(out_dir), envvars.EXERCISE_OUT: str(out_dir)}
    # In a session of its own, led by guard.py: it kills the group once this process is gone.
    watch = launcher_watch().fileno()
    with open(out_dir / "output.txt", "wb") as f:
        process = subprocess.Popen([sys.executable, "-I", "-S", str(GUARD), str(watch), *cmd],
                                   env=env, cwd=out_dir, stdin=subprocess.DEVNULL, stdout=f,
                                   stderr=subprocess.STDOUT, start_new_session=True,
                                   pass_fds=(watch,))
    return Started(mode, world_size, out_dir, process, time.monotonic())


def start_plain(exercise: str, script: Path, out_dir: Path) -> Started:
    """The harness as one plain process (no RANK in its environment), run by a rank's bootstrap."""
    return _start("plain", [sys.executable, BOOTSTRAP, str(HARNESS), exercise, str(script)], 1, out_dir)


def start_torchrun(exercise: str, script: Path, out_dir: Path, world_size: int = 2) -> Started:
    """The harness under ``torchrun --standalone``; its own files go into ``out_dir`` (by default
    they would make a new folder in the system's temporary folder per check, never removed)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(world_size), "--max-restarts", "0",
           "--log-dir", str(Path(out_dir).resolve() / TORCHRUN_LOG_DIR),
           BOOTSTRAP, str(HARNESS), exercise, str(script)]
    return _start("torchrun", cmd, world_size, out_dir)


def finish(started: Started, deadline: float, timeout: float) -> HarnessRun:
    """Wait for ``started`` until ``deadline`` (time.monotonic()), stopping its whole session then."""
    result = HarnessRun(started.mode, started.world_size, timeout)
    process = started.process
    try:
        result.timed_out = not _wait_for_exit(process, max(0.0, deadline - time.monotonic()))
    finally:  # past the deadline, or an interrupt: leave nothing running
        if result.timed_out or not procgroup.has_exited(process):
            _stop(process, _rank_pids(_records(started.out_dir, started.world_size)))
        else:
            procgroup.end(process)
    result.seconds = time.monotonic() - started.t0
    result.records = _records(started.out_dir, started.world_size)
    result.pids = [process.pid] + _rank_pids(result.records)
    output = (started.out_dir / "output.txt").read_text(errors="replace").splitlines()
    result.exit_codes = {r: (result.final(r) or {}).get("exit_code") for r in result.ranks}
    if result.timed_out:
        result.still_running = [r for r in result.ranks if result.final(r) is None]
        result.failure = f"did not finish within {timeout:g} s"
        return result
    failed = [r for r in result.ranks if result.exit_codes[r] != 0]
    if process.returncode != 0 or failed:
        rank = failed[0] if failed else None
        result.failed_rank = rank
        result.traceback = _traceback_tail(output)
        if rank is None:  # no rank recorded an error: torchrun itself (or the process) failed
            last = next((line.strip() for line in reversed(output) if line.strip()), "(no output)")
            result.failure = f"{started.mode} failed ({describe_exit(process.returncode)}): {last}"
        else:
            result.failure = _failure(result, rank)
    return result


def _wait_for_exit(p: subprocess.Popen, timeout: float) -> bool:
    """Wait up to ``timeout`` s until ``p`` exits, without reaping it (its group id stays ours)."""
    return procgroup.wait_until(lambda: procgroup.has_exited(p), timeout)


def _stop(p: subprocess.Popen, strays: Iterable[int] = (), grace: float = 3.0) -> None:
    """SIGTERM to the session's group (torchrun stops its ranks), SIGKILL to what is left after
    ``grace`` s, then SIGKILL to the groups of ``strays`` (torchrun's ranks lead their own)."""
    procgroup.killpg(p, signal.SIGTERM)
    _wait_for_exit(p, grace)
    procgroup.end(p)
    strays = [pid for pid in strays if procinfo.alive(pid)]
    for pid in strays:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    procgroup.wait_until(lambda: not any(map(procinfo.alive, strays)), procgroup.KILL_WAIT_S)


def _rank_pids(records: Dict[int, List[dict]]) -> List[int]:  # from the ranks' start records
    return [rec["pid"] for recs in records.values() for rec in recs if rec.get("event") == "start"]


def _traceback_tail(lines: List[str], keep: int = 8) -> List[str]:
    starts = [i for i, line in enumerate(lines) if TRACEBACK in line]
    return lines[starts[-1]:][-keep:] if starts else lines[-keep:]


# -- How a check runs its exercise (``Exercise.run``): the runs, in the order its judge takes them
def per_world_size(exercise, script: Path, folder: Path, timeout: float,
                   echo: str) -> List[HarnessRun]:
    """The harness under launch, once per world size, the next only once the runs so far pass:
    a wrong answer's report comes after its first world size (a hang would only hang again)."""
    done: List[HarnessRun] = []
    for world_size in exercise.world_sizes:
        if done and (done[-1].timed_out or not all(c.passed for c in exercise.judge(*done))):
            break
        sub = "run" if len(exercise.world_sizes) == 1 else f"w{world_size}"
        done.append(run_launch(exercise.name, script, folder / sub, timeout, world_size, echo=echo,
                               harness=exercise.harness))
        if done[-1].timed_out:
            break
    return done


def normal_then_failing(exercise, script: Path, folder: Path, timeout: float,
                        echo: str) -> List[HarnessRun]:
    """A normal run, then one in which rank ``FAIL_RANK`` raises mid-training (not after a hang)."""
    world_size = exercise.world_sizes[0]
    done = [run_launch(exercise.name, script, folder / "run", timeout, world_size, echo=echo)]
    if not done[0].timed_out:
        done.append(run_launch(exercise.name, script, folder / "rank_fails", timeout, world_size,
                               env={envvars.EXERCISE_FAIL_RANK: str(FAIL_RANK)}, echo=echo))
    return done


def three_ways(exercise, script: Path, folder: Path, timeout: float,
               echo: str) -> List[HarnessRun]:
    """Under launch, as one plain process and under torchrun, all at once."""
    deadline = time.monotonic() + timeout
    started = [start_plain(exercise.name, script, folder / "plain"),
               start_torchrun(exercise.name, script, folder / "torchrun", exercise.world_sizes[0])]
    try:
        launched = run_launch(exercise.name, script, folder / "launch", timeout,
                              exercise.world_sizes[0], echo=echo)
    except BaseException:  # an interrupt, or a launch that could not start: stop the others now
        for process in started:
            finish(process, time.monotonic(), timeout)
        raise
    return [launched] + [finish(process, deadline, timeout) for process in started]
