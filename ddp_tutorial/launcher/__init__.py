"""Start one OS process per rank from a script file, and guard them from the notebook; imports
no torch, pickles no notebook code, never forks the kernel. Modules in the order of one launch
(docs/how-it-is-built.md): ``spec``, this loop, ``start``, ``warm``, ``procgroup``, ``net``."""

from __future__ import annotations

import math
import time
from typing import Dict, List, Optional, Sequence, Tuple

from ddp_tutorial import runfolder, stacks
from ddp_tutorial.launcher import start
from ddp_tutorial.launcher.errors import (LaunchConfigError, LaunchError, LaunchTimeout,
                                          WorkerError, describe_exit, last_traceback)
from ddp_tutorial.launcher.net import free_port, loopback_interface
from ddp_tutorial.launcher.spec import BOOTSTRAP, MAX_WORLD_SIZE, LaunchSpec, check_args_with
from ddp_tutorial.launcher.warm import prestart_warm, use_warm, warm_ready
from ddp_tutorial.runfolder import Run

__all__ = ["launch", "Run", "LaunchSpec", "LaunchError", "LaunchConfigError", "WorkerError",
           "LaunchTimeout", "describe_exit", "free_port", "loopback_interface", "BOOTSTRAP",
           "MAX_WORLD_SIZE", "check_args_with", "prestart_warm", "warm_ready"]

#: The most a deadline waits for the ranks' stacks (a rank that cannot answer only delays SIGTERM).
STACKS_WAIT_S = 2.0


def launch(script, world_size: int, args: Sequence[str] = (), *, timeout: float = 120.0,
           backend: str = "auto", run_dir=None, env: Optional[Dict[str, str]] = None,
           echo: str = "all", max_restarts: int = 0, master_port: Optional[int] = None,
           grace: float = 1.0, warm: Optional[bool] = None) -> Run:
    """Run ``script`` (a .py path such as ``TRAIN_SCRIPT``, or ``"-m package.module"``) as
    ``world_size`` processes, one per rank, as torchrun would (its environment contract,
    MASTER_ADDR=127.0.0.1), each rank's output live as ``[rank r] ...``; return its ``Run``.

    Bad input raises ``LaunchConfigError`` before anything starts or any folder is made. The first
    rank that fails stops the whole group (``WorkerError``, after any restarts); a deadline turns a
    hang into ``LaunchTimeout`` with each rank's stack; an interrupt stops every rank; no rank
    outlives the launch, nor the process that called it. A rank that cannot start: ``LaunchError``.

    Args:
        args: command-line arguments for every rank: a list (strings, numbers, paths).
        timeout: seconds for the whole launch; a run still going then is a hang.
        backend: ``"auto"``, ``"gloo"`` or ``"nccl"``, passed as DDP_TUTORIAL_BACKEND.
        run_dir: a new or empty folder for the results; default ``runs/<time>-<script>-<id>``.
        env: extra environment variables for the workers, str -> str (they win over ours).
        echo: ``"all"`` prints every rank's output live, ``"rank0"`` rank 0's, ``"none"`` none.
        max_restarts: as torchrun's ``--max-restarts``: after a failure, restart the whole group.
        master_port: a port for rank 0 to bind on 127.0.0.1 (to show why not to hard-code one).
        grace: seconds between SIGTERM and SIGKILL when stopping workers.
        warm: True forks the ranks from Python's forkserver, torch imported (``launcher/warm.py``);
            False starts each as a new process, as torchrun would; None: ``DDP_TUTORIAL_WARM``
            ("1"/"0") if set, else warm on Linux only (nccl: cold); ``run.start_mode`` says which.
    """
    t0 = time.monotonic()
    spec = LaunchSpec.build(script, world_size, args, timeout=timeout, backend=backend,
                            run_dir=run_dir, env=env, echo=echo, max_restarts=max_restarts,
                            master_port=master_port, grace=grace, warm=warm)
    cold_reason = use_warm(spec.warm, spec.backend, spec.env)
    for number in range(spec.max_restarts + 1):
        try:
            return supervise(spec, start.start_attempt(spec, number, cold_reason), t0)
        except WorkerError as exc:
            if number == spec.max_restarts:
                raise
            print(f"[launch] rank {exc.rank} failed ({describe_exit(exc.exit_code)}); "
                  f"restarting all ranks, attempt {number + 1} of {spec.max_restarts}", flush=True)


