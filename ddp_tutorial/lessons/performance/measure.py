"""The performance lab's measurements (notebook 07, the bench), each one launch of a probe in
``workers/`` (no torch here), and what each says in words."""

from __future__ import annotations

import statistics
from typing import Dict, List, Sequence

from ddp_tutorial.backend import gpu_count
from ddp_tutorial.launcher import launch
from ddp_tutorial.lessons.worker_scripts import worker_script
from ddp_tutorial.lessons.performance.costmodel import (
    GB, KB, MB, NCCL_CLASS_ALPHA_S, PAPER_LIKE_JOB, PROJECTION_ASSUMPTIONS, busbw, efficiency_at,
    fit_alpha_beta, projection_grid, ring_time, sweep_table)

CROSSCHECK_BYTES = 16 * MB
#: The probe of DDP itself (buckets, overlap, skipped syncs); notebook 07 shows parts of its code.
DDP_SCRIPT = worker_script(__file__, "perf_ddp.py")


def allreduce_sweep(world_sizes: Sequence[int] = (2, 4), quick: bool = False,
                    backend: str = "gloo") -> Dict:
    """All-reduce latency over sizes, a launch per world size: ``table`` (with algbw and busbw),
    the α-β ``fit`` (also ``fit_by_world_size``), a plain copy's rate, on GPUs CUDA events."""
    samples, cuda_samples, ceilings, backends, memcpy = [], [], [], set(), []
    for world_size in world_sizes:
        run = launch(worker_script(__file__, "perf_allreduce.py"), world_size,
                     ["--quick"] * quick + ["--backend", backend], timeout=300, echo="rank0")
        samples += run.result(0, "sweep")
        cuda_samples += run.result(0, "cuda_sweep")
        ceilings.append(run.result(0, "memcpy_Bps"))
        memcpy = run.result(0, "memcpy_by_size")
        backends.add(run.result(0, "backend"))
    return {"samples": samples, "table": sweep_table(samples), "fit": fit_alpha_beta(samples),
            "memcpy_Bps": max(ceilings), "memcpy_by_size": memcpy,
            "backend": "/".join(sorted(backends)), "world_sizes": list(world_sizes),
            # One fit per world size too: with more ranks than cores, the latency of
            # small messages is the OS scheduler's, which no ring model describes.
            "fit_by_world_size": {w: fit_alpha_beta([s for s in samples if s["world_size"] == w])
                                  for w in world_sizes},
            "cuda_samples": cuda_samples, **({"cuda_fit": fit_alpha_beta(cuda_samples)}
                                             if cuda_samples else {})}


def plain_crosscheck(sweep: Dict) -> Dict:
    """A bare all-reduce loop at 16 MB on 2 ranks, launched alone, against the sweep and the fit."""
    run = launch(worker_script(__file__, "perf_plain_allreduce.py"), 2, [str(CROSSCHECK_BYTES)],
                 timeout=120, echo="none", env={"CUDA_VISIBLE_DEVICES": ""})  # gloo, as the sweep
    plain_s = run.result(0, "seconds")
    sweep_s = next(s["seconds"] for s in sweep["samples"]
                   if s["world_size"] == 2 and s["bytes"] == CROSSCHECK_BYTES)
    fit_s = ring_time(CROSSCHECK_BYTES, 2, sweep["fit"]["alpha_s"], sweep["fit"]["bandwidth"])
    return {"world_size": 2, "plain_s": plain_s, "sweep_s": sweep_s, "fit_s": fit_s,
            **{f"{name}_gap": abs(t - plain_s) / plain_s for name, t in (("sweep", sweep_s),
                                                                          ("fit", fit_s))}}


def ddp_lab(world_size: int = 2, quick: bool = False, sections: Sequence[str] = (),
            backend: str = "gloo", steps: int = 0) -> Dict:
    """What ``workers/perf_ddp.py`` reports, in one launch (its docstring names the keys);
    ``steps`` per setting (0: the script's default)."""
    args = ["--quick"] * quick + ["--backend", backend] + ["--sections", *sections] * bool(sections)
    args += ["--steps", str(steps)] * bool(steps)
    return launch(DDP_SCRIPT, world_size, args, timeout=300, echo="rank0").results(0)[-1]


