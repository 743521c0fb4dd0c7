"""Judge an exercise from what the harness measured: one ``Criterion`` per thing a correct script does.

Every criterion is decided from the ranks' records alone (counts, parameters,
sampler orders, calls seen), never from the learner's source. A failed one
says what was measured and, where the measurement matches a typical mistake,
names it. No torch in here.
"""

from __future__ import annotations

import os
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from ddp_tutorial.exercises.runs import HarnessRun
from ddp_tutorial.launcher import procgroup
from ddp_tutorial.lessons import port_can_be_bound
from ddp_tutorial.exercises.settings import ACCUM_STEPS, EPOCHS, FAIL_AT_CALL, FAIL_RANK

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


#: A criterion judged from every rank's ``final`` record: (attempt, finals by rank) -> Criterion.
FinalsJudge = Callable[[HarnessRun, Dict[int, dict]], Criterion]


def max_difference(a: Optional[Sequence[float]], b: Optional[Sequence[float]]) -> float:
    """Largest absolute difference of two parameter lists (inf when one is missing or they differ in size)."""
    if a is None or b is None or len(a) != len(b):
        return float("inf")
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "es" if word.endswith("ch") else "s")


def ranks_text(ranks: Sequence[int]) -> str:
    return ", ".join(f"rank {r}" for r in ranks)


def judged_from_finals(attempt: HarnessRun, judges: Sequence[Tuple[str, FinalsJudge]]) -> List[Criterion]:
    """``(name, judge)`` pairs judged on every rank's final record; "not measured" where a rank has none."""
    finals = attempt.finals()
    if len(finals) < attempt.world_size:
        return [not_measured(name, attempt) for name, _ in judges]
    return [judge(attempt, finals) for _, judge in judges]


# -- Common criteria ---------------------------------------------------------
def where_it_waits(attempt: HarnessRun, rank: int) -> Optional[str]:
    """The collective (or rendezvous) a rank still running at the deadline was waiting in, if any."""
    records = attempt.records.get(rank, [])
    entered = {r["n"]: r["op"] for r in records if r.get("event") == "collective_enter"}
    left = {r["n"] for r in records if r.get("event") == "collective"}
    waiting = sorted(set(entered) - left)
    if waiting:
        return f"waiting in {entered[waiting[0]]} (its collective call #{waiting[0]})"
    events = {r.get("event") for r in records}
    if "init_called" in events and "init" not in events:
        return "waiting in init_process_group for the other ranks"
    return None


def collective_calls(attempt: HarnessRun, rank: int) -> List[str]:
    """The collectives the script called on ``rank``, in order (entered, whether or not they returned)."""
    return [r["op"] for r in attempt.events(rank, "collective_enter")]


def ended_on_its_own(attempt: HarnessRun, rank: int) -> bool:
    """The rank's script ran to its end without raising: what it never called, it never would have."""
    final = attempt.final(rank)
    return final is not None and not final.get("error")


def first_collective_difference(attempt: HarnessRun) -> Optional[str]:
    """Where the ranks' sequences of collective calls first differ, in words; None where they agree.

    A rank that crashed, or was stopped, before a call is not said to have skipped it:
    only a rank whose script ended on its own, or one waiting in another collective.
    """
    calls = {r: collective_calls(attempt, r) for r in attempt.ranks}
    for i in range(max((len(c) for c in calls.values()), default=0)):
        at = {r: c[i] if i < len(c) else None for r, c in calls.items()}
        if len(set(at.values())) == 1:
            continue
        skipped = [r for r, op in at.items() if op is None]
        if skipped and not all(ended_on_its_own(attempt, r) for r in skipped):
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
        return (f"collective call #{i + 1} differs: " + ", ".join(f"rank {r} called {op}" for r, op in made.items())
                + f": {SAME_CALLS}")
    return None


def ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


#: Collectives that work in place: the result is in the tensor passed, the return value is None (a Work).
IN_PLACE = ("all_reduce", "broadcast")


def used_a_return_value(attempt: HarnessRun) -> Optional[str]:
    """What to say when a rank failed using an in-place collective's return value (None, or a Work)."""
    rank = attempt.failed_rank
    error = (attempt.final(rank) or {}).get("error") if rank is not None else None
    if not error or error["type"] not in ("AttributeError", "TypeError"):
        return None
    if "'NoneType'" not in error["message"] and "'Work'" not in error["message"]:
        return None
    done = [c["op"] for c in attempt.events(rank, "collective") if c["op"] in IN_PLACE]
    if not done:
        return None
    op = done[-1]
    return (f"rank {rank} used a value that is None (or a Work) after {op}: dist.{op} works in place and "
            f"returns None (or a Work with async_op=True). The result is in the tensor you passed: "
            f"call dist.{op}(value), then read value")


