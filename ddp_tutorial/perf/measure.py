"""The performance lab's measurements: what DDP costs on this machine (notebook 07, the bench).

Each measurement is one launch of a probe in ``perf/workers``; the analysis
(the α-β fit, the scaling projection) uses ``perf.costmodel``. This module
imports no torch: the measurements run in worker processes.

    sweep = measure.allreduce_sweep(world_sizes=(2,), quick=True)
    lab = measure.ddp_lab(world_size=2, quick=True)
    proj = measure.projection(sweep, lab)
"""

from __future__ import annotations

import statistics
from typing import Dict, List, Optional, Sequence

from ddp_tutorial.backend import gpu_count
from ddp_tutorial.launcher import launch, worker_script
from ddp_tutorial.perf import costmodel as perf

CROSSCHECK_BYTES = 16 * perf.MB
#: The probe of DDP itself (buckets, overlap, skipped syncs); notebook 07 shows parts of its code.
DDP_SCRIPT = worker_script(__file__, "perf_ddp.py")


def allreduce_sweep(world_sizes: Sequence[int] = (2, 4), quick: bool = False, backend: str = "gloo",
                    timeout: float = 300.0) -> Dict:
    """All-reduce latency over sizes for each world size, with algbw, busbw and the α-β fit.

    Args:
        world_sizes: ranks per sweep (one launch each).
        quick: every 4x in size instead of every 2x, fewer calls.
        backend: ``"gloo"``, ``"nccl"`` or ``"auto"`` (nccl when the workers see CUDA).
        timeout: seconds per launch.

    Returns:
        ``samples`` and ``table`` (one row per world size and size), ``fit`` (α, B, R²),
        ``memcpy_Bps`` (the ceiling), ``memcpy_by_size`` (the copy rate at each size), ``backend``,
        and ``cuda_samples``/``cuda_fit`` on GPUs.
    """
    samples, cuda_samples, ceilings, backends, memcpy = [], [], [], set(), []
    for world_size in world_sizes:
        run = launch(worker_script(__file__, "perf_allreduce.py"), world_size,
                     ["--quick"] * quick + ["--backend", backend], timeout=timeout, echo="rank0")
        samples += run.result(0, "sweep")
        cuda_samples += run.result(0, "cuda_sweep")
        ceilings.append(run.result(0, "memcpy_Bps"))
        memcpy = run.result(0, "memcpy_by_size")
        backends.add(run.result(0, "backend"))
    result = {"samples": samples, "table": perf.sweep_table(samples), "fit": perf.fit_alpha_beta(samples),
              "memcpy_Bps": max(ceilings), "memcpy_by_size": memcpy, "backend": "/".join(sorted(backends)),
              "world_sizes": list(world_sizes), "cuda_samples": cuda_samples,
              # One fit per world size too: with more ranks than cores, the latency of
              # small messages is the OS scheduler's, which no ring model describes.
              "fit_by_world_size": {w: perf.fit_alpha_beta([s for s in samples if s["world_size"] == w])
                                    for w in world_sizes}}
    if cuda_samples:
        result["cuda_fit"] = perf.fit_alpha_beta(cuda_samples)
    return result


def plain_crosscheck(sweep: Dict, world_size: int = 2, backend: str = "gloo", timeout: float = 120.0) -> Dict:
    """A bare all-reduce loop at 16 MB, launched alone, against the sweep's 16 MB point and the fit.

    Returns:
        ``plain_s``, ``sweep_s``, ``fit_s`` and the relative gaps of the last two to the plain loop.
    """
    env = {"CUDA_VISIBLE_DEVICES": ""} if backend == "gloo" else None  # the bare script picks nccl on GPUs
    run = launch(worker_script(__file__, "perf_plain_allreduce.py"), world_size, [str(CROSSCHECK_BYTES)],
                 timeout=timeout, echo="none", env=env)
    plain_s = run.result(0, "seconds")
    sweep_s = next(s["seconds"] for s in sweep["samples"]
                   if s["world_size"] == world_size and s["bytes"] == CROSSCHECK_BYTES)
    fit = sweep["fit"]
    fit_s = perf.ring_time(CROSSCHECK_BYTES, world_size, fit["alpha_s"], fit["bandwidth"])
    return {"world_size": world_size, "plain_s": plain_s, "sweep_s": sweep_s, "fit_s": fit_s,
            "sweep_gap": perf.relative_gap(sweep_s, plain_s), "fit_gap": perf.relative_gap(fit_s, plain_s)}


