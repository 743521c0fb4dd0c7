"""Notebook helpers of lesson 11: DistributedDataParallel built by hand, measured against torch's.

One launch of ``workers/build_ddp_lab.py`` (4 ranks) measures every version of
``workers/my_ddps.py`` beside torch's DDP on the same models and batches; a
second, short one shows the hand-made DDP on a parameter that got no gradient:
one rank's all-reduce fails at the group's timeout, the other waits for ever
until ``launch``'s deadline. The helpers here turn the records into the tables
the notebook prints, plots and asserts. No torch is imported here.

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
from ddp_tutorial.lessons import script_source
from ddp_tutorial.runfolder import Run

SCRIPT = worker_script(__file__, "build_ddp_lab.py")
VERSIONS_SCRIPT = worker_script(__file__, "my_ddps.py")
PARTS = ("construct", "exact", "overlap", "cases")
VERSIONS = ("naive", "flat", "overlap", "bucket")
NAMES = {"naive": "NaiveDDP", "flat": "FlatDDP", "overlap": "OverlapDDP", "bucket": "BucketDDP", "ddp": "torch DDP",
         "ddp_default": "DDP default"}
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

    Args:
        world_size: ranks; ``exact`` runs W = 2, 3 and 4 in groups of ranks 0..W-1 (those up to it).
        steps: SGD steps of ``exact``.
        timeout: seconds before the launch counts as hung.
        progress: print each part as rank 0 finishes it, and the time the launch took.
        **launch_kwargs: passed to ``launch`` (``run_dir``, ``env``, ...).
    """
    t0 = time.monotonic()
    run = launch(SCRIPT, world_size, ["--parts", ",".join(PARTS), "--steps", str(steps)], timeout=timeout,
                 echo="rank0" if progress else "none", **launch_kwargs)
    if progress:
        print(f"the lab took {time.monotonic() - t0:.1f} s")
    return run


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


def buffers(run: Run) -> Dict[str, dict]:
    """Per version: the buffer each rank set after construction (rank + 1), and the value its next forward saw."""
    out: Dict[str, dict] = {}
    for rank, recs in _records(run, "buffers").items():
        for rec in recs:
            row = out.setdefault(rec["version"], {"set": [], "seen": []})
            row["set"].append(rec["set"])
            row["seen"].append(rec["seen"])
    return out


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
        return f"{'identical' if c['bit_identical'] else format(c['max_diff'], '.1e'):>13}"
    lines = [f"{'W':>2}  " + "".join(f"{NAMES[v]:>13}" for v in (*VERSIONS, "ddp_default"))
             + "   float32 rounding (DDP vs float64)"]
    for w, row in sorted(table.items()):
        cells = "".join(cell(c) for c in row["versions"].values()) + cell(row["ddp_default"])
        lines.append(f"{w:>2}  {cells}   {row['ddp_vs_float64']:.1e}")
    return "\n".join(lines)


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
    """One step's times. ``exposed_ms``: from the last gradient to synced, what the step waited for.
    ``in_flight_ms``: time before the last gradient with at least one all-reduce launched and not yet
    completed; it counts an all-reduce from its launch, so also while it waits in gloo's queue behind
    another or for the peer to launch the same one: more than the time spent moving bytes. ``window_ms``:
    DDP's logger's measure of overlap recomputed, the first launch to the last gradient."""
    last_grad, backward = max(step["ready"]), step["backward"]
    ars = step["all_reduces"]
    first_launch = min(a[0] for a in ars)
    return {"exposed_ms": 1e3 * (step["synced"] - last_grad),
            "in_flight_ms": 1e3 * busy([(max(a, backward), min(b, last_grad)) for a, b, _ in ars]),
            "comm_ms": 1e3 * busy([(a, b) for a, b, _ in ars]),
            "launched_before_backward_end": sum(start < last_grad for start, _, _ in ars),
            "bytes_after_backward": sum(b for start, _, b in ars if start >= last_grad),
            "window_ms": 1e3 * max(0.0, last_grad - first_launch),
            "backward_ms": 1e3 * (last_grad - backward),
            "step_ms": 1e3 * (step["step_end"] - step["forward"]),
            "all_reduces": len(ars), "bytes": sum(b for _, _, b in ars)}


def overlap_summary(run: Run) -> Dict[str, dict]:
    """Per version and DDP: medians over the timed steps (the first left out: warm-up, and DDP's one bucket)
    and both ranks, and ``least_exposed_ms``, the least exposed communication of those steps: another process
    on a shared CPU only adds time to a step (a descheduled peer makes every version wait), so the least is the
    version's own cost. For DDP also ``logger``: its own overlap per iteration and its running mean."""
    out: Dict[str, dict] = {}
    for rank, recs in _records(run, "overlap").items():
        for rec in recs:
            row = out.setdefault(rec["version"], {"per_step": [], "logger": {}})
            row["per_step"] += [_step_numbers(s) for s in rec["steps"][1:]]
            if "buckets" in rec:  # BucketDDP: the bytes of each tensor, per bucket
                row["buckets"] = rec["buckets"]
            elif "buckets" in rec["steps"][-1]:  # torch's DDP: (bytes, tensors) per bucket, its last step
                row["buckets"] = rec["steps"][-1]["buckets"]
            if "avg_backward_compute_comm_overlap_time" in rec:
                steps = rec["steps"]
                per_iteration = [s["logger_overlap_ms"] for s in steps if "logger_overlap_ms" in s]
                row["logger"][rank] = {
                    "running_mean_ms": rec["avg_backward_compute_comm_overlap_time"] / 1e6,  # ns -> ms
                    "per_iteration_ms": per_iteration,
                    # the same quantity from this lab's clocks, for the same iterations
                    "window_ms": [_step_numbers(s)["window_ms"] for s in steps[:len(per_iteration)]],
                    "buckets_per_iteration": [len(s["buckets"]) for s in steps]}
    for row in out.values():
        keys = row["per_step"][0].keys()
        row.update({k: statistics.median(s[k] for s in row["per_step"]) for k in keys})
        row["least_exposed_ms"] = min(s["exposed_ms"] for s in row["per_step"])
    finals = [r for recs in _records(run, "overlap_final").values() for r in recs]
    for version in out:
        out[version]["same_as_ddp"] = all(f["digests"][version] == f["digests"]["ddp"] for f in finals)
    return out


