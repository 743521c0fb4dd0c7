"""Judge exercise "my_ddp" from what ``workers/my_ddp_harness.py`` measured at W = 2 and 4: a
failure names the mistake it matches; a criterion that mistake upsets as a side effect says "not
measured". Allowed beyond torch's DDP: either bucket rule (``my_ddp_buckets``), any order that is
the same on every rank, buffers broadcast at construction only, and for an unused parameter an
error on every rank (DDP raises: ``Reducer::ensure_prior_reduction_finished``). No torch here."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ddp_tutorial.exercises.judge.common import Criterion, max_difference, not_measured, ran_to_end, ranks_text
from ddp_tutorial.lessons.build_ddp.my_ddp_buckets import (  # noqa: F401
    BROADCAST, BUCKETS, CAPS, NO_SYNC, ORDER, OVERLAP, RAN, SAME, SAME_GRAD, TOLERANCE, UNUSED,
    buckets, bytes_text, caps_text, fill_at_most, fill_reaching, layouts, overlap, trainings)
from ddp_tutorial.exercises.runs import HarnessRun


def _call_text(call) -> str:
    op, nbytes = call
    return f"{op} of {nbytes:,} bytes" if nbytes is not None else op


def _mismatch(runs: List[HarnessRun]) -> Optional[Tuple[HarnessRun, dict]]:
    """Where the ranks' collectives parted: the first ``mismatch`` the lockstep reported."""
    return next(((run, found[0]) for run in runs for r in run.ranks
                 if (found := run.events(r, "mismatch"))), None)


def _mismatch_text(run: HarnessRun, event: dict) -> str:
    at, peers = event["index"], {int(r): s for r, s in event["peers"].items()}
    at_index = {r: (tuple(s[at]) if at < len(s) else None) for r, s in sorted(peers.items())}
    made = ", ".join(f"rank {r}: {_call_text(c) if c else 'none'}" for r, c in at_index.items())
    where = f"W = {run.world_size}, {event['segment']}: collective #{at + 1} differs ({made})"
    calls = [c for c in at_index.values() if c]
    if len(calls) == len(at_index) and len({c[0] for c in calls}) == 1 and calls[0][0] == "all_reduce":
        return (where + ". Buckets built in an order that differs across ranks (from a set, or sorted by id()): the "
                "k-th all-reduce of every rank is summed together, so they sum the wrong tensors, or wait for ever. "
                "Build them from module.parameters(), a list in the same order everywhere")
    missing = [r for r, c in at_index.items() if c is None]
    if missing:
        callers = [r for r, c in at_index.items() if c is not None]
        return (where + f": {ranks_text(callers)} called {_call_text(at_index[callers[0]])}, which "
                f"{ranks_text(missing)} never called in that step. A collective waits until every rank of the group "
                "calls it: call it on every rank (no `if rank == 0:` around dist.broadcast; src=0 already says who "
                "sends). Stopped here, instead of at gloo's timeout")
    return (where + ": the ranks called different collectives at the same point, so each waits for a call its peers "
            "never make. Every rank must make the same collectives in the same order")


def ran(runs: List[HarnessRun]) -> Criterion:
    found = _mismatch(runs)
    if found:
        run, event = found
        return Criterion(RAN, False, f"W = {run.world_size}: stopped in {event['segment']}: the ranks called "
                                     f"different collectives (see '{ORDER}')")
    problems = []
    for run in runs:
        c = ran_to_end(run, RAN)
        if not c.passed:
            where = {r: run.events(r, "segment")[-1]["name"] for r in run.ranks if run.events(r, "segment")}
            at = f" (in {', '.join(f'rank {r}: {w}' for r, w in where.items())})" if run.timed_out and where else ""
            problems.append(f"W = {run.world_size}{at}: {c.detail}")
    if not problems:
        return Criterion(RAN, True, ", ".join(f"W = {r.world_size}: {r.seconds:.1f} s" for r in runs))
    errors = " ".join(str((run.final(r) or {}).get("error") or "") for run in runs for r in run.ranks)
    if "doesn't require gradient" in errors or "does not require grad" in errors:
        problems.insert(0, "a hook on a frozen parameter: a parameter with requires_grad=False gets no gradient, "
                           "and register_post_accumulate_grad_hook refuses it. Hook only `if p.requires_grad`")
    if "defines no class MyDDP" in errors:
        problems.insert(0, "the file defines no class MyDDP: keep the skeleton's class name")
    return Criterion(RAN, False, "\n".join(problems))


