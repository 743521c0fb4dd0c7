"""Pitfall 1: BatchNorm statistics are per rank; a broadcast, an all-reduce and SyncBatchNorm."""

from __future__ import annotations

from ddp_tutorial.lessons.pitfalls.common import max_abs_diff, part, per_rank, ranks_agree
from ddp_tutorial.lessons.table import text_table
from ddp_tutorial.runfolder import Run


BATCHNORM_VARIANTS = {
    "no_sync": "plain BatchNorm, no buffer sync",
    "broadcast": "plain BatchNorm, DDP default",
    "allreduce": "all-reduced batch statistics",
    "syncbn": "SyncBatchNorm",
}


def batchnorm_summary(run: Run) -> dict:
    """Per BatchNorm variant, the largest differences across ranks and from one process on the
    global batch (statistics, parameters, eval outputs); a refused variant has ``errors``."""
    env, ref = part(run, "batchnorm", "env"), part(run, "batchnorm", "reference")
    out = {"world_size": run.world_size, "torch": env["torch"], "cuda_devices": env["cuda_devices"],
           "device": env["device"], "keyword": env["buffer_sync_keyword"],
           "reference": {"running_mean": ref["running_mean"], "running_var": ref["running_var"]}}

    def stats(rec):
        return rec["running_mean"] + rec["running_var"]

    for name in BATCHNORM_VARIANTS:
        recs = per_rank(run, "batchnorm", name)
        if "errors" in recs[0]:
            out[name] = {"errors": recs[0]["errors"]}
            continue
        out[name] = {
            "running_mean": {r: rec["running_mean"] for r, rec in recs.items()},
            "across_ranks": max(max_abs_diff(stats(rec), stats(recs[0])) for rec in recs.values()),
            "vs_reference": max(max_abs_diff(stats(rec), stats(ref)) for rec in recs.values()),
            "params_vs_reference": max(max_abs_diff(rec["params"], ref["params"]) for rec in recs.values()),
            "eval_across_ranks": max(max_abs_diff(rec["eval_out"], recs[0]["eval_out"]) for rec in recs.values()),
            "starts_equal": ranks_agree(recs, "forward_start_means"),
            "rank0_vs_own_ema": max_abs_diff(recs[0]["running_mean"], recs[0]["own_ema"]),
        }
    return out


def format_batchnorm(summary: dict) -> str:
    """One line per variant: how far apart the ranks are, and how far from one process."""
    keys = ("across_ranks", "vs_reference", "eval_across_ranks", "params_vs_reference")
    rows = [(label, *(f"{summary[name][k]:.2e}" for k in keys))
            for name, label in BATCHNORM_VARIANTS.items() if "errors" not in summary[name]]
    refused = [f"{label}: refused on {summary['device']}: " + " / ".join(summary[name]["errors"])
               for name, label in BATCHNORM_VARIANTS.items() if "errors" in summary[name]]
    title = (f"{summary['world_size']} ranks, torch {summary['torch']}, "
             f"device {summary['device']}; largest absolute differences:")
    header = ["variant", "stats across ranks", "stats vs one process", "eval outputs across ranks",
              "params vs one process"]
    return "\n".join([text_table(header, rows, title), *refused])


def format_broadcast_buffers(summary: dict) -> str:
    """What DDP's default buffer broadcast did, measured on the ``broadcast`` variant."""
    b, n = summary["broadcast"], summary["no_sync"]
    return "\n".join([
        f"DDP(model) keyword for it in torch {summary['torch']}: {summary['keyword']}=True (the default)",
        f"every forward started from the same buffers on every rank: {b['starts_equal']} "
        f"(without the broadcast: {n['starts_equal']})",
        f"rank 0's running mean vs the running mean of rank 0's own batches alone: {b['rank0_vs_own_ema']:.1e}",
        f"running statistics after the last step, across ranks: {b['across_ranks']:.2e} "
        "(each rank's last forward updated its own copy)",
        f"running statistics vs one process on the global batch: {b['vs_reference']:.2e}",
    ])