def ran_to_end(attempt: HarnessRun, name: str = RAN_TO_END) -> Criterion:
    """Every rank exited 0; else who failed with what, or who was still running at the deadline."""
    if attempt.finished:
        return Criterion(name, True, f"{plural(attempt.world_size, 'rank')}, exit code 0, {attempt.seconds:.1f} s")
    differ = first_collective_difference(attempt)
    if not attempt.timed_out:
        why = differ or used_a_return_value(attempt)
        return Criterion(name, False, f"{why}.\n{attempt.failure}" if why else attempt.failure)
    waits = {r: where_it_waits(attempt, r) for r in attempt.still_running}
    parts = [f"rank {r} was still running" + (f", {w}" if w else "") for r, w in waits.items()]
    done = [r for r in attempt.ranks if r not in attempt.still_running]
    if done:
        parts.append(f"{ranks_text(done)} had finished")
    advice = (f"{differ[:1].upper()}{differ[1:]}, or a rank waits forever in a call its peers never make" if differ
              else "Every rank must make the same collective calls in the same order, or a rank waits "
              "forever in a call its peers never make" if any(waits.values()) else
              "A script that waits for something that never comes (a peer, an endless loop) looks like this")
    return Criterion(name, False, f"{attempt.failure}: {'; '.join(parts)}. {advice}; all ranks were stopped")


def not_measured(name: str, attempt: HarnessRun, why: str = "") -> Criterion:
    why = why or ("the run stopped early" if not attempt.finished else "nothing was recorded")
    return Criterion(name, False, f"{NOT_MEASURED}{why}")


#: How a criterion's detail starts when the run gave no evidence either way (shown without a ✗).
NOT_MEASURED = "not measured: "


def absent(name: str, attempt: HarnessRun, detail: str) -> Criterion:
    """A criterion that failed for want of something the script never did.

    In a run that stopped early (a crash, a deadline) the script may simply not
    have got there: then it is "not measured", never a ✗ with a reason that may be false.
    """
    if attempt.finished:
        return Criterion(name, False, detail)
    return not_measured(name, attempt, "the script stopped before it got there (see the first criterion)")


# -- init --------------------------------------------------------------------
def hard_coded_rank(attempt: HarnessRun, called: Dict[int, List[dict]]) -> Optional[str]:
    """What was wrong if init_process_group got a rank= or world_size= other than the launcher's."""
    for rank in attempt.ranks:
        if not called[rank]:
            continue
        given = called[rank][-1]
        starts = attempt.events(rank, "start")
        env_rank = int(starts[0]["rank_env"]) if starts else rank
        env_world = int(starts[0]["world_size_env"]) if starts else attempt.world_size
        if given["rank_arg"] not in (None, env_rank) or given["world_size_arg"] not in (None, env_world):
            return (f"process {rank} called init_process_group(rank={given['rank_arg']}, "
                    f"world_size={given['world_size_arg']}), but the launcher made it rank {env_rank} of "
                    f"{env_world}: hard-coded values do not form one group. Leave rank= and world_size= "
                    "out: env:// reads the RANK and WORLD_SIZE the launcher set for each process")
    return None


def joined_one_group(attempt: HarnessRun) -> Criterion:
    world = attempt.world_size
    called = {r: attempt.events(r, "init_called") for r in attempt.ranks}
    joined = {r: attempt.events(r, "init") for r in attempt.ranks}
    hard_coded = hard_coded_rank(attempt, called)
    if hard_coded:
        return Criterion(JOINED, False, hard_coded)
    if not any(called.values()):
        return Criterion(JOINED, False, "init_process_group was never called: call "
                                        "dist.init_process_group(\"gloo\") before any collective")
    missing = [r for r in attempt.ranks if not joined[r]]
    if missing:
        return Criterion(JOINED, False, f"{ranks_text(missing)} did not complete init_process_group")
    sizes = {r: joined[r][-1]["world_size"] for r in attempt.ranks}
    ranks = {r: joined[r][-1]["rank"] for r in attempt.ranks}
    if set(sizes.values()) == {world} and sorted(ranks.values()) == attempt.ranks:
        return Criterion(JOINED, True, f"world size {world} on every rank, ranks {sorted(ranks.values())}")
    seen = ", ".join(f"process {r}: rank {ranks[r]} of {sizes[r]}" for r in attempt.ranks)
    return Criterion(JOINED, False, f"{seen}, not one group of {world}")


