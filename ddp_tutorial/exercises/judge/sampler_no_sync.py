"""Judge exercises "sampler" (DistributedSampler, set_epoch) and "no_sync" (gradient accumulation)."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ddp_tutorial.exercises.judge.common import (
    absent, Criterion, judged_from_finals, K_MICRO_STEPS, max_difference, not_measured,
    ONE_ALLREDUCE_PER_STEP, plural, ran_to_end, ranks_text, RESHUFFLED, SAME_AS_ONE_PROCESS, SAME_DATASET,
    SHARDS, TOLERANCE)
from ddp_tutorial.exercises.judge.init_wrap import why_not_averaged
from ddp_tutorial.exercises.runs import HarnessRun
from ddp_tutorial.exercises.settings import ACCUM_STEPS, EPOCHS


def same_dataset(run: HarnessRun, finals: Dict[int, dict]) -> Criterion:
    prints = {r: (f["sampler_iterations"] or f["loader_iterations"])[0]["dataset"]
              for r, f in finals.items() if f["sampler_iterations"] or f["loader_iterations"]}
    if len(prints) < run.world_size:
        silent = [r for r in run.ranks if r not in prints]
        return not_measured(SAME_DATASET, run, f"{ranks_text(silent)} iterated no DataLoader or sampler")
    if len(set(prints.values())) == 1:
        return Criterion(SAME_DATASET, True, f"fingerprint {prints[0]} on every rank")
    return Criterion(SAME_DATASET, False, (
        "the ranks built different datasets (" + ", ".join(f"rank {r}: {p}" for r, p in prints.items())
        + "): per-rank random data. Build it from a seed every rank shares (task.make_dataset()); "
          "a DistributedSampler shards one dataset, it cannot make different ones agree"))


def shards(run: HarnessRun, finals: Dict[int, dict]) -> Criterion:
    """Each epoch, the ranks' DistributedSampler indices are disjoint and cover the dataset."""
    iterations = {r: f["sampler_iterations"] for r, f in finals.items()}
    without = [r for r, its in iterations.items() if not its]
    if without:
        loaders = finals[without[0]]["loader_iterations"]
        used = f"its DataLoader used a {loaders[0]['sampler']}" if loaders else "it iterated no DataLoader"
        return absent(SHARDS, run, (
            f"{ranks_text(without)} iterated no DistributedSampler ({used}): every rank reads the whole "
            "dataset. Pass sampler=DistributedSampler(dataset) to the DataLoader, without shuffle=True"))
    size = iterations[0][0]["dataset_size"]
    for epoch in range(min(len(its) for its in iterations.values())):
        everyone = [i for its in iterations.values() for i in its[epoch]["indices"]]
        overlap, missing = len(everyone) - len(set(everyone)), size - len(set(everyone))
        if overlap or missing:
            found = f"in epoch {epoch}, {overlap} indices went to more than one rank and {missing} of {size} to none"
            at = {r: its[epoch] for r, its in iterations.items()}
            placed = {(it["num_replicas"], it["rank"]) for it in at.values()}
            if placed == {(run.world_size, r) for r in run.ranks}:  # world size and ranks right: the orders differ
                for key, advice in (("seed", "give every rank the same seed (or leave seed= out)"),
                                    ("shuffle", "give every rank the same shuffle=")):
                    if len({it[key] for it in at.values()}) > 1:
                        given = ", ".join(f"rank {r}: {key}={it[key]}" for r, it in at.items())
                        return Criterion(SHARDS, False, (
                            f"{found} ({given}): each rank takes every W-th index of one permutation drawn from "
                            f"seed + epoch, so the ranks must draw the same one: {advice}"))
                return Criterion(SHARDS, False, f"{found}, with num_replicas and rank right on every rank")
            how = ", ".join(f"rank {r}: num_replicas={it['num_replicas']}, rank={it['rank']}" for r, it in at.items())
            return Criterion(SHARDS, False, (
                f"{found} ({how}): let DistributedSampler read the world size and rank from the process group"))
    return Criterion(SHARDS, True, f"{size} samples, {len(iterations[0][0]['indices'])} per rank per epoch")


