"""Run a learner's exercise script in this rank with observers on torch, and report what they saw.

    python rank/bootstrap.py harness.py EXERCISE SCRIPT

``exercises.check`` starts it on every rank (under ``launch``, ``torchrun`` or as one plain
process). It puts the observers (``observers.py``) on torch, runs SCRIPT as ``__main__`` and
``report()``s: ``start``, the calls as they happen, ``final`` after the script, then on rank 0
``references`` (one process's results: after ``final``, so a peer's failure costs only those).
What the script raised goes on to the bootstrap. It never reads the learner's source.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Optional

import torch
import torch.distributed as dist

from ddp_tutorial.exercises.workers import reference
from ddp_tutorial.exercises.workers.observers import Observations, Observers
from ddp_tutorial.rank import bootstrap
from ddp_tutorial.runfolder import report

#: Exercises whose checks compare the final parameters with one process's.
NEEDS_REFERENCE = ("no_sync", "capstone")
# This module runs the script for the rank: the script's traceback starts below its frames.
globals()[bootstrap.RUNS_THE_SCRIPT] = True


#: The harness's files: their frames (an observer between script and torch) are not the learner's.
KIT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HARNESS_FILES = {os.path.join(KIT, *parts) for parts in (
    ("exercises", "workers", "harness.py"), ("exercises", "workers", "observers.py"),
    ("lessons", "sharding", "workers", "shard_records.py"))}


def without_harness_frames(tb):
    """The traceback ``tb`` with the harness's frames taken out, wherever they are in it."""
    kept = []
    while tb is not None:
        if os.path.abspath(tb.tb_frame.f_code.co_filename) not in HARNESS_FILES:
            kept.append(tb)
        tb = tb.tb_next
    for earlier, later in zip(kept, kept[1:] + [None]):
        earlier.tb_next = later
    return kept[0] if kept else None


def error_record(exc: BaseException, script: str):
    """Type, message, the script's line it came from, and the last lines of the traceback."""
    lines = traceback.format_exception(type(exc), exc, bootstrap.script_frames(exc.__traceback__))
    frames = traceback.extract_tb(exc.__traceback__)
    last = ([f for f in frames if os.path.abspath(f.filename) == script] or [None])[-1]
    where = (f"{os.path.basename(script)}, line {last.lineno}: {(last.line or '').strip()}"
             if last else None)
    return {"type": type(exc).__name__, "message": str(exc)[:800], "where": where,
            "traceback": "".join(lines).rstrip().splitlines()[-8:]}


def checkpoint_records(seen: Observations):
    """For each file this rank saved: does it load strictly into ``task.make_model()`` (as a plain
    process would load it; the DDP wrapper's keys start with ``module.``), and what it holds."""
    from ddp_tutorial.exercises.workers import task

    checked = []
    for path in dict.fromkeys(save["path"] for save in seen.saves):
        record = {"path": path, "loads": False, "error": None, "params": None, "prefixed_keys": []}
        try:
            state = torch.load(path, weights_only=True)
            if isinstance(state, dict):
                prefixed = [k for k in state if isinstance(k, str) and k.startswith("module.")]
                record["prefixed_keys"] = prefixed[:3]
            model = task.make_model()
            model.load_state_dict(state, strict=True)
            record["loads"], record["params"] = True, reference.flat_parameters(model.parameters())
        except Exception as exc:  # any file a script may write: report what went wrong
            record["error"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
        checked.append(record)
    return checked


def run(exercise: str, script: str) -> Optional[BaseException]:
    """Run ``script`` under the observers and report; returns what it raised (None: status 0)."""
    torch.set_num_threads(1)  # ranks share a small machine
    launcher = {"port": os.environ.get("MASTER_PORT"), "rank": int(os.environ.get("RANK", 0)),
                "world_size": int(os.environ.get("WORLD_SIZE", 1))}
    report({"event": "start", "exercise": exercise, "pid": os.getpid(),
            "rank_env": os.environ.get("RANK"), "world_size_env": os.environ.get("WORLD_SIZE"),
            "launcher_port": launcher["port"]})
    seen = Observations()
    observers = Observers(seen, launcher)
    observers.install(keep_store=exercise == "shard")
    if exercise == "shard":  # imported here: it loads ZeroRedundancyOptimizer, unused elsewhere
        from ddp_tutorial.lessons.sharding.workers import shard_records

        shard_records.observe(observers)
    failure, error, code = None, None, 0
    try:
        bootstrap.run_script([script])
    except SystemExit as exc:
        code = bootstrap.exit_code(exc)  # the status Python would give (a message printed now)
        if code:
            failure = SystemExit(code)
            error = {"type": "SystemExit", "message": f"sys.exit({exc.code!r})", "where": None,
                     "traceback": []}
    except BaseException as exc:  # the script's own error: recorded here, reported by the bootstrap
        exc.__traceback__ = without_harness_frames(exc.__traceback__)
        failure, code, error = exc, bootstrap.exit_code(exc), error_record(exc, script)
    observers.remove()  # the references below must not be counted
    record = {"event": "final", "exit_code": code, "error": error,
              "initialized_at_exit": dist.is_initialized(), **seen.as_record()}
    if exercise == "capstone":
        record["checkpoints"] = checkpoint_records(seen)
    report(record)  # first: a peer's failure stops this rank, and the references take a while
    if exercise in NEEDS_REFERENCE and int(os.environ.get("RANK", 0)) == 0 and error is None:
        world_size = seen.init_world_size or int(os.environ.get("WORLD_SIZE", 1))
        seed = seen.sampler_iterations[0]["seed"] if seen.sampler_iterations else 0
        report({"event": "references", "reference_world_size": world_size,
                "references": reference.references(world_size, seed)})
    if exercise == "shard":
        shard_records.report_after(seen, failed=failure is not None)
    return failure


def main(argv) -> None:
    if len(argv) != 2:
        sys.exit("usage: bootstrap.py harness.py EXERCISE SCRIPT")
    failure = run(argv[0], os.path.abspath(argv[1]))
    if failure is not None:  # to the bootstrap running this file, which exits as for any script
        raise failure


if __name__ == "__main__":
    main(sys.argv[1:])