def projection(sweep: Dict, lab: Dict) -> Dict:
    """The scaling projection of this kit's model (measured) and ``PAPER_LIKE_JOB``, with α fitted
    and NCCL-class, K = 1 and 8; ``key``: the efficiencies at 256 and 1024 workers."""
    kit = {"label": "this kit's model (measured)", "model_bytes": lab["model_bytes"],
           "compute_s_per_sample": lab["compute"]["s_per_sample"],
           "batch_per_worker": lab["compute"]["batch_size"]}
    alphas = {"fitted": sweep["fit"]["alpha_s"], "NCCL-class": NCCL_CLASS_ALPHA_S}
    rows = [row for name, alpha in alphas.items() for job in (kit, PAPER_LIKE_JOB)
            for row in projection_grid(alpha_s=alpha, accum_steps=(1, 8), alpha_label=name, **job)]
    key = [{"job": job["label"], "alpha": name, "accum_steps": k,
            **{f"{gbps}GBps@{p}": efficiency_at(rows, p, label=job["label"], alpha_label=name,
                                                bandwidth_GBps=gbps, accum_steps=k)
               for gbps in (25, 100, 450) for p in (256, 1024)}}
           for name in alphas for job in (kit, PAPER_LIKE_JOB) for k in (1, 8)]
    return {"rows": rows, "key": key, "alpha_s": alphas["fitted"], "alphas": alphas,
            "jobs": [kit, PAPER_LIKE_JOB], "assumptions": PROJECTION_ASSUMPTIONS}


def accumulation_ratios(rows: Sequence[Dict]) -> List[Dict]:
    """Per straggler setting, against K=1: transfer time and bytes all-reduced per sample; 1/K."""
    k1 = {r["straggler_ms"]: r for r in rows if r["accum_steps"] == 1}
    return [{**r, "ideal": 1.0 / r["accum_steps"], **{
        f"{name}_per_sample_vs_k1": r[key] / k1[r["straggler_ms"]][key] for name, key in
        (("comm", "transfer_s_per_sample"), ("bytes", "allreduced_bytes_per_sample"))}}
        for r in rows]


def gpu_part(quick: bool) -> Dict:
    """The sweep and the DDP lab again with nccl on 2 GPUs or more; else skipped, with why."""
    gpus = gpu_count()
    if gpus < 2:
        return {"skipped": f"{gpus} GPU(s) visible: the nccl sweep needs one GPU per "
                           "rank and at least 2 ranks; CPU numbers above are gloo"}
    sweep = allreduce_sweep(tuple(p for p in (2, 4) if p <= gpus), quick=quick, backend="auto")
    lab = ddp_lab(2, quick, ["buckets", "overlap", "fidelity"], backend="auto")
    return {"sweep": sweep, "ddp": lab, "auto_picked": sweep["backend"]}