def meets_at_launcher(attempt: HarnessRun) -> Criterion:
    calls = [events[-1] for r in attempt.ranks if (events := attempt.events(r, "init_called"))]
    if not calls:
        return not_measured(MEETS_AT_LAUNCHER, attempt, "init_process_group was never called")
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


def all_reduce_sum(attempt: HarnessRun) -> Criterion:
    world = attempt.world_size
    expected = world * (world + 1) / 2
    problems = []
    entered = {r: "all_reduce" in collective_calls(attempt, r) for r in attempt.ranks}
    if any(entered.values()) and not all(entered.values()):
        skipped = [r for r, e in entered.items() if not e]
        callers = [r for r, e in entered.items() if e]
        return Criterion(ALL_REDUCE_SUM, False, f"{ranks_text(skipped)} never called all_reduce "
                                                f"({ranks_text(callers)} did): {SAME_CALLS}")
    for rank in attempt.ranks:
        done = [c for c in attempt.events(rank, "collective") if c["op"] == "all_reduce"]
        own = [d for d in done if d["input"] and set(d["input"]) == {rank + 1}]  # any shape, all rank + 1
        if not done and not attempt.finished:
            return not_measured(ALL_REDUCE_SUM, attempt, f"rank {rank} finished no all_reduce before the run "
                                                         "stopped (see the first criterion)")
        if not done:
            problems.append(f"rank {rank} finished no all_reduce")
        elif not own:
            problems.append(f"rank {rank} all-reduced {done[-1]['input']}, not rank + 1 = {rank + 1}")
        elif set(own[-1]["output"]) != {expected}:
            problems.append(f"rank {rank} got {own[-1]['output']}, not {expected:g}: a sum over all "
                            f"{world} ranks (the default op, SUM) gives 1 + ... + {world}")
    return Criterion(ALL_REDUCE_SUM, not problems,
                     "; ".join(problems) or f"{expected:g} on {plural(world, 'rank')}")


def judge_init(attempt: HarnessRun) -> List[Criterion]:
    return [ran_to_end(attempt), joined_one_group(attempt), meets_at_launcher(attempt), all_reduce_sum(attempt),
            destroyed_everywhere(attempt)]


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


def first_step_that_differs(finals: Dict[int, dict]) -> Optional[str]:
    """None if every rank held the same parameters after every optimizer step; else where they first differ."""
    steps = {r: f["params_per_step"] for r, f in finals.items()}
    counts = {r: len(s) for r, s in steps.items()}
    if len(set(counts.values())) > 1:
        return "the ranks made different numbers of optimizer steps: " + ", ".join(
            f"rank {r}: {n}" for r, n in counts.items())
    for i in range(counts[0]):
        for rank in steps:
            d = max_difference(steps[0][i], steps[rank][i])
            if d > TOLERANCE:
                return f"after optimizer step {i + 1}, rank 0 and rank {rank} differ by up to {d:.3g}"
    return None


def wrapped(attempt: HarnessRun, finals: Dict[int, dict]) -> Criterion:
    unwrapped = [r for r, f in finals.items() if not f["ddp_wraps"]]
    if not unwrapped:
        return Criterion(WRAPPED, True, "DDP built on every rank")
    if any(finals[r]["ddp_attempts"] for r in unwrapped):
        return Criterion(WRAPPED, False, f"{ranks_text(unwrapped)}: DistributedDataParallel(...) raised "
                                         "(its error is above)")
    return absent(WRAPPED, attempt, f"{ranks_text(unwrapped)} built no DistributedDataParallel: "
                                     "model = DDP(model) before training")


def same_after_wrap(attempt: HarnessRun, finals: Dict[int, dict]) -> Criterion:
    unwrapped = [r for r, f in finals.items() if not f["ddp_wraps"]]
    if unwrapped:
        return not_measured(SAME_AFTER_WRAP, attempt, f"no DDP model on {ranks_text(unwrapped)}")
    after_wrap = {r: f["ddp_wraps"][0]["params_after_wrap"] for r, f in finals.items()}
    d = max(max_difference(after_wrap[0], p) for p in after_wrap.values())
    return Criterion(SAME_AFTER_WRAP, d <= TOLERANCE, "DDP broadcast rank 0's parameters" if d <= TOLERANCE
                     else f"they differ by up to {d:.3g} right after DDP was built")


