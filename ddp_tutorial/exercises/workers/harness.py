"""Run a learner's exercise script in this rank with observers on torch, and report what they saw.

    python rank/bootstrap.py harness.py EXERCISE SCRIPT

``exercises.check`` starts this file on every rank (under ``launch``, ``torchrun``
or as one plain process), always run by a rank's bootstrap. It puts the observers
(``observers.py``) on the torch functions a DDP script calls, runs SCRIPT as
``__main__``, and ``report()``s the measurements; the check judges them in the
notebook. Nothing here reads the learner's source: it only watches calls.

Records (``event`` key): ``start``; ``init_called`` and ``init`` around
``init_process_group``; ``collective_enter`` and ``collective`` around each
collective the script calls (``all_reduce``, ``barrier``, ``broadcast``, ``all_gather``, ...); ``destroy``
before ``destroy_process_group`` runs; and
``final`` after the script ended, with every count, the parameters, the
sampler orders, the saves, the error if any, and in the capstone whether
each saved checkpoint loads strictly into ``task.make_model()``; then, on rank 0,
``references``: the one-process results (``ddp_tutorial.exercises.workers.reference``),
after ``final`` so that a peer's failure during them (which stops this rank)
costs only the references. All but those two are written the moment they
happen, so a rank that hangs or dies still leaves them. Exercise "shard" observes
ZeroRedundancyOptimizer too and reports more after ``final`` (``lessons/sharding/workers/shard_records.py``).

Once the ``final`` record is written, what the script raised goes on to the bootstrap,
which reports it and exits as for any script (``bootstrap.run_rank``): the same exit
status, traceback and failure note under every launcher.
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


#: The harness's own files: their frames (an observer between the script and torch) are not the learner's.
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
    in_script = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.abspath(f.filename) == script]
    where = (f"{os.path.basename(script)}, line {in_script[-1].lineno}: {(in_script[-1].line or '').strip()}"
             if in_script else None)
    return {"type": type(exc).__name__, "message": str(exc)[:800], "where": where,
            "traceback": "".join(lines).rstrip().splitlines()[-8:]}


def sampler_seed(seen: Observations) -> int:
    return seen.sampler_iterations[0]["seed"] if seen.sampler_iterations else 0


def checkpoint_records(seen: Observations):
    """For each file this rank saved: does it load strictly into ``task.make_model()``, and what it holds.

    A plain process must be able to use the checkpoint: the DDP wrapper's own
    ``state_dict()`` has every key prefixed with ``module.`` and does not load.
    """
    from ddp_tutorial.exercises.workers import task

    checked = []
    for path in dict.fromkeys(save["path"] for save in seen.saves):
        record = {"path": path, "loads": False, "error": None, "params": None, "prefixed_keys": []}
        try:
            state = torch.load(path, weights_only=True)
            if isinstance(state, dict):
                record["prefixed_keys"] = [k for k in state if isinstance(k, str) and k.startswith("module.")][:3]
            model = task.make_model()
            model.load_state_dict(state, strict=True)
            record["loads"], record["params"] = True, reference.flat_parameters(model.parameters())
        except Exception as exc:  # any file a script may write: report what went wrong
            record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        checked.append(record)
    return checked


def run(exercise: str, script: str) -> Optional[BaseException]:
    """Run ``script`` under the observers and report; returns what it raised (None: it ended with status 0)."""
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
        code = bootstrap.exit_code(exc)  # the status Python itself would give (a message printed now)
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
    report(record)  # first: a peer's failure stops this rank, and the references below take a while
    if exercise in NEEDS_REFERENCE and int(os.environ.get("RANK", 0)) == 0 and error is None:
        world_size = seen.init_world_size or int(os.environ.get("WORLD_SIZE", 1))
        report({"event": "references", "reference_world_size": world_size,
                "references": reference.references(world_size, sampler_seed(seen))})
    if exercise == "shard":
        shard_records.report_after(seen, failed=failure is not None)
    return failure


def end_as_the_script_did(failure: Optional[BaseException]) -> None:
    """Hand what the script raised on to the bootstrap running this file, which exits as for any script."""
    if failure is not None:
        raise failure


def main(argv) -> None:
    if len(argv) != 2:
        sys.exit("usage: bootstrap.py harness.py EXERCISE SCRIPT")
    end_as_the_script_did(run(argv[0], os.path.abspath(argv[1])))


if __name__ == "__main__":
    main(sys.argv[1:])
