"""Notebook 11's helpers: the lab measures the hand-made DDPs of ``workers/my_ddps.py`` beside
torch's, a second launch shows BucketDDP hanging on a parameter that got no gradient. No torch."""

from __future__ import annotations

import statistics
import time
from typing import Dict, List

from ddp_tutorial.exercises.judge.common import max_difference as max_diff
from ddp_tutorial.launcher import LaunchTimeout, warm_ready, launch
from ddp_tutorial.lessons.worker_scripts import worker_script
from ddp_tutorial.lessons import rank_results as part_records, script_source
from ddp_tutorial.lessons.build_ddp.my_ddp_buckets import fill_at_most, fill_reaching  # noqa: F401
from ddp_tutorial.lessons.build_ddp.overlap import (  # noqa: F401
    NAMES, VERSIONS, _step_numbers, busy, cap25_buckets, ddp_overlap, describe_overlap,
    find_unused_cost, format_side_by_side, overlap_summary, records, timeline)
from ddp_tutorial.lessons.table import text_table
from ddp_tutorial.runfolder import Run

SCRIPT = worker_script(__file__, "build_ddp_lab.py")
VERSIONS_SCRIPT = worker_script(__file__, "my_ddps.py")
#: The toy model's trainable tensors and their bytes (fc2's bias and ``fixed`` are not trainable).
TRAINABLE_TENSORS, TRAINABLE_BYTES = 6, 2132
#: The timing model's simulated GPU kernel per hidden layer (ms): the lab's KERNEL_MS.
KERNEL_MS = 10.0


def show(*names: str) -> None:
    """Print the source of classes or functions of ``my_ddps.py`` (read, not imported)."""
    print("\n\n".join(script_source(VERSIONS_SCRIPT, name) for name in names))


def run_lab(world_size: int = 4, steps: int = 5, timeout: float = 120.0, progress: bool = True,
            **launch_kwargs) -> Run:
    """The lab but the hang on ``world_size`` ranks (``steps`` SGD steps at each W from 2 up);
    ``progress`` echoes rank 0's."""
    t0 = time.monotonic()
    run = launch(SCRIPT, world_size, ["--steps", str(steps)], timeout=timeout,
                 echo="rank0" if progress else "none", **launch_kwargs)
    if progress:
        print(f"the lab took {time.monotonic() - t0:.1f} s")
    return run


# -- 1. Broadcast at construction ------------------------------------------------
def _by_version(run: Run, part: str) -> Dict[str, List[dict]]:
    out: Dict[str, List[dict]] = {}
    for rec in records(run, part):
        out.setdefault(rec["version"], []).append(rec)
    return out


def construction(run: Run) -> Dict[str, dict]:
    """Per version: did the ranks start different and end with rank 0's weights; broadcasts made."""
    return {v: {"ranks_differed_before": len({r["before"] for r in recs}) == run.world_size,
                "all_equal_rank0_after": {r["after"] for r in recs} == {recs[0]["rank0_built"]},
                "broadcasts": sorted({r["broadcasts"] for r in recs})}
            for v, recs in _by_version(run, "construct").items()}


def buffers(run: Run) -> Dict[str, dict]:
    """Per version: the buffer each rank set after construction, and what its next forward saw."""
    return {v: {"set": [r["set"] for r in recs], "seen": [r["seen"] for r in recs]}
            for v, recs in _by_version(run, "buffers").items()}


# -- 2./3./5. Exactness, all-reduces, buckets -----------------------------------------
def _exact(run: Run) -> Dict[int, Dict[int, dict]]:
    """world size -> rank -> its ``exact`` record."""
    out: Dict[int, Dict[int, dict]] = {}
    for rank, recs in part_records(run, "exact").items():
        for rec in recs:
            out.setdefault(rec["world_size"], {})[rank] = rec
    return out


def exactness(run: Run) -> Dict[int, dict]:
    """Per W: each version's largest difference from torch's DDP, whether bit-identical, and
    float32's own rounding there (DDP against one float64 process)."""
    out = {}
    for w, ranks in _exact(run).items():
        rank0 = ranks[0]
        finals, first = rank0["finals"], rank0["first_grads"]

        def against_ddp(v):
            return {"max_diff": max_diff(finals[v], finals["ddp"]),
                    "bit_identical": finals[v] == finals["ddp"]}
        out[w] = {"versions": {v: against_ddp(v) for v in VERSIONS},
                  # DDP without a comm hook (x * (1/W) into the bucket) against allreduce_hook; and the
                  # share of the first step's averaged gradient elements that differ
                  "ddp_default": {**against_ddp("ddp_default"), "grads_differ": sum(
                      x != y for x, y in zip(first["ddp_default"], first["ddp"])) / len(first["ddp"])},
                  "ddp_vs_float64": max_diff(finals["ddp"], rank0["float64"]),
                  "ranks_agree": all(r["finals"] == finals for r in ranks.values()),
                  "has_grad": rank0["has_grad"], "steps": len(rank0["steps"]["ddp"])}
    return out


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
    """Per version (and DDP): all-reduce calls and bytes in the first step, at ``world_size``."""
    steps = _exact(run)[world_size][0]["steps"]
    return {v: s[0] for v, s in steps.items() if v != "ddp_default"}  # its C++ path is unseen