def same_after_steps(attempt: HarnessRun, finals: Dict[int, dict]) -> Criterion:
    idle = [r for r, f in finals.items() if not f["optimizer_steps"]]
    if idle:
        return absent(SAME_AFTER_STEPS, attempt, f"no optimizer step ran on {ranks_text(idle)}")
    if not attempt.finished and len({f["optimizer_steps"] for f in finals.values()}) > 1:
        return not_measured(SAME_AFTER_STEPS, attempt, "a rank stopped before the others (see the first criterion)")
    differ = first_step_that_differs(finals)
    if differ:
        return Criterion(SAME_AFTER_STEPS, False, f"{differ}: {why_not_averaged(finals)}")
    return Criterion(SAME_AFTER_STEPS, True, f"{plural(finals[0]['optimizer_steps'], 'step')} alike")


def judge_wrap(attempt: HarnessRun) -> List[Criterion]:
    return [ran_to_end(attempt)] + judged_from_finals(attempt, [
        (WRAPPED, wrapped), (SAME_AFTER_WRAP, same_after_wrap), (SAME_AFTER_STEPS, same_after_steps)])


# -- sampler -----------------------------------------------------------------
def same_dataset(attempt: HarnessRun, finals: Dict[int, dict]) -> Criterion:
    prints = {}
    for rank, final in finals.items():
        sources = final["sampler_iterations"] or final["loader_iterations"]
        if sources:
            prints[rank] = sources[0]["dataset"]
    if len(prints) < attempt.world_size:
        silent = [r for r in attempt.ranks if r not in prints]
        return not_measured(SAME_DATASET, attempt, f"{ranks_text(silent)} iterated no DataLoader or sampler")
    if len(set(prints.values())) == 1:
        return Criterion(SAME_DATASET, True, f"fingerprint {prints[0]} on every rank")
    return Criterion(SAME_DATASET, False, (
        "the ranks built different datasets (" + ", ".join(f"rank {r}: {p}" for r, p in prints.items())
        + "): per-rank random data. Build it from a seed every rank shares (task.make_dataset()); "
          "a DistributedSampler shards one dataset, it cannot make different ones agree"))


def shards(attempt: HarnessRun, finals: Dict[int, dict]) -> Criterion:
    """Each epoch, the ranks' DistributedSampler indices are disjoint and cover the dataset."""
    iterations = {r: f["sampler_iterations"] for r, f in finals.items()}
    without = [r for r, its in iterations.items() if not its]
    if without:
        loaders = finals[without[0]]["loader_iterations"]
        used = f"its DataLoader used a {loaders[0]['sampler']}" if loaders else "it iterated no DataLoader"
        return absent(SHARDS, attempt, (
            f"{ranks_text(without)} iterated no DistributedSampler ({used}): every rank reads the whole "
            "dataset. Pass sampler=DistributedSampler(dataset) to the DataLoader, without shuffle=True"))
    size = iterations[0][0]["dataset_size"]
    for epoch in range(min(len(its) for its in iterations.values())):
        everyone = [i for its in iterations.values() for i in its[epoch]["indices"]]
        overlap, missing = len(everyone) - len(set(everyone)), size - len(set(everyone))
        if overlap or missing:
            how = ", ".join(f"rank {r}: num_replicas={its[epoch]['num_replicas']}, rank={its[epoch]['rank']}"
                            for r, its in iterations.items())
            return Criterion(SHARDS, False, (
                f"in epoch {epoch}, {overlap} indices went to more than one rank and {missing} of {size} to "
                f"none ({how}): let DistributedSampler read the world size and rank from the process group"))
    return Criterion(SHARDS, True, f"{size} samples, {len(iterations[0][0]['indices'])} per rank per epoch")


