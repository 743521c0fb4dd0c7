"""The launch loop: watch an attempt's ranks until they finish, fail, hang or are interrupted.

Fail-fast: the first rank that fails stops the whole group (``WorkerError`` names it, by
the moment each rank noted its failure). A deadline turns a hang into ``LaunchTimeout``
with each rank's stack. An interrupt stops every rank. With ``max_restarts`` a failed
attempt is followed by a new one, as under torchrun. ``launch_run`` is where the facts
of the launch are put on the ``Run``, for every outcome.
"""

from __future__ import annotations

import math
import time
from typing import Dict, List, Tuple

from ddp_tutorial import runfolder, stacks
from ddp_tutorial.launcher import start, warm
from ddp_tutorial.launcher.errors import LaunchTimeout, WorkerError, describe_exit, last_traceback
from ddp_tutorial.launcher.spec import LaunchSpec
from ddp_tutorial.runfolder import Run

#: The most a deadline waits for the ranks' stacks (they come in milliseconds; a rank that cannot
#: answer, e.g. one stopped with SIGSTOP, only delays the SIGTERM that follows).
STACKS_WAIT_S = 2.0


def run_attempts(spec: LaunchSpec, t0: float) -> Run:
    """Start and supervise attempts until one succeeds, or the restarts are used up.

    Args:
        t0: ``time.monotonic()`` when ``launch`` was called; the deadline is ``t0 + spec.timeout``.
    """
    deadline = t0 + spec.timeout
    cold_reason = warm.use_warm(spec.warm, spec.backend, spec.env)
    number = 0
    while True:
        attempt = start.start_attempt(spec, number, cold_reason)
        try:
            return supervise(spec, attempt, deadline, t0)
        except WorkerError as exc:
            if number >= spec.max_restarts:
                raise
            number += 1
            print(f"[launch] rank {exc.rank} failed ({describe_exit(exc.exit_code)}); "
                  f"restarting all ranks, attempt {number} of {spec.max_restarts}", flush=True)


def launch_run(spec: LaunchSpec, attempt: start.Attempt, t0: float) -> Run:
    """The ``Run`` of the launch, with what ``launch`` knows of it besides the run folder."""
    run = Run(spec.run_dir, spec.world_size)
    group = attempt.group
    run.output, run.exit_codes, run.pids = group.output, dict(group.exit_codes), group.pids
    run.master_port = attempt.port
    run.start_mode, run.cold_reason = attempt.start_mode, attempt.cold_reason
    run.wall_seconds = time.monotonic() - t0
    return run


def supervise(spec: LaunchSpec, attempt: start.Attempt, deadline: float, t0: float) -> Run:
    """Wait for the attempt's ranks, printing their output; stop them all on failure, deadline or interrupt."""
    group = attempt.group
    failed = None
    try:
        while True:
            group.reap()
            codes = group.exit_codes
            failed = next((r for r, c in codes.items() if c not in (None, 0)), None)
            if failed is not None or group.done():
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            group.pump(min(0.05, left))
    except BaseException:  # KeyboardInterrupt from the notebook's stop button, and the like
        group.stop(spec.grace)
        group.close(drain_s=0.0)
        raise
    if failed is None and group.done():
        group.close()
        runfolder.drop_rank_notes_if_empty(spec.run_dir)
        return launch_run(spec, attempt, t0)
    # Failure or deadline: stop everyone, read what is left, then explain.
    failed_on_their_own = {r for r, c in group.exit_codes.items() if c not in (None, 0)}
    # Still running: not rank 0 once its script is done and it only keeps the store for the others.
    still = [r for r, c in group.exit_codes.items() if c is None and r not in group.scripts_done]
    if failed is None:  # the deadline: where was each rank? Asked before any rank is stopped.
        group.ask_for_stacks(lambda r: runfolder.stacks_file(spec.run_dir, attempt.number, r).exists(),
                             lambda r: _wrote_stack(spec.run_dir, attempt.number, r), STACKS_WAIT_S)
    group.stop(spec.grace)  # SIGTERM: a rank finishes reporting its failure (and writes its stacks if not asked)
    group.close()
    run = launch_run(spec, attempt, t0)
    if failed is not None:
        notes = runfolder.failure_notes(spec.run_dir, attempt.number)
        raise _worker_error(run, failure_order(group.exit_seen, failed_on_their_own, notes), still)
    raise _timeout(spec, attempt.number, run, still)


def _wrote_stack(run_dir, attempt: int, rank: int) -> bool:
    try:
        return stacks.wrote_script_stack(runfolder.stacks_file(run_dir, attempt, rank).read_text(errors="replace"))
    except OSError:
        return False


def failure_order(exit_seen: Dict[int, float], exited_failing, notes: Dict[int, dict]) -> List[int]:
    """The ranks that failed, earliest first: by the moment each noted its failure
    (``time.monotonic()``, one clock for the machine), else by when its exit was seen.

    A failure whose error says a peer's connection closed (``peer_gone``) is a consequence
    of another rank's failure, and comes after every other: the rank that failed first may
    still be unwinding its script when its peer notes the closed connection.
    """
    failed = set(exited_failing) | set(notes)

    def when(rank: int) -> Tuple[bool, float, int]:
        note = notes.get(rank, {})
        noted = note.get("failed_at")
        if isinstance(noted, (int, float)):
            return bool(note.get("peer_gone")), float(noted), rank
        return False, exit_seen.get(rank, math.inf), rank

    return sorted(failed, key=when)


def _worker_error(run: Run, order: List[int], still: List[int]) -> WorkerError:
    first, after = order[0], order[1:]
    code = run.exit_codes[first]
    tb = last_traceback(run.output[first])
    stopped = ", ".join(str(r) for r in still if r not in after) or "none"
    later = "".join(f"; rank {r} failed after it ({describe_exit(run.exit_codes[r])})" for r in after)
    return WorkerError(
        f"rank {first} failed first, with {describe_exit(code)}{later}; stopped the other ranks "
        f"still running ({stopped}). Results so far: {run.run_dir}\n--- rank {first} output ---\n{tb}",
        first, code, tb, run, after)


def _timeout(spec: LaunchSpec, attempt: int, run: Run, still: List[int]) -> LaunchTimeout:
    detail = ", ".join(
        f"rank {r} at step {run.last_step(r)}" if run.last_step(r) is not None
        else f"rank {r} before its first step" for r in still)
    rank_stacks = stacks.rank_stacks(spec.run_dir, attempt, still)
    waits = stacks.rank_waits(spec.run_dir, attempt, still)
    if spec.echo != "none":
        print(f"[launch] deadline passed; where each rank was:\n{stacks.format_stacks(rank_stacks, waits)}",
              flush=True)
    return LaunchTimeout(
        f"timed out after {spec.timeout:g} s with ranks still running: {detail} (last finished "
        f"micro-step). A rank waiting for a peer that never comes looks like this: a wrong "
        f"world size, a skipped collective, or uneven inputs. All ranks were stopped; "
        f"each one's Python stack is in .stacks. Results so far: {spec.run_dir}",
        {r: run.last_step(r) for r in still}, run, rank_stacks, waits)
