"""Judge exercises "init" (join one group, all_reduce, leave) and "wrap" (DistributedDataParallel)."""

from __future__ import annotations

from typing import Dict, List

from ddp_tutorial.exercises.judge.common import (
    absent, ALL_REDUCE_SUM, collective_calls, Criterion, destroyed_everywhere, ended_on_its_own, JOINED,
    judged_from_finals, max_difference, MEETS_AT_LAUNCHER, not_measured, plural, ran_to_end, ranks_text,
    SAME_AFTER_STEPS, SAME_AFTER_WRAP, SAME_CALLS, TOLERANCE, WRAPPED)
from ddp_tutorial.exercises.runs import HarnessRun


def joined_one_group(run: HarnessRun) -> Criterion:
    world = run.world_size
    called = {r: run.events(r, "init_called") for r in run.ranks}
    joined = {r: run.events(r, "init") for r in run.ranks}
    for rank in (r for r in run.ranks if called[r]):  # rank=, world_size= not the launcher's
        given, starts = called[rank][-1], run.events(rank, "start")
        env_rank = int(starts[0]["rank_env"]) if starts else rank
        env_world = int(starts[0]["world_size_env"]) if starts else world
        if (given["rank_arg"] not in (None, env_rank)
                or given["world_size_arg"] not in (None, env_world)):
            return Criterion(JOINED, False, (
                f"process {rank} called init_process_group(rank={given['rank_arg']}, "
                f"world_size={given['world_size_arg']}), but the launcher made it rank "
                f"{env_rank} of {env_world}: hard-coded values do not form one group. Leave "
                "rank= and world_size= out: env:// reads the RANK and WORLD_SIZE the launcher "
                "set for each process"))
    if not any(called.values()):
        return Criterion(JOINED, False, "init_process_group was never called: call "
                                        "dist.init_process_group(\"gloo\") before any collective")
    missing = [r for r in run.ranks if not joined[r]]
    if missing:
        return Criterion(JOINED, False, f"{ranks_text(missing)} did not complete init_process_group")
    sizes = {r: joined[r][-1]["world_size"] for r in run.ranks}
    ranks = {r: joined[r][-1]["rank"] for r in run.ranks}
    if set(sizes.values()) == {world} and sorted(ranks.values()) == run.ranks:
        return Criterion(JOINED, True, f"world size {world} on every rank, ranks {sorted(ranks.values())}")
    seen = ", ".join(f"process {r}: rank {ranks[r]} of {sizes[r]}" for r in run.ranks)
    return Criterion(JOINED, False, f"{seen}, not one group of {world}")


def meets_at_launcher(run: HarnessRun) -> Criterion:
    calls = [events[-1] for r in run.ranks if (events := run.events(r, "init_called"))]
    if not calls:
        return not_measured(MEETS_AT_LAUNCHER, run, "init_process_group was never called")
    wrong = [c for c in calls if c["launcher_port"] is not None
             and c["rendezvous_port"] not in (c["launcher_port"], "store")]
    if wrong:
        c = wrong[0]
        return Criterion(MEETS_AT_LAUNCHER, False, (
            f"init_method={c['init_method']!r} hard-codes port {c['rendezvous_port']}, but the launcher's "
            f"rendezvous is MASTER_PORT={c['launcher_port']}: drop init_method (env:// is the default; it "
            "reads MASTER_ADDR and MASTER_PORT), so the launcher picks a free port for every run"))
    return Criterion(MEETS_AT_LAUNCHER, True, f"port {calls[0]['launcher_port']} via "
                                              f"{calls[0]['init_method'] or 'env://'}")


def all_reduce_sum(run: HarnessRun) -> Criterion:
    world = run.world_size
    expected = world * (world + 1) / 2
    problems = []
    entered = {r: "all_reduce" in collective_calls(run, r) for r in run.ranks}
    if any(entered.values()) and not all(entered.values()):
        skipped = [r for r, e in entered.items() if not e]
        callers = [r for r, e in entered.items() if e]
        if not all(ended_on_its_own(run, r) for r in skipped):  # stopped before it got there: no accusation
            return not_measured(ALL_REDUCE_SUM, run, f"{ranks_text(skipped)} stopped before calling all_reduce "
                                                     "(see the first criterion)")
        return Criterion(ALL_REDUCE_SUM, False, f"{ranks_text(skipped)} never called all_reduce "
                                                f"({ranks_text(callers)} did): {SAME_CALLS}")
    for rank in run.ranks:
        done = [c for c in run.events(rank, "collective") if c["op"] == "all_reduce"]
        own = [d for d in done if d["input"] and set(d["input"]) == {rank + 1}]  # any shape, all rank + 1
        if not done and not run.finished:
            return not_measured(ALL_REDUCE_SUM, run, f"rank {rank} finished no all_reduce before the run "
                                                         "stopped (see the first criterion)")
        unwaited = [c for c in run.events(rank, "collective_enter") if c["op"] == "all_reduce" and c.get("async")]
        if not done and unwaited:
            problems.append(f"rank {rank} called all_reduce(async_op=True) and never called wait() on the Work it "
                            "returned: the sum is in the tensor only once work.wait() returns (or leave "
                            "async_op out: then all_reduce returns when it is done)")
        elif not done:
            problems.append(f"rank {rank} finished no all_reduce")
        elif not own:
            problems.append(f"rank {rank} all-reduced {done[-1]['input']}, not rank + 1 = {rank + 1}")
        elif set(own[-1]["output"]) != {expected}:
            problems.append(f"rank {rank} got {own[-1]['output']}, not {expected:g}: a sum over all "
                            f"{world} ranks (the default op, SUM) gives 1 + ... + {world}")
    return Criterion(ALL_REDUCE_SUM, not problems,
                     "; ".join(problems) or f"{expected:g} on {plural(world, 'rank')}")


