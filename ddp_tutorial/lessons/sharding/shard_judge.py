"""Exercise "shard" (a DDP script with Adam made ZeRO-1), judged from ``workers/shard_records.py``'s
measurements; one a run that stopped early never made says "not measured". No torch in here."""

from __future__ import annotations

from typing import Dict, List, Optional

from ddp_tutorial.exercises.judge.common import (
    absent, Criterion, max_difference, NOT_MEASURED, not_measured, plural, ran_to_end, ranks_text)
from ddp_tutorial.exercises.judge.sampler_no_sync import reshuffled
from ddp_tutorial.exercises.runs import HarnessRun
from ddp_tutorial.exercises.shard import LR

#: Final parameters closer than this to the DDP script's replay count as equal (float rounding).
TOLERANCE = 1e-6

SHARDED = "Adam's state is sharded: each rank holds its partition's, together exactly one copy"
SAME_AS_DDP = f"final parameters equal the DDP script's (Adam, lr={LR}), within {TOLERANCE:g}"
CHECKPOINT = ("rank 0's checkpoint holds the whole optimizer state as training left it "
              "(consolidate_state_dict on every rank, after the last step)")
#: Saved and held Adam moments closer than this count as the same state.
STATE_TOLERANCE = 1e-6
#: The local optimizer of a ZeRO that runs Adam (with overlap_with_ddp=True, Adam's functional form).
ADAMS = {"Adam", "_FunctionalAdam"}
OVERLAP_NEVER_STEPS = (
    "with overlap_with_ddp=True, ZeRO builds its Adam only inside DDP's communication hook "
    "(hook_with_zero_step), and optimizer.step() does nothing (torch logs \"`step()` should not be included in "
    "the training loop when `overlap_with_ddp=True`\"); that hook refuses gloo. Leave overlap_with_ddp at its "
    "default (False)")
#: What consolidate_state_dict does, in the words every message uses (torch 2.13's implementation).
CONSOLIDATE_IS_COLLECTIVE = ("it is a collective: every shard but the target's own is broadcast from the rank "
                             "that holds it, and every rank takes part in each of those broadcasts")

def stopped_early(run: HarnessRun, finals: Dict[int, dict]) -> Optional[str]:
    """Why a measurement is missing in a run that stopped early; None if not for that reason."""
    if run.finished:
        return None
    silent = [r for r in run.ranks if r not in finals]
    who = f"rank {run.failed_rank} failed" if run.failed_rank is not None else "the run did not finish"
    if silent:
        return f"{ranks_text(silent)} reported nothing: {who} (see the first criterion)"
    return f"{who} (see the first criterion)"


def why_no_state(finals: Dict[int, dict]) -> Optional[str]:
    """Why Adam built no state on some rank, from what the harness saw; None if every rank holds some."""
    for rank, f in sorted(finals.items()):
        if f["optimizer"] is None:
            return f"rank {rank} built no optimizer that stepped"
        if f["trains_ddp_model"] is False:
            return (f"rank {rank}'s optimizer holds parameters that are not those of the model DDP wraps (another "
                    "model's, e.g. a second task.make_model()): the backward fills the gradients of the wrapped "
                    f"model, so these {plural(f['param_tensors'], 'parameter')} never got a gradient, and Adam "
                    "skips a parameter without one: no state, no update. Build the optimizer on the trained "
                    "model's parameters (model.parameters() of the DDP model)")
        if not f["optimizer_steps"]:
            return f"no optimizer step ran on rank {rank}"
        if not f["params_with_grad"]:
            return (f"rank {rank}'s optimizer stepped {plural(f['optimizer_steps'], 'time')}, but none of its "
                    f"{plural(f['param_tensors'], 'parameter')} had a gradient then, so Adam built no state")
    return None