def reshuffled(run: HarnessRun, finals: Dict[int, dict]) -> Criterion:
    """The sampler's order changes from epoch to epoch (set_epoch)."""
    its = finals[0]["sampler_iterations"]
    if not its:
        return not_measured(RESHUFFLED, run, "no DistributedSampler was iterated")
    if len(its) < 2:
        return absent(RESHUFFLED, run, f"the sampler was iterated {plural(len(its), 'time')}: "
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


def judge_sampler(run: HarnessRun) -> List[Criterion]:
    return [ran_to_end(run)] + judged_from_finals(run, [
        (SAME_DATASET, same_dataset), (SHARDS, shards), (RESHUFFLED, reshuffled)])


# -- no_sync -----------------------------------------------------------------
def one_allreduce_per_step(run: HarnessRun, finals: Dict[int, dict]) -> Criterion:
    """Bucket all-reduces (counted by the comm hook) == optimizer steps x buckets, on every rank."""
    for rank, f in sorted(finals.items()):
        if not f["ddp_wraps"]:
            return absent(ONE_ALLREDUCE_PER_STEP, run, f"rank {rank} built no DDP model, so no gradient "
                                                            "was all-reduced: wrap the model in DDP")
        if not run.finished:
            return not_measured(ONE_ALLREDUCE_PER_STEP, run, "counts of a run that stopped early "
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


def k_micro_steps(run: HarnessRun, finals: Dict[int, dict]) -> Criterion:
    """Each epoch's optimizer steps come after every K-th micro-batch and after its last, on every rank."""
    for rank, f in sorted(finals.items()):
        epochs, steps = epochs_of(f), f.get("forwards_at_step", [])
        if not f["ddp_forwards"] or not epochs:
            return absent(K_MICRO_STEPS, run, f"rank {rank} made no forward through DDP in a DataLoader loop")
        # every K-th forward of each epoch, and its last (train.sync_schedule)
        planned = [n for first, last in epochs for n in range(first, last + 1)
                   if (n - first + 1) % ACCUM_STEPS == 0 or n == last]
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


def same_as_one_process(run: HarnessRun, finals: Dict[int, dict]) -> Criterion:
    """Final parameters on every rank equal the one-process reference rank 0 computed."""
    rank0 = finals[0]
    if "references" not in rank0:  # computed after rank 0's script, and only where that script succeeded
        why = ("rank 0's script failed, so it computed no reference (see the first criterion)" if rank0.get("error")
               else "rank 0 was stopped before it computed the reference (see the first criterion)"
               if not run.finished else "rank 0 computed no reference")
        return not_measured(SAME_AS_ONE_PROCESS, run, why)
    mine, refs = rank0["final_params"], rank0["references"]
    if mine is None:
        return absent(SAME_AS_ONE_PROCESS, run, "no optimizer stepped: there are no trained parameters")
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
    steps = rank0.get("forwards_at_step", [])
    wiped = sorted(set(rank0.get("zero_grad_at", [])) - {0, *steps})  # zero_grad() inside a window
    if wiped:
        return Criterion(SAME_AS_ONE_PROCESS, False, (
            f"{detail}: zero_grad() ran after forwards {wiped[:8]}"
            f"{' ...' if len(wiped) > 8 else ''}, inside a window (the optimizer stepped after "
            f"forwards {steps[:8]}{' ...' if len(steps) > 8 else ''}): it wiped the gradients the "
            "window's earlier micro-batches had accumulated. Zero the gradients only right after "
            "each optimizer step"))
    if not ranks_agree:
        detail += f"; the ranks also differ from each other: {why_not_averaged(finals)}"
    return Criterion(SAME_AS_ONE_PROCESS, False, detail)


def judge_no_sync(run: HarnessRun) -> List[Criterion]:
    return [ran_to_end(run)] + judged_from_finals(run, [
        (ONE_ALLREDUCE_PER_STEP, one_allreduce_per_step), (K_MICRO_STEPS, k_micro_steps),
        (SAME_AS_ONE_PROCESS, same_as_one_process)])