def broadcast(runs: List[HarnessRun]) -> Criterion:
    for run in runs:
        built = run.finals("construct")
        if len(built) < run.world_size:
            return not_measured(BROADCAST, run)
        differ = [r for r, b in built.items() if b["after"] != b["rank0"]]
        if differ and any(b["broadcasts"] for b in built.values()) and not any(
                b.get("broadcasts_on_module") for b in built.values()):
            return Criterion(BROADCAST, False, (
                f"W = {run.world_size}: {built[differ[0]]['broadcasts']} broadcasts, none of them of the module's "
                f"own tensors, and {ranks_text(differ)} still differ{'s' if len(differ) == 1 else ''} from rank 0: "
                "the broadcasts went to a copy. Broadcast the parameters and buffers of the module MyDDP was "
                "given, in place"))
        if differ:
            none = all(b["broadcasts"] == 0 for b in built.values())
            return Criterion(BROADCAST, False, (
                f"W = {run.world_size}: each rank built the model from its own seed, and after MyDDP(...) "
                f"{ranks_text(differ)} still differ{'s' if len(differ) == 1 else ''} from rank 0"
                + (": no broadcast at construction. dist.broadcast(t, src=0) every parameter and buffer in __init__"
                   if none else f" ({built[differ[0]]['broadcasts']} broadcasts made): broadcast every parameter "
                   "and buffer from src=0, in place")))
        differ = [r for r, b in built.items() if b["buffers_after"] != b["buffers_rank0"]]
        if differ:
            names = ", ".join(built[differ[0]]["buffers"])
            return Criterion(BROADCAST, False, (
                f"W = {run.world_size}: the parameters are rank 0's, but the buffer ({names}) of "
                f"{ranks_text(differ)} still differs from rank 0's: buffers not broadcast. Broadcast "
                "module.buffers() too, as torch's DDP does (at construction, and before every forward)"))
    n = runs[0].events(0, "construct")[-1]["broadcasts"]
    return Criterion(BROADCAST, True, f"every rank equal to rank 0 after construction, parameters and buffer "
                                      f"({n} broadcasts), at W = " + " and ".join(str(r.world_size) for r in runs))


def _never_reset(trains: Dict[int, List[dict]]) -> Optional[str]:
    """Launches that stop after each training's first step: per-step state that is never reset."""
    for recs in trains.values():
        counts = {t["cap"]: [len(s["all_reduces"]) for s in t["steps"]] for t in recs}
        if any(c[0] and min(c[1:]) < c[0] for c in counts.values()):
            made = sum(sum(c) for c in counts.values())
            expected = sum(c[0] * len(c) for c in counts.values())
            shown = "; ".join(f"{c} at {bytes_text(cap)}" for cap, c in counts.items())
            return (f"all-reduces per step {shown}: {made} launched over the {sum(len(c) for c in counts.values())} "
                    f"steps against {expected}. After the first step fewer buckets are launched: reset the "
                    "per-step state (arrival counts, launched handles) in finish_gradient_synchronization(), "
                    "ready for the next backward")
    return None


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
    reset = _never_reset(trains)
    if reset:
        return reset
    gaps = [t["gaps"] for recs in trains.values() for t in recs if t.get("gaps")]
    if gaps and any(s["all_reduces"] for s in steps) and all(g["local_to_ddp"] > 100 * SAME_GRAD for g in gaps):
        if all(g["to_local"] <= SAME_GRAD for g in gaps):
            return ("the all-reduced values never reach p.grad: after finish_gradient_synchronization() every "
                    "rank's gradients are still its own, bit for bit, though all-reduces ran. Copy each "
                    "bucket's averaged values back into its parameters' p.grad after the wait")
        if all(g["to_local_over_w"] <= SAME_GRAD for g in gaps):
            return (f"the all-reduced values never reach p.grad: after finish_gradient_synchronization() every "
                    f"rank's gradients are its own divided by {w}, not the average. Copy each bucket's averaged "
                    "values back into its parameters' p.grad after the wait")
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
        trains = trainings(run)
        if trains is None:
            return not_measured(SAME, run)
        diff = max(max_difference(t["final"], t["ddp_final"]) for recs in trains.values() for t in recs)
        racy = any(s["not_waited"] or s["changed_after_launch"] for recs in trains.values() for t in recs
                   for s in t["steps"])
        if diff > TOLERANCE or racy:  # a race may be won on one run: the mistake is there all the same
            built = run.finals("construct").values()
            hooked = (min(b["hooked_params"] for b in built), min(b["hooks_registered"] for b in built))
            issue = _train_issue(run, trains, hooked)
            detail = f"W = {run.world_size}: the parameters differ from DDP's by up to {diff:.3g}"
            return Criterion(SAME, False, detail + (f": {issue}" if issue else ""))
        worst = max(worst, diff)
    return Criterion(SAME, True, f"max difference {worst:.2g} at W = 2 and 4, at caps of {caps_text(CAPS)}")


def no_sync(runs: List[HarnessRun]) -> Criterion:
    for run in runs:
        recs = run.finals("no_sync")
        if len(recs) < run.world_size:
            return not_measured(NO_SYNC, run)
        counts = recs[0]["all_reduces"]
        if any(counts[:-1]):
            return Criterion(NO_SYNC, False, f"W = {run.world_size}: all-reduces per micro-batch {counts}: the "
                                             "backward inside no_sync() still all-reduced. Let no_sync() set a flag "
                                             "the hooks read, and skip the launch while it is set")
        trains = trainings(run)
        if not counts[-1]:
            if trains and not any(s["all_reduces"] for t in trains[0] for s in t["steps"]):
                return not_measured(NO_SYNC, run, f"no all-reduce at all (see '{SAME}')")
            return Criterion(NO_SYNC, False, f"W = {run.world_size}: all-reduces per micro-batch {counts}: the "
                                             "backward after no_sync() all-reduced nothing, though training steps "
                                             "do. The arrivals counted inside no_sync() must not count: count "
                                             "only while syncing")
        diff = max(max_difference(r["final"], r["ddp_final"]) for r in recs.values())
        if diff > TOLERANCE:
            if not same_as_ddp(runs).passed:
                return not_measured(NO_SYNC, run, f"all-reduces per micro-batch {counts}, as they should be; whether "
                                                  f"the sum is right cannot be told while training differs from "
                                                  f"DDP's (see '{SAME[:40]}...')")
            return Criterion(NO_SYNC, False, f"W = {run.world_size}: all-reduces per micro-batch {counts}, "
                                             f"parameters differ from DDP's by {diff:.3g}: the backward after "
                                             "no_sync() must all-reduce the accumulated sum")
    return Criterion(NO_SYNC, True, f"all-reduces per micro-batch {runs[0].events(0, 'no_sync')[-1]['all_reduces']}, "
                                    "the parameters equal DDP's no_sync()")


def unused(runs: List[HarnessRun]) -> Criterion:
    answers = []
    for run in runs:
        recs = run.finals("unused")
        if len(recs) < run.world_size:
            stuck = [r for r in run.still_running
                     if run.events(r, "segment") and "unused" in run.events(r, "segment")[-1]["name"]]
            if run.timed_out and stuck:
                return Criterion(UNUSED, False, (
                    f"W = {run.world_size}: {ranks_text(stuck)} still waiting at the check's deadline "
                    f"({run.timeout:.0f} s) in {run.events(stuck[0], 'segment')[-1]['name']}: a parameter no forward "
                    "uses never gets a gradient, so waiting for it never ends. Raise an error instead "
                    "(in finish_gradient_synchronization(), where its bucket is still missing)"))
            return not_measured(UNUSED, run)
        raised = {r: rec["raised"] for r, rec in recs.items() if rec["raised"]}
        if raised and len(raised) < run.world_size:
            return Criterion(UNUSED, False, f"W = {run.world_size}: only {ranks_text(sorted(raised))} raised; every "
                                            "rank must, or the others wait in their next collective")
        if raised:
            first = raised[min(raised)]
            answers.append(f"W = {run.world_size}: raised at step {first['step']} on every rank "
                           f"({first['type']}: {first['message'][:90]})")
            continue
        diff = max(max_difference(r["final"], r["ddp_final"]) for r in recs.values())
        if diff <= TOLERANCE:
            answers.append(f"W = {run.world_size}: no error, and the parameters equal "
                           "DDP(find_unused_parameters=True)'s")
            continue
        if not same_as_ddp(runs).passed:
            return not_measured(UNUSED, run, f"no error, and the parameters differ from DDP's; so does training "
                                             f"(see '{SAME[:40]}...')")
        rec = recs[0]
        made = sum(sum(s["all_reduces"]) for s in rec["steps"]) // max(1, len(rec["steps"]))
        return Criterion(UNUSED, False, (
            f"W = {run.world_size}: no error, and after 2 steps the parameters differ from DDP's by {diff:.3g}. "
            f"A parameter no forward uses gets no gradient, so its bucket was never all-reduced "
            f"({made:,} of {rec['trainable_bytes']:,} bytes of gradients a step were) and the other gradients in it "
            "stayed each rank's own. In finish_gradient_synchronization(), raise an error when a bucket was "
            "not launched (torch's DDP raises)"))
    return Criterion(UNUSED, True, "; ".join(answers))


def same_order(runs: List[HarnessRun]) -> Criterion:
    found = _mismatch(runs)
    if found:
        return Criterion(ORDER, False, _mismatch_text(*found))
    compared = 0
    for run in runs:
        launches = {r: [(e["case"], e.get("op", "all_reduce"), e["bytes"]) for e in run.events(r, "launch")]
                    for r in run.ranks}
        shortest = min(len(v) for v in launches.values())
        if not run.finished and len({len(v) for v in launches.values()}) > 1:
            counts = ", ".join(f"rank {r}: {len(v)}" for r, v in launches.items())
            return Criterion(ORDER, False, f"W = {run.world_size}: collectives called {counts}: a rank called "
                                           "one its peers never did")
        compared += sum(1 for c in launches[0][:shortest] if c[1] == "all_reduce")
    if not compared:
        return not_measured(ORDER, runs[0], "no rank launched an all-reduce: there is no order to compare")
    return Criterion(ORDER, True, f"the same collectives, sizes and order on every rank ({compared} all-reduces "
                                  "compared)")


def judge_my_ddp(*runs: HarnessRun) -> List[Criterion]:
    return [ran(runs), broadcast(runs), same_as_ddp(runs), buckets(runs), overlap(runs), no_sync(runs),
            unused(runs), same_order(runs)]