# -- What each measurement says: every comparison's direction decided by the run described ------
def size(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit it reaches (``16 MiB``)."""
    unit, scale = next(((u, s) for u, s in (("MiB", MB), ("KiB", KB)) if nbytes >= s), ("B", 1))
    return f"{nbytes / scale:g} {unit}"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _above(higher: bool) -> str:
    return "above" if higher else "below"


def describe_sweep(sweep: Dict, world_size: int = 2) -> str:
    """Where busbw peaked, how the largest size compares with the peak, the fit and a plain copy."""
    rows = sorted((r for r in sweep["table"] if r["world_size"] == world_size),
                  key=lambda r: r["bytes"])
    fit, first, last = sweep["fit"], rows[0], rows[-1]
    peak = max(rows, key=lambda r: r["busbw_GBps"])
    top, end, bandwidth = peak["busbw_GBps"], last["busbw_GBps"], fit["bandwidth"] / GB
    lines = [f"busbw rose from {first['busbw_GBps']:.3f} GB/s at {size(first['bytes'])} to its "
             f"peak, {top:.2f} GB/s at {size(peak['bytes'])}" + (
                 " (the largest size)." if peak is last else
                 f", then {'fell' if end < top else 'stayed'} to {end:.2f} GB/s at "
                 f"{size(last['bytes'])}."),
             f"The fitted B is {bandwidth:.2f} GB/s: the peak is {_above(top > bandwidth)} it, the "
             f"largest size {_above(end > bandwidth)} it."]
    model = busbw(last["bytes"], ring_time(last["bytes"], world_size, fit["alpha_s"],
                                           fit["bandwidth"]), world_size) / GB
    lines.append(f"At {size(last['bytes'])} the ring model predicts {model:.2f} GB/s and the sweep "
                 f"measured {end:.2f} GB/s: the point lies {_above(end >= model)} the model's "
                 "line.")
    copies = {m["bytes"]: m["Bps"] / GB for m in sweep.get("memcpy_by_size") or []}
    if peak["bytes"] in copies and last["bytes"] in copies and peak is not last:
        at_peak, at_end = copies[peak["bytes"]], copies[last["bytes"]]
        lines.append(f"A plain copy ran at {at_peak:.1f} GB/s at {size(peak['bytes'])} and "
                     f"{at_end:.1f} GB/s at {size(last['bytes'])}: " + (
                         "the copy slowed down with size too." if at_end < at_peak else
                         "the copy did not slow down with size in this run."))
    return "\n".join(lines)


def describe_buckets(rows: Sequence[Dict], fit: Dict) -> str:
    """All-reduces, CPU and backward's time from the smallest cap to the largest; ``fit``'s
    price of the extra all-reduces."""
    rows = sorted(rows, key=lambda r: r["bucket_cap_mb"])
    small, big = rows[0], rows[-1]
    lines = [f"From {small['allreduce_calls_per_step']:.0f} all-reduces per step at bucket_cap_mb "
             f"{small['bucket_cap_mb']:g} to {big['allreduce_calls_per_step']:.0f} at "
             f"{big['bucket_cap_mb']:g}: " + ", ".join(
                 f"{what} {ms(small[key])} -> {ms(big[key])} ({small[key] / big[key]:.1f}x)"
                 for key, what in (("cpu_s", "CPU time per step"),
                                   ("backward_s", "backward's wall time"))) + "."]
    for key, what in (("cpu_s", "CPU time"), ("backward_s", "Backward's wall time")):
        bumps = "; ".join(f"{b['bucket_cap_mb']:g} ({ms(b[key])}) above {a['bucket_cap_mb']:g} "
                          f"({ms(a[key])})" for a, b in zip(rows, rows[1:]) if b[key] > a[key])
        lines.append(f"{what} did not fall at every step: {bumps}." if bumps else
                     f"{what} fell at every step of the cap.")
    ratio = small["backward_s"] / big["backward_s"]
    extra = small["allreduce_calls_per_step"] - big["allreduce_calls_per_step"]
    latency = extra * ring_time(0, 2, fit["alpha_s"], fit["bandwidth"])
    measured = small["backward_s"] - big["backward_s"]
    lines += [f"The DDP paper reports more than 2x from the bucket size alone; backward's wall "
              f"time here: {ratio:.1f}x, {_above(ratio > 2)} that.",
              f"The ring model prices the {extra:.0f} extra all-reduces at {ms(latency)} of "
              f"latency (2 alpha each); backward measured {ms(measured)} more, "
              f"{'more' if measured > latency else 'less'} than that."]
    return "\n".join(lines)


#: The ways notebook 07 syncs gradients, as its overlap figure names them.
OVERLAP_WAYS = {"ddp": "DDP (buckets, overlapped)", "flat": "one flat all-reduce after backward",
                "per_gradient": "one all-reduce per gradient after backward",
                "none": "no communication"}


def describe_overlap(r: Dict) -> str:
    """What DDP overlapped, which way was fastest, what each cost in CPU time."""
    syncs = ("ddp", "flat", "per_gradient")
    wall = {w: r[f"{w}_step_s"] for w in OVERLAP_WAYS}
    cpu = {w: r[f"{w}_cpu_s"] for w in OVERLAP_WAYS}
    more_cpu = {w: f" ({(cpu[w] - cpu['none']) * 1e3:+.2f} ms)" for w in syncs}
    by_cpu, by_wall = sorted(syncs, key=cpu.get), sorted(syncs, key=wall.get)
    names = lambda order: " < ".join(OVERLAP_WAYS[w].split(" (")[0] for w in order)  # noqa: E731
    return "\n".join([
        f"DDP ran with bucket_cap_mb={r['bucket_cap_mb']:g}: {r['allreduces']} all-reduces per "
        f"step, {r['launched_before_last_gradient']} of them launched before backward had computed "
        f"its last gradient. DDP's logger: {ms(r['avg_backward_compute_comm_overlap_time_s'])} of "
        f"its {ms(r['avg_backward_comm_time_s'])} of communication overlapped backward's "
        "computation.",
        "Wall time per step (median): "
        + ", ".join(f"{OVERLAP_WAYS[w]} {ms(wall[w])}" for w in OVERLAP_WAYS) + ".",
        f"Fastest way to sync here: {OVERLAP_WAYS[by_wall[0]]}. DDP " + (
            f"beat one flat all-reduce ({wall['flat'] / wall['ddp']:.2f}x faster)."
            if wall["ddp"] < wall["flat"] else
            f"lost to one flat all-reduce ({wall['ddp'] / wall['flat']:.2f}x slower)."),
        "CPU time per step, every thread of the rank: " + ", ".join(
            f"{OVERLAP_WAYS[w]} {ms(cpu[w])}{more_cpu.get(w, '')}" for w in OVERLAP_WAYS)
        + f". DDP's {r['allreduces']} all-reduces cost "
        + ("more" if cpu["ddp"] > cpu["flat"] else "less") + " CPU time than one flat one.",
        f"Ranked by CPU time: {names(by_cpu)}; by wall time: {names(by_wall)}: "
        + ("the same order." if by_cpu == by_wall else "a different order."),
        f"DDP's backward (until its last all-reduce was done) took {ms(r['ddp_backward_s'])} of "
        f"wall time, backward without communication {ms(r['none_backward_s'])}: "
        f"{(r['ddp_backward_s'] - r['none_backward_s']) * 1e3:+.2f} ms, against "
        f"{(cpu['ddp'] - cpu['none']) * 1e3:+.2f} ms of CPU time per step.",
        f"{r['ranks']} ranks on {r['cores']} cores: " + (
            "the ranks' compute alone can fill every core, so gloo's threads take their CPU time "
            "from it." if r["ranks"] >= r["cores"] else
            "cores to spare, where gloo's threads can work while backward computes.")])


def by_straggler(rows: Sequence[Dict]) -> Dict[float, List[Dict]]:
    """The accumulation rows of each straggler setting, in the order of K."""
    return {delay: sorted((r for r in rows if r["straggler_ms"] == delay),
                          key=lambda r: r["accum_steps"])
            for delay in sorted({r["straggler_ms"] for r in rows})}


def straggler_setting(straggler_ms: float) -> str:
    return f"random 0-{straggler_ms:g} ms straggler sleeps" if straggler_ms else "no straggler"


def describe_accumulation(rows: Sequence[Dict]) -> str:
    """Bytes and transfer time per sample against K=1 (``accumulation_ratios``), and the wait."""
    lines = []
    for straggler_ms, sel in by_straggler(rows).items():
        rises = ", ".join(f"K={b['accum_steps']}" for a, b in zip(sel, sel[1:])
                          if b["comm_per_sample_vs_k1"] > a["comm_per_sample_vs_k1"])
        transfer, wait = (statistics.median(r[f"{part}_s_per_optimizer_step"] for r in sel)
                          for part in ("transfer", "wait"))
        lines += [
            straggler_setting(straggler_ms) + ": bytes per sample vs K=1 "
            + ", ".join(f"K={r['accum_steps']} {r['bytes_per_sample_vs_k1']:.3f}" for r in sel)
            + "; transfer time per sample "
            + ", ".join(f"K={r['accum_steps']} {r['comm_per_sample_vs_k1']:.2f}" for r in sel)
            + (f": it rose at {rises}, against the bytes." if rises else ": it fell at every K."),
            f"  per optimizer step (median over K): transfer {ms(transfer)}, wait {ms(wait)}: "
            f"the wait is {'larger' if wait > transfer else 'smaller'} than the transfer."]
    return "\n".join(lines)


def describe_projection(proj: Dict) -> str:
    """The projection's efficiencies behind notebook 07's statements, with the α they used."""
    key = {(p["job"], p["alpha"], p["accum_steps"]): p for p in proj["key"]}
    kit, paper, alphas = proj["jobs"][0]["label"], PAPER_LIKE_JOB["label"], proj["alphas"]
    at256 = [key[(kit, "fitted", 1)][f"{g}GBps@256"] for g in (25, 100, 450)]
    nccl = key[(paper, "NCCL-class", 1)]
    lifts = [key[(job, alpha, 8)][k] - key[(job, alpha, 1)][k]
             for (job, alpha, k8) in key if k8 == 8 for k in key[(job, alpha, 8)] if "@" in k]
    return "\n".join([
        f"alpha fitted here: {alphas['fitted'] * 1e6:.0f} us per message, "
        f"{alphas['fitted'] / alphas['NCCL-class']:.0f}x the NCCL-class "
        f"{alphas['NCCL-class'] * 1e6:.0f} us.",
        f"{kit}, fitted alpha, K=1: {min(at256):.0%}-{max(at256):.0%} at 256 workers over 25-450 "
        f"GB/s (the bandwidth moves it by {(max(at256) - min(at256)) * 100:.0f} points).",
        f"{paper}, NCCL-class alpha, 25 GB/s, K=1: {nccl['25GBps@256']:.0%} at 256 workers, "
        f"{nccl['25GBps@1024']:.0%} at 1024.",
        f"K=8 against K=1: efficiency {'higher' if min(lifts) > 0 else 'not higher'} in every "
        f"case, by {min(lifts) * 100:.0f} to {max(lifts) * 100:.0f} points."])


def describe_overhead(over: Dict, target: float = 0.05) -> str:
    """The instrumented/plain step ratio against the bench's ``target``."""
    ratio, steps = 1 + over["overhead"], over["steps"]
    text = (f"instrumented / plain DDP, median single step over {steps} steps each, taking turns: "
            f"{ratio:.3f}. ")
    noise = (f"{steps} steps per variant on a shared machine cannot resolve a few percent (the "
             "bench's full run can).")
    if ratio < 1:
        return text + (f"The instrumented steps were {1 - ratio:.0%} faster; instrumentation "
                       f"only adds work, so this is noise: {noise}")
    if ratio - 1 <= target:
        return text + f"Within the bench's {target:.0%} target."
    return text + f"Above the bench's {target:.0%} target; {noise}"
