"""What every exercise's judging shares: ``Criterion``, the criteria's names, the common criteria
(``ran_to_end``, ``destroyed_everywhere``), and ``not_measured``/``absent`` for missing evidence."""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

from ddp_tutorial.exercises.runs import HarnessRun
from ddp_tutorial.exercises.settings import ACCUM_STEPS


#: Parameters closer than this count as equal (float32 sums in another order differ by ~1e-7).
TOLERANCE = 1e-5

RAN_TO_END = "runs to the end on every rank"
JOINED = "joins one group: world size and ranks 0..W-1 as the launcher set them"
MEETS_AT_LAUNCHER = "meets at the launcher's MASTER_ADDR:MASTER_PORT"
ALL_REDUCE_SUM = "all_reduce of rank + 1 gives 1 + ... + W on every rank"
WRAPPED = "the model is wrapped in DistributedDataParallel on every rank"
SAME_AFTER_WRAP = "parameters identical on every rank right after wrapping"
SAME_AFTER_STEPS = "parameters identical on every rank after every optimizer step (gradients averaged)"
SAME_DATASET = "every rank builds the same dataset"
SHARDS = "a DistributedSampler gives each rank a disjoint shard, together the whole dataset"
RESHUFFLED = "a new order every epoch (set_epoch)"
ONE_ALLREDUCE_PER_STEP = "one gradient all-reduce per bucket per optimizer step"
K_MICRO_STEPS = (f"an optimizer step after every K = {ACCUM_STEPS} micro-batches, and after each epoch's last "
                 "(a shorter last window)")
SAME_AS_ONE_PROCESS = (f"final parameters equal one process on the global batch ({ACCUM_STEPS} x world size "
                       f"x batch), within {TOLERANCE:g}")
CLEAN_EXIT = "a clean exit (exit code 0) on every rank"
DESTROYED = "destroy_process_group called on every rank"
NOTHING_LEFT = "no process left behind"
PORT_FREE = "the rendezvous port is free again after the run"
FAILING_RANK_LEAVES = "a rank that raises mid-training still leaves the group (try/finally)"
ONLY_RANK0_SAVES = "only rank 0 writes the checkpoint"
CLEAN_TEARDOWN = "clean teardown: destroy_process_group on every rank, exit code 0, no process left"
RUNS_PLAIN = "runs unchanged as one plain process (no RANK in the environment)"
RUNS_TORCHRUN = "runs under torchrun --standalone --nproc-per-node 2"
CHECKPOINT_LOADS = ("the checkpoint (under launch and under torchrun) loads strictly into task.make_model() "
                    "and holds one process's parameters")
SAME_CALLS = "every rank must make the same collective calls in the same order"


class Criterion(NamedTuple):
    name: str
    passed: bool
    detail: str


def max_difference(a: Optional[Sequence[float]], b: Optional[Sequence[float]]) -> float:
    """Largest absolute difference of two parameter lists (inf: one missing, or sizes differ)."""
    if a is None or b is None or len(a) != len(b):
        return float("inf")
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "es" if word.endswith("ch") else "s")


def ranks_text(ranks: Sequence[int]) -> str:
    return ", ".join(f"rank {r}" for r in ranks)


def judged_from_finals(run: HarnessRun, judges: Sequence[Tuple[str, Callable]]) -> List[Criterion]:
    """Each ``(name, judge)``'s ``judge(run, finals)``; "not measured" where a rank has no final."""
    finals = run.finals()
    if len(finals) < run.world_size:
        return [not_measured(name, run) for name, _ in judges]
    return [judge(run, finals) for _, judge in judges]


# -- Common criteria ---------------------------------------------------------
def where_it_waits(run: HarnessRun, rank: int) -> Optional[str]:
    """The collective (or rendezvous) a rank running at the deadline was waiting in, if any."""
    records = run.records.get(rank, [])
    entered = {r["n"]: r["op"] for r in records if r.get("event") == "collective_enter"}
    left = {r["n"] for r in records if r.get("event") == "collective"}
    waiting = sorted(set(entered) - left)
    if waiting:
        return f"waiting in {entered[waiting[0]]} (its collective call #{waiting[0]})"
    events = {r.get("event") for r in records}
    if "init_called" in events and "init" not in events:
        return "waiting in init_process_group for the other ranks"
    return None


def collective_calls(run: HarnessRun, rank: int) -> List[str]:
    """The collectives the script entered on ``rank``, in order."""
    return [r["op"] for r in run.events(rank, "collective_enter")]


def ended_on_its_own(run: HarnessRun, rank: int) -> bool:
    """The rank's script ended without raising: what it never called, it never would have."""
    final = run.final(rank)
    return final is not None and not final.get("error")


