"""Pitfall 5: one seed or one per rank: dropout masks, sampler orders and the model's start."""

from __future__ import annotations

from typing import Dict

from ddp_tutorial.lessons.pitfalls.common import per_rank
from ddp_tutorial.lessons.table import text_table
from ddp_tutorial.runfolder import Run


def _coverage(sampler: Dict[int, dict], key: str, dataset_size: int) -> dict:
    seen = [i for rec in sampler.values() for i in rec[key]]
    distinct = len(set(seen))
    return {"seen": len(seen), "distinct": distinct, "twice_or_more": len(seen) - distinct,
            "never": dataset_size - distinct}


def _masks(dropout: Dict[int, dict], key: str) -> dict:
    steps = len(dropout[0][key])
    distinct = [len({row for rec in dropout.values() for row in rec[key][s]}) for s in range(steps)]
    rows = sum(len(rec[key][0]) for rec in dropout.values())
    # every mask bit of ranks 1.. against the same bit of rank 0
    bits = [a == b for rank, rec in dropout.items() if rank for s in range(steps)
            for mine, theirs in zip(rec[key][s], dropout[0][key][s]) for a, b in zip(mine, theirs)]
    return {"distinct_per_step": distinct, "rows_per_step": rows,
            "agreement_with_rank0": sum(bits) / len(bits)}


def seeding_summary(run: Run) -> dict:
    """Init digests, sampler coverage and dropout masks, with one seed and with per-rank seeds."""
    init, sampler, dropout = (per_rank(run, "seeding", name) for name in ("init", "sampler", "dropout"))
    size = sampler[0]["dataset_size"]
    return {
        "world_size": run.world_size, "dataset_size": size,
        "init_distinct": {k: len({rec[k] for rec in init.values()}) for k in ("same_seed", "per_rank_seed")},
        "sampler": {k: _coverage(sampler, k, size) for k in ("same_seed", "per_rank_seed")},
        "dropout": {k: _masks(dropout, k) for k in ("same_seed", "per_rank_seed")},
    }


def format_seeding(summary: dict) -> str:
    s, keys = summary, ("same_seed", "per_rank_seed")
    c, m = s["sampler"], s["dropout"]
    rows = [("distinct fresh models", *(f"{s['init_distinct'][k]} of {s['world_size']}"
                                         for k in keys)),
            ("sampler slots", *(c[k]["seen"] for k in keys)),
            (f"distinct samples (of {s['dataset_size']})", *(c[k]["distinct"] for k in keys)),
            ("samples seen twice or more", *(c[k]["twice_or_more"] for k in keys)),
            ("samples never seen", *(c[k]["never"] for k in keys)),
            ("distinct dropout masks per step",
             *(f"{m[k]['distinct_per_step']} of {m[k]['rows_per_step']}" for k in keys)),
            ("mask bits agreeing with rank 0",
             *(f"{100 * m[k]['agreement_with_rank0']:.0f} %" for k in keys))]
    return text_table(["", "one seed on every rank", "seed + rank"], rows)