def reshuffled(attempt: HarnessRun, finals: Dict[int, dict]) -> Criterion:
    """The sampler's order changes from epoch to epoch (set_epoch)."""
    its = finals[0]["sampler_iterations"]
    if not its:
        return not_measured(RESHUFFLED, attempt, "no DistributedSampler was iterated")
    if len(its) < 2:
        return absent(RESHUFFLED, attempt, f"the sampler was iterated {plural(len(its), 'time')}: "
                                            f"train for {EPOCHS} epochs")
    repeats = [e for e in range(1, len(its)) if its[e]["indices"] == its[0]["indices"]]
    if not repeats:
        return Criterion(RESHUFFLED, True, f"sampler epochs {[it['epoch'] for it in its]}, each order different")
    e = repeats[0]
    if its[e]["epoch"] == its[0]["epoch"]:
        return Criterion(RESHUFFLED, False, (
            f"epoch {e} repeated epoch 0's order (the sampler's epoch stayed {its[e]['epoch']}): call "
            "sampler.set_epoch(epoch) at the start of every epoch; the shuffle comes from seed + epoch"))
    return Criterion(RESHUFFLED, False, f"epoch {e} repeated epoch 0's order although set_epoch was called: "
                                        "give DistributedSampler shuffle=True")


def judge_sampler(attempt: HarnessRun) -> List[Criterion]:
    return [ran_to_end(attempt)] + judged_from_finals(attempt, [
        (SAME_DATASET, same_dataset), (SHARDS, shards), (RESHUFFLED, reshuffled)])


# -- no_sync -----------------------------------------------------------------
def one_allreduce_per_step(attempt: HarnessRun, finals: Dict[int, dict]) -> Criterion:
    """Bucket all-reduces (counted by the comm hook) == optimizer steps x buckets, on every rank."""
    for rank, f in sorted(finals.items()):
        if not f["ddp_wraps"]:
            return absent(ONE_ALLREDUCE_PER_STEP, attempt, f"rank {rank} built no DDP model, so no gradient "
                                                            "was all-reduced: wrap the model in DDP")
        if not attempt.finished:
            return not_measured(ONE_ALLREDUCE_PER_STEP, attempt, "counts of a run that stopped early "
                                                                 "(see the first criterion)")
        steps, micro, count = f["optimizer_steps"], f["ddp_forwards"], f["bucket_allreduces"]
        buckets = max(1, f["buckets"])
        if steps and count == steps * buckets:
            continue
        measured = (f"rank {rank} ran {plural(count, 'bucket all-reduce')} for "
                    f"{plural(steps, 'optimizer step')} ({plural(micro, 'micro-batch')}, "
                    f"{plural(buckets, 'bucket')})")
        if micro and count == micro * buckets:
            if f["no_sync_entries"] == 0:
                why = ("one per micro-batch: no_sync() was never used, so every backward all-reduced. "
                       "Run the micro-batches before the last of each window inside `with model.no_sync():`")
            else:
                why = (f"one per micro-batch, although no_sync() was entered "
                       f"{plural(f['no_sync_entries'], 'time')}: the forward ran outside no_sync(). DDP "
                       "decides in forward whether the coming backward all-reduces, so put the forward "
                       "(model(x)) inside the with block too")
        elif count == 0:
            why = "no gradient was all-reduced: forward through the DDP model, and let the last micro-batch sync"
        else:
            why = f"expected {steps * buckets}"
        return Criterion(ONE_ALLREDUCE_PER_STEP, False, f"{measured}: {why}")
    f = finals[0]
    return Criterion(ONE_ALLREDUCE_PER_STEP, True, f"{plural(f['bucket_allreduces'], 'bucket all-reduce')} for "
                                                   f"{plural(f['optimizer_steps'], 'optimizer step')} "
                                                   f"({plural(f['ddp_forwards'], 'micro-batch')}) on every rank")


def epochs_of(final: dict) -> List[Tuple[int, int]]:
    """(first, last) forward number through DDP of each epoch's micro-batches, from the DataLoader's iterations."""
    starts = [it["forwards_before"] for it in final["loader_iterations"] if "forwards_before" in it]
    ends = starts[1:] + [final["ddp_forwards"]]
    return [(a + 1, b) for a, b in zip(starts, ends) if b > a]


def planned_steps(first: int, last: int) -> List[int]:
    """After which forwards a script steps in one epoch: every K-th, and the epoch's last (train.sync_schedule)."""
    return [n for n in range(first, last + 1) if (n - first + 1) % ACCUM_STEPS == 0 or n == last]


