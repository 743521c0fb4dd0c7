"""The performance lab from the command line: what DDP costs here, and how fast the kit itself is.

    python -m ddp_tutorial.bench              # full: 2-3 minutes on 2 CPU cores, plus the notebook suite
    python -m ddp_tutorial.bench --quick      # fewer sizes and steps: about 30 s
    python -m ddp_tutorial.bench --out runs/bench
    python -m ddp_tutorial.bench --notebooks 5 --busy-core 2   # only the notebook suite, 5 rounds

It prints one table: the all-reduce sweep and its α-β fit, buckets, overlap,
accumulation, the scaling projection, and the kit's own speed as ratios measured
side by side in the same run. ``--out`` gets ``bench.json`` and the figures.
The notebook ``06_performance_lab.ipynb`` calls the same functions.
This module imports no torch: the measurements run in worker processes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ddp_tutorial import perf, selfcheck
from ddp_tutorial.launcher import launch, scripts_path

CROSSCHECK_BYTES = 16 * perf.MB


def visible_gpus() -> int:
    """GPUs ``nvidia-smi`` lists (0 without it), without importing torch."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


# -- Measurements (each one launch) --------------------------------------------
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
        ``memcpy_Bps`` (the ceiling), ``backend``, and ``cuda_samples``/``cuda_fit`` on GPUs.
    """
    samples, cuda_samples, ceilings, backends = [], [], [], set()
    for world_size in world_sizes:
        run = launch(scripts_path("perf_allreduce.py"), world_size,
                     ["--quick"] * quick + ["--backend", backend], timeout=timeout, echo="rank0")
        samples += run.result(0, "sweep")
        cuda_samples += run.result(0, "cuda_sweep")
        ceilings.append(run.result(0, "memcpy_Bps"))
        backends.add(run.result(0, "backend"))
    result = {"samples": samples, "table": perf.sweep_table(samples), "fit": perf.fit_alpha_beta(samples),
              "memcpy_Bps": max(ceilings), "backend": "/".join(sorted(backends)),
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
    run = launch(scripts_path("perf_plain_allreduce.py"), world_size, [str(CROSSCHECK_BYTES)],
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
        The dict ``scripts/perf_ddp.py`` reported (see its docstring for the keys).
    """
    args = ["--quick"] * quick + ["--backend", backend]
    if sections:
        args += ["--sections", *sections]
    run = launch(scripts_path("perf_ddp.py"), world_size, args, timeout=timeout, echo="rank0")
    return run.results(0)[-1]


def grad_view(world_size: int = 2, steps: int = 8, width: int = 256, timeout: float = 120.0) -> List[Dict]:
    """Where the gradients live with and without ``gradient_as_bucket_view`` (one launch).

    Returns one row per (view, set_to_none): ``grad_storages``, ``buckets``,
    ``grad_bytes``, ``bucket_bytes``, ``grad_bytes_inside_buckets`` and the median ``step_s``.
    """
    run = launch(scripts_path("perf_grad_view.py"), world_size, ["--steps", str(steps), "--width", str(width)],
                 timeout=timeout, echo="none")
    return run.result(0, "grad_view")


