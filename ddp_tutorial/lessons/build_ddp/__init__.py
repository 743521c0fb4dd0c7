"""Notebook helpers of lesson 11: DistributedDataParallel built by hand, measured against torch's.

One launch of ``workers/build_ddp_lab.py`` (4 ranks) measures every version of
``workers/my_ddps.py`` beside torch's DDP on the same models and batches; a
second, short one shows the hand-made DDP on a parameter that got no gradient:
one rank's all-reduce fails at the group's timeout, the other waits for ever
until ``launch``'s deadline. The helpers here (and the overlap part's in
``overlap.py``, gathered into this package's names) turn the records into the
tables the notebook prints, plots and asserts. No torch is imported here.

    lab = run_lab()                         # construct, exact, overlap, cases: one launch
    print(format_exactness(exactness(lab)))
    hang = unused_parameter_hang()          # rank 0's error, rank 1's stack at the deadline
"""

from __future__ import annotations

import statistics
import textwrap
import time
from typing import Dict, List

from ddp_tutorial.launcher import LaunchTimeout, warm_ready, launch, worker_script
from ddp_tutorial.lessons import rank_results as part_records, script_source
from ddp_tutorial.lessons.build_ddp.overlap import (  # noqa: F401
    NAMES, VERSIONS, _step_numbers, busy, cap25_buckets, ddp_overlap, describe_overlap, fastest,
    find_unused_cost, format_side_by_side, overlap_summary, timeline)
from ddp_tutorial.lessons.table import text_table
from ddp_tutorial.runfolder import Run

SCRIPT = worker_script(__file__, "build_ddp_lab.py")
VERSIONS_SCRIPT = worker_script(__file__, "my_ddps.py")
PARTS = ("construct", "exact", "overlap", "cases")
#: The toy model's trainable tensors (fc1 weight and bias, fc2 weight = fc3 weight, fc3 bias, out weight and
#: bias) and their bytes; fc2's frozen bias and the requires_grad=False ``fixed`` are not among them.
TRAINABLE_TENSORS, TRAINABLE_BYTES = 6, 2132
#: The timing model's simulated GPU kernel: the backward of each of its 3 hidden layers waits this long (ms),
#: as ``workers/build_ddp_lab.py``'s KERNEL_MS.
KERNEL_MS = 10.0


def show(*names: str) -> None:
    """Print the source of classes or functions of ``my_ddps.py`` (read, not imported)."""
    print("\n\n".join(script_source(VERSIONS_SCRIPT, name) for name in names))


def run_lab(world_size: int = 4, steps: int = 5, timeout: float = 120.0, progress: bool = True,
            **launch_kwargs) -> Run:
    """Launch ``build_ddp_lab.py`` (construct, exact, overlap, cases) on ``world_size`` ranks (gloo, CPU).

    ``exact`` runs ``steps`` SGD steps at W = 2, 3 and 4, in groups of ranks 0..W-1 (those up to
    ``world_size``); ``progress`` prints each part as rank 0 finishes it, and the launch's time.
    """
    t0 = time.monotonic()
    run = launch(SCRIPT, world_size, ["--parts", ",".join(PARTS), "--steps", str(steps)], timeout=timeout,
                 echo="rank0" if progress else "none", **launch_kwargs)
    if progress:
        print(f"the lab took {time.monotonic() - t0:.1f} s")
    return run


def max_diff(a: List[float], b: List[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b)) if len(a) == len(b) else float("inf")


# -- 1. Broadcast at construction ------------------------------------------------
def construction(run: Run) -> Dict[str, dict]:
    """Per version: did every rank start different and end with rank 0's weights; broadcasts it made."""
    out: Dict[str, dict] = {}
    for rank, recs in part_records(run, "construct").items():
        for rec in recs:
            row = out.setdefault(rec["version"], {"distinct_before": set(), "after": set(), "rank0": rec["rank0_built"],
                                                  "broadcasts": set()})
            row["distinct_before"].add(rec["before"])
            row["after"].add(rec["after"])
            row["broadcasts"].add(rec["broadcasts"])
    return {v: {"ranks_differed_before": len(r["distinct_before"]) == run.world_size,
                "all_equal_rank0_after": r["after"] == {r["rank0"]},
                "broadcasts": sorted(r["broadcasts"])} for v, r in out.items()}


def buffers(run: Run) -> Dict[str, dict]:
    """Per version: the buffer each rank set after construction (rank + 1), and the value its next forward saw."""
    out: Dict[str, dict] = {}
    for rank, recs in part_records(run, "buffers").items():
        for rec in recs:
            row = out.setdefault(rec["version"], {"set": [], "seen": []})
            row["set"].append(rec["set"])
            row["seen"].append(rec["seen"])
    return out


