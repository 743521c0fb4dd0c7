"""Run the harness over a learner's script: under ``launch``, under ``torchrun``, or as one process.

Each way gives a ``HarnessRun``: every rank's harness records, exit codes, and
what went wrong if something did (a crash, a deadline). Nothing here raises
for a learner's mistake: that is the judge's to describe. No torch in here.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import ddp_tutorial
from ddp_tutorial import envvars
from ddp_tutorial.exercises import settings
from ddp_tutorial.launcher import describe_exit, loopback_interface, procgroup

HARNESS = Path(__file__).resolve().parent / "workers" / "harness.py"
PACKAGE_PARENT = Path(ddp_tutorial.__file__).resolve().parent.parent
#: Variables of an outer launcher that must not leak into a plain process or torchrun.
LAUNCHER_VARS = envvars.TORCHRUN_CONTRACT + (envvars.STORE,)
#: Seconds a stopped torchrun (or plain process) gets between SIGTERM and SIGKILL.
STOP_GRACE_S = 3.0


@dataclass
class HarnessRun:
    """One run of the harness over the learner's script.

    Attributes:
        mode: "launch", "torchrun" or "plain".
        world_size: ranks started.
        timeout: the deadline it ran under, in seconds.
        records: per rank, the harness's reports in order.
        exit_codes: per rank, its exit code (None: still running when stopped, or unknown).
        pids: every process the run started (ranks, and torchrun's agent).
        port: the rendezvous port (launch only).
        failed_rank: the first rank that failed, if one did.
        failure: one line on what went wrong (None when every rank exited 0).
        traceback: the last lines of the failed rank's traceback.
        timed_out: the deadline passed with ranks still running.
        still_running: those ranks.
        seconds: wall time.
    """

    mode: str
    world_size: int
    timeout: float
    records: Dict[int, List[dict]] = field(default_factory=dict)
    exit_codes: Dict[int, Optional[int]] = field(default_factory=dict)
    pids: List[int] = field(default_factory=list)
    port: Optional[int] = None
    failed_rank: Optional[int] = None
    failure: Optional[str] = None
    traceback: List[str] = field(default_factory=list)
    timed_out: bool = False
    still_running: List[int] = field(default_factory=list)
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

    def final(self, rank: int) -> Optional[dict]:
        """The rank's ``final`` record: what it measured once the script ended (None if it never did)."""
        finals = self.events(rank, "final")
        return finals[-1] if finals else None

    def finals(self) -> Dict[int, dict]:
        """``final`` records of the ranks that wrote one."""
        return {r: f for r in self.ranks if (f := self.final(r)) is not None}


def _records(run_dir: Path, world_size: int) -> Dict[int, List[dict]]:
    run = ddp_tutorial.Run(run_dir, world_size)
    return {rank: run.results(rank) for rank in range(world_size)}


def _error(records: List[dict]) -> Optional[dict]:
    """The error the harness recorded for a rank's script, or None."""
    for rec in reversed(records):
        if rec.get("event") == "final" and rec.get("error"):
            return rec["error"]
    return None


def _failure(rank: int, exit_code: Optional[int], error: Optional[dict], traceback: List[str]) -> str:
    """One line on how ``rank`` failed (where in the script, if known), then its traceback's last lines."""
    if error and error["type"] == "LauncherMismatch":  # the harness stopped it; the judge explains
        return f"rank {rank} was stopped in init_process_group: {error['message']}"
    head = f"rank {rank} failed" + (f" ({describe_exit(exit_code)})" if exit_code is not None else "")
    if error and error.get("where"):
        head += f" at {error['where']}"
    lines = error["traceback"] if error and error.get("traceback") else traceback
    if not lines:
        return head + (f": {error['type']}: {error['message']}" if error else "")
    what = "traceback" if error or any("Traceback (most recent call last)" in line for line in lines) else "output"
    return head + f"; the end of its {what}:\n" + "\n".join(lines[-4:])


def _last_line(lines: List[str]) -> str:
    return next((line.strip() for line in reversed(lines) if line.strip()), "(no output)")


def run_launch(exercise: str, script: Path, run_dir: Path, timeout: float, world_size: int = 2,
               env: Optional[Dict[str, str]] = None, echo: str = "none", harness: Path = HARNESS) -> HarnessRun:
    """``harness`` on ``world_size`` ranks under ``ddp_tutorial.launch``; ``echo`` as launch's."""
    attempt = HarnessRun("launch", world_size, timeout)
    run_dir = run_dir.resolve()
    t0 = time.monotonic()
    run = None
    try:
        run = ddp_tutorial.launch(str(harness), world_size, args=[exercise, str(script)], timeout=timeout,
                                  echo=echo, run_dir=str(run_dir),
                                  env={envvars.EXERCISE_OUT: str(run_dir), **(env or {})})
        attempt.exit_codes = dict(run.exit_codes)
    except ddp_tutorial.WorkerError as exc:
        run = exc.run
        attempt.failed_rank = exc.rank
        attempt.exit_codes = {exc.rank: exc.exit_code}
        attempt.traceback = (exc.traceback or "").splitlines()[-8:]
    except ddp_tutorial.LaunchTimeout as exc:
        run = exc.run
        attempt.timed_out = True
        attempt.still_running = sorted(exc.still_running)
    attempt.seconds = time.monotonic() - t0
    if run is not None:
        attempt.pids = list(run.pids)
        attempt.port = run.master_port
    attempt.records = _records(run_dir, world_size)
    if attempt.failed_rank is not None:
        rank = attempt.failed_rank
        attempt.failure = _failure(rank, attempt.exit_codes[rank], _error(attempt.records.get(rank, [])),
                                   attempt.traceback)
    elif attempt.timed_out:
        attempt.failure = f"did not finish within {timeout:g} s"
    return attempt


def _clean_env(out_dir: Path) -> Dict[str, str]:
    """The environment of a plain process or torchrun: no outer launcher's variables, our folder."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}
    env.update({
        "PYTHONPATH": os.pathsep.join(filter(None, [str(PACKAGE_PARENT), env.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",  # ranks share a small machine
        "PYTHONUNBUFFERED": "1",
        envvars.RUN_DIR: str(out_dir),  # where the harness's report() writes
        envvars.EXERCISE_OUT: str(out_dir),
    })
    loopback = loopback_interface()
    if loopback:  # gloo listens and connects on loopback, whatever the host name resolves to
        env["GLOO_SOCKET_IFNAME"] = loopback
    return env


@dataclass
class Started:
    """A plain process or torchrun started by ``start_plain`` / ``start_torchrun``, not yet waited for."""

    mode: str
    world_size: int
    out_dir: Path
    process: subprocess.Popen
    log: Path
    t0: float


def _start(mode: str, cmd: List[str], world_size: int, out_dir: Path) -> Started:
    out_dir = out_dir.resolve()  # the process runs in it: relative paths would point further down
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / "output.txt"
    with open(log, "wb") as f:
        # A session of its own: stopping it reaches every rank it started; stdin closed.
        process = subprocess.Popen(cmd, env=_clean_env(out_dir), stdin=subprocess.DEVNULL, stdout=f,
                                   stderr=subprocess.STDOUT, start_new_session=True, cwd=out_dir)
    return Started(mode, world_size, out_dir, process, log, time.monotonic())


def start_plain(exercise: str, script: Path, out_dir: Path) -> Started:
    """The harness as one plain process: ``python harness.py`` with no RANK in its environment."""
    return _start("plain", [sys.executable, str(HARNESS), exercise, str(script)], 1, out_dir)


def start_torchrun(exercise: str, script: Path, out_dir: Path, world_size: int = 2) -> Started:
    """The harness under ``torchrun --standalone`` (its rendezvous on a free port of its choosing)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(world_size), "--max-restarts", "0",
           str(HARNESS), exercise, str(script)]
    return _start("torchrun", cmd, world_size, out_dir)