def import_torch_seconds(repeats: int = 1) -> float:
    """Wall seconds of ``python -c "import torch"``: what every rank pays before it does anything."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        times.append(time.perf_counter() - t0)
    return perf.median(times)


def launch_phases(run, t0: float, t1: float) -> Dict[str, float]:
    """Split one probe launch (``scripts/perf_launch_probe.py``) into phases, in seconds.

    Args:
        run: the probe's ``Run``; each rank reported wall-clock timestamps.
        t0: ``time.time()`` when ``launch`` was called; t1: when it returned.
    """
    ranks = range(len(run.ranks))
    stamps = {k: [run.result(r, k) for r in ranks] for k in ("started", "imported", "joined", "finished")}
    return {"spawn": min(stamps["started"]) - t0,  # until the first rank runs its first line
            "import_torch": max(stamps["imported"]) - min(stamps["started"]),  # until the last has torch
            "join": max(stamps["joined"]) - max(stamps["imported"]),  # init_process_group after that
            "work": max(stamps["finished"]) - max(stamps["joined"]),  # all_reduce, barrier, destroy
            "exit": t1 - max(stamps["finished"])}  # interpreter teardown, reaping


def launch_speed(repeats: int = 3, world_size: int = 4, timeout: float = 120.0) -> Dict:
    """``launch`` vs ``torchrun --standalone`` on hello.py, alternating, medians of ``repeats`` each.

    Each repeat also launches ``perf_launch_probe.py`` twice, as is and with ranks
    waiting for rank 0's store before init (``--wait-for-store``), to show where the time goes.

    Returns:
        ``launch_s``, ``torchrun_s``, ``ratio`` (target <= 0.75), ``fixed_s`` and
        ``fixed_ratio`` (the probe with the store wait), ``phases`` and ``fixed_phases``
        (``launch_phases`` medians), the ranks' median ``init_s`` under launch,
        ``import_torch_s`` and ``floor_s`` (world_size imports shared by the cores).
    """
    hello, probe = scripts_path("hello.py"), scripts_path("perf_launch_probe.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(world_size), hello]
    times: Dict[str, List[float]] = {"launch": [], "torchrun": [], "probe": [], "fixed": []}
    phases: Dict[str, List[Dict[str, float]]] = {"probe": [], "fixed": []}
    init_s: List[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run = launch(hello, world_size, timeout=timeout, echo="none")
        times["launch"].append(time.perf_counter() - t0)
        init_s += [run.result(r, "init_s") for r in range(world_size)]
        t0 = time.perf_counter()
        subprocess.run(torchrun, check=True, capture_output=True, timeout=timeout,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
        times["torchrun"].append(time.perf_counter() - t0)
        for name, flags in (("probe", []), ("fixed", ["--wait-for-store"])):
            wall0, t0 = time.time(), time.perf_counter()
            run = launch(probe, world_size, flags, timeout=timeout, echo="none")
            times[name].append(time.perf_counter() - t0)
            phases[name].append(launch_phases(run, wall0, time.time()))
    import_s = import_torch_seconds()
    cores = os.cpu_count() or 1
    med = {name: perf.median(values) for name, values in times.items()}
    return {"launch_s": med["launch"], "torchrun_s": med["torchrun"], "ratio": med["launch"] / med["torchrun"],
            "probe_s": med["probe"], "fixed_s": med["fixed"], "fixed_ratio": med["fixed"] / med["torchrun"],
            "phases": {k: perf.median([p[k] for p in phases["probe"]]) for k in phases["probe"][0]},
            "fixed_phases": {k: perf.median([p[k] for p in phases["fixed"]]) for k in phases["fixed"][0]},
            "init_s": perf.median(init_s), "import_torch_s": import_s,
            "floor_s": world_size * import_s / min(cores, world_size), "cores": cores,
            "world_size": world_size, "repeats": repeats}


def notebook_suite(folder: str = "notebooks", timeout: float = 600.0) -> Dict:
    """Wall seconds of one ``pytest --nbmake`` round over ``folder`` (target: under 180 s on 2 cores)."""
    notebooks = sorted(Path(folder).glob("*.ipynb"))
    if not notebooks:
        return {"skipped": f"no notebooks in {folder!r}"}
    t0 = time.perf_counter()
    results = selfcheck.notebook_round(notebooks, timeout)
    seconds = time.perf_counter() - t0
    failed = [name for name, r in results.items() if not r["passed"]]
    return {"seconds": seconds, "ratio": seconds / 180.0, "notebooks": [n.name for n in notebooks],
            "passed": not failed, "failed": failed,
            "summary": f"{len(results) - len(failed)} of {len(results)} notebooks passed"}


# -- Analysis -------------------------------------------------------------------
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
    """For each straggler setting: transfer time per sample relative to K=1, next to the ideal 1/K."""
    out = []
    for row in rows:
        base = next(r for r in rows if r["straggler_ms"] == row["straggler_ms"] and r["accum_steps"] == 1)
        out.append({**row, "comm_per_sample_vs_k1": row["transfer_s_per_sample"] / base["transfer_s_per_sample"],
                    "ideal": 1.0 / row["accum_steps"]})
    return out


# -- The whole bench ------------------------------------------------------------
def run_bench(quick: bool = False, out: Optional[str] = None, notebooks: Optional[bool] = None) -> Dict:
    """Every measurement, its analysis and (with ``out``) ``bench.json`` and the figures.

    Args:
        quick: the short version (tests, the notebook).
        out: folder for ``bench.json`` and the PNG figures (nothing saved if None).
        notebooks: time the notebook suite (default: only in full mode).
    """
    t0 = time.perf_counter()
    results: Dict = {"quick": quick, "section_seconds": {}}

    def timed(name, measure, *args, **kwargs):
        start = time.perf_counter()
        results[name] = measure(*args, **kwargs)
        results["section_seconds"][name] = time.perf_counter() - start

    timed("allreduce", allreduce_sweep, (2, 4), quick=quick)
    timed("crosscheck", plain_crosscheck, results["allreduce"])
    timed("ddp", ddp_lab, 2, quick=quick)
    results["accumulation"] = accumulation_ratios(results["ddp"]["accumulation"])
    results["projection"] = projection(results["allreduce"], results["ddp"])
    timed("launch", launch_speed, 1 if quick else 3)
    timed("gpu", gpu_part, quick)
    if notebooks if notebooks is not None else not quick:
        timed("notebooks", notebook_suite)
    results["bench_seconds"] = time.perf_counter() - t0
    if out:
        save(results, out)
    return results


def gpu_part(quick: bool) -> Dict:
    """The sweep and the DDP lab again with ``backend="auto"`` on GPUs (nccl); the sweep also with CUDA events.

    Skipped, with the reason, where there are fewer than two GPUs: nccl needs one GPU per rank.
    """
    gpus = visible_gpus()
    if gpus < 2:
        return {"skipped": f"{gpus} GPU(s) visible (nvidia-smi): the nccl sweep needs one GPU per "
                           "rank and at least 2 ranks; CPU numbers above are gloo"}
    sweep = allreduce_sweep(tuple(p for p in (2, 4) if p <= gpus), quick=quick, backend="auto")
    lab = ddp_lab(2, quick=quick, sections=["compute", "buckets", "overlap", "fidelity"], backend="auto")
    return {"sweep": sweep, "ddp": lab, "auto_picked": sweep["backend"]}


def save(results: Dict, out: str) -> None:
    """``bench.json`` and one PNG per figure into ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    from ddp_tutorial.plots import perf as perf_plots

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "bench.json").write_text(json.dumps(results, indent=1, default=str))
    figures = {
        "allreduce_sweep.png": lambda: perf_plots.plot_allreduce_sweep(results["allreduce"]),
        "bucket_sweep.png": lambda: perf_plots.plot_bucket_sweep(results["ddp"]["buckets"]),
        "overlap.png": lambda: perf_plots.plot_overlap(results["ddp"]["overlap"]),
        "accumulation.png": lambda: perf_plots.plot_accumulation(results["accumulation"]),
        "scaling_projection.png": lambda: perf_plots.plot_scaling_projection(results["projection"]),
        "scaling_projection_nccl_alpha.png":
            lambda: perf_plots.plot_scaling_projection(results["projection"], alpha="NCCL-class"),
    }
    for name, draw in figures.items():
        ax = draw()
        ax.figure.savefig(folder / name, dpi=110, bbox_inches="tight")
        matplotlib.pyplot.close(ax.figure)