def where_the_tail_went(epochs: List[Tuple[int, int]], steps: List[int]) -> Optional[str]:
    """The first epoch whose last micro-batches ended no window: what happened to their gradients."""
    for e, (first, last) in enumerate(epochs):
        tail = (last - first + 1) % ACCUM_STEPS
        if not tail or last in steps:
            continue
        later = [n for n in steps if n > last]
        fate = (f"joined epoch {e + 1}'s first optimizer step" if later and e + 1 < len(epochs)
                and later[0] <= epochs[e + 1][1] else "were never applied")
        return (f"the last {plural(tail, 'micro-batch')} of epoch {e} ({last - first + 1} = "
                f"{(last - first + 1) // ACCUM_STEPS} x {ACCUM_STEPS} + {tail}) ended no window, so no optimizer "
                f"step followed them: their gradients stayed in .grad and {fate} (the epoch's tail). Step after "
                f"the epoch's last micro-batch too, a shorter last window of {tail}, and divide its losses by "
                f"{tail}, its own size (train.sync_schedule and train.loss_divisors)")
    return None


def k_micro_steps(attempt: HarnessRun, finals: Dict[int, dict]) -> Criterion:
    """Each epoch's optimizer steps come after every K-th micro-batch and after its last, on every rank."""
    for rank, f in sorted(finals.items()):
        epochs, steps = epochs_of(f), f.get("forwards_at_step", [])
        if not f["ddp_forwards"] or not epochs:
            return absent(K_MICRO_STEPS, attempt, f"rank {rank} made no forward through DDP in a DataLoader loop")
        planned = [n for first, last in epochs for n in planned_steps(first, last)]
        if steps == planned:
            continue
        tail = where_the_tail_went(epochs, steps)
        if tail:
            return Criterion(K_MICRO_STEPS, False, f"rank {rank}: {tail}")
        return Criterion(K_MICRO_STEPS, False, (
            f"rank {rank} stepped after forwards {steps} of {f['ddp_forwards']} (epochs of "
            f"{[last - first + 1 for first, last in epochs]} micro-batches); a window of K = {ACCUM_STEPS} steps "
            f"after forwards {planned}: once every {ACCUM_STEPS} micro-batches, and after each epoch's last"))
    sizes = [last - first + 1 for first, last in epochs_of(finals[0])]
    return Criterion(K_MICRO_STEPS, True, f"{plural(finals[0]['optimizer_steps'], 'step')} for epochs of "
                                          f"{sizes} micro-batches (windows of {ACCUM_STEPS}, then the rest)")


#: The typical mistakes whose results the harness computes too, and what to do about each.
MISTAKE_RESULTS = {
    "loss not divided by K": (f"they match one process whose loss was not divided by K: the window's "
                              f"gradients add up to {ACCUM_STEPS} times the mean's. Divide each micro-batch's "
                              f"loss by K = {ACCUM_STEPS} (the last, shorter window's by its own size)"),
    "tail left in .grad": ("they match a run that stepped only after every K-th micro-batch: each epoch's "
                           "tail (the micro-batches after its last full window) stayed in .grad and joined "
                           "the next epoch's first step, and the last epoch's tail was never applied. Step "
                           "after the epoch's last micro-batch too, with its losses divided by the size of "
                           "that shorter window (train.sync_schedule, train.loss_divisors)"),
    "tail divided by K": ("they match a run that divided the last, shorter window's losses by K too: its "
                          "gradients add up to less than its mean's. Divide each loss by the size of its "
                          "window: K, or what is left of the epoch in the last one (train.loss_divisors)"),
    "no set_epoch": ("they match a run that reused epoch 0's order every epoch: call "
                     "sampler.set_epoch(epoch) at the start of each epoch"),
}


