"""Judge exercises "teardown" (destroy_process_group on every path, nothing left) and "capstone"
(every part together, under launch, torchrun and as one plain process)."""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence

from ddp_tutorial.exercises.judge.common import (
    absent, CHECKPOINT_LOADS, CLEAN_EXIT, CLEAN_TEARDOWN, Criterion, destroyed_everywhere,
    FAILING_RANK_LEAVES, judged_from_finals, K_MICRO_STEPS, max_difference, not_measured, NOTHING_LEFT,
    ONE_ALLREDUCE_PER_STEP, ONLY_RANK0_SAVES, plural, PORT_FREE, ran_to_end, RESHUFFLED, RUNS_PLAIN,
    RUNS_TORCHRUN, SAME_AS_ONE_PROCESS, SHARDS, TEARDOWN_RULE, TOLERANCE)
from ddp_tutorial.exercises.judge.sampler_no_sync import (
    k_micro_steps, one_allreduce_per_step, reshuffled, same_as_one_process, shards)
from ddp_tutorial.exercises.runs import HarnessRun
from ddp_tutorial.exercises.settings import FAIL_AT_CALL, FAIL_RANK
from ddp_tutorial.launcher import procinfo
from ddp_tutorial.lessons import port_can_be_bound


def nothing_left(harness_runs: Sequence[HarnessRun]) -> Criterion:
    pids = [pid for run in harness_runs for pid in run.pids]
    left = [pid for pid in pids if procinfo.alive(pid)]
    if left:
        return Criterion(NOTHING_LEFT, False, f"process(es) {left} still alive after the run")
    return Criterion(NOTHING_LEFT, True, f"the {len(pids)} processes started ({', '.join(map(str, pids))}) are gone")


def port_released(run: HarnessRun) -> Criterion:
    if run.port is None:
        return not_measured(PORT_FREE, run, "the launch reported no port")
    if port_can_be_bound(run.port):
        return Criterion(PORT_FREE, True, f"127.0.0.1:{run.port} can be listened on again")
    return Criterion(PORT_FREE, False, f"127.0.0.1:{run.port} is still taken")


def failing_rank_leaves(normal: HarnessRun, failing: Optional[HarnessRun]) -> Criterion:
    """In the run where rank FAIL_RANK raises mid-training, it still calls destroy_process_group."""
    if failing is None:
        return not_measured(FAILING_RANK_LEAVES, normal, "the first run did not finish, so the failing run "
                                                         "was skipped")
    records = failing.records.get(FAIL_RANK, [])
    fired = [i for i, r in enumerate(records) if r.get("event") == "injected_failure"]
    if not fired:
        return Criterion(FAILING_RANK_LEAVES, False, (
            f"in the run with rank {FAIL_RANK} made to fail, it never reached task.loss_fn call "
            f"#{FAIL_AT_CALL} ({failing.failure or 'it finished'}): compute the loss with task.loss_fn"))
    if any(r.get("event") == "destroy" for r in records[fired[0]:]):
        return Criterion(FAILING_RANK_LEAVES, True, f"rank {FAIL_RANK} raised InjectedFailure and called "
                                                    "destroy_process_group on its way out")
    if normal.events(FAIL_RANK, "destroy"):
        why = ("No finally: it leaves the group at the end of a run that succeeds, but not on the way "
               f"out of an exception. Put the training in try:. {TEARDOWN_RULE}")
    else:
        why = (f"Rank {FAIL_RANK} never calls it, not even when training succeeds. Put the training in "
               f"try:, on every rank. {TEARDOWN_RULE}")
    return Criterion(FAILING_RANK_LEAVES, False, f"rank {FAIL_RANK} raised InjectedFailure mid-training and "
                                                 f"exited without calling destroy_process_group. {why}")


def judge_teardown(normal: HarnessRun, failing: Optional[HarnessRun] = None) -> List[Criterion]:
    harness_runs = [a for a in (normal, failing) if a is not None]
    return [ran_to_end(normal, CLEAN_EXIT), destroyed_everywhere(normal), nothing_left(harness_runs),
            port_released(normal), failing_rank_leaves(normal, failing)]


# -- capstone ----------------------------------------------------------------
def only_rank0_saves(run: HarnessRun, finals: Dict[int, dict]) -> Criterion:
    saves = {r: f["saves"] for r, f in finals.items()}
    if not saves[0]:
        return absent(ONLY_RANK0_SAVES, run, "rank 0 saved nothing: keep the original script's "
                                                  "torch.save, on rank 0")
    others = [r for r, s in saves.items() if r != 0 and s]
    if others:
        r = others[0]
        return Criterion(ONLY_RANK0_SAVES, False, (
            f"rank {r} also called torch.save ({os.path.basename(saves[r][0]['path'])}): with every rank "
            "saving, several processes write one file at once. Save only where rank == 0; the ranks hold "
            "the same model"))
    return Criterion(ONLY_RANK0_SAVES, True, f"rank 0 saved {os.path.basename(saves[0][0]['path'])}, "
                                             "no other rank saved")


