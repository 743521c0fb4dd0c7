"""What DDP costs, in numbers: bandwidth definitions, the ring all-reduce cost model, its fit, a projection.

Pure arithmetic on measured numbers: no torch here, so a notebook can import it for free.
The measurements come from ``ddp_tutorial/perf/workers/perf_*.py`` (run through ``bench``).

The ring all-reduce of ``n`` bytes over ``p`` ranks sends ``2(p-1)`` messages of
``n/p`` bytes per rank, one after the other::

    t(n, p) = 2(p-1)·α + 2(p-1)/p · n / B

α is the per-message latency, B the link bandwidth (bytes/s). nccl-tests report
``algbw = n / t`` and ``busbw = algbw · 2(p-1)/p``; busbw is the rate the busiest
link runs at, so it can be compared with B whatever the number of ranks.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Sequence

KB, MB, GB = 1024, 1024 ** 2, 1e9

#: All-reduce sizes of the full sweep (1 KB to 64 MB, every 2x) and of the quick one (every 4x).
FULL_SIZES = [KB * 2 ** i for i in range(17)]
QUICK_SIZES = [KB * 4 ** i for i in range(9)]


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth, nccl-tests' definition: bytes of the tensor over the time (bytes/s)."""
    return nbytes / seconds


def busbw(nbytes: float, seconds: float, world_size: int) -> float:
    """Bus bandwidth of an all-reduce: ``algbw · 2(p-1)/p`` (bytes/s), nccl-tests' definition."""
    return algbw(nbytes, seconds) * 2 * (world_size - 1) / world_size


def ring_time(nbytes: float, world_size: int, alpha_s: float, bandwidth: float) -> float:
    """Seconds of one ring all-reduce of ``nbytes`` over ``world_size`` ranks (α-β model)."""
    if world_size < 2:
        return 0.0
    steps = 2 * (world_size - 1)
    return steps * alpha_s + steps / world_size * nbytes / bandwidth


def sweep_table(samples: Iterable[Dict]) -> List[Dict]:
    """Add algbw and busbw (GB/s) to each ``{"world_size", "bytes", "seconds"}`` sample.

    Args:
        samples: one dict per (world size, size) with the median seconds of one all-reduce.
    """
    rows = []
    for s in samples:
        p, n, t = s["world_size"], s["bytes"], s["seconds"]
        rows.append({**s, "latency_ms": t * 1e3, "algbw_GBps": algbw(n, t) / GB,
                     "busbw_GBps": busbw(n, t, p) / GB})
    return rows


def fit_alpha_beta(samples: Sequence[Dict]) -> Dict[str, float]:
    """Fit α and B of the ring model to measured all-reduce times, over every world size at once.

    Least squares on the relative error (each point weighted by 1/t): the sweep spans
    four decades of time, and a plain fit would let the 64 MB points decide alone.

    Args:
        samples: dicts with ``world_size``, ``bytes`` and ``seconds``.

    Returns:
        ``alpha_s`` (latency per message), ``bandwidth`` (B, bytes/s), ``beta_s_per_byte``
        (1/B), ``r2`` (coefficient of determination of log t against the model's log t),
        and ``r2_linear`` (the same on t itself).
    """
    rows = [(s["world_size"], s["bytes"], s["seconds"]) for s in samples if s["world_size"] >= 2]
    if len(rows) < 2:
        raise ValueError("need at least two all-reduce timings with world_size >= 2 to fit α and β")
    # t = a·x1 + b·x2 with x1 = 2(p-1), x2 = 2(p-1)/p·n; weighted normal equations by hand.
    s11 = s12 = s22 = s1t = s2t = 0.0
    for p, n, t in rows:
        w = 1.0 / (t * t)
        x1, x2 = 2.0 * (p - 1), 2.0 * (p - 1) / p * n
        s11 += w * x1 * x1
        s12 += w * x1 * x2
        s22 += w * x2 * x2
        s1t += w * x1 * t
        s2t += w * x2 * t
    det = s11 * s22 - s12 * s12
    if det == 0:
        raise ValueError("all-reduce sizes do not vary: cannot separate α from β")
    alpha = (s22 * s1t - s12 * s2t) / det
    beta = (s11 * s2t - s12 * s1t) / det
    if alpha <= 0:  # noise can push one term negative; then fit the other one alone
        alpha, beta = 0.0, s2t / s22
    elif beta <= 0:
        alpha, beta = s1t / s11, 0.0
    bandwidth = 1.0 / beta if beta > 0 else math.inf
    predicted = [ring_time(n, p, alpha, bandwidth) for p, n, _ in rows]
    measured = [t for _, _, t in rows]
    return {"alpha_s": alpha, "bandwidth": bandwidth, "beta_s_per_byte": beta,
            "r2": r_squared([math.log(t) for t in measured], [math.log(max(t, 1e-12)) for t in predicted]),
            "r2_linear": r_squared(measured, predicted), "points": len(rows)}


def r_squared(measured: Sequence[float], predicted: Sequence[float]) -> float:
    """1 - SS_res / SS_tot: 1 is a perfect fit, 0 no better than the mean."""
    mean = sum(measured) / len(measured)
    ss_tot = sum((m - mean) ** 2 for m in measured)
    ss_res = sum((m - q) ** 2 for m, q in zip(measured, predicted))
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan")


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        raise ValueError("median of no values")
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def relative_gap(value: float, reference: float) -> float:
    """``|value - reference| / reference``: 0.2 means 20 % apart."""
    return abs(value - reference) / reference