def supervise(spec: LaunchSpec, attempt: start.Attempt, t0: float) -> Run:
    """Wait for the attempt's ranks; stop them all on failure, deadline or interrupt."""
    group = attempt.group

    def failed_on_their_own():
        return [r for r, c in group.exit_codes.items() if c not in (None, 0)]

    try:
        group.wait(t0 + spec.timeout, until=failed_on_their_own)
    except BaseException:  # KeyboardInterrupt from the notebook's stop button, and the like
        group.stop(spec.grace)
        group.close(drain_s=0.0)
        raise
    failed = failed_on_their_own()
    if not failed and group.done():
        group.close()
        runfolder.drop_rank_notes_if_empty(spec.run_dir)
        return _run(spec, attempt, t0)
    # Still running: not rank 0 once its script is done and it only keeps the store for the others.
    still = [r for r, c in group.exit_codes.items() if c is None and r not in group.scripts_done]
    if not failed:  # the deadline: where was each rank? Asked before any rank is stopped.
        group.ask_for_stacks(lambda r: _stack_written(spec.run_dir, attempt.number, r),
                             STACKS_WAIT_S)
    group.stop(spec.grace)  # SIGTERM: a rank finishes reporting its failure, or writes its stacks
    group.close()
    run = _run(spec, attempt, t0)
    if failed:
        notes = runfolder.failure_notes(spec.run_dir, attempt.number)
        raise _worker_error(run, failure_order(group.exit_seen, failed, notes), still)
    raise _timeout(spec, attempt.number, run, still)


def _run(spec: LaunchSpec, attempt: start.Attempt, t0: float) -> Run:
    """The ``Run`` of the launch, with what ``launch`` knows of it besides the run folder."""
    run = Run(spec.run_dir, spec.world_size)
    group = attempt.group
    run.output, run.exit_codes, run.pids = group.output, dict(group.exit_codes), group.pids
    run.master_port = attempt.port
    run.start_mode, run.cold_reason = attempt.start_mode, attempt.cold_reason
    run.wall_seconds = time.monotonic() - t0
    return run


def _stack_written(run_dir, attempt: int, rank: int) -> Optional[bool]:
    """None while the rank cannot answer (no stacks file yet), else whether it wrote its stack."""
    try:
        text = runfolder.stacks_file(run_dir, attempt, rank).read_text(errors="replace")
    except OSError:
        return None
    return stacks.wrote_script_stack(text)


def failure_order(exit_seen: Dict[int, float], exited_failing, notes: Dict[int, dict]) -> List[int]:
    """The ranks that failed, earliest first: by when each noted its failure (one monotonic clock
    for the machine), else when its exit was seen; a ``peer_gone`` failure (a consequence) last."""
    def when(rank: int) -> Tuple[bool, float, int]:
        note = notes.get(rank, {})
        noted = note.get("failed_at")
        if isinstance(noted, (int, float)):
            return bool(note.get("peer_gone")), float(noted), rank
        return False, exit_seen.get(rank, math.inf), rank

    return sorted(set(exited_failing) | set(notes), key=when)


def _worker_error(run: Run, order: List[int], still: List[int]) -> WorkerError:
    first, after = order[0], order[1:]
    code, tb = run.exit_codes[first], last_traceback(run.output[first])
    stopped = ", ".join(str(r) for r in still if r not in after) or "none"
    later = "".join(f"; rank {r} failed after it ({describe_exit(run.exit_codes[r])})"
                    for r in after)
    return WorkerError(
        f"rank {first} failed first, with {describe_exit(code)}{later}; stopped the other ranks "
        f"still running ({stopped}). Results so far: {run.run_dir}\n"
        f"--- rank {first} output ---\n{tb}",
        first, code, tb, run, after)


def _timeout(spec: LaunchSpec, attempt: int, run: Run, still: List[int]) -> LaunchTimeout:
    detail = ", ".join(f"rank {r} at step {run.last_step(r)}" if run.last_step(r) is not None
                       else f"rank {r} before its first step" for r in still)
    rank_stacks, waits = stacks.rank_stacks(spec.run_dir, attempt, still)
    if spec.echo != "none":
        print("[launch] deadline passed; where each rank was:\n"
              + stacks.format_stacks(rank_stacks, waits), flush=True)
    return LaunchTimeout(
        f"timed out after {spec.timeout:g} s with ranks still running: {detail} (last finished "
        f"micro-step). A rank waiting for a peer that never comes looks like this: a wrong "
        f"world size, a skipped collective, or uneven inputs. All ranks were stopped; "
        f"each one's Python stack is in .stacks. Results so far: {spec.run_dir}",
        {r: run.last_step(r) for r in still}, run, rank_stacks, waits)
