"""Pitfall 4: evaluation skewed by the sampler's padding, and the exact (correct, count) fix."""

from __future__ import annotations

from typing import Dict, List, Optional

from ddp_tutorial.lessons.pitfalls.common import ranks_agree, records
from ddp_tutorial.lessons.table import text_table
from ddp_tutorial.runfolder import Run


def evaluation_rows(run: Run) -> List[dict]:
    """Per validation-set size: the true accuracy and the three ways of combining the ranks'.

    Accuracies are fractions; ``*_counts`` are [correct, samples counted].
    """
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


def format_evaluation(rows: List[dict], size: Optional[int] = None) -> str:
    """The one size in detail (default: the first with padding), then a line per size."""
    padded = [r for r in rows if r["padding"]]
    pick = next((r for r in rows if r["size"] == size), None) if size else (padded or rows)[0]
    lines = []
    if pick:
        p = pick
        lines += [f"{p['size']} samples on {p['world_size']} ranks: {p['padding']} padding slot(s), "
                  f"repeating sample(s) {p['repeated']}",
                  "  each rank's own accuracy: " + ", ".join(f"{a:.3f}" for a in p["per_rank"]),
                  f"  mean of the ranks' accuracies    {p['mean_of_means']:.4f}",
                  f"  all-reduce over every slot        {p['padded']:.4f}  ({p['padded_counts'][0]}/{p['padded_counts'][1]})",
                  f"  all-reduce over real samples      {p['fixed']:.4f}  ({p['fixed_counts'][0]}/{p['fixed_counts'][1]})",
                  f"  one process on the whole set      {p['true']:.4f}  ({p['true_counts'][0]}/{p['true_counts'][1]})",
                  "", ""]
    keys = ("mean_of_means", "padded", "fixed", "true")
    header = ["size", "padding", "mean of means", "every slot", "real only", "true"]
    rows = [(r["size"], r["padding"], *(f"{r[k]:.4f}" for k in keys)) for r in rows]
    return "\n".join(lines) + text_table(header, rows)