# -- Scaling projection --------------------------------------------------------
#: The assumptions of ``project_step``, printed next to its plot.
PROJECTION_ASSUMPTIONS = [
    "weak scaling: each worker keeps its batch, so the global batch grows with the workers",
    "compute time per sample is the one measured here (one worker, no communication)",
    "ring all-reduce per bucket: 2(p-1)·α + 2(p-1)/p · bucket/B",
    "α is either the one fitted here (gloo over loopback: software latency, pessimistic) or an "
    "assumed NCCL-class 10 us per message",
    "B is the link bandwidth of each scenario (busbw a real fabric sustains, not its peak)",
    "backward is 2/3 of compute; buckets reduce while backward runs, so only the comm that "
    "does not fit under that backward (and at least the last bucket) adds to the step",
    "with K-step accumulation, only the last micro-step of K syncs (no_sync on the others)",
    "no stragglers, no contention between jobs, a flat ring (NCCL switches to trees at "
    "scale, which makes the latency term grow as log p instead of p)",
]


def project_step(workers: int, *, alpha_s: float, bandwidth: float, compute_s_per_sample: float,
                 model_bytes: float, batch_per_worker: int, bucket_bytes: float = 25 * MB,
                 accum_steps: int = 1, backward_fraction: float = 2 / 3) -> Dict[str, float]:
    """Predicted time of one optimizer step on ``workers`` workers, and the scaling efficiency.

    Args:
        workers: number of data-parallel workers.
        alpha_s: all-reduce latency per message (fitted α).
        bandwidth: link bandwidth B in bytes/s.
        compute_s_per_sample: forward + backward + optimizer seconds per sample on one worker.
        model_bytes: gradient bytes all-reduced per sync.
        batch_per_worker: samples per micro-batch per worker.
        bucket_bytes: DDP's bucket cap (``bucket_cap_mb`` in bytes).
        accum_steps: K, micro-batches per optimizer step.
        backward_fraction: share of a micro-step's compute that is backward (overlap window).

    Returns:
        ``step_s``, ``compute_s``, ``comm_s`` (all buckets), ``exposed_comm_s`` (what overlap
        does not hide), ``efficiency`` (single-worker step time / this one: 1.0 is linear
        scaling) and ``samples_per_s`` for the whole job.
    """
    micro_compute = compute_s_per_sample * batch_per_worker
    compute = micro_compute * accum_steps
    buckets = max(1, math.ceil(model_bytes / bucket_bytes))
    last_bucket = model_bytes - (buckets - 1) * bucket_bytes
    comm = sum(ring_time(min(bucket_bytes, model_bytes), workers, alpha_s, bandwidth)
               for _ in range(buckets - 1)) + ring_time(last_bucket, workers, alpha_s, bandwidth)
    last = ring_time(last_bucket, workers, alpha_s, bandwidth)
    exposed = max(comm - backward_fraction * micro_compute, last) if workers > 1 else 0.0
    step = compute + exposed
    return {"workers": workers, "step_s": step, "compute_s": compute, "comm_s": comm,
            "exposed_comm_s": exposed, "efficiency": compute / step,
            "samples_per_s": workers * batch_per_worker * accum_steps / step}


def projection_grid(*, alpha_s: float, compute_s_per_sample: float, model_bytes: float,
                    batch_per_worker: int, bandwidths_GBps: Sequence[float] = (25, 100, 450),
                    workers: Sequence[int] = tuple(2 ** i for i in range(1, 11)),
                    bucket_mbs: Sequence[float] = (25.0,), accum_steps: Sequence[int] = (1,),
                    label: str = "", alpha_label: str = "") -> List[Dict]:
    """``project_step`` for every (bandwidth, bucket size, K, workers); one dict per point."""
    rows = []
    for gbps in bandwidths_GBps:
        for bucket_mb in bucket_mbs:
            for k in accum_steps:
                for p in workers:
                    point = project_step(p, alpha_s=alpha_s, bandwidth=gbps * GB,
                                         compute_s_per_sample=compute_s_per_sample,
                                         model_bytes=model_bytes, batch_per_worker=batch_per_worker,
                                         bucket_bytes=bucket_mb * MB, accum_steps=k)
                    rows.append({**point, "bandwidth_GBps": gbps, "bucket_mb": bucket_mb,
                                 "accum_steps": k, "label": label, "alpha_s": alpha_s,
                                 "alpha_label": alpha_label})
    return rows


def efficiency_at(rows: Sequence[Dict], workers: int, **match) -> Optional[float]:
    """The projected efficiency at ``workers`` for the first row matching ``match`` (e.g. bandwidth_GBps=100)."""
    for row in rows:
        if row["workers"] == workers and all(row.get(k) == v for k, v in match.items()):
            return row["efficiency"]
    return None


#: α of a GPU fabric with NCCL (assumed; nccl-tests on NVLink/InfiniBand show a few to tens of us).
NCCL_CLASS_ALPHA_S = 10e-6

#: A ResNet-50-like job as in the DDP paper (V100s): its gradients and an assumed compute rate.
PAPER_LIKE_JOB = {"label": "ResNet-50-like (assumed)", "model_bytes": 25.6e6 * 4,
                  "compute_s_per_sample": 1 / 350.0, "batch_per_worker": 32}