def buckets(run: Run, world_size: int = 4) -> Dict[int, dict]:
    """BucketDDP for the three caps: the buckets (parameter names) and the all-reduces of a step."""
    return {int(n): {"cap_bytes": round(b["cap_mb"] * 2**20), "buckets": b["buckets"],
                     "all_reduces": b["per_step"][0]["all_reduces"], "bytes": b["per_step"][0]["bytes"]}
            for n, b in _exact(run)[world_size][0]["buckets"].items()}


def small_allreduce_ms(run: Run) -> float:
    """Median ms of one of NaiveDDP's blocking all-reduces at W = 2 (steps 2 on, both ranks)."""
    times = [t for r in _exact(run)[2].values() for step in r["steps"]["naive"][1:]
             for t in step["seconds"]]
    return 1e3 * statistics.median(times)


def ddp_buckets(run: Run) -> Dict[int, dict]:
    """torch's DDP at the same three caps (W = 2, rank 0): per iteration the buckets its comm hook
    was handed, in launch order, and the order the gradients became ready."""
    out = {}
    for n, b in _exact(run)[2][0]["buckets"].items():
        out[int(n)] = {"cap_bytes": round(b["cap_mb"] * 2**20),
                       "iterations": [{"buckets": [x["params"] for x in it["launched"]],
                                       "bytes": [x["bytes"] for x in it["launched"]],
                                       "launch_order": [x["index"] for x in it["launched"]],
                                       "ready": it["ready"]} for it in b["ddp"]["iterations"]]}
    return out


def format_ddp_buckets(table: Dict[int, dict], bucket_ddp: Dict[int, dict]) -> str:
    """Per cap: BucketDDP's buckets (every step), then DDP's per iteration (bytes, parameters)."""
    lines = []
    for n, row in table.items():
        mine = bucket_ddp[n]
        lines.append(f"cap {row['cap_bytes']:,} bytes  BucketDDP, every step: "
                     f"{len(mine['buckets'])} bucket(s) {mine['buckets']}")
        for i, it in enumerate(row["iterations"], 1):
            sizes = " + ".join(f"{b:,} B" for b in it["bytes"])
            lines.append(f"{'':<22}torch DDP, iteration {i}: {len(it['buckets'])} bucket(s) "
                         f"({sizes}) {it['buckets']}")
    return "\n".join(lines)


# -- 6. Cases ----------------------------------------------------------------------
def cases(run: Run) -> dict:
    """no_sync: all-reduces per micro-step and the parameters against DDP's; find_unused on a branch."""
    recs = records(run, "cases")
    rank0 = next(r for r in recs if r["rank"] == 0)
    ddp = rank0["no_sync"]["ddp"]["final"]
    return {"k": rank0["k"],
            "no_sync": {v: {"all_reduces": o["all_reduces_per_micro_step"],
                            "max_diff": max_diff(o["final"], ddp)}
                        for v, o in rank0["no_sync"].items()},
            "find_unused_ranks_agree": len({r["find_unused_digest"] for r in recs}) == 1,
            "find_unused_steps": rank0["find_unused_steps"],
            "no_sync_placement": rank0["no_sync_placement"]}


#: Seconds more a deadline gives ranks that start cold (each imports torch and torch._dynamo).
COLD_START_S = 25.0


def unused_parameter_hang(pg_timeout: float = 1.0, timeout: float = 3.0) -> dict:
    """BucketDDP on 2 ranks where only rank 0 takes a branch: rank 0's all-reduce fails at the
    group's ``pg_timeout`` (the lab notes it, ends rank 0), rank 1 still waits at the deadline
    ``timeout``. Returns the LaunchTimeout's first line, stacks and each rank's report."""
    # Warm ranks have imported torch, so the deadline measures the hang; cold ones import it first,
    # inside both the deadline and init_process_group's wait (bounded by the group's timeout).
    if not warm_ready():
        pg_timeout, timeout = pg_timeout + COLD_START_S / 2, timeout + COLD_START_S
    t0 = time.monotonic()
    try:
        launch(SCRIPT, 2, ["--parts", "hang", "--pg-timeout", str(pg_timeout)], timeout=timeout,
               echo="none")
    except LaunchTimeout as err:
        return {"error": str(err).splitlines()[0], "deadline": timeout, "pg_timeout": pg_timeout,
                "stacks": err.stacks, "waiting_in": err.waiting_in,
                "still_running": sorted(err.still_running), "seconds": time.monotonic() - t0,
                "reports": {r: (err.run.results(r) or [None])[-1] for r in range(2)} if err.run else {}}
    raise AssertionError("the hang launch finished: the hand-made DDP did not wait")


def innermost(stack: str, frames: int = 2) -> str:
    """The ``frames`` most recent lines of a LaunchTimeout stack (most recent call first)."""
    return "\n".join(stack.splitlines()[:frames])