def sharded(run: HarnessRun, finals: Dict[int, dict]) -> Criterion:
    """Every rank holds less than one full Adam state, and the ranks together hold exactly one."""
    if len(finals) < run.world_size:
        return not_measured(SHARDED, run, stopped_early(run, finals))
    idle = [r for r, f in finals.items() if f["optimizer"] is None or not f["optimizer_steps"]]
    if idle:
        return absent(SHARDED, run, f"no optimizer step ran on {ranks_text(idle)}: keep the training loop's "
                                    "optimizer.step()")
    full = max(f["full_state_bytes"] for f in finals.values())
    held = {r: f["state_bytes"] for r, f in finals.items()}
    measured = ", ".join(f"rank {r}: {b:,} bytes" for r, b in held.items())
    kinds = {f["optimizer"] for f in finals.values()}
    if "ZeroRedundancyOptimizer" not in kinds:
        return Criterion(SHARDED, False, (
            f"every rank holds Adam's whole state ({measured}; one full copy is {full:,} bytes): the "
            f"optimizer is {', '.join(sorted(kinds))}, so {run.world_size} copies exist. Shard it: "
            "torch.distributed.optim's ZeroRedundancyOptimizer gives each rank an Adam (the same learning rate) "
            "for its share of the parameters only"))
    local = {f["local_optimizer"] for f in finals.values()}
    if None in local:
        return Criterion(SHARDED, False, f"{measured}: {OVERLAP_NEVER_STEPS}")
    if not local <= ADAMS:  # overlap_with_ddp=True runs Adam's functional form
        return Criterion(SHARDED, False, f"ZeroRedundancyOptimizer runs {', '.join(sorted(local))} on each rank, "
                                         "not Adam: pass optimizer_class=torch.optim.Adam")
    if sum(held.values()) == full and all(b < full for b in held.values()):
        return Criterion(SHARDED, True, f"{measured}; together {sum(held.values()):,} = one copy")
    why = why_no_state(finals) if not all(held.values()) else None
    return Criterion(SHARDED, False, f"{measured}: together {sum(held.values()):,} bytes, but one full copy "
                                     f"is {full:,}" + (f": {why}" if why else ""))


def same_as_ddp(run: HarnessRun, finals: Dict[int, dict]) -> Criterion:
    """The final parameters on every rank equal those the DDP script with Adam reaches."""
    rank0 = finals.get(0, {})
    # ZeRO that built no Adam (overlap_with_ddp=True without its hook) changes no parameter: known
    # without the reference, which may be missing.
    never = [r for r, f in finals.items() if f["optimizer"] == "ZeroRedundancyOptimizer"
             and f["local_optimizer"] is None and f["optimizer_steps"]]
    if "reference" not in rank0 and never:
        return Criterion(SAME_AS_DDP, False, f"no parameter changed on {ranks_text(never)}: {OVERLAP_NEVER_STEPS}")
    if "reference" not in rank0:
        return not_measured(SAME_AS_DDP, run, stopped_early(run, finals) or "rank 0 computed no reference")
    idle = [r for r, f in finals.items() if f["final_params"] is None]
    if idle:
        return absent(SAME_AS_DDP, run, f"no optimizer stepped on {ranks_text(idle)}: there are no trained "
                                        "parameters to compare")
    steps = {r: f["optimizer_steps"] for r, f in finals.items()}
    if not run.finished and (len(finals) < run.world_size or min(steps.values()) < rank0["reference_steps"]):
        return not_measured(SAME_AS_DDP, run, f"optimizer steps per rank {steps} of the DDP script's "
                                              f"{rank0['reference_steps']}: {stopped_early(run, finals)}")
    sizes = {r: len(f["final_params"]) for r, f in finals.items()}
    if any(n != len(rank0["reference"]) for n in sizes.values()):
        r = next(r for r, n in sizes.items() if n != len(rank0["reference"]))
        return Criterion(SAME_AS_DDP, False, (
            f"rank {r}'s optimizer holds {sizes[r]} numbers in {plural(finals[r]['param_tensors'], 'parameter')}, "
            f"the model has {len(rank0['reference'])}: give the optimizer every parameter, model.parameters()"))
    diffs = {r: max_difference(f["final_params"], rank0["reference"]) for r, f in finals.items()}
    worst = max(diffs.values())
    if worst <= TOLERANCE:
        return Criterion(SAME_AS_DDP, True, f"max difference {worst:.2g} on {plural(len(diffs), 'rank')}")
    detail = f"the parameters differ from the DDP script's by up to {worst:.3g}"
    why = why_no_state(finals)
    if why:
        return Criterion(SAME_AS_DDP, False, f"{detail}: {why}")
    lrs = {f["lr"] for f in finals.values() if f["lr"] is not None}
    if lrs and lrs != {LR}:
        lr = sorted(lrs)[0]
        default = " (Adam's default: lr= was not passed on)" if lr == 0.001 else ""
        return Criterion(SAME_AS_DDP, False, (
            f"{detail}: the learning rate is {lr:g}{default}, the DDP script's Adam used {LR:g}. Swapping the "
            f"optimizer must not change the training: ZeroRedundancyOptimizer(..., lr={LR}) passes it to Adam"))
    if len(set(steps.values())) > 1 or steps[0] != rank0["reference_steps"]:
        return Criterion(SAME_AS_DDP, False, f"{detail}: optimizer steps per rank {steps}, the DDP script makes "
                                             f"{rank0['reference_steps']}")
    if any(f["local_optimizer"] is None for f in finals.values()):
        return Criterion(SAME_AS_DDP, False, f"{detail}: {OVERLAP_NEVER_STEPS}")
    local = {f["local_optimizer"] for f in finals.values()}
    if not local <= ADAMS:
        return Criterion(SAME_AS_DDP, False, f"{detail}: each rank's share is stepped by "
                                             f"{', '.join(sorted(local))}, not Adam (see the criterion above)")
    if any(f["overlap_with_ddp"] for f in finals.values()):
        return Criterion(SAME_AS_DDP, False, (
            f"{detail}: with overlap_with_ddp=True, ZeRO steps inside DDP's communication hook, and torch "
            "documents that the first two or three iterations make no update while DDP rebuilds its buckets; "
            "the DDP script updates from the first step. Leave overlap_with_ddp at its default (False) here"))
    order = reshuffled(run, run.finals()) if run.final(0) else None  # the sampler's criterion
    if order and not order.passed and not order.detail.startswith(NOT_MEASURED):
        return Criterion(SAME_AS_DDP, False, f"{detail}: {order.detail}")
    return Criterion(SAME_AS_DDP, False, detail)