def ddp_lab(world_size: int = 2, quick: bool = False, sections: Optional[Sequence[str]] = None,
            backend: str = "gloo", timeout: float = 300.0) -> Dict:
    """Buckets, overlap, accumulation, instrumentation overhead and sync-time fidelity: one launch.

    Returns:
        The dict ``perf/workers/perf_ddp.py`` reported (see its docstring for the keys).
    """
    args = ["--quick"] * quick + ["--backend", backend]
    if sections:
        args += ["--sections", *sections]
    run = launch(DDP_SCRIPT, world_size, args, timeout=timeout, echo="rank0")
    return run.results(0)[-1]


def grad_view(world_size: int = 2, steps: int = 8, width: int = 256, timeout: float = 120.0) -> List[Dict]:
    """Where the gradients live with and without ``gradient_as_bucket_view`` (one launch).

    Returns one row per (view, set_to_none): ``grad_storages``, ``buckets``,
    ``grad_bytes``, ``bucket_bytes``, ``grad_bytes_inside_buckets`` and the median ``step_s``.
    """
    run = launch(worker_script(__file__, "perf_grad_view.py"), world_size, ["--steps", str(steps), "--width", str(width)],
                 timeout=timeout, echo="none")
    return run.result(0, "grad_view")


def projection(sweep: Dict, lab: Dict) -> Dict:
    """The scaling projection from the fitted α and the measured compute time per sample.

    Two jobs: this kit's model (measured compute, its gradient bytes) and a
    ResNet-50-like one (``perf.PAPER_LIKE_JOB``, assumed numbers); two values of α
    (fitted here, and NCCL-class); link bandwidths of 25, 100 and 450 GB/s; bucket
    sizes 1 and 25 MB; K = 1 and 8.

    Returns:
        ``rows`` (every projected point), ``key`` (efficiency at 256 and 1024 workers
        per job, α and bandwidth, for 25 MB buckets), ``jobs``, ``alphas``, ``assumptions``.
    """
    kit_job = {"label": "this kit's model (measured)", "model_bytes": lab["model_bytes"],
               "compute_s_per_sample": lab["compute"]["s_per_sample"],
               "batch_per_worker": lab["compute"]["batch_size"]}
    jobs = [kit_job, perf.PAPER_LIKE_JOB]
    alphas = {"fitted": sweep["fit"]["alpha_s"], "NCCL-class": perf.NCCL_CLASS_ALPHA_S}
    rows = []
    for alpha_label, alpha in alphas.items():
        for job in jobs:
            rows += perf.projection_grid(
                alpha_s=alpha, compute_s_per_sample=job["compute_s_per_sample"],
                model_bytes=job["model_bytes"], batch_per_worker=job["batch_per_worker"],
                bucket_mbs=(1.0, 25.0), accum_steps=(1, 8), label=job["label"], alpha_label=alpha_label)
    key = []
    for alpha_label in alphas:
        for job in jobs:
            for k in (1, 8):
                point = {"job": job["label"], "alpha": alpha_label, "accum_steps": k}
                for gbps in (25, 100, 450):
                    for workers in (256, 1024):
                        point[f"{gbps}GBps@{workers}"] = perf.efficiency_at(
                            rows, workers, label=job["label"], alpha_label=alpha_label, bandwidth_GBps=gbps,
                            bucket_mb=25.0, accum_steps=k)
                key.append(point)
    return {"rows": rows, "key": key, "alpha_s": alphas["fitted"], "alphas": alphas, "jobs": jobs,
            "assumptions": perf.PROJECTION_ASSUMPTIONS}


def accumulation_ratios(rows: Sequence[Dict]) -> List[Dict]:
    """For each straggler setting, relative to K=1: transfer time and bytes all-reduced per sample, and 1/K."""
    out = []
    for row in rows:
        base = next(r for r in rows if r["straggler_ms"] == row["straggler_ms"] and r["accum_steps"] == 1)
        out.append({**row, "comm_per_sample_vs_k1": row["transfer_s_per_sample"] / base["transfer_s_per_sample"],
                    "bytes_per_sample_vs_k1": row["allreduced_bytes_per_sample"] / base["allreduced_bytes_per_sample"],
                    "ideal": 1.0 / row["accum_steps"]})
    return out


