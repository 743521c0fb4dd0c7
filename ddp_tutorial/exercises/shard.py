"""Exercise "shard": turn a DDP script with Adam into ZeRO-1, judged from what the ranks measured.

The learner's script trains ``task``'s model with DDP and Adam (learning rate
``LR``), then saves a checkpoint on rank 0 (``checkpoint_path()``). The check
runs it under ``workers/shard_harness.py``, which adds to the common harness
what this exercise needs: the Adam state each rank holds at the end, the
ZeroRedundancyOptimizer calls (``consolidate_state_dict``, ``state_dict``),
what rank 0 saved, and on rank 0 the parameters the original DDP script
reaches (replayed in one process). The skeleton and solution import this
module for ``LR`` and ``checkpoint_path``. No torch in here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List

from ddp_tutorial.exercises.judge.common import Criterion, max_difference, not_measured, plural, ran_to_end, ranks_text
from ddp_tutorial.exercises.runs import HarnessRun
from ddp_tutorial import envvars

#: The learning rate of the DDP script's Adam.
LR = 0.01
HARNESS = Path(__file__).resolve().parent / "workers" / "shard_harness.py"
#: Final parameters closer than this to the DDP script's count as equal. The harness replays DDP's
#: arithmetic (each rank's gradient, divided by W, summed), so a correct ZeRO-1 run lands within
#: float rounding of it (0.0 measured on 2 ranks).
TOLERANCE = 1e-6

SHARDED = "Adam's state is sharded: each rank holds its partition's, together exactly one copy"
SAME_AS_DDP = f"final parameters equal the DDP script's (Adam, lr={LR}), within {TOLERANCE:g}"
CHECKPOINT = "rank 0's checkpoint holds the whole optimizer state (consolidate_state_dict on every rank)"

HINT = ("optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=shard.LR): "
        "it builds an Adam of its own for this rank's share of the parameters and passes lr= on to it. "
        "Before saving: optimizer.consolidate_state_dict(to=0) on every rank (it is a collective: each rank other "
        "than 0 broadcasts its shard, and every rank takes part in each broadcast), then optimizer.state_dict() "
        "on rank 0 only.")


def checkpoint_path() -> str:
    """Where the script saves its checkpoint: in the check's run folder, else the current folder."""
    return os.path.join(os.environ.get(envvars.EXERCISE_OUT) or ".", "shard_checkpoint.pt")


def shard_finals(run: HarnessRun) -> Dict[int, dict]:
    """Per rank, what ``shard_harness.py`` measured once the script ended."""
    return {r: recs[-1] for r in run.ranks if (recs := run.events(r, "shard_final"))}


def sharded(run: HarnessRun, finals: Dict[int, dict]) -> Criterion:
    """Every rank holds less than one full Adam state, and the ranks together hold exactly one."""
    if len(finals) < run.world_size or any(f["optimizer"] is None for f in finals.values()):
        idle = [r for r in run.ranks if r not in finals or finals[r]["optimizer"] is None]
        return not_measured(SHARDED, run, f"no optimizer stepped on {ranks_text(idle)}")
    full = finals[0]["full_state_bytes"]
    held = {r: f["state_bytes"] for r, f in finals.items()}
    measured = ", ".join(f"rank {r}: {b:,} bytes" for r, b in held.items())
    kinds = {f["optimizer"] for f in finals.values()}
    if "ZeroRedundancyOptimizer" not in kinds:
        return Criterion(SHARDED, False, (
            f"every rank holds Adam's whole state ({measured}; one full copy is {full:,} bytes): the "
            f"optimizer is {', '.join(sorted(kinds))}, so {run.world_size} copies exist. Build "
            "ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=...)"))
    local = {f["local_optimizer"] for f in finals.values()}
    if local != {"Adam"}:
        return Criterion(SHARDED, False, f"ZeroRedundancyOptimizer runs {', '.join(sorted(local))} on each rank, "
                                         "not Adam: pass optimizer_class=torch.optim.Adam")
    if sum(held.values()) == full and all(b < full for b in held.values()):
        return Criterion(SHARDED, True, f"{measured}; together {sum(held.values()):,} = one copy")
    return Criterion(SHARDED, False, f"{measured}: together {sum(held.values()):,} bytes, but one full copy "
                                     f"is {full:,}")


