"""Pitfall 6: the learning rate for a W times larger global batch, with warm-up."""

from __future__ import annotations

from ddp_tutorial.lessons.pitfalls.common import part
from ddp_tutorial.lessons.table import text_table
from ddp_tutorial.runfolder import Run


def lr_summary(run: Run) -> dict:
    """Loss curves (loss on the whole set against samples seen) and their final ratios to W = 1."""
    c = dict(part(run, "lr", "curves"))  # a copy: the curves move out of it
    curves = {k: c.pop(k) for k in ("single", "kept", "scaled")}
    return {**c, "global_batch": c["world_size"] * c["batch_size"], "curves": curves,
            "final": {k: v[-1] for k, v in curves.items()},
            "final_ratio": {k: curves[k][-1] / curves["single"][-1] for k in ("kept", "scaled")}}


def format_lr(summary: dict) -> str:
    s, w = summary, summary["world_size"]
    rows = [(f"one process, lr {s['lr']:g}", "single"),
            (f"{w} ranks, lr kept at {s['lr']:g}", "kept"),
            (f"{w} ranks, lr {s['scaled_lr']:g} after {s['warmup_steps']} warm-up steps", "scaled")]
    title = (f"W = {w} ranks x b = {s['batch_size']} (K = 1): global batch {s['global_batch']}; "
             f"one process: batch {s['batch_size']}. After {s['samples'][-1]} samples seen:")
    return text_table(["run", "final loss", "ratio to one process"],
                      [(label, f"{s['final'][key]:.4f}", f"{s['final_ratio'].get(key, 1):.2f} x")
                       for label, key in rows], title)