def judge_init(run: HarnessRun) -> List[Criterion]:
    return [ran_to_end(run), joined_one_group(run), meets_at_launcher(run), all_reduce_sum(run),
            destroyed_everywhere(run)]


# -- wrap --------------------------------------------------------------------
def why_not_averaged(finals: Dict[int, dict]) -> str:
    """Why the ranks' parameters drifted apart, from what DDP saw."""
    if not all(f["ddp_wraps"] for f in finals.values()):
        return ("each rank stepped on its own gradients, and nothing averaged them: wrap the model, "
                "model = DDP(model)")
    if all(f["ddp_forwards"] == 0 for f in finals.values()):
        return ("the model is wrapped, but no forward went through the wrapper, so no gradient was "
                "all-reduced (0 bucket all-reduces): call the wrapped model, ddp_model(x), not "
                "ddp_model.module(x) or the model you wrapped")
    if all(f["bucket_allreduces"] == 0 for f in finals.values()):
        return "no gradient bucket was all-reduced: the backward passes ran without DDP syncing them"
    return "the gradients were not averaged alike on every rank"


def wrapped(run: HarnessRun, finals: Dict[int, dict]) -> Criterion:
    unwrapped = [r for r, f in finals.items() if not f["ddp_wraps"]]
    if not unwrapped:
        return Criterion(WRAPPED, True, "DDP built on every rank")
    if any(finals[r]["ddp_attempts"] for r in unwrapped):
        return Criterion(WRAPPED, False, f"{ranks_text(unwrapped)}: DistributedDataParallel(...) raised "
                                         "(its error is above)")
    return absent(WRAPPED, run, f"{ranks_text(unwrapped)} built no DistributedDataParallel: "
                                     "model = DDP(model) before training")


def same_after_wrap(run: HarnessRun, finals: Dict[int, dict]) -> Criterion:
    unwrapped = [r for r, f in finals.items() if not f["ddp_wraps"]]
    if unwrapped:
        return not_measured(SAME_AFTER_WRAP, run, f"no DDP model on {ranks_text(unwrapped)}")
    after_wrap = {r: f["ddp_wraps"][0]["params_after_wrap"] for r, f in finals.items()}
    d = max(max_difference(after_wrap[0], p) for p in after_wrap.values())
    return Criterion(SAME_AFTER_WRAP, d <= TOLERANCE, "DDP broadcast rank 0's parameters" if d <= TOLERANCE
                     else f"they differ by up to {d:.3g} right after DDP was built")


def same_after_steps(run: HarnessRun, finals: Dict[int, dict]) -> Criterion:
    idle = [r for r, f in finals.items() if not f["optimizer_steps"]]
    if idle:
        return absent(SAME_AFTER_STEPS, run, f"no optimizer step ran on {ranks_text(idle)}")
    if not run.finished and len({f["optimizer_steps"] for f in finals.values()}) > 1:
        return not_measured(SAME_AFTER_STEPS, run, "a rank stopped before the others (see the first criterion)")
    elsewhere = [r for r, f in finals.items() if f.get("optimizer_trains_ddp_model") is False]
    if elsewhere:
        return Criterion(SAME_AFTER_STEPS, False, (
            f"on {ranks_text(elsewhere)} the optimizer steps parameters that are not those of the model DDP wraps "
            "(another model's): the backward fills the wrapped model's gradients, so the stepped parameters never "
            "change, and staying identical shows nothing. Build the optimizer on the wrapped model's parameters, "
            "model.parameters() of the DDP model (or of the model you wrapped: they are the same tensors)"))
    gradless = [r for r, f in finals.items() if f.get("params_with_grad") == 0]
    if gradless:
        return Criterion(SAME_AFTER_STEPS, False, (
            f"on {ranks_text(gradless)} no parameter had a gradient when the optimizer stepped, so nothing "
            "trained: call loss.backward() before optimizer.step()"))
    steps = {r: f["params_per_step"] for r, f in finals.items()}
    if len({len(s) for s in steps.values()}) > 1:
        counts = ", ".join(f"rank {r}: {len(s)}" for r, s in steps.items())
        return Criterion(SAME_AFTER_STEPS, False, "the ranks made different numbers of optimizer "
                                                  f"steps: {counts}: {why_not_averaged(finals)}")
    for i in range(len(steps[0])):
        for rank, per_step in steps.items():
            if (d := max_difference(steps[0][i], per_step[i])) > TOLERANCE:
                return Criterion(SAME_AFTER_STEPS, False, (
                    f"after optimizer step {i + 1}, rank 0 and rank {rank} differ by up to "
                    f"{d:.3g}: {why_not_averaged(finals)}"))
    return Criterion(SAME_AFTER_STEPS, True, f"{plural(finals[0]['optimizer_steps'], 'step')} alike")


def judge_wrap(run: HarnessRun) -> List[Criterion]:
    return [ran_to_end(run)] + judged_from_finals(run, [
        (WRAPPED, wrapped), (SAME_AFTER_WRAP, same_after_wrap), (SAME_AFTER_STEPS, same_after_steps)])