def first_collective_difference(run: HarnessRun) -> Optional[str]:
    """Where the ranks' collective calls first differ, in words (None: they agree). A rank that
    crashed, or was stopped, before a call is not said to have skipped it."""
    calls = {r: collective_calls(run, r) for r in run.ranks}
    for i in range(max((len(c) for c in calls.values()), default=0)):
        at = {r: c[i] if i < len(c) else None for r, c in calls.items()}
        if len(set(at.values())) == 1:
            continue
        skipped = [r for r, op in at.items() if op is None]
        if skipped and not all(ended_on_its_own(run, r) for r in skipped):
            return None  # it stopped early: the crash (or the deadline) is the story
        made = {r: op for r, op in at.items() if op is not None}
        if skipped:
            op = next(iter(made.values()))
            callers = [r for r, o in made.items() if o == op]
            never = [r for r in skipped if op not in calls[r]]
            if never:
                return f"{ranks_text(never)} never called {op} ({ranks_text(callers)} did): {SAME_CALLS}"
            return (f"{ranks_text(skipped)} made {plural(i, 'collective call')}, {ranks_text(callers)} a "
                    f"{ordinal(i + 1)}: {op}: {SAME_CALLS}")
        called = ", ".join(f"rank {r} called {op}" for r, op in made.items())
        return f"collective call #{i + 1} differs: {called}: {SAME_CALLS}"
    return None


def ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


#: Collectives that work in place: the result is in the tensor passed; they return None (a Work).
IN_PLACE = ("all_reduce", "broadcast")


def used_a_return_value(run: HarnessRun) -> Optional[str]:
    """What to say when a rank failed using an in-place collective's return value (None, or a Work)."""
    rank = run.failed_rank
    error = (run.final(rank) or {}).get("error") if rank is not None else None
    done = [c["op"] for c in run.events(rank, "collective") if c["op"] in IN_PLACE]
    if not (error and done and error["type"] in ("AttributeError", "TypeError")
            and ("'NoneType'" in error["message"] or "'Work'" in error["message"])):
        return None
    op = done[-1]
    return (f"rank {rank} used a value that is None (or a Work) after {op}: dist.{op} works in place and "
            f"returns None (or a Work with async_op=True). The result is in the tensor you passed: "
            f"call dist.{op}(value), then read value")


def ran_to_end(run: HarnessRun, name: str = RAN_TO_END) -> Criterion:
    """Every rank exited 0; else who failed with what, or who was still running at the deadline."""
    if run.finished:
        return Criterion(name, True, f"{plural(run.world_size, 'rank')}, exit code 0, {run.seconds:.1f} s")
    differ = first_collective_difference(run)
    if not run.timed_out:
        why = differ or used_a_return_value(run)
        return Criterion(name, False, f"{why}.\n{run.failure}" if why else run.failure)
    waits = {r: where_it_waits(run, r) for r in run.still_running}
    parts = [f"rank {r} was still running" + (f", {w}" if w else "") for r, w in waits.items()]
    done = [r for r in run.ranks if r not in run.still_running]
    if done:
        parts.append(f"{ranks_text(done)} had finished")
    advice = (f"{differ[:1].upper()}{differ[1:]}, or a rank waits forever in a call its peers never make" if differ
              else "Every rank must make the same collective calls in the same order, or a rank waits "
              "forever in a call its peers never make" if any(waits.values()) else
              "A script that waits for something that never comes (a peer, an endless loop) looks like this")
    return Criterion(name, False, f"{run.failure}: {'; '.join(parts)}. {advice}; all ranks were stopped")


def not_measured(name: str, run: HarnessRun, why: str = "") -> Criterion:
    why = why or ("the run stopped early" if not run.finished else "nothing was recorded")
    return Criterion(name, False, f"{NOT_MEASURED}{why}")


#: How a criterion's detail starts when the run gave no evidence either way (shown without a ✗).
NOT_MEASURED = "not measured: "


def absent(name: str, run: HarnessRun, detail: str) -> Criterion:
    """Failed for want of something the script never did; "not measured" in a run that stopped
    early, where the script may not have got there."""
    if run.finished:
        return Criterion(name, False, detail)
    return not_measured(name, run, "the script stopped before it got there (see the first criterion)")


#: The one rule the teardown check, its hint and notebook 05 state.
TEARDOWN_RULE = ("Call destroy_process_group() in finally, on every path; with gloo it returns promptly even "
                 "if a peer died; with nccl a stuck collective must be aborted first (the watchdog / "
                 "TORCH_NCCL_ASYNC_ERROR_HANDLING)")


def destroyed_everywhere(run: HarnessRun) -> Criterion:
    problems = []
    for rank in run.ranks:
        final = run.final(rank)
        if not run.events(rank, "destroy"):
            problems.append(f"rank {rank} never called destroy_process_group")
        elif final and final["initialized_at_exit"]:
            problems.append(f"rank {rank} still had a process group when its script ended")
    if not problems:
        return Criterion(DESTROYED, True, "every rank left the group before exiting")
    if not run.finished:
        return not_measured(DESTROYED, run, "the run stopped early (see the first criterion)")
    advice = ("every rank must leave the group, not only some" if len(problems) < run.world_size
              else f"{TEARDOWN_RULE[:1].lower()}{TEARDOWN_RULE[1:]}")
    return Criterion(DESTROYED, False, f"{'; '.join(problems)}: {advice}")