def finish(started: Started, deadline: float, timeout: float) -> HarnessRun:
    """Wait for ``started`` until ``deadline`` (time.monotonic()), stopping its whole session then."""
    attempt = HarnessRun(started.mode, started.world_size, timeout)
    process = started.process
    try:
        process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        attempt.timed_out = True
        attempt.records = _records(started.out_dir, started.world_size)
        _stop(process, _rank_pids(attempt))
    except BaseException:  # an interrupt: leave nothing running
        attempt.records = _records(started.out_dir, started.world_size)
        _stop(process, _rank_pids(attempt))
        raise
    attempt.seconds = time.monotonic() - started.t0
    attempt.records = _records(started.out_dir, started.world_size)
    attempt.pids = [process.pid] + _rank_pids(attempt)
    output = started.log.read_text(errors="replace").splitlines()
    for rank in attempt.ranks:
        final = attempt.final(rank)
        attempt.exit_codes[rank] = final["exit_code"] if final else None
    if attempt.timed_out:
        attempt.still_running = [r for r in attempt.ranks if attempt.final(r) is None]
        attempt.failure = f"did not finish within {timeout:g} s"
        return attempt
    failed = [r for r in attempt.ranks if attempt.exit_codes[r] not in (0,)]
    if process.returncode != 0 or failed:
        rank = failed[0] if failed else None
        attempt.failed_rank = rank
        attempt.traceback = _traceback_tail(output)
        if rank is None:  # no rank recorded an error: torchrun itself (or the process) failed
            attempt.failure = (f"{started.mode} failed ({describe_exit(process.returncode)}): "
                               f"{_last_line(output)}")
        else:
            attempt.failure = _failure(rank, attempt.exit_codes[rank], _error(attempt.records.get(rank, [])),
                                       attempt.traceback)
    return attempt


def _rank_pids(attempt: HarnessRun) -> List[int]:
    return [rec["pid"] for rank in attempt.ranks for rec in attempt.events(rank, "start")]


def _traceback_tail(lines: List[str], keep: int = 8) -> List[str]:
    starts = [i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line]
    return lines[starts[-1]:][-keep:] if starts else lines[-keep:]


def _stop(process: subprocess.Popen, rank_pids: List[int]) -> None:
    """Stop a run past its deadline: its own session, then any rank left in a session of its own.

    torchrun starts each rank in a new session, so signalling torchrun's group
    does not reach them: SIGTERM lets torchrun stop its ranks itself; what is
    left after STOP_GRACE_S gets SIGKILL, the ranks by the pids they reported.
    """
    _signal_group(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        _signal_group(process.pid, signal.SIGKILL)  # not reaped yet: the group id is still ours
        process.wait()
    _kill_and_wait([pid for pid in rank_pids if procgroup.alive(pid)])


def _kill_and_wait(pids: List[int], timeout: float = STOP_GRACE_S) -> None:
    """SIGKILL each pid's process group and wait (up to ``timeout``) until those processes are gone.

    A pidfd is opened before the signal, so a pid reused meanwhile is not hit,
    and it becomes readable the moment its process exits: no polling loop.
    """
    poller, fds = select.poll(), []
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # gone already, or no pidfd here: signal only
            _signal_group(pid, signal.SIGKILL)
            continue
        fds.append(fd)
        poller.register(fd, select.POLLIN)
        _signal_group(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    pending = set(fds)
    while pending and time.monotonic() < deadline:
        for fd, _ in poller.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            pending.discard(fd)
            poller.unregister(fd)
    for fd in fds:
        os.close(fd)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass

