"""Notebook helpers of lesson 11: DistributedDataParallel built by hand, measured against torch's.

One launch of ``workers/build_ddp_lab.py`` (4 ranks) measures every version of
``workers/my_ddps.py`` beside torch's DDP on the same models and batches; a
second, short one shows the hand-made DDP waiting for ever on a parameter that
got no gradient. The helpers here turn the records into the tables the notebook
prints, plots and asserts. No torch is imported here.

    lab = run_lab()                         # construct, exact, overlap, cases: one launch
    print(format_exactness(exactness(lab)))
    hang = unused_parameter_hang()          # LaunchTimeout, each rank's stack
"""

from __future__ import annotations

import statistics
import time
from typing import Dict, List

from ddp_tutorial.launcher import LaunchTimeout, warm_ready, launch, worker_script
from ddp_tutorial.lessons import script_source
from ddp_tutorial.runfolder import Run

SCRIPT = worker_script(__file__, "build_ddp_lab.py")
VERSIONS_SCRIPT = worker_script(__file__, "my_ddps.py")
PARTS = ("construct", "exact", "overlap", "cases")
VERSIONS = ("naive", "flat", "overlap", "bucket")
NAMES = {"naive": "NaiveDDP", "flat": "FlatDDP", "overlap": "OverlapDDP", "bucket": "BucketDDP", "ddp": "torch DDP"}
#: The toy model's trainable tensors (fc1 weight and bias, fc2 weight = fc3 weight, fc3 bias, out weight and
#: bias) and their bytes; fc2's frozen bias and the requires_grad=False ``fixed`` are not among them.
TRAINABLE_TENSORS, TRAINABLE_BYTES = 6, 2132


def show(name: str) -> None:
    """Print the source of a class or function of ``my_ddps.py`` (read, not imported)."""
    print(script_source(VERSIONS_SCRIPT, name))


def run_lab(world_size: int = 4, steps: int = 5, timeout: float = 120.0, **launch_kwargs) -> Run:
    """Launch ``build_ddp_lab.py`` (construct, exact, overlap, cases) on ``world_size`` ranks (gloo, CPU).

    Args:
        world_size: ranks; ``exact`` runs W = 2, 3 and 4 in groups of ranks 0..W-1 (those up to it).
        steps: SGD steps of ``exact``.
        timeout: seconds before the launch counts as hung.
        **launch_kwargs: passed to ``launch`` (``run_dir``, ``env``, ...).
    """
    return launch(SCRIPT, world_size, ["--parts", ",".join(PARTS), "--steps", str(steps)], timeout=timeout,
                  echo="none", **launch_kwargs)


def _records(run: Run, part: str) -> Dict[int, List[dict]]:
    return {rank: [r for r in run.results(rank) if r.get("part") == part] for rank in range(run.world_size)}


def max_diff(a: List[float], b: List[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b)) if len(a) == len(b) else float("inf")


# -- 1. Broadcast at construction ------------------------------------------------
def construction(run: Run) -> Dict[str, dict]:
    """Per version: did every rank start different and end with rank 0's weights; broadcasts it made."""
    out: Dict[str, dict] = {}
    for rank, recs in _records(run, "construct").items():
        for rec in recs:
            row = out.setdefault(rec["version"], {"distinct_before": set(), "after": set(), "rank0": rec["rank0_built"],
                                                  "broadcasts": set()})
            row["distinct_before"].add(rec["before"])
            row["after"].add(rec["after"])
            row["broadcasts"].add(rec["broadcasts"])
    return {v: {"ranks_differed_before": len(r["distinct_before"]) == run.world_size,
                "all_equal_rank0_after": r["after"] == {r["rank0"]},
                "broadcasts": sorted(r["broadcasts"])} for v, r in out.items()}


# -- 2./3./5. Exactness, all-reduces, buckets -----------------------------------------
def _exact(run: Run) -> Dict[int, Dict[int, dict]]:
    """world size -> rank -> its ``exact`` record."""
    out: Dict[int, Dict[int, dict]] = {}
    for rank, recs in _records(run, "exact").items():
        for rec in recs:
            out.setdefault(rec["world_size"], {})[rank] = rec
    return out


def exactness(run: Run) -> Dict[int, dict]:
    """Per world size: each version's largest difference from torch's DDP after the same SGD steps, whether
    bit-identical, and the size of float32's own rounding there (DDP against one float64 process)."""
    out = {}
    for w, ranks in _exact(run).items():
        rank0 = ranks[0]
        finals = rank0["finals"]
        out[w] = {"versions": {v: {"max_diff": max_diff(finals[v], finals["ddp"]),
                                   "bit_identical": finals[v] == finals["ddp"]} for v in VERSIONS},
                  "ddp_vs_float64": max_diff(finals["ddp"], rank0["float64"]),
                  "ranks_agree": all(r["finals"] == finals for r in ranks.values()),
                  "has_grad": rank0["has_grad"], "steps": len(rank0["steps"]["ddp"])}
    return out


def format_exactness(table: Dict[int, dict]) -> str:
    lines = [f"{'W':>2}  " + "".join(f"{NAMES[v]:>13}" for v in VERSIONS) + "   float32 rounding (DDP vs float64)"]
    for w, row in sorted(table.items()):
        cells = "".join(f"{'identical' if c['bit_identical'] else format(c['max_diff'], '.1e'):>13}"
                        for c in row["versions"].values())
        lines.append(f"{w:>2}  {cells}   {row['ddp_vs_float64']:.1e}")
    return "\n".join(lines)


def allreduces_per_step(run: Run, world_size: int = 4) -> Dict[str, dict]:
    """Per version (and DDP): all-reduce calls and bytes in one step (the first), at ``world_size``."""
    return {v: s[0] for v, s in _exact(run)[world_size][0]["steps"].items()}


def buckets(run: Run, world_size: int = 4) -> Dict[int, dict]:
    """BucketDDP for the three caps: the buckets (parameter names) and the all-reduces of a step."""
    return {int(n): {"cap_bytes": round(b["cap_mb"] * 2**20), "buckets": b["buckets"],
                     "all_reduces": b["per_step"][0]["all_reduces"], "bytes": b["per_step"][0]["bytes"]}
            for n, b in _exact(run)[world_size][0]["buckets"].items()}


# -- 4. Overlap ------------------------------------------------------------------
def busy(intervals) -> float:
    """Length of the union of ``(start, end)`` intervals: time with at least one of them in progress."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def _step_numbers(step: dict) -> dict:
    """One step's times: exposed communication (from the last gradient to synced), communication hidden under
    backward (time before the last gradient with an all-reduce in flight), and DDP's logger's measure of
    overlap recomputed (the last gradient minus the first launch)."""
    last_grad, backward = max(step["ready"]), step["backward"]
    ars = step["all_reduces"]
    first_launch = min(a[0] for a in ars)
    return {"exposed_ms": 1e3 * (step["synced"] - last_grad),
            "hidden_ms": 1e3 * busy([(max(a, backward), min(b, last_grad)) for a, b, _ in ars]),
            "comm_ms": 1e3 * busy([(a, b) for a, b, _ in ars]),
            "launched_before_backward_end": sum(start < last_grad for start, _, _ in ars),
            "window_ms": 1e3 * max(0.0, last_grad - first_launch),
            "step_ms": 1e3 * (step["step_end"] - step["forward"]),
            "all_reduces": len(ars), "bytes": sum(b for _, _, b in ars)}


def overlap_summary(run: Run) -> Dict[str, dict]:
    """Per version and DDP: medians over the timed steps (the first left out: warm-up) and both ranks, and
    ``least_exposed_ms``, the least exposed communication of those steps: another process on a shared CPU only
    adds time to a step (a descheduled peer makes every version wait), so the least is the version's own cost."""
    out: Dict[str, dict] = {}
    for rank, recs in _records(run, "overlap").items():
        for rec in recs:
            row = out.setdefault(rec["version"], {"per_step": [], "logger": {}})
            row["per_step"] += [_step_numbers(s) for s in rec["steps"][1:]]
            if "avg_backward_compute_comm_overlap_time" in rec:
                row["logger"][rank] = {k: rec[k] / 1e6 for k in rec if k.startswith("avg_")}  # ns -> ms
    for row in out.values():
        keys = row["per_step"][0].keys()
        row.update({k: statistics.median(s[k] for s in row["per_step"]) for k in keys})
        row["least_exposed_ms"] = min(s["exposed_ms"] for s in row["per_step"])
    finals = [r for recs in _records(run, "overlap_final").values() for r in recs]
    for version in out:
        out[version]["same_as_ddp"] = all(f["digests"][version] == f["digests"]["ddp"] for f in finals)
    return out