def same_as_one_process(attempt: HarnessRun, finals: Dict[int, dict]) -> Criterion:
    """Final parameters on every rank equal the one-process reference rank 0 computed."""
    rank0 = finals[0]
    if "references" not in rank0:
        return not_measured(SAME_AS_ONE_PROCESS, attempt, "rank 0 computed no reference")
    mine, refs = rank0["final_params"], rank0["references"]
    if mine is None:
        return Criterion(SAME_AS_ONE_PROCESS, False, "no optimizer stepped: there are no trained parameters")
    d = max_difference(mine, refs["correct"])
    others = {r: max_difference(mine, f["final_params"]) for r, f in finals.items()}
    ranks_agree = all(o <= TOLERANCE for o in others.values())
    if d <= TOLERANCE and ranks_agree:
        return Criterion(SAME_AS_ONE_PROCESS, True, f"max difference {d:.2g} on every rank")
    if d <= TOLERANCE:
        r = max(others, key=others.get)
        return Criterion(SAME_AS_ONE_PROCESS, False, f"rank 0 matches, but rank {r} differs from rank 0 by up "
                                                     f"to {others[r]:.3g}: {why_not_averaged(finals)}")
    detail = f"rank 0's parameters differ from one process's by up to {d:.3g}"
    for mistake, why in MISTAKE_RESULTS.items():
        if max_difference(mine, refs.get(mistake)) <= TOLERANCE:
            return Criterion(SAME_AS_ONE_PROCESS, False, f"{detail}: {why}")
    if not ranks_agree:
        detail += f"; the ranks also differ from each other: {why_not_averaged(finals)}"
    return Criterion(SAME_AS_ONE_PROCESS, False, detail)


def judge_no_sync(attempt: HarnessRun) -> List[Criterion]:
    return [ran_to_end(attempt)] + judged_from_finals(attempt, [
        (ONE_ALLREDUCE_PER_STEP, one_allreduce_per_step), (K_MICRO_STEPS, k_micro_steps),
        (SAME_AS_ONE_PROCESS, same_as_one_process)])


# -- teardown ----------------------------------------------------------------
#: The one rule the teardown check, its hint and notebook 05 state.
TEARDOWN_RULE = ("Call destroy_process_group() in finally, on every path; with gloo it returns promptly even "
                 "if a peer died; with nccl a stuck collective must be aborted first (the watchdog / "
                 "TORCH_NCCL_ASYNC_ERROR_HANDLING)")
def destroyed_everywhere(attempt: HarnessRun) -> Criterion:
    problems = []
    for rank in attempt.ranks:
        final = attempt.final(rank)
        if not attempt.events(rank, "destroy"):
            problems.append(f"rank {rank} never called destroy_process_group")
        elif final and final["initialized_at_exit"]:
            problems.append(f"rank {rank} still had a process group when its script ended")
    if not problems:
        return Criterion(DESTROYED, True, "every rank left the group before exiting")
    if not attempt.finished:
        return not_measured(DESTROYED, attempt, "the run stopped early (see the first criterion)")
    advice = ("every rank must leave the group, not only some" if len(problems) < attempt.world_size
              else f"{TEARDOWN_RULE[:1].lower()}{TEARDOWN_RULE[1:]}")
    return Criterion(DESTROYED, False, f"{'; '.join(problems)}: {advice}")


def nothing_left(attempts: Sequence[HarnessRun]) -> Criterion:
    pids = [pid for a in attempts for pid in a.pids]
    left = [pid for pid in pids if procgroup.alive(pid)]
    if left:
        return Criterion(NOTHING_LEFT, False, f"process(es) {left} still alive after the run")
    return Criterion(NOTHING_LEFT, True, f"the {len(pids)} processes started ({', '.join(map(str, pids))}) are gone")


def port_released(attempt: HarnessRun) -> Criterion:
    if attempt.port is None:
        return not_measured(PORT_FREE, attempt, "the launch reported no port")
    if port_can_be_bound(attempt.port):
        return Criterion(PORT_FREE, True, f"127.0.0.1:{attempt.port} can be listened on again")
    return Criterion(PORT_FREE, False, f"127.0.0.1:{attempt.port} is still taken")


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


def judge_teardown(normal: HarnessRun, failing: Optional[HarnessRun]) -> List[Criterion]:
    attempts = [a for a in (normal, failing) if a is not None]
    return [ran_to_end(normal, CLEAN_EXIT), destroyed_everywhere(normal), nothing_left(attempts),
            port_released(normal), failing_rank_leaves(normal, failing)]


# -- capstone ----------------------------------------------------------------
def only_rank0_saves(attempt: HarnessRun, finals: Dict[int, dict]) -> Criterion:
    saves = {r: f["saves"] for r, f in finals.items()}
    if not saves[0]:
        return absent(ONLY_RANK0_SAVES, attempt, "rank 0 saved nothing: keep the original script's "
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


def clean_teardown(attempt: HarnessRun) -> Criterion:
    if attempt.timed_out:
        return not_measured(CLEAN_TEARDOWN, attempt, "the launch did not finish (see its first line)")
    for criterion in (ran_to_end(attempt), destroyed_everywhere(attempt), nothing_left([attempt])):
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