def ddp_overlap(summary: Dict[str, dict]) -> dict:
    """DDP's overlap, like with like: its logger per iteration against the lab's clocks for the same
    iterations (2 on, medians of both ranks), iteration 1 alone, and the logger's running mean."""
    logger = summary["ddp"]["logger"]
    later = [v for r in logger.values() for v in r["per_iteration_ms"][1:]]
    ours = [v for r in logger.values() for v in r["window_ms"][1:]]
    return {"logger_ms": statistics.median(later), "clocks_ms": statistics.median(ours),
            "iterations": f"2-{len(next(iter(logger.values()))['per_iteration_ms'])}",
            "iteration1_ms": statistics.median(r["per_iteration_ms"][0] for r in logger.values()),
            "running_mean_ms": statistics.median(r["running_mean_ms"] for r in logger.values()),
            "buckets_per_iteration": next(iter(logger.values()))["buckets_per_iteration"]}


def format_side_by_side(summary: Dict[str, dict]) -> str:
    lines = [f"{'version':<12}{'step ms':>9}{'all-reduces':>13}{'KiB':>7}{'exposed ms':>12}{'in flight ms':>14}"
             f"{'launched in backward':>22}  final = DDP's"]
    for v, s in summary.items():
        lines.append(f"{NAMES[v]:<12}{s['step_ms']:>9.1f}{s['all_reduces']:>13.0f}{s['bytes'] / 1024:>7.0f}"
                     f"{s['exposed_ms']:>12.1f}{s['in_flight_ms']:>14.1f}{s['launched_before_backward_end']:>22.0f}  "
                     f"{s['same_as_ddp']}")
    return "\n".join(lines)


def fastest(summary: Dict[str, dict], key: str = "step_ms") -> List[str]:
    """The versions (and DDP) from the least ``key`` to the most, in this run."""
    return sorted(summary, key=lambda v: summary[v][key])


def describe_overlap(summary: Dict[str, dict]) -> str:
    """What this run's side by side shows, in sentences built from its numbers (so their direction is the run's)."""
    least = {v: s["least_exposed_ms"] for v, s in summary.items()}
    steps = len(summary["flat"]["per_step"])
    flat = least["flat"]
    lines = [f"Exposed communication, least of {steps} steps: "
             + ", ".join(f"{NAMES[v]} {t:.1f} ms" for v, t in least.items()) + "."]
    for v in ("overlap", "bucket", "ddp"):
        s = summary[v]
        lines.append(
            f"{NAMES[v]} waited {'less' if least[v] < flat else 'more'} than FlatDDP after backward "
            f"({least[v]:.1f} against {flat:.1f} ms): it launched {s['launched_before_backward_end']:.0f} of its "
            f"{s['all_reduces']:.0f} all-reduces while backward still had gradients to produce, and left "
            f"{s['bytes_after_backward'] / 1024:.0f} KiB of {s['bytes'] / 1024:.0f} to after the last gradient.")
    ov = summary["overlap"]
    lines.append(
        f"OverlapDDP had an all-reduce in flight for {ov['in_flight_ms']:.1f} ms of backward (median), "
        f"{'more' if ov['in_flight_ms'] > summary['flat']['comm_ms'] else 'less'} than FlatDDP's whole all-reduce "
        f"of the same bytes ({summary['flat']['comm_ms']:.1f} ms): in flight counts each all-reduce from its launch, "
        "so also while it waits in gloo's queue behind the ones launched before it, and for the peer to launch "
        "it too; it is time during which communication could happen, not time spent moving bytes.")
    order = fastest(summary)
    lines.append("Median step times in this run: " + ", ".join(f"{NAMES[v]} {summary[v]['step_ms']:.1f} ms"
                                                                for v in order) + " (fastest first).")
    return "\n".join(textwrap.fill(line, 110) for line in lines)


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


def find_unused_cost(run: Run) -> Dict[str, dict]:
    """DDP on the timing model, every parameter used, with find_unused_parameters False and True: step time
    (median ms, both ranks) and the buckets (bytes, parameters) of its last step."""
    finals = [r for recs in _records(run, "overlap_final").values() for r in recs]
    return {key: {"step_ms": 1e3 * statistics.median(t for f in finals for t in f["find_unused_step_s"][key]),
                  "buckets": finals[0]["find_unused_buckets"][key]} for key in ("False", "True")}


def cap25_buckets(run: Run) -> list:
    """DDP's buckets (bytes, parameters) on the timing model with bucket_cap_mb=25, after its rebuild."""
    return next(r for recs in _records(run, "overlap_final").values() for r in recs)["cap25_buckets"]


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