# -- 2./3./5. Exactness, all-reduces, buckets -----------------------------------------
def _exact(run: Run) -> Dict[int, Dict[int, dict]]:
    """world size -> rank -> its ``exact`` record."""
    out: Dict[int, Dict[int, dict]] = {}
    for rank, recs in part_records(run, "exact").items():
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
                  # torch's DDP without a comm hook (x * (1/W) into the bucket) against DDP with allreduce_hook
                  "ddp_default": {"max_diff": max_diff(finals["ddp_default"], finals["ddp"]),
                                  "bit_identical": finals["ddp_default"] == finals["ddp"],
                                  # the first step's averaged gradients: the share of elements that differ
                                  "grads_differ": _share_differing(rank0["first_grads"]["ddp_default"],
                                                                   rank0["first_grads"]["ddp"])},
                  "ddp_vs_float64": max_diff(finals["ddp"], rank0["float64"]),
                  "ranks_agree": all(r["finals"] == finals for r in ranks.values()),
                  "has_grad": rank0["has_grad"], "steps": len(rank0["steps"]["ddp"])}
    return out


def _share_differing(a: List[float], b: List[float]) -> float:
    return sum(x != y for x, y in zip(a, b)) / len(a)


def format_exactness(table: Dict[int, dict]) -> str:
    """One row per W: each version (and DDP's default path) against DDP with allreduce_hook."""
    def cell(c):
        return "identical" if c["bit_identical"] else f"{c['max_diff']:.1e}"
    header = ["W", *(NAMES[v] for v in (*VERSIONS, "ddp_default")),
              "float32 rounding (DDP vs float64)"]
    return text_table(header,
                      [(w, *map(cell, row["versions"].values()), cell(row["ddp_default"]),
                        f"{row['ddp_vs_float64']:.1e}") for w, row in sorted(table.items())])


def allreduces_per_step(run: Run, world_size: int = 4) -> Dict[str, dict]:
    """Per version (and DDP): all-reduce calls and bytes in one step (the first), at ``world_size``."""
    return {v: s[0] for v, s in _exact(run)[world_size][0]["steps"].items() if v != "ddp_default"}  # C++: unseen


def buckets(run: Run, world_size: int = 4) -> Dict[int, dict]:
    """BucketDDP for the three caps: the buckets (parameter names) and the all-reduces of a step."""
    return {int(n): {"cap_bytes": round(b["cap_mb"] * 2**20), "buckets": b["buckets"],
                     "all_reduces": b["per_step"][0]["all_reduces"], "bytes": b["per_step"][0]["bytes"]}
            for n, b in _exact(run)[world_size][0]["buckets"].items()}


def small_allreduce_ms(run: Run) -> float:
    """Median time of one of NaiveDDP's blocking all-reduces at W = 2 (the toy model's gradients, 20 to 1,024
    bytes each, steps 2 on, both ranks): what one small all-reduce costs on this machine, in ms."""
    times = [t for r in _exact(run)[2].values() for step in r["steps"]["naive"][1:] for t in step["seconds"]]
    return 1e3 * statistics.median(times)


def ddp_buckets(run: Run) -> Dict[int, dict]:
    """torch's DDP at the same three caps (W = 2, rank 0): per iteration the buckets its comm hook was handed,
    in launch order (``index``, parameter names, bytes), and the order the gradients became ready."""
    out = {}
    for n, b in _exact(run)[2][0]["buckets"].items():
        its = b["ddp"]["iterations"]
        out[int(n)] = {"cap_bytes": round(b["cap_mb"] * 2**20),
                       "iterations": [{"buckets": [x["params"] for x in it["launched"]],
                                       "bytes": [x["bytes"] for x in it["launched"]],
                                       "launch_order": [x["index"] for x in it["launched"]],
                                       "ready": it["ready"]} for it in its],
                       "rebuilt_bucket_sizes": b["ddp"]["rebuilt_bucket_sizes"]}
    return out


