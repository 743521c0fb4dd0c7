"""The performance lab's measurements: what DDP costs on this machine (notebook 07, the bench).

Each measurement is one launch of a probe in ``perf/workers``; the analysis
(the α-β fit, the scaling projection) uses ``perf.costmodel``. This module
imports no torch: the measurements run in worker processes.

    sweep = measure.allreduce_sweep(world_sizes=(2,), quick=True)
    lab = measure.ddp_lab(world_size=2, quick=True)
    proj = measure.projection(sweep, lab)
"""

from __future__ import annotations

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
        ``memcpy_Bps`` (the ceiling), ``backend``, and ``cuda_samples``/``cuda_fit`` on GPUs.
    """
    samples, cuda_samples, ceilings, backends = [], [], [], set()
    for world_size in world_sizes:
        run = launch(worker_script(__file__, "perf_allreduce.py"), world_size,
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