def same_as_ddp(run: HarnessRun, finals: Dict[int, dict]) -> Criterion:
    """The final parameters on every rank equal those the DDP script with Adam reaches."""
    rank0 = finals.get(0, {})
    if "reference" not in rank0:
        return not_measured(SAME_AS_DDP, run, "rank 0 computed no reference (its script failed)")
    diffs = {r: max_difference(f["final_params"], rank0["reference"]) for r, f in finals.items()}
    worst = max(diffs.values())
    if worst <= TOLERANCE:
        return Criterion(SAME_AS_DDP, True, f"max difference {worst:.2g} on {plural(len(diffs), 'rank')}")
    detail = f"the parameters differ from the DDP script's by up to {worst:.3g}"
    lrs = {f["lr"] for f in finals.values() if f["lr"] is not None}
    if lrs and lrs != {LR}:
        lr = sorted(lrs)[0]
        default = " (Adam's default: lr= was not passed on)" if lr == 0.001 else ""
        return Criterion(SAME_AS_DDP, False, (
            f"{detail}: the learning rate is {lr:g}{default}, the DDP script's Adam used {LR:g}. Swapping the "
            f"optimizer must not change the training: ZeroRedundancyOptimizer(..., lr={LR}) passes it to Adam"))
    steps = {r: f["optimizer_steps"] for r, f in finals.items()}
    if len(set(steps.values())) > 1 or steps[0] != rank0["reference_steps"]:
        return Criterion(SAME_AS_DDP, False, f"{detail}: optimizer steps per rank {steps}, the DDP script makes "
                                             f"{rank0['reference_steps']}")
    return Criterion(SAME_AS_DDP, False, detail)


def whole_checkpoint(run: HarnessRun, finals: Dict[int, dict]) -> Criterion:
    """Rank 0 saved a checkpoint whose optimizer state covers every parameter (consolidated first)."""
    consolidated = {r: f["consolidate_calls"] for r, f in finals.items()}
    refused = {r: f["state_dict_refused"] for r, f in finals.items() if f["state_dict_refused"]}
    if refused:
        r = min(refused)
        return Criterion(CHECKPOINT, False, (
            f"rank {r} called optimizer.state_dict() without consolidate_state_dict(), and it raised: "
            f"\"{refused[r]}\". A ZeroRedundancyOptimizer's state is spread over the ranks; call "
            "optimizer.consolidate_state_dict(to=0) on every rank first, then save optimizer.state_dict() on rank 0"))
    if len(finals) == run.world_size and 0 < sum(1 for n in consolidated.values() if n) < run.world_size:
        missing = [r for r, n in consolidated.items() if not n]
        return Criterion(CHECKPOINT, False, (
            f"consolidate_state_dict() ran on {ranks_text([r for r in consolidated if r not in missing])} only, "
            f"not on {ranks_text(missing)}: it is a collective (one broadcast per rank's shard, and every rank "
            f"takes part in each), so call it "
            "on every rank, before the `if rank == 0:` that saves"))
    saves = finals.get(0, {}).get("saved_optimizer_states", [])
    if not saves:
        return Criterion(CHECKPOINT, False, "rank 0 saved no optimizer state: keep the script's torch.save of "
                                            "{\"model\": ..., \"optimizer\": optimizer.state_dict()}")
    last, n_params = saves[-1], finals[0]["param_tensors"]
    if last["params_with_state"] < n_params:
        return Criterion(CHECKPOINT, False, (
            f"the saved optimizer state covers {last['params_with_state']} of {n_params} parameters: that is "
            "one rank's shard (e.g. optimizer.optim.state_dict()). Save optimizer.state_dict() after "
            "consolidate_state_dict(to=0)"))
    if last["state_bytes"] != finals[0]["full_state_bytes"]:
        return Criterion(CHECKPOINT, False, f"the saved optimizer state holds {last['state_bytes']:,} bytes, one "
                                            f"full Adam state is {finals[0]['full_state_bytes']:,}")
    return Criterion(CHECKPOINT, True, f"{last['params_with_state']} of {n_params} parameters' Adam state, "
                                       f"{last['state_bytes']:,} bytes")


def judge_shard(run: HarnessRun) -> List[Criterion]:
    finals = shard_finals(run)
    criteria = [ran_to_end(run)]
    if not finals:
        return criteria + [not_measured(name, run) for name in (SHARDED, SAME_AS_DDP, CHECKPOINT)]
    return criteria + [sharded(run, finals), same_as_ddp(run, finals), whole_checkpoint(run, finals)]