def format_side_by_side(summary: Dict[str, dict]) -> str:
    lines = [f"{'version':<12}{'step ms':>9}{'all-reduces':>13}{'KiB':>7}{'exposed ms':>12}{'hidden ms':>11}"
             f"{'launched in backward':>22}  final = DDP's"]
    for v, s in summary.items():
        lines.append(f"{NAMES[v]:<12}{s['step_ms']:>9.1f}{s['all_reduces']:>13.0f}{s['bytes'] / 1024:>7.0f}"
                     f"{s['exposed_ms']:>12.1f}{s['hidden_ms']:>11.1f}{s['launched_before_backward_end']:>22.0f}  "
                     f"{s['same_as_ddp']}")
    return "\n".join(lines)


def timeline(run: Run, version: str, step: int = -1) -> Dict[int, dict]:
    """rank -> one step's events, in ms from that rank's forward start: backward, each gradient ready, each
    all-reduce (launch, done), the wait after backward."""
    out = {}
    for rank, recs in _records(run, "overlap").items():
        for rec in recs:
            if rec["version"] != version:
                continue
            s = rec["steps"][step]
            t0 = s["forward"]
            ms = lambda t: 1e3 * (t - t0)  # noqa: E731
            out[rank] = {"backward": (ms(s["backward"]), ms(max(s["ready"]))), "ready": [ms(t) for t in s["ready"]],
                         "all_reduces": [(ms(a), ms(b)) for a, b, _ in s["all_reduces"]],
                         "synced": ms(s["synced"]), "step_end": ms(s["step_end"])}
    return out


def find_unused_cost(run: Run) -> Dict[str, float]:
    """DDP's step time (median ms, both ranks) with find_unused_parameters False and True, every parameter used."""
    finals = [r for recs in _records(run, "overlap_final").values() for r in recs]
    return {key: 1e3 * statistics.median(t for f in finals for t in f["find_unused_step_s"][key])
            for key in ("False", "True")}


# -- 6. Cases ----------------------------------------------------------------------
def cases(run: Run) -> dict:
    """no_sync: all-reduces per micro-step and the final parameters against DDP's; find_unused on a branch."""
    recs = [r for recs in _records(run, "cases").values() for r in recs]
    rank0 = next(r for r in recs if r["rank"] == 0)
    ddp = rank0["no_sync"]["ddp"]["final"]
    return {"k": rank0["k"],
            "no_sync": {v: {"all_reduces": o["all_reduces_per_micro_step"], "max_diff": max_diff(o["final"], ddp)}
                        for v, o in rank0["no_sync"].items()},
            "find_unused_ranks_agree": len({r["find_unused_digest"] for r in recs}) == 1,
            "find_unused_steps": rank0["find_unused_steps"]}


#: Seconds more a deadline gives ranks that start cold: each imports torch and torch._dynamo (about
#: 3.5 CPU-s per rank, two ranks on two busy cores).
COLD_START_S = 25.0


def unused_parameter_hang(timeout: float = 5.0) -> dict:
    """BucketDDP on 2 ranks where only rank 0 takes a branch: launched with a short deadline, it times out.

    Returns:
        ``error`` (the LaunchTimeout's first line), ``deadline`` (s), ``stacks`` and ``waiting_in`` per rank (from the
        LaunchTimeout), ``reports`` per rank (took the branch, gradients it got of how many parameters),
        ``seconds``. Raises AssertionError if the launch did not time out.
    """
    # The deadline counts from the launch: with torch imported by the forkserver first, it
    # measures the hang, not an import that a busy machine or a slow torch stretches. Cold ranks
    # (macOS's default) import torch and torch._dynamo first: their deadline covers that too.
    deadline = timeout if warm_ready() else timeout + COLD_START_S
    t0 = time.monotonic()
    try:
        launch(SCRIPT, 2, ["--parts", "hang"], timeout=deadline, echo="none")
    except LaunchTimeout as err:
        return {"error": str(err).splitlines()[0], "deadline": deadline, "stacks": err.stacks,
                "waiting_in": err.waiting_in,
                "still_running": sorted(err.still_running), "seconds": time.monotonic() - t0,
                "reports": {r: (err.run.results(r) or [None])[-1] for r in range(2)} if err.run else {}}
    raise AssertionError("the hang launch finished: the hand-made DDP did not wait")


def innermost(stack: str, frames: int = 2) -> str:
    """The ``frames`` most recent lines of a LaunchTimeout stack (most recent call first)."""
    return "\n".join(stack.splitlines()[:frames])
