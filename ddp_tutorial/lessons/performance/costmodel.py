"""What DDP costs: bandwidths, the ring all-reduce model (``n`` bytes over ``p`` ranks:
``2(p-1)·α + 2(p-1)/p · n / B``, notebook 07), its fit, a projection (no torch)."""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np

KB, MB, GB = 1024, 1024 ** 2, 1e9

#: All-reduce sizes of the full sweep (1 KB to 64 MB, every 2x) and of the quick one (every 4x).
FULL_SIZES = [KB * 2 ** i for i in range(17)]
QUICK_SIZES = [KB * 4 ** i for i in range(9)]


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth (nccl-tests): bytes of the tensor over the time."""
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
    """Each ``{"world_size", "bytes", "seconds"}`` sample with latency (ms), algbw, busbw (GB/s)."""
    return [{**s, "latency_ms": s["seconds"] * 1e3,
             "algbw_GBps": algbw(s["bytes"], s["seconds"]) / GB,
             "busbw_GBps": busbw(s["bytes"], s["seconds"], s["world_size"]) / GB} for s in samples]


def fit_alpha_beta(samples: Sequence[Dict]) -> Dict[str, float]:
    """Fit α and B (bytes/s) of the ring model to all-reduce times, over every world size at once:
    least squares on the relative error, as the times span four decades. ``r2`` is on log t."""
    rows = [(s["world_size"], s["bytes"], s["seconds"]) for s in samples if s["world_size"] >= 2]
    if len(rows) < 2:
        raise ValueError("need at least two all-reduce timings with world_size >= 2 to fit")
    p, n, t = np.array(rows, dtype=float).T
    # t = α·2(p-1) + β·2(p-1)/p·n, both sides over t: each point's relative error counts
    x, ones = np.column_stack([2 * (p - 1), 2 * (p - 1) / p * n]) / t[:, None], np.ones_like(t)
    (alpha, beta), _, rank, _ = np.linalg.lstsq(x, ones, rcond=None)
    if rank < 2:
        raise ValueError("all-reduce sizes do not vary: cannot separate α from β")
    if alpha <= 0:  # noise can push one term negative; then fit the other one alone
        alpha, beta = 0.0, np.linalg.lstsq(x[:, 1:], ones, rcond=None)[0][0]
    elif beta <= 0:
        alpha, beta = np.linalg.lstsq(x[:, :1], ones, rcond=None)[0][0], 0.0
    bandwidth = 1.0 / beta if beta > 0 else math.inf
    model = np.array([ring_time(nbytes, size, alpha, bandwidth) for size, nbytes, _ in rows])
    return {"alpha_s": float(alpha), "bandwidth": float(bandwidth), "beta_s_per_byte": float(beta),
            "r2": r_squared(np.log(t), np.log(np.maximum(model, 1e-12))),
            "r2_linear": r_squared(t, model), "points": len(rows)}


def r_squared(measured: np.ndarray, predicted: np.ndarray) -> float:
    """1 - SS_res / SS_tot: 1 is a perfect fit, 0 no better than the mean."""
    ss_tot = ((measured - measured.mean()) ** 2).sum()
    return float(1 - ((measured - predicted) ** 2).sum() / ss_tot) if ss_tot > 0 else math.nan


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
#: α of a GPU fabric with NCCL (assumed; nccl-tests on NVLink/InfiniBand show a few to tens of us).
NCCL_CLASS_ALPHA_S = 10e-6
#: A ResNet-50-like job as in the DDP paper (V100s): its gradients and an assumed compute rate.
PAPER_LIKE_JOB = {"label": "ResNet-50-like (assumed)", "model_bytes": 25.6e6 * 4,
                  "compute_s_per_sample": 1 / 350.0, "batch_per_worker": 32}


def project_step(workers: int, *, alpha_s: float, bandwidth: float, compute_s_per_sample: float,
                 model_bytes: float, batch_per_worker: int, bucket_bytes: float = 25 * MB,
                 accum_steps: int = 1, backward_fraction: float = 2 / 3) -> Dict[str, float]:
    """Predicted time of one optimizer step on ``workers`` workers (K = ``accum_steps``
    micro-batches), and ``efficiency``: one worker's step time over this one (1.0 is linear).
    ``exposed_comm_s`` is the communication that ``backward_fraction`` of compute cannot hide."""
    micro_compute = compute_s_per_sample * batch_per_worker
    compute = micro_compute * accum_steps
    buckets = max(1, math.ceil(model_bytes / bucket_bytes))
    last = ring_time(model_bytes - (buckets - 1) * bucket_bytes, workers, alpha_s, bandwidth)
    comm = (buckets - 1) * ring_time(bucket_bytes, workers, alpha_s, bandwidth) + last
    exposed = max(comm - backward_fraction * micro_compute, last) if workers > 1 else 0.0
    step = compute + exposed
    return {"workers": workers, "step_s": step, "compute_s": compute, "comm_s": comm,
            "exposed_comm_s": exposed, "efficiency": compute / step}


def projection_grid(*, alpha_s: float, compute_s_per_sample: float, model_bytes: float,
                    batch_per_worker: int, bandwidths_GBps: Sequence[float] = (25, 100, 450),
                    accum_steps: Sequence[int] = (1,), label: str = "",
                    alpha_label: str = "") -> List[Dict]:
    """``project_step`` on 2 to 1024 workers for every bandwidth and K (25 MB buckets)."""
    return [{**project_step(2 ** i, alpha_s=alpha_s, bandwidth=gbps * GB, accum_steps=k,
                            compute_s_per_sample=compute_s_per_sample, model_bytes=model_bytes,
                            batch_per_worker=batch_per_worker),
             "bandwidth_GBps": gbps, "accum_steps": k, "label": label, "alpha_s": alpha_s,
             "alpha_label": alpha_label}
            for gbps in bandwidths_GBps for k in accum_steps for i in range(1, 11)]


def efficiency_at(rows: Sequence[Dict], workers: int, **match) -> Optional[float]:
    """The projected efficiency at ``workers`` of the first row that matches ``match``."""
    return next((row["efficiency"] for row in rows if row["workers"] == workers
                 and all(row.get(k) == v for k, v in match.items())), None)
