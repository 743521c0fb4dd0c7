"""Exercise "my_ddp"'s shared thresholds, criteria names and record readers, and its bucket and
overlap criteria. No torch here."""

from __future__ import annotations

import itertools
from typing import Dict, List, Optional, Sequence

from ddp_tutorial.exercises.judge.common import Criterion, not_measured, plural
from ddp_tutorial.exercises.runs import HarnessRun

#: Parameters this close to DDP's count as equal (W = 4 sums in another order: the last bits differ).
TOLERANCE = 1e-6
#: Gradients this close to this rank's own (unsynchronised) ones are those: same ops, same bits.
SAME_GRAD = 1e-7
STEPS = 3
#: The caps the harness trains with, in bytes (its CAP_BYTES).
CAPS = (2**20, 900, 500)

RAN = "runs to the end on every rank, at W = 2 (then at W = 4)"
BROADCAST = "construction: every rank starts from rank 0's parameters and buffers (a broadcast)"
SAME = (f"parameters after {STEPS} SGD steps equal torch's DDP within {TOLERANCE:g} (tied weights, a frozen bias, "
        "a requires_grad=False parameter, a buffer; caps of 1 MiB, 900 and 500 bytes)")
BUCKETS = ("buckets follow bucket_cap_mb: a new bucket once the next gradient would pass the cap (DDP's rule, "
           "closing a bucket once it reaches or passes the cap, passes too)")
OVERLAP = ("overlap: all-reduces launched with async_op=True while backward still had gradients to produce, "
           "waited for after it")
NO_SYNC = "no_sync() skips the all-reduce, and the next backward syncs the sum"
UNUSED = ("a trainable parameter no forward uses: an error on every rank (as torch's DDP raises), "
          "never un-averaged gradients in silence")
ORDER = "every rank calls the same collectives in the same order"


def bytes_text(n: int) -> str:
    return "1 MiB" if n == 2**20 else f"{n:,} bytes"


def caps_text(caps: Sequence[int]) -> str:
    names = [bytes_text(c) for c in caps]
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


def trainings(run: HarnessRun) -> Optional[Dict[int, List[dict]]]:
    trains = {r: run.events(r, "train") for r in run.ranks}
    return None if any(len(t) < len(CAPS) for t in trains.values()) else trains


def fill_at_most(sizes: Sequence[int], cap: float) -> List[int]:
    """Buckets filled in this order, a new one when the next gradient would pass the cap (the exercise's rule)."""
    buckets: List[int] = []
    for size in sizes:
        if buckets and buckets[-1] + size <= cap:
            buckets[-1] += size
        else:
            buckets.append(size)
    return buckets


def fill_reaching(sizes: Sequence[int], cap: float) -> List[int]:
    """DDP's rule: a bucket closes once it reaches or passes the cap (reducer.cpp,
    ``compute_bucket_assignment_by_size``: ``if (bucket.size >= bucket_size_limit)``)."""
    buckets: List[int] = [0]
    for size in sizes:
        buckets[-1] += size
        if buckets[-1] >= cap:
            buckets.append(0)
    return [b for b in buckets if b]


def layouts(sizes: Sequence[int], cap: int) -> set:
    """Every bucket layout (sizes, sorted) that either rule gives in some order of the parameters;
    also with the cap read as 10**6 bytes per MB (no mistake either)."""
    found = set()
    for limit in (cap, cap / 2**20 * 10**6):
        for order in itertools.permutations(sizes):
            found.add(tuple(sorted(fill_at_most(order, limit))))
            found.add(tuple(sorted(fill_reaching(order, limit))))
    return found


