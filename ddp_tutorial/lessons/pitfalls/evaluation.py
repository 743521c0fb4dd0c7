"""Pitfall 4: evaluation skewed by the sampler's padding, and the exact (correct, count) fix."""

from __future__ import annotations

from typing import Dict, List

from ddp_tutorial.lessons.pitfalls.common import ranks_agree, records
from ddp_tutorial.lessons.table import text_table
from ddp_tutorial.runfolder import Run


def evaluation_rows(run: Run) -> List[dict]:
    """Per set size: the true accuracy and three ways of combining the ranks' (``*_counts``:
    [correct, samples counted])."""
    per_size: Dict[int, Dict[int, dict]] = {}
    for rank in range(run.world_size):
        for rec in records(run, "evaluation", "eval", rank):
            per_size.setdefault(rec["size"], {})[rank] = rec
    rows = []
    for size, recs in sorted(per_size.items()):
        r0 = recs[0]
        true_c, true_n = r0["true"]
        rows.append({
            "size": size, "world_size": len(recs),
            "padding": sum(sum(rec["padded"]) for rec in recs.values()),
            "repeated": sorted(i for rec in recs.values() for i, pad in zip(rec["indices"], rec["padded"]) if pad),
            "per_rank": [recs[r]["own_accuracy"] for r in sorted(recs)],
            "true": true_c / true_n, "true_counts": [true_c, true_n],
            "mean_of_means": r0["mean_of_means"],
            "padded": r0["padded_counts"][0] / r0["padded_counts"][1], "padded_counts": r0["padded_counts"],
            "fixed": r0["real_counts"][0] / r0["real_counts"][1], "fixed_counts": r0["real_counts"],
            "fixed_on_every_rank": ranks_agree(recs, "real_counts"),
        })
    return rows


def format_evaluation(rows: List[dict], size: int) -> str:
    """Set size ``size`` in detail, then a line per size."""
    p = next(r for r in rows if r["size"] == size)
    lines = [f"{p['size']} samples on {p['world_size']} ranks: {p['padding']} padding slot(s), "
             f"repeating sample(s) {p['repeated']}",
             "  each rank's own accuracy: " + ", ".join(f"{a:.3f}" for a in p["per_rank"]),
             f"  mean of the ranks' accuracies     {p['mean_of_means']:.4f}"]
    for key, label in (("padded", "all-reduce over every slot"), ("fixed", "all-reduce over real samples"),
                       ("true", "one process on the whole set")):
        correct, count = p[key + "_counts"]
        lines.append(f"  {label:<34}{p[key]:.4f}  ({correct}/{count})")
    lines += ["", ""]
    keys = ("mean_of_means", "padded", "fixed", "true")
    header = ["size", "padding", "mean of means", "every slot", "real only", "true"]
    rows = [(r["size"], r["padding"], *(f"{r[k]:.4f}" for k in keys)) for r in rows]
    return "\n".join(lines) + text_table(header, rows)
