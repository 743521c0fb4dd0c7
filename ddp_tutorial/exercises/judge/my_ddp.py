"""Judge exercise "my_ddp": a learner's MyDDP against torch's DDP, from what the harness measured at W = 2 and 4.

The harness (``workers/my_ddp_harness.py``) reports per rank: the construction
(``construct``), three trainings with caps forcing 1, 2 and 3 buckets (``train``)
and a no_sync accumulation (``no_sync``), each beside DDP on the same batches,
and every all-reduce the moment it was launched (``launch``). Each criterion is
judged on both runs; a failure names the mistake its measurement matches. No torch here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ddp_tutorial.exercises.judge.common import (NOT_MEASURED, Criterion, max_difference, not_measured, ran_to_end,
                                                ranks_text)
from ddp_tutorial.exercises.runs import HarnessRun

HARNESS = Path(__file__).resolve().parent.parent / "workers" / "my_ddp_harness.py"
WORLD_SIZES = (2, 4)
#: Parameters closer than this to DDP's count as equal. Measured (notebook 11): W = 2 is bit-identical;
#: at W = 4 the order of the 4-way sum differs and the parameters differ by about 1.5e-8 after 5 steps.
TOLERANCE = 1e-6
STEPS = 3

RAN = "runs to the end on every rank, at W = 2 and W = 4"
BROADCAST = "construction: every rank starts from rank 0's parameters (a broadcast)"
SAME = (f"parameters after {STEPS} SGD steps equal torch's DDP within {TOLERANCE:g} (tied weights, a frozen bias, "
        "a requires_grad=False parameter; caps forcing 1, 2 and 3 buckets)")
OVERLAP = "overlap: all-reduces launched during backward, from hooks"
NO_SYNC = "no_sync() skips the all-reduce, and the next backward syncs the sum"
ORDER = "every rank launches the same all-reduces in the same order"

HINT = ("In __init__: dist.broadcast(t, src=0) for every parameter and buffer (under torch.no_grad()). Then the "
        "buckets: walk reversed([p for p in module.parameters() if p.requires_grad]) (a list: the same order on "
        "every rank; frozen parameters get no hook) and start a new bucket when the next one would pass the cap. "
        "p.register_post_accumulate_grad_hook(fn) calls fn(p) once p.grad is complete: count the bucket's arrivals, "
        "and at its last one torch.cat its gradients, divide by the world size, and keep the handle of "
        "dist.all_reduce(flat, async_op=True). Touch flat no more until finish_gradient_synchronization() has "
        "waited for the handle; then copy its pieces back into each p.grad. no_sync(): a flag the hook reads.")


def _records(run: HarnessRun, event: str) -> Dict[int, List[dict]]:
    return {r: run.events(r, event) for r in run.ranks}


def _error_text(runs: List[HarnessRun]) -> str:
    return " ".join(str((run.final(r) or {}).get("error") or "") for run in runs for r in run.ranks)


def ran(runs: List[HarnessRun]) -> Criterion:
    problems = []
    for run in runs:
        c = ran_to_end(run, RAN)
        if not c.passed:
            problems.append(f"W = {run.world_size}: {c.detail}")
    if not problems:
        return Criterion(RAN, True, ", ".join(f"W = {r.world_size}: {r.seconds:.1f} s" for r in runs))
    errors = _error_text(runs)
    if "doesn't require gradient" in errors or "does not require grad" in errors:
        problems.insert(0, "a hook on a frozen parameter: a parameter with requires_grad=False gets no gradient, "
                           "and register_post_accumulate_grad_hook refuses it. Hook only `if p.requires_grad`")
    if "defines no class MyDDP" in errors:
        problems.insert(0, "the file defines no class MyDDP: keep the skeleton's class name")
    return Criterion(RAN, False, "\n".join(problems))


def broadcast(runs: List[HarnessRun]) -> Criterion:
    for run in runs:
        built = {r: recs[-1] for r, recs in _records(run, "construct").items() if recs}
        if len(built) < run.world_size:
            return not_measured(BROADCAST, run)
        differ = [r for r, b in built.items() if b["after"] != b["rank0"]]
        if differ:
            none = all(b["broadcasts"] == 0 for b in built.values())
            return Criterion(BROADCAST, False, (
                f"W = {run.world_size}: each rank built the model from its own seed, and after MyDDP(...) "
                f"{ranks_text(differ)} still differ{'s' if len(differ) == 1 else ''} from rank 0"
                + (": no broadcast at construction. dist.broadcast(t, src=0) every parameter and buffer in __init__"
                   if none else f" ({built[differ[0]]['broadcasts']} broadcasts made): broadcast every parameter "
                   "and buffer from src=0, in place")))
    n = runs[0].events(0, "construct")[-1]["broadcasts"]
    return Criterion(BROADCAST, True, f"every rank equal to rank 0 after construction ({n} broadcasts), at W = "
                                      + " and ".join(str(r.world_size) for r in runs))


def _train_issue(run: HarnessRun, trains: Dict[int, List[dict]], hooked: Tuple[int, int]) -> Optional[str]:
    """The classic mistake the measurements of a failing training match, or None."""
    steps = [s for recs in trains.values() for t in recs for s in t["steps"]]
    w = run.world_size
    if any(s["changed_after_launch"] for s in steps):
        return ("a gradient changed in place after its all-reduce was launched (before its handle was waited for): "
                "the all-reduce reads and writes that tensor on another thread. Divide before the launch, "
                "or after the wait")
    if any(s["not_waited"] for s in steps):
        return ("stepping before the handles are waited for: finish_gradient_synchronization() returned with "
                "all-reduces launched with async_op=True whose handle was never waited for. Call handle.wait() on each")
    if any("param" in s["kinds"] for s in steps):
        return "all-reducing param.data instead of .grad: the gradients are what must be averaged, not the weights"
    if steps and all(not s["all_reduces"] for s in steps) and hooked == (0, 0):
        return ("no hook and no all-reduce: the gradients were never synchronised. Register "
                "p.register_post_accumulate_grad_hook on each trainable parameter, launch the all-reduces there")
    if steps and all(not s["all_reduces"] for s in steps) and hooked[0] == 0:
        return (f"hooks registered on another model: MyDDP registered {hooked[1]} hooks, none on the module it was "
                "given, and no all-reduce ran. Keep self.module = module (not a copy) and hook its parameters")
    ratios = [t["grad_ratio"] for recs in trains.values() for t in recs if t["grad_ratio"] == t["grad_ratio"]]
    if ratios:
        ratio = sorted(ratios)[len(ratios) // 2]
        if abs(ratio - w) < 0.05 * w:
            return (f"not dividing by W: the gradients are {ratio:.2f} times DDP's, the sum over {w} ranks. Divide by "
                    "dist.get_world_size() once")
        if abs(ratio - 1 / w) < 0.05 / w:
            return (f"dividing twice: the gradients are {ratio:.3f} times DDP's, 1/{w}. Divide by the world size once, "
                    "before the all-reduce or after it, not both")
    return None


def same_as_ddp(runs: List[HarnessRun]) -> Criterion:
    worst = 0.0
    for run in runs:
        trains = _records(run, "train")
        if any(len(t) < 3 for t in trains.values()):
            return not_measured(SAME, run)
        diff = max(max_difference(t["final"], t["ddp_final"]) for recs in trains.values() for t in recs)
        racy = any(s["not_waited"] or s["changed_after_launch"] for recs in trains.values() for t in recs
                   for s in t["steps"])
        if diff > TOLERANCE or racy:  # a race may be won on one run: the mistake is there all the same
            built = [recs[-1] for recs in _records(run, "construct").values() if recs]
            hooked = (min(b["hooked_params"] for b in built), min(b["hooks_registered"] for b in built))
            issue = _train_issue(run, trains, hooked)
            detail = f"W = {run.world_size}: the parameters differ from DDP's by up to {diff:.3g}"
            return Criterion(SAME, False, detail + (f": {issue}" if issue else ""))
        worst = max(worst, diff)
    return Criterion(SAME, True, f"max difference {worst:.2g} at W = 2 and 4, with 1, 2 and 3 buckets")


def overlap(runs: List[HarnessRun]) -> Criterion:
    for run in runs:
        trains = _records(run, "train")
        if any(len(t) < 3 for t in trains.values()):
            return not_measured(OVERLAP, run)
        launched = {r: sum(s["launched_in_backward"] for t in recs for s in t["steps"]) for r, recs in trains.items()}
        late = [r for r, n in launched.items() if n == 0]
        if late:
            return Criterion(OVERLAP, False, (
                f"W = {run.world_size}: {ranks_text(late)} launched no all-reduce before backward's last gradient: "
                "the all-reduces run after backward, so none is hidden. Launch them from "
                "p.register_post_accumulate_grad_hook, with async_op=True"))
    n = sum(s["launched_in_backward"] for t in runs[0].events(0, "train") for s in t["steps"])
    return Criterion(OVERLAP, True, f"rank 0 at W = 2 launched {n} all-reduces before backward's last gradient")


def no_sync(runs: List[HarnessRun]) -> Criterion:
    for run in runs:
        recs = {r: v[-1] for r, v in _records(run, "no_sync").items() if v}
        if len(recs) < run.world_size:
            return not_measured(NO_SYNC, run)
        counts = recs[0]["all_reduces"]
        if any(counts[:-1]):
            return Criterion(NO_SYNC, False, f"W = {run.world_size}: all-reduces per micro-batch {counts}: the "
                                             "backward inside no_sync() still all-reduced. Let no_sync() set a flag "
                                             "the hooks read, and skip the launch while it is set")
        diff = max(max_difference(r["final"], r["ddp_final"]) for r in recs.values())
        if not counts[-1] or diff > TOLERANCE:
            return Criterion(NO_SYNC, False, f"W = {run.world_size}: all-reduces per micro-batch {counts}, "
                                             f"parameters differ from DDP's by {diff:.3g}: the backward after "
                                             "no_sync() must all-reduce the accumulated sum")
    return Criterion(NO_SYNC, True, f"all-reduces per micro-batch {runs[0].events(0, 'no_sync')[-1]['all_reduces']}, "
                                    "the parameters equal DDP's no_sync()")


def same_order(runs: List[HarnessRun]) -> Criterion:
    for run in runs:
        launches = {r: [(e["case"], e["step"], e["bytes"]) for e in run.events(r, "launch")] for r in run.ranks}
        shortest = min(len(v) for v in launches.values())
        for i in range(shortest):
            at = {r: v[i] for r, v in launches.items()}
            if len(set(at.values())) > 1:
                sizes = ", ".join(f"rank {r}: {b[2]} bytes" for r, b in at.items())
                return Criterion(ORDER, False, (
                    f"W = {run.world_size}: all-reduce #{i + 1} ({at[0][0]}, step {at[0][1]}) differs: {sizes}. "
                    "Buckets built in an order that differs across ranks (from a set, or sorted by id()): the k-th "
                    "all-reduce of every rank is summed together, so they sum the wrong tensors, or wait for ever. "
                    "Build them from module.parameters(), a list in the same order everywhere"))
        if not run.finished and len({len(v) for v in launches.values()}) > 1:
            counts = ", ".join(f"rank {r}: {len(v)}" for r, v in launches.items())
            return Criterion(ORDER, False, f"W = {run.world_size}: all-reduces launched {counts}: a rank launched "
                                           "one its peers never did")
    if not any(run.events(r, "launch") for run in runs for r in run.ranks):  # nothing to compare: no ✓
        return Criterion(ORDER, False, f"{NOT_MEASURED}no rank launched an all-reduce from a gradient hook")
    return Criterion(ORDER, True, "the same sizes in the same order on every rank")


def judge_my_ddp(runs: List[HarnessRun]) -> List[Criterion]:
    return [ran(runs), broadcast(runs), same_as_ddp(runs), overlap(runs), no_sync(runs), same_order(runs)]