def buckets(runs: List[HarnessRun]) -> Criterion:
    seen = None
    for run in runs:
        trains = trainings(run)
        if trains is None:
            return not_measured(BUCKETS, run)
        for r, recs in trains.items():
            first = {t["cap"]: t["steps"][0] for t in recs}
            if any("param" in s["kinds"] for s in first.values()):
                return not_measured(BUCKETS, run, f"the all-reduces are of parameters, not gradients (see '{SAME}')")
            if not any(s["all_reduces"] for s in first.values()):
                return not_measured(BUCKETS, run, "no all-reduce of gradients was launched")
            if not any(s["launched_in_backward"] or s["in_last_hook"] for s in first.values()):
                # Buckets are what hooks launch during backward; after it, the one diagnosis is overlap's.
                return not_measured(BUCKETS, run, f"every all-reduce was launched after backward (see '{OVERLAP[:8]}')")
            sizes = recs[0]["param_bytes"]
            made = {cap: s["all_reduces"] for cap, s in first.items()}
            counts = {cap: len(v) for cap, v in made.items()}
            where = f"W = {run.world_size}, rank {r}: "
            caps = caps_text(list(made))
            if len(set(counts.values())) == 1:
                n = counts[CAPS[0]]
                if n == 1:
                    return Criterion(BUCKETS, False, where + f"one all-reduce a step at every cap ({caps}): "
                                     "bucket_cap_mb is ignored, every gradient in one bucket. Start a new bucket "
                                     "when the next gradient would pass the cap")
                if n == len(sizes):
                    return Criterion(BUCKETS, False, where + f"one all-reduce per parameter at every cap ({n} a step "
                                     f"at {caps}): bucket_cap_mb is ignored. Put the gradients in buckets of up "
                                     "to the cap, one all-reduce per bucket")
                return Criterion(BUCKETS, False, where + f"{n} all-reduces a step at every cap ({caps}): the "
                                 "buckets do not follow bucket_cap_mb")
            for cap, got in made.items():
                if sum(got) != sum(sizes):
                    return Criterion(BUCKETS, False, where + f"at a cap of {bytes_text(cap)} a step all-reduced "
                                     f"{sum(got):,} bytes of gradients ({got}), the trainable gradients are "
                                     f"{sum(sizes):,}: each trainable gradient belongs in exactly one bucket")
                if tuple(sorted(got)) not in layouts(sizes, cap):
                    reverse = list(reversed(sizes))
                    return Criterion(BUCKETS, False, where + (
                        f"at a cap of {bytes_text(cap)}: all-reduces of {got} bytes. The gradients ({sizes} bytes, "
                        f"in registration order) filled up to the cap give {fill_at_most(reverse, cap)} in "
                        f"reverse order (a new bucket when the next gradient would pass the cap), or "
                        f"{fill_reaching(reverse, cap)} by DDP's rule (a bucket closes once it reaches or passes "
                        "the cap)"))
            seen = seen or counts
    shown = ", ".join(f"{n} at {bytes_text(cap)}" for cap, n in seen.items())
    return Criterion(BUCKETS, True, f"buckets per step: {shown}, each a layout the cap gives")


def overlap(runs: List[HarnessRun]) -> Criterion:
    total = {"in": 0, "all": 0}
    for run in runs:
        trains = trainings(run)
        if trains is None:
            return not_measured(OVERLAP, run)
        for r, recs in trains.items():
            sizes = recs[0]["param_bytes"]
            steps = [(t["cap"], k, s) for t in recs if t["cap"] < sum(sizes) for k, s in enumerate(t["steps"])
                     if s["launched_in_backward"] or s["in_last_hook"] or s["after_backward"]]
            if not steps:
                return not_measured(OVERLAP, run, "no all-reduce was launched")
            if r == 0 and run is runs[0]:
                total = {"in": sum(s["overlapping"] for _, _, s in steps),
                         "all": sum(len([o for o in s["ops"] if o == "all_reduce"]) for _, _, s in steps)}
            late = [(cap, k, s) for cap, k, s in steps if not s["overlapping"]]
            if not late:
                continue
            cap, k, s = late[0]
            made = len([o for o in s["ops"] if o == "all_reduce"])
            where = (f"W = {run.world_size}, rank {r}, cap {bytes_text(cap)}, step {k}: {s['overlapping']} of {made} "
                     "all-reduces overlap backward")
            if s["blocking_in_backward"]:
                why = ("blocking all-reduces (no async_op=True) during backward: backward stops until each is done, "
                       "so nothing runs beside it. Launch with async_op=True and wait in "
                       "finish_gradient_synchronization()")
            elif s["waited_in_backward"]:
                why = ("the all-reduces were waited for during backward (handle.wait() in the hook): backward "
                       "stops there. Keep the handles; wait in finish_gradient_synchronization()")
            elif s["in_last_hook"] and not s["after_backward"]:
                why = (f"{plural(s['in_last_hook'], 'all-reduce')} launched in the last gradient's hook, once backward "
                       "had produced every gradient: nothing is left for them to overlap. Launch each bucket from "
                       "the hook of its own last gradient, while backward still computes the others")
            else:
                why = (f"{plural(s['after_backward'], 'all-reduce')} launched after backward returned (in "
                       "finish_gradient_synchronization()): nothing overlaps. Launch them during backward, from "
                       "p.register_post_accumulate_grad_hook, with async_op=True")
            return Criterion(OVERLAP, False, f"{where}: {why}")
    return Criterion(OVERLAP, True, (f"rank 0 at W = 2: {total['in']} of {total['all']} all-reduces at the caps that "
                                     "make several buckets were launched while backward still had gradients to "
                                     "produce (counted by a hook that runs before the class's)"))
