"""Pitfall 7: gradient clipping with accumulation: once, after the all-reduce."""

from __future__ import annotations

from ddp_tutorial.lessons.pitfalls.common import part, per_rank, ranks_agree
from ddp_tutorial.runfolder import Run


def clipping_summary(run: Run) -> dict:
    """Per variant: distance from one process after each step, ranks agreeing, the norms clipped."""
    out = {}
    for name in ("right", "wrong"):
        recs = per_rank(run, "clipping", name)
        out[name] = {"max_diff": recs[0]["max_diff"], "ranks_agree": ranks_agree(recs, "digest"),
                     "norms": {r: rec["norms"] for r, rec in recs.items()}}
    right = part(run, "clipping", "right")
    out["reference_norms"], out["max_norm"] = right["reference_norms"], right["max_norm"]
    return out


def format_clipping(summary: dict) -> str:
    s, join = summary, ", ".join
    lines = [f"clip_grad_norm_(max_norm={s['max_norm']}); global-batch gradient norm of one process "
             f"per step: {join(f'{n:.3f}' for n in s['reference_norms'])}"]
    for name, what in (("right", "clip once, after the all-reduce"), ("wrong", "clip every micro-step")):
        lines.append(f"{what:<32} params vs one process per step: "
                     f"{join(f'{d:.1e}' for d in s[name]['max_diff'])}; "
                     f"ranks identical: {s[name]['ranks_agree']}")
    first = "; ".join(f"rank {r}: {join(f'{n:.3f}' for n in norms[0])}"
                      for r, norms in s["wrong"]["norms"].items())
    return "\n".join(lines + [f"norms the wrong clips saw in step 0: {first}"])