def held_at_the_end(finals: Dict[int, dict], run: HarnessRun) -> Optional[Dict[int, dict]]:
    """Every parameter's Adam state at the end, by global index; None where a rank is missing."""
    if len(finals) < run.world_size:
        return None
    held: Dict[int, dict] = {}
    for f in finals.values():
        for index, state in f["held_state"]:
            held.setdefault(index, state)
    return held


def stale_parameters(saved: dict, held: Dict[int, dict]) -> Dict[int, float]:
    """Saved step per parameter index, where the saved state is not the one training left."""
    stale = {}
    for index, state in saved["state"]:
        now = held.get(index)
        if now is None or state["step"] != now["step"] or len(state["values"]) != len(now["values"]) or any(
                abs(a - b) > STATE_TOLERANCE for a, b in zip(state["values"], now["values"])):
            stale[index] = state["step"]
    return stale


def steps_text(steps: Dict[int, Optional[float]]) -> str:
    """{parameter index: step} as Python prints it ("-" for no state)."""
    return "{" + ", ".join(f"{i}: {'-' if s is None else f'{s:g}'}" for i, s in steps.items()) + "}"


def whole_checkpoint(run: HarnessRun, finals: Dict[int, dict]) -> Criterion:
    """Rank 0 saved a checkpoint whose optimizer state is every parameter's, as training left it."""
    consolidated = {r: f["consolidations"] for r, f in finals.items()}
    refused = {r: f["state_dict_refused"] for r, f in finals.items() if f["state_dict_refused"]}
    if refused:
        r = min(refused)
        targets = sorted(set(refused[r]["consolidated_to"]))
        if targets:  # it did consolidate, to another rank: only that rank holds the gathered state
            to = targets[-1]
            return Criterion(CHECKPOINT, False, (
                f"rank {r} called optimizer.state_dict() after consolidate_state_dict(to={to}), and it raised: "
                f"\"{refused[r]['message']}\". Only the target, rank {to}, holds the gathered state; on every "
                f"other rank state_dict() raises. Call consolidate_state_dict(to={to}) on every rank, then "
                f"optimizer.state_dict() only on rank {to}, inside the `if rank == {to}:` that saves"))
        return Criterion(CHECKPOINT, False, (
            f"rank {r} called optimizer.state_dict() without consolidate_state_dict(), and it raised: "
            f"\"{refused[r]['message']}\". A ZeroRedundancyOptimizer's state is spread over the ranks; call "
            "optimizer.consolidate_state_dict(to=0) on every rank first, then save optimizer.state_dict() on rank 0"))
    if len(finals) == run.world_size and 0 < sum(1 for n in consolidated.values() if n) < run.world_size:
        missing = [r for r, n in consolidated.items() if not n]
        return Criterion(CHECKPOINT, False, (
            f"consolidate_state_dict() ran on {ranks_text([r for r in consolidated if r not in missing])} only, "
            f"not on {ranks_text(missing)}: {CONSOLIDATE_IS_COLLECTIVE}, so call it on every rank, before the "
            "`if rank == 0:` that saves"))
    saves = finals.get(0, {}).get("saved_optimizer_states", [])
    if not saves:
        return absent(CHECKPOINT, run, "rank 0 saved no optimizer state: keep the script's torch.save of "
                                       "{\"model\": ..., \"optimizer\": optimizer.state_dict()}")
    last, n_params = saves[-1], finals[0]["param_tensors"]
    held = held_at_the_end(finals, run)
    steps_made = finals[0]["optimizer_steps"]
    saved_steps = {i: s["step"] for i, s in last["state"]}
    before_save = [c for c in consolidated[0] if c["after_steps"] <= last["after_steps"]]
    if last["after_steps"] < steps_made:
        return Criterion(CHECKPOINT, False, (
            f"rank 0 saved its last checkpoint after {last['after_steps']} of its "
            f"{plural(steps_made, 'optimizer step')}: "
            "save after training, so that the checkpoint holds the state training left"))
    if before_save and before_save[-1]["after_steps"] < steps_made:
        counts = [str(c["after_steps"]) for c in before_save]
        when = ", ".join(counts[:-1]) + " and " + counts[-1] if len(counts) > 1 else counts[0]
        at_end = f"; at the end {steps_text({i: held[i]['step'] for i in sorted(held)})}" if held else ""
        saved = (f"a mix of moments (per-parameter step counts {steps_text(saved_steps)}{at_end})" if saved_steps
                 else f"empty (no parameter had Adam state when it ran{at_end})")
        return Criterion(CHECKPOINT, False, (
            f"consolidate_state_dict() ran on rank 0 after {when} of the {plural(steps_made, 'optimizer step')}, "
            f"never after the last: it gathers the ranks' shards as they are when called, so the saved state is "
            f"{saved}. Call it after the last optimizer.step(), right before saving"))
    if last["params_with_state"] == 0:
        why = why_no_state(finals)
        local = {f["local_optimizer"] for f in finals.values()}
        if not why and not local <= ADAMS:
            why = (f"{', '.join(sorted(local))} keeps no per-parameter state here (Adam does: see the criterion "
                   "on sharding)")
        return Criterion(CHECKPOINT, False, f"the saved optimizer state is empty (0 of {n_params} parameters)"
                         + (f": {why}" if why else ""))
    if held is not None and set(saved_steps) < set(held) and not consolidated[0]:
        own = {i for i, _ in finals[0]["held_state"]}
        whose = "rank 0's own shard" if set(saved_steps) == own else "one rank's shard"
        return Criterion(CHECKPOINT, False, (
            f"the saved optimizer state covers {last['params_with_state']} of {n_params} parameters: that is "
            f"{whose} (e.g. optimizer.optim.state_dict()), and consolidate_state_dict() was never called. "
            f"Call optimizer.consolidate_state_dict(to=0) on every rank ({CONSOLIDATE_IS_COLLECTIVE}), "
            "then save optimizer.state_dict() on rank 0"))
    if held is not None:
        stale = stale_parameters(last, held)
        missing = sorted(set(held) - set(saved_steps))
        if stale or missing:
            return Criterion(CHECKPOINT, False, (
                f"the saved optimizer state is not the one training left: per-parameter step counts "
                f"{steps_text({i: saved_steps.get(i) for i in sorted(held)})} saved, "
                f"{steps_text({i: held[i]['step'] for i in sorted(held)})} at the end"
                + (f", and the moments of parameters {sorted(stale)} differ" if stale else "")
                + ": save optimizer.state_dict() of the optimizer that trained, after consolidate_state_dict()"))
    if last["state_bytes"] != finals[0]["full_state_bytes"]:
        return Criterion(CHECKPOINT, False, f"the saved optimizer state holds {last['state_bytes']:,} bytes, one "
                                            f"full Adam state is {finals[0]['full_state_bytes']:,}")
    if held is None:
        return not_measured(CHECKPOINT, run, f"the state training left is unknown: {stopped_early(run, finals)}")
    return Criterion(CHECKPOINT, True, f"{last['params_with_state']} of {n_params} parameters' Adam state, "
                                       f"{last['state_bytes']:,} bytes, each at step "
                                       f"{', '.join(sorted({f'{s:g}' for s in saved_steps.values()}))} as training "
                                       "left it")


def judge_shard(run: HarnessRun) -> List[Criterion]:
    finals = run.finals("shard_final", "shard_reference")
    criteria = [ran_to_end(run)]
    if not finals:
        return criteria + [not_measured(name, run, stopped_early(run, finals) or "")
                           for name in (SHARDED, SAME_AS_DDP, CHECKPOINT)]
    return criteria + [sharded(run, finals), same_as_ddp(run, finals), whole_checkpoint(run, finals)]