# -- The table ------------------------------------------------------------------
def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def format_table(results: Dict) -> str:
    """The bench's printed report: every measured figure and ratio, one line each."""
    lines = []
    add = lines.append
    sweep, fit = results["allreduce"], results["allreduce"]["fit"]
    add(f"== all-reduce sweep ({sweep['backend']}, ranks {sweep['world_sizes']}) ==")
    add(f"{'ranks':>5} {'size':>9} {'latency':>10} {'algbw GB/s':>11} {'busbw GB/s':>11} {'model':>10}")
    for row in sweep["table"]:
        model_s = perf.ring_time(row["bytes"], row["world_size"], fit["alpha_s"], fit["bandwidth"])
        add(f"{row['world_size']:>5} {_size(row['bytes']):>9} {_ms(row['seconds']):>10} "
            f"{row['algbw_GBps']:>11.3f} {row['busbw_GBps']:>11.3f} {_ms(model_s):>10}")
    add(f"ring fit: alpha = {fit['alpha_s'] * 1e6:.1f} us per message, B = {fit['bandwidth'] / perf.GB:.2f} GB/s, "
        f"R^2 = {fit['r2']:.3f} (log t), {fit['r2_linear']:.3f} (t); memcpy ceiling "
        f"{sweep['memcpy_Bps'] / perf.GB:.1f} GB/s")
    for world_size, f in sorted(sweep.get("fit_by_world_size", {}).items()):
        add(f"  fit of {world_size} ranks alone: alpha = {f['alpha_s'] * 1e6:.1f} us, B = "
            f"{f['bandwidth'] / perf.GB:.2f} GB/s, R^2 = {f['r2']:.3f} (log t), {f['r2_linear']:.3f} (t)")
    c = results["crosscheck"]
    add(f"cross-check at 16 MB, {c['world_size']} ranks: plain loop alone {_ms(c['plain_s'])}, sweep "
        f"{_ms(c['sweep_s'])} ({c['sweep_gap']:.0%} apart), fit {_ms(c['fit_s'])} ({c['fit_gap']:.0%} apart); "
        f"target <= 20%")
    ddp = results["ddp"]
    add(f"== DDP ({ddp['backend']}, {ddp['world_size']} ranks, model of {ddp['param_tensors']} tensors, "
        f"{ddp['model_bytes'] / 1e3:.0f} KB) ==")
    add(f"compute per sample (1 rank, no comm): {ddp['compute']['s_per_sample'] * 1e6:.1f} us")
    buckets = ddp["buckets"]
    for row in buckets:
        add(f"bucket_cap_mb {row['bucket_cap_mb']:>7g}: {row['allreduce_calls_per_step']:>5.1f} all-reduces/step, "
            f"backward {_ms(row['backward_s'])}")
    slowest = max(r["backward_s"] for r in buckets)
    fastest = min(r["backward_s"] for r in buckets)
    add(f"backward, worst bucket size / best: {slowest / fastest:.2f}x (the DDP paper: > 2x)")
    o = ddp["overlap"]
    add(f"overlap (bucket_cap_mb {o['bucket_cap_mb']}): iteration DDP {_ms(o['ddp_step_s'])}, per-gradient "
        f"all-reduce after backward {_ms(o['per_gradient_step_s'])}, one flat all-reduce "
        f"{_ms(o['flat_step_s'])}; DDP logger: backward compute {_ms(o['avg_backward_compute_time_s'])}, "
        f"comm {_ms(o['avg_backward_comm_time_s'])}, overlap {_ms(o['avg_backward_compute_comm_overlap_time_s'])}")
    add("accumulation: K  straggler  time/sample  per optimizer step: transfer + wait"
        "   transfer/sample vs K=1 (ideal 1/K)")
    for row in results["accumulation"]:
        add(f"{'':>12}{row['accum_steps']:>3} {row['straggler_ms']:>7g} ms {row['s_per_sample'] * 1e6:>9.1f} us "
            f"{_ms(row['transfer_s_per_optimizer_step']):>20} + {_ms(row['wait_s_per_optimizer_step']):<9} "
            f"{row['comm_per_sample_vs_k1']:>14.2f} ({row['ideal']:.3f})")
    proj = results["projection"]
    alphas = ", ".join(f"{name} {a * 1e6:.0f} us" for name, a in proj["alphas"].items())
    add(f"== scaling projection: efficiency at 256 / 1024 workers (alpha: {alphas}; bucket 25 MB) ==")
    add(f"{'job':<28} {'alpha':<11} {'K':>2} {'25 GB/s':>13} {'100 GB/s':>13} {'450 GB/s':>13}")
    for point in proj["key"]:
        cells = [f"{point[f'{g}GBps@256']:.0%} / {point[f'{g}GBps@1024']:.0%}" for g in (25, 100, 450)]
        add(f"{point['job']:<28} {point['alpha']:<11} {point['accum_steps']:>2} "
            + " ".join(f"{c:>13}" for c in cells))
    add("assumptions: " + "; ".join(proj["assumptions"]))
    add("== the kit's own speed (side by side, this run) ==")
    ln = results["launch"]
    add(f"launch: launch() {ln['launch_s']:.2f} s vs torchrun --standalone {ln['torchrun_s']:.2f} s, "
        f"{ln['world_size']} ranks of hello.py: ratio {ln['ratio']:.2f} (target <= 0.75); rank init_process_group "
        f"{ln['init_s'] * 1e3:.0f} ms (median); import torch {ln['import_torch_s']:.2f} s, floor "
        f"{ln['floor_s']:.2f} s ({ln['world_size']} imports on {min(ln['cores'], ln['world_size'])} cores)")
    for label, key, total in (("as is", "phases", ln["probe_s"]), ("with the store wait", "fixed_phases", ln["fixed_s"])):
        parts = ", ".join(f"{k} {v:.2f}" for k, v in ln[key].items())
        add(f"  where it goes, probe {label}: {total:.2f} s = {parts} s")
    add(f"  with ranks waiting for rank 0's store before init: {ln['fixed_s']:.2f} s, "
        f"ratio {ln['fixed_ratio']:.2f} to torchrun")
    ov = ddp["overhead"]
    add(f"instrumentation: SyncTimer + JSON line per step vs plain DDP, taking turns step by step: "
        f"{1 + ov['overhead']:.3f}x, median step {_ms(ov['instrumented_step_s'])} vs "
        f"{_ms(ov['plain_step_s'])} over {ov['steps']} steps each ({ov['overhead']:+.1%}; target <= +5%)")
    fi = ddp["fidelity"]
    add(f"sync-time fidelity: SyncTimer {_ms(fi['synctimer_s'])} vs DDP logger avg_backward_comm_time "
        f"{_ms(fi['ddp_logger_s'])}: ratio {fi['ratio']:.2f} (target within 25%)")
    nb = results.get("notebooks")
    if nb is None:
        add("notebook suite: not timed (quick mode; run the full bench)")
    elif "skipped" in nb:
        add(f"notebook suite: skipped, {nb['skipped']}")
    else:
        add(f"notebook suite: {nb['seconds']:.0f} s for {len(nb['notebooks'])} notebooks, ratio "
            f"{nb['ratio']:.2f} of 180 s ({'passed' if nb['passed'] else 'FAILED'}: {nb['summary']}"
            + (f"; failed: {', '.join(nb['failed'])}" if nb["failed"] else "") + ")")
    gpu = results["gpu"]
    if "skipped" in gpu:
        add(f"GPU: skipped, {gpu['skipped']}")
    else:
        g = gpu["sweep"]
        add(f"GPU: backend=auto picked {gpu['auto_picked']}; wall-clock fit alpha = "
            f"{g['fit']['alpha_s'] * 1e6:.1f} us, B = {g['fit']['bandwidth'] / perf.GB:.1f} GB/s; CUDA-event fit "
            f"alpha = {g['cuda_fit']['alpha_s'] * 1e6:.1f} us, B = {g['cuda_fit']['bandwidth'] / perf.GB:.1f} GB/s")
        lab = gpu["ddp"]
        best = min(r["backward_s"] for r in lab["buckets"])
        add(f"GPU DDP ({lab['backend']}): backward worst/best bucket size "
            f"{max(r['backward_s'] for r in lab['buckets']) / best:.2f}x; iteration DDP "
            f"{_ms(lab['overlap']['ddp_step_s'])}, per-gradient {_ms(lab['overlap']['per_gradient_step_s'])}, "
            f"flat {_ms(lab['overlap']['flat_step_s'])}; sync fidelity ratio {lab['fidelity']['ratio']:.2f}")
        for row in perf.sweep_table(g["cuda_samples"]):
            add(f"  cuda events {row['world_size']} ranks {_size(row['bytes']):>7}: {_ms(row['seconds'])}, "
                f"busbw {row['busbw_GBps']:.1f} GB/s")
    sections = ", ".join(f"{k} {v:.0f} s" for k, v in results["section_seconds"].items())
    add(f"bench wall time: {results['bench_seconds']:.0f} s ({sections})")
    return "\n".join(lines)