def gpu_part(quick: bool) -> Dict:
    """The sweep and the DDP lab again with ``backend="auto"`` on GPUs (nccl); the sweep also with CUDA events.

    Skipped, with the reason, where there are fewer than two GPUs: nccl needs one GPU per rank.
    """
    gpus = gpu_count()
    if gpus < 2:
        return {"skipped": f"{gpus} GPU(s) visible: the nccl sweep needs one GPU per "
                           "rank and at least 2 ranks; CPU numbers above are gloo"}
    sweep = allreduce_sweep(tuple(p for p in (2, 4) if p <= gpus), quick=quick, backend="auto")
    lab = ddp_lab(2, quick=quick, sections=["compute", "buckets", "overlap", "fidelity"], backend="auto")
    return {"sweep": sweep, "ddp": lab, "auto_picked": sweep["backend"]}



# -- What each measurement says, in sentences built from its numbers ----------------------------------
# The notebook prints these instead of stating numbers or trends in its text: every comparison's
# direction is decided here, by the run being described.
def _size(nbytes: float) -> str:
    for unit, scale in (("MiB", perf.MB), ("KiB", perf.KB)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def describe_sweep(sweep: Dict, world_size: int = 2) -> str:
    """Where busbw peaked, how the largest size compares with the peak, the fit and a plain copy.

    Args:
        sweep: ``allreduce_sweep``'s result.
        world_size: which world size's rows to describe.
    """
    rows = sorted((r for r in sweep["table"] if r["world_size"] == world_size), key=lambda r: r["bytes"])
    fit, first, last = sweep["fit"], rows[0], rows[-1]
    peak = max(rows, key=lambda r: r["busbw_GBps"])
    bandwidth = fit["bandwidth"] / perf.GB
    lines = [f"busbw rose from {first['busbw_GBps']:.3f} GB/s at {_size(first['bytes'])} to its peak, "
             f"{peak['busbw_GBps']:.2f} GB/s at {_size(peak['bytes'])}"
             + (" (the largest size)." if peak is last else
                f", then {'fell' if last['busbw_GBps'] < peak['busbw_GBps'] else 'stayed'} to "
                f"{last['busbw_GBps']:.2f} GB/s at {_size(last['bytes'])}.")]
    side = lambda busbw: "above" if busbw > bandwidth else "below"
    lines.append(f"The fitted B is {bandwidth:.2f} GB/s: the peak is {side(peak['busbw_GBps'])} it, "
                 f"the largest size {side(last['busbw_GBps'])} it.")
    model = perf.busbw(last["bytes"], perf.ring_time(last["bytes"], world_size, fit["alpha_s"], fit["bandwidth"]),
                       world_size) / perf.GB
    lines.append(f"At {_size(last['bytes'])} the ring model predicts {model:.2f} GB/s and the sweep measured "
                 f"{last['busbw_GBps']:.2f} GB/s: the point lies {'below' if last['busbw_GBps'] < model else 'above'} "
                 f"the model's line.")
    copies = {m["bytes"]: m["Bps"] / perf.GB for m in sweep.get("memcpy_by_size") or []}
    if peak["bytes"] in copies and last["bytes"] in copies and peak is not last:
        slower = copies[last["bytes"]] < copies[peak["bytes"]]
        lines.append(f"A plain copy ran at {copies[peak['bytes']]:.1f} GB/s at {_size(peak['bytes'])} and "
                     f"{copies[last['bytes']]:.1f} GB/s at {_size(last['bytes'])}: "
                     + ("the copy slowed down with size too." if slower else
                        "the copy did not slow down with size in this run."))
    return "\n".join(lines)


def describe_buckets(rows: Sequence[Dict], fit: Optional[Dict] = None) -> str:
    """All-reduces, CPU time and backward's wall time from the smallest cap to the largest.

    Args:
        rows: ``ddp_lab(...)["buckets"]``.
        fit: ``allreduce_sweep(...)["fit"]`` to say what the α-β model predicts for the extra all-reduces.
    """
    rows = sorted(rows, key=lambda r: r["bucket_cap_mb"])
    small, big = rows[0], rows[-1]
    lines = [f"From {small['allreduce_calls_per_step']:.0f} all-reduces per step at bucket_cap_mb "
             f"{small['bucket_cap_mb']:g} to {big['allreduce_calls_per_step']:.0f} at {big['bucket_cap_mb']:g}: "
             f"CPU time per step {_ms(small['cpu_s'])} -> {_ms(big['cpu_s'])} "
             f"({small['cpu_s'] / big['cpu_s']:.1f}x), backward's wall time {_ms(small['backward_s'])} -> "
             f"{_ms(big['backward_s'])} ({small['backward_s'] / big['backward_s']:.1f}x)."]
    for key, what in (("cpu_s", "CPU time"), ("backward_s", "Backward's wall time")):
        bumps = [(a, b) for a, b in zip(rows, rows[1:]) if b[key] > a[key]]
        if bumps:
            lines.append(f"{what} did not fall at every step: " + "; ".join(
                f"{b['bucket_cap_mb']:g} ({_ms(b[key])}) above {a['bucket_cap_mb']:g} ({_ms(a[key])})"
                for a, b in bumps) + ".")
        else:
            lines.append(f"{what} fell at every step of the cap.")
    ratio = small["backward_s"] / big["backward_s"]
    lines.append(f"The DDP paper reports more than 2x from the bucket size alone; backward's wall time here: "
                 f"{ratio:.1f}x, {'above' if ratio > 2 else 'below'} that.")
    if fit is not None:
        extra = small["allreduce_calls_per_step"] - big["allreduce_calls_per_step"]
        latency = extra * perf.ring_time(0, 2, fit["alpha_s"], fit["bandwidth"])
        measured = small["backward_s"] - big["backward_s"]
        lines.append(f"The ring model prices the {extra:.0f} extra all-reduces at {_ms(latency)} of latency "
                     f"(2 alpha each); backward measured {_ms(measured)} more, "
                     f"{'more' if measured > latency else 'less'} than that.")
    return "\n".join(lines)


#: The ways notebook 07 syncs gradients, as its overlap figure names them.
OVERLAP_WAYS = {"ddp": "DDP (buckets, overlapped)", "flat": "one flat all-reduce after backward",
                "per_gradient": "one all-reduce per gradient after backward", "none": "no communication"}


def describe_overlap(result: Dict) -> str:
    """What DDP overlapped, which way was fastest, and what each way cost in CPU time.

    Args:
        result: ``ddp_lab(...)["overlap"]``.
    """
    r = result
    lines = [f"DDP ran with bucket_cap_mb={r['bucket_cap_mb']:g}: {r['allreduces']} all-reduces per step, "
             f"{r['launched_before_last_gradient']} of them launched before backward had computed its last "
             f"gradient. DDP's logger: {_ms(r['avg_backward_compute_comm_overlap_time_s'])} of its "
             f"{_ms(r['avg_backward_comm_time_s'])} of communication overlapped backward's computation."]
    syncs = ("ddp", "flat", "per_gradient")
    wall = {w: r[f"{w}_step_s"] for w in OVERLAP_WAYS}
    cpu = {w: r[f"{w}_cpu_s"] for w in OVERLAP_WAYS}
    lines.append("Wall time per step (median): "
                 + ", ".join(f"{OVERLAP_WAYS[w]} {_ms(wall[w])}" for w in OVERLAP_WAYS) + ".")
    fastest = min(syncs, key=wall.get)
    lines.append(f"Fastest way to sync here: {OVERLAP_WAYS[fastest]}. DDP "
                 + (f"beat one flat all-reduce ({wall['flat'] / wall['ddp']:.2f}x faster)."
                    if wall["ddp"] < wall["flat"] else
                    f"lost to one flat all-reduce ({wall['ddp'] / wall['flat']:.2f}x slower)."))
    lines.append(f"CPU time per step, every thread of the rank: " + ", ".join(
        f"{OVERLAP_WAYS[w]} {_ms(cpu[w])}" + ("" if w == "none" else f" ({(cpu[w] - cpu['none']) * 1e3:+.2f} ms)")
        for w in OVERLAP_WAYS) + f". DDP's {r['allreduces']} all-reduces cost "
        + ("more" if cpu["ddp"] > cpu["flat"] else "less") + " CPU time than one flat one.")
    by_cpu, by_wall = sorted(syncs, key=cpu.get), sorted(syncs, key=wall.get)
    names = lambda order: " < ".join(OVERLAP_WAYS[w].split(" (")[0] for w in order)
    lines.append(f"Ranked by CPU time: {names(by_cpu)}; by wall time: {names(by_wall)}: "
                 + ("the same order." if by_cpu == by_wall else "a different order."))
    more_wall = r["ddp_backward_s"] - r["none_backward_s"]
    lines.append(f"DDP's backward (until its last all-reduce was done) took {_ms(r['ddp_backward_s'])} of wall time, "
                 f"backward without communication {_ms(r['none_backward_s'])}: {more_wall * 1e3:+.2f} ms, against "
                 f"{(cpu['ddp'] - cpu['none']) * 1e3:+.2f} ms of CPU time per step.")
    lines.append(f"{r['ranks']} ranks on {r['cores']} cores: " + (
        "the ranks' compute alone can fill every core, so gloo's threads take their CPU time from it."
        if r["ranks"] >= r["cores"] else
        "cores to spare, where gloo's threads can work while backward computes."))
    return "\n".join(lines)


def describe_accumulation(rows: Sequence[Dict]) -> str:
    """Bytes and transfer time per sample against K=1, and the wait, for each straggler setting.

    Args:
        rows: ``accumulation_ratios(...)``.
    """
    lines = []
    for straggler_ms in sorted({r["straggler_ms"] for r in rows}):
        sel = sorted((r for r in rows if r["straggler_ms"] == straggler_ms), key=lambda r: r["accum_steps"])
        setting = "no straggler" if not straggler_ms else f"random 0-{straggler_ms:g} ms straggler sleeps"
        ratios = [r["comm_per_sample_vs_k1"] for r in sel]
        rises = [b for a, b in zip(sel, sel[1:]) if b["comm_per_sample_vs_k1"] > a["comm_per_sample_vs_k1"]]
        lines.append(f"{setting}: bytes per sample vs K=1 " + ", ".join(
            f"K={r['accum_steps']} {r['bytes_per_sample_vs_k1']:.3f}" for r in sel) + "; transfer time per sample "
            + ", ".join(f"K={r['accum_steps']} {r['comm_per_sample_vs_k1']:.2f}" for r in sel) + ": "
            + ("it fell at every K." if not rises else "it rose at " + ", ".join(f"K={r['accum_steps']}" for r in rises)
               + ", against the bytes."))
        transfer = statistics.median(r["transfer_s_per_optimizer_step"] for r in sel)
        wait = statistics.median(r["wait_s_per_optimizer_step"] for r in sel)
        lines.append(f"  per optimizer step (median over K): transfer {_ms(transfer)}, wait {_ms(wait)}: "
                     f"the wait is {'larger' if wait > transfer else 'smaller'} than the transfer.")
    return "\n".join(lines)


def describe_projection(proj: Dict) -> str:
    """The projection's efficiencies behind notebook 07's three statements, with the α they used."""
    key = {(p["job"], p["alpha"], p["accum_steps"]): p for p in proj["key"]}
    kit, paper = proj["jobs"][0]["label"], perf.PAPER_LIKE_JOB["label"]
    fitted = key[(kit, "fitted", 1)]
    at256 = [fitted[f"{g}GBps@256"] for g in (25, 100, 450)]
    lines = [f"alpha fitted here: {proj['alphas']['fitted'] * 1e6:.0f} us per message, "
             f"{proj['alphas']['fitted'] / proj['alphas']['NCCL-class']:.0f}x the NCCL-class "
             f"{proj['alphas']['NCCL-class'] * 1e6:.0f} us.",
             f"{kit}, fitted alpha, K=1: {min(at256):.0%}-{max(at256):.0%} at 256 workers over 25-450 GB/s "
             f"(the bandwidth moves it by {(max(at256) - min(at256)) * 100:.0f} points)."]
    nccl = key[(paper, "NCCL-class", 1)]
    lines.append(f"{paper}, NCCL-class alpha, 25 GB/s, K=1: {nccl['25GBps@256']:.0%} at 256 workers, "
                 f"{nccl['25GBps@1024']:.0%} at 1024.")
    lifts = [key[(job, alpha, 8)][k] - key[(job, alpha, 1)][k]
             for (job, alpha, k8) in key if k8 == 8 for k in key[(job, alpha, 8)] if "@" in k]
    lines.append(f"K=8 against K=1: efficiency {'higher' if min(lifts) > 0 else 'not higher'} in every case, "
                 f"by {min(lifts) * 100:.0f} to {max(lifts) * 100:.0f} points.")
    return "\n".join(lines)


def describe_overhead(over: Dict, target: float = 0.05) -> str:
    """The instrumented/plain step ratio, and what it can and cannot say."""
    ratio = 1 + over["overhead"]
    text = f"instrumented / plain DDP, median single step over {over['steps']} steps each, taking turns: {ratio:.3f}. "
    if ratio < 1:
        return text + (f"The instrumented steps were {1 - ratio:.0%} faster; instrumentation only adds work, so "
                       f"this is noise: {over['steps']} steps per variant on a shared machine cannot resolve a few "
                       "percent (the bench's full run can).")
    if ratio - 1 <= target:
        return text + f"Within the bench's {target:.0%} target."
    return text + (f"Above the bench's {target:.0%} target; {over['steps']} steps per variant on a shared machine "
                   "cannot judge a few percent: the bench's full run can.")