def clean_teardown(run: HarnessRun) -> Criterion:
    if run.timed_out:
        return not_measured(CLEAN_TEARDOWN, run, "the launch did not finish (see its first line)")
    for criterion in (ran_to_end(run), destroyed_everywhere(run), nothing_left([run])):
        if not criterion.passed:
            return Criterion(CLEAN_TEARDOWN, False, criterion.detail)
    return Criterion(CLEAN_TEARDOWN, True, "every rank left the group and exited 0; its processes are gone")


def runs_plain(plain: HarnessRun) -> Criterion:
    if not plain.finished:
        return Criterion(RUNS_PLAIN, False, ran_to_end(plain).detail + "\n(without RANK there is no launcher: "
                         "guard the DDP parts, e.g. with `if \"RANK\" in os.environ`)")
    final = plain.final(0)
    if not final or not final["optimizer_steps"]:
        return Criterion(RUNS_PLAIN, False, "it ran, but no optimizer step was taken")
    return Criterion(RUNS_PLAIN, True, f"{plural(final['optimizer_steps'], 'optimizer step')}, exit code 0, "
                                       f"{plain.seconds:.1f} s")


def runs_torchrun(run: HarnessRun) -> Criterion:
    if not run.finished:
        return Criterion(RUNS_TORCHRUN, False, ran_to_end(run).detail)
    finals = run.finals()
    if len(finals) < run.world_size:
        return not_measured(RUNS_TORCHRUN, run, "a rank reported no end")
    same = same_as_one_process(run, finals)
    if not same.passed:
        return Criterion(RUNS_TORCHRUN, False, f"it ran, but {same.detail}")
    return Criterion(RUNS_TORCHRUN, True, f"exit code 0 on every rank, the same parameters as one process, "
                                          f"{run.seconds:.1f} s")


def checkpoint_problem(run: HarnessRun) -> Optional[str]:
    """What is wrong with the checkpoint rank 0 of ``run`` saved (None: it loads and holds the right model)."""
    final = run.final(0) or {}
    checked = final.get("checkpoints") or []
    if not checked:
        return "rank 0 saved no checkpoint"
    record = checked[-1]
    name = os.path.basename(record["path"])
    if record["prefixed_keys"]:
        return (f"{name} does not load into task.make_model(): its keys start with "
                f"\"module.\" ({', '.join(record['prefixed_keys'])}, ...): that is the DDP wrapper's "
                "state_dict(). Save the model inside it, model.state_dict() of the model you wrapped (or "
                "ddp_model.module.state_dict()), so that a plain process can load it")
    if not record["loads"]:
        return f"{name} does not load into task.make_model() with strict=True: {record['error']}"
    reference = (final.get("references") or {}).get("correct")
    if reference is None:
        return None  # no reference to compare with: the parameters are judged by the other criteria
    d = max_difference(record["params"], reference)
    if d <= TOLERANCE:
        return None
    if max_difference(record["params"], final.get("final_params")) <= TOLERANCE:
        return (f"{name} loads and holds rank 0's trained parameters, but they differ from one process's by "
                f"up to {d:.3g}: the training is what differs (see the parameters' criterion)")
    return (f"{name} loads, but holds other parameters than rank 0 trained (up to {d:.3g} from one "
            "process's): save after training, the trained model's state_dict()")


def checkpoint_loads(launched: HarnessRun, torchrun: HarnessRun) -> Criterion:
    """The file rank 0 saved, under launch and under torchrun, is one process's trained model, loadable as is."""
    runs = [run for run in (launched, torchrun) if run.finished]
    if not runs:
        return not_measured(CHECKPOINT_LOADS, launched, "neither run finished (see the criteria above)")
    problems: Dict[str, List[str]] = {}  # the same problem under both: said once
    for run in runs:
        if (problem := checkpoint_problem(run)):
            problems.setdefault(problem, []).append(run.mode)
    if problems:
        return Criterion(CHECKPOINT_LOADS, False, "; ".join(f"under {' and under '.join(modes)}, {problem}"
                                                            for problem, modes in problems.items()))
    if len(runs) < 2:
        missed = ({"launch", "torchrun"} - {run.mode for run in runs}).pop()
        return not_measured(CHECKPOINT_LOADS, launched, f"the {missed} run did not finish")
    return Criterion(CHECKPOINT_LOADS, True, "both load with strict=True and equal one process's parameters")


def judge_capstone(launched: HarnessRun, plain: HarnessRun, torchrun: HarnessRun) -> List[Criterion]:
    measured = judged_from_finals(launched, [
        (SAME_AS_ONE_PROCESS, same_as_one_process), (ONE_ALLREDUCE_PER_STEP, one_allreduce_per_step),
        (K_MICRO_STEPS, k_micro_steps), (SHARDS, shards), (RESHUFFLED, reshuffled),
        (ONLY_RANK0_SAVES, only_rank0_saves)])
    return ([ran_to_end(launched, f"runs under launch on {launched.world_size} ranks")] + measured
            + [checkpoint_loads(launched, torchrun), clean_teardown(launched), runs_plain(plain),
               runs_torchrun(torchrun)])