def format_ddp_buckets(table: Dict[int, dict], bucket_ddp: Dict[int, dict]) -> str:
    """Per cap: BucketDDP's buckets (every step), then DDP's per iteration (bytes, and the parameters)."""
    lines = []
    for n, row in table.items():
        mine = bucket_ddp[n]
        lines.append(f"cap {row['cap_bytes']:,} bytes  BucketDDP, every step: {len(mine['buckets'])} "
                     f"bucket(s) {mine['buckets']}")
        for i, it in enumerate(row["iterations"], 1):
            sizes = " + ".join(f"{b:,} B" for b in it["bytes"])
            lines.append(f"{'':<22}torch DDP, iteration {i}: {len(it['buckets'])} bucket(s) ({sizes}) {it['buckets']}")
    return "\n".join(lines)


def fill_buckets(sizes: List[int], cap: int, closes_at_cap: bool) -> List[int]:
    """Bucket sizes from filling gradients of ``sizes`` bytes in order, by one of the two rules: DDP's (a bucket
    closes once it reaches the cap: reducer.cpp ``compute_bucket_assignment_by_size``, ``bucket.size >=
    bucket_size_limit``) or BucketDDP's (a new bucket starts when the next gradient would pass the cap)."""
    out, size = [], 0
    for nbytes in sizes:
        if not closes_at_cap and size and size + nbytes > cap:
            out.append(size)
            size = 0
        size += nbytes
        if closes_at_cap and size >= cap:
            out.append(size)
            size = 0
    return out + ([size] if size else [])


# -- 6. Cases ----------------------------------------------------------------------
def cases(run: Run) -> dict:
    """no_sync: all-reduces per micro-step and the final parameters against DDP's; find_unused on a branch."""
    recs = [r for recs in part_records(run, "cases").values() for r in recs]
    rank0 = next(r for r in recs if r["rank"] == 0)
    ddp = rank0["no_sync"]["ddp"]["final"]
    return {"k": rank0["k"],
            "no_sync": {v: {"all_reduces": o["all_reduces_per_micro_step"], "max_diff": max_diff(o["final"], ddp)}
                        for v, o in rank0["no_sync"].items()},
            "find_unused_ranks_agree": len({r["find_unused_digest"] for r in recs}) == 1,
            "find_unused_steps": rank0["find_unused_steps"], "no_sync_placement": rank0["no_sync_placement"]}


#: Seconds more a deadline gives ranks that start cold: each imports torch and torch._dynamo (about
#: 3.5 CPU-s per rank, two ranks on two busy cores).
COLD_START_S = 25.0


def unused_parameter_hang(pg_timeout: float = 2.0, timeout: float = 5.0) -> dict:
    """BucketDDP on 2 ranks where only rank 0 takes a branch, under a process-group timeout ``pg_timeout`` and a
    launch deadline ``timeout``: rank 0's all-reduce fails at the group's timeout (the lab notes the error and
    ends rank 0), rank 1 still waits when the deadline passes.

    Returns:
        ``error`` (the LaunchTimeout's first line), ``deadline`` and ``pg_timeout`` (s), ``stacks`` and
        ``waiting_in`` of the ranks still running, ``still_running``, ``reports`` per rank (took the branch,
        gradients it got of how many parameters, and rank 0's ``error`` with ``error_after_s``), ``seconds``.
        Raises AssertionError if the launch did not time out.
    """
    # The deadline counts from the launch: with torch imported by the forkserver first, it
    # measures the hang, not an import that a busy machine or a slow torch stretches. Cold ranks
    # (macOS's default) import torch and torch._dynamo first, and meet in init_process_group, whose
    # wait the group's timeout also bounds: their timeout and deadline cover the imports too.
    if not warm_ready():
        pg_timeout, timeout = pg_timeout + COLD_START_S / 2, timeout + COLD_START_S
    t0 = time.monotonic()
    try:
        launch(SCRIPT, 2, ["--parts", "hang", "--pg-timeout", str(pg_timeout)], timeout=timeout, echo="none")
    except LaunchTimeout as err:
        return {"error": str(err).splitlines()[0], "deadline": timeout, "pg_timeout": pg_timeout,
                "stacks": err.stacks, "waiting_in": err.waiting_in,
                "still_running": sorted(err.still_running), "seconds": time.monotonic() - t0,
                "reports": {r: (err.run.results(r) or [None])[-1] for r in range(2)} if err.run else {}}
    raise AssertionError("the hang launch finished: the hand-made DDP did not wait")


def wrapped_lines(text: str, width: int = 110) -> List[str]:
    """``text`` cut into lines of at most ``width`` characters at spaces (no word cut in two)."""
    return textwrap.wrap(text, width) or [""]


def innermost(stack: str, frames: int = 2) -> str:
    """The ``frames`` most recent lines of a LaunchTimeout stack (most recent call first)."""
    return "\n".join(stack.splitlines()[:frames])