def _size(nbytes: float) -> str:
    for unit, scale in (("MB", perf.MB), ("KB", perf.KB)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def headline_numbers(results: Dict) -> Dict[str, float]:
    """The fits and ratios the bench exists to produce, by name (tests check they are finite)."""
    fit, ddp = results["allreduce"]["fit"], results["ddp"]
    buckets = ddp["buckets"]
    return {
        "alpha_s": fit["alpha_s"], "bandwidth": fit["bandwidth"], "r2": fit["r2"],
        "crosscheck_gap": results["crosscheck"]["sweep_gap"],
        "bucket_speedup": max(r["backward_s"] for r in buckets) / min(r["backward_s"] for r in buckets),
        "overlap_s": ddp["overlap"]["avg_backward_compute_comm_overlap_time_s"],
        "launch_ratio": results["launch"]["ratio"], "launch_fixed_ratio": results["launch"]["fixed_ratio"],
        "instrumentation_overhead": ddp["overhead"]["overhead"],
        "sync_fidelity_ratio": ddp["fidelity"]["ratio"],
        **{f"efficiency[{p['job']}, {p['alpha']}, K={p['accum_steps']}, {k}]": v
           for p in results["projection"]["key"] for k, v in p.items() if "@" in k},
    }


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_tutorial.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, steps and repeats (about 30 s)")
    parser.add_argument("--out", default=None, help="folder for bench.json and the figures")
    parser.add_argument("--notebooks", nargs="?", type=_positive_int, const=0, default=None, metavar="N",
                        help="alone: time one `pytest --nbmake notebooks/` round in the bench (the default "
                             "in full mode); with N: skip the rest and run the notebook suite N times, "
                             "printing how often each notebook passed")
    parser.add_argument("--no-notebooks", dest="notebooks", action="store_const", const=-1,
                        help="do not time the notebook suite")
    parser.add_argument("--busy-core", nargs="?", type=int, const=-1, default=0, metavar="K",
                        help="with --notebooks N: keep one core busy during the last K rounds "
                             "(all rounds without K), as on a shared classroom server")
    args = parser.parse_args(argv)
    if args.notebooks is not None and args.notebooks > 0:  # N rounds of the notebook suite, nothing else
        busy = args.notebooks if args.busy_core < 0 else args.busy_core
        result = selfcheck.notebook_rounds(args.notebooks, busy)
        print(selfcheck.format_rounds(result), flush=True)
        return 0 if result.get("passed") == result.get("runs") else 1
    if args.busy_core:
        parser.error("--busy-core goes with --notebooks N")
    results = run_bench(args.quick, args.out, None if args.notebooks is None else args.notebooks == 0)
    print(format_table(results), flush=True)
    if args.out:
        print(f"saved {Path(args.out) / 'bench.json'} and figures", flush=True)
    bad = [k for k, v in headline_numbers(results).items() if not _finite(v)]
    if bad:
        print(f"not finite: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
