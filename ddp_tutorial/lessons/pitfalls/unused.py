"""Pitfall 2: parameters without a gradient; find_unused_parameters, static_graph and their cost."""

from __future__ import annotations

import re
import statistics
import textwrap
from typing import List, Sequence

from ddp_tutorial.lessons.pitfalls.common import part, per_rank, ranks_agree
from ddp_tutorial.lessons.table import text_table
from ddp_tutorial.runfolder import Run


def unused_indices(message: str) -> List[int]:
    """The indices in "Parameter indices which did not receive grad for rank N: i j ..."."""
    m = re.search(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)", message)
    return [int(i) for i in m.group(1).split()] if m else []


def timing_stats(values: Sequence[float]) -> dict:
    """Median and quartiles, in milliseconds."""
    q1, _, q3 = statistics.quantiles(values, n=4)
    return {"median_ms": 1e3 * statistics.median(values), "q1_ms": 1e3 * q1, "q3_ms": 1e3 * q3}


def paired_cost(run: Run, variant: str, clock: str = "cpu_s", baseline: str = "no flag") -> dict:
    """Per step, ``variant``'s time minus the baseline's (taken in turn), pooled over ranks: the
    median, ``relative`` to the baseline's, and the share of ``steps`` where it was slower."""
    diffs, base = [], []
    for rec in per_rank(run, "unused", "cost").values():
        diffs += [v - b for v, b in zip(rec[clock][variant], rec[clock][baseline])]
        base += rec[clock][baseline]
    median = statistics.median(diffs)
    return {"median_ms": 1e3 * median, "relative": median / statistics.median(base),
            "slower_fraction": sum(d > 0 for d in diffs) / len(diffs), "steps": len(diffs)}


def unused_summary(run: Run) -> dict:
    """The error, both fixes, and what each wrapping costs per step."""
    err = part(run, "unused", "error")
    names = err["param_names"]
    fixes = {}
    for name in ("find_unused", "static_graph"):
        recs = per_rank(run, "unused", name)
        fixes[name] = {"schedule": recs[0]["schedule"], "without_grad": recs[0]["without_grad"],
                       "ranks_agree": ranks_agree(recs, "digest"), "max_diff_reference": recs[0]["max_diff_reference"]}
    cost = per_rank(run, "unused", "cost")
    variants = list(cost[0]["cpu_s"])
    static = part(run, "unused", "static_graph_error")
    clocks = ("cpu", "wall")
    return {
        "error_step": err["step"], "error_first_line": err["first_line"], "error_message": err["message"],
        "unused_params": [names[i] for i in unused_indices(err["message"])], "param_names": names,
        **fixes, "static_graph_error": static["first_line"],
        "static_graph_message": static["message"],
        "cost": {"layers": cost[0]["layers"],
                 **{c: {v: timing_stats([t for rec in cost.values() for t in rec[f"{c}_s"][v]])
                        for v in variants} for c in clocks},
                 **{f"paired_{c}": {v: paired_cost(run, v, f"{c}_s") for v in variants[1:]}
                    for c in clocks}},
    }


def format_unused_error(summary: dict) -> str:
    """The error as the ranks got it, and which parameters it was about."""
    wrapped = "\n".join(textwrap.fill(line, 100) for line in summary["error_message"].splitlines())
    return (f"plain DDP(model) failed at step {summary['error_step']} (steps 0, 2, 4 use the aux head):\n"
            f"{wrapped}\n\nparameter indices in the message -> names: {', '.join(summary['unused_params'])}")


FIX_SETTINGS = {"find_unused": "find_unused_parameters=True", "static_graph": "static_graph=True"}
SCHEDULES = {"alternate": "the aux head on even steps only", "never": "the aux head never used"}


def format_unused_fixes(summary: dict) -> str:
    """Per fix: which parameters had no gradient at each step, the match with one process, and
    static_graph's own error on the alternating head, in full."""
    lines = []
    for name, setting in FIX_SETTINGS.items():
        f = summary[name]
        lines.append(f"DDP(model, {setting}), {SCHEDULES[f['schedule']]}:")
        per_step = [f"{step}: {', '.join(names) if names else 'none'}" for step, names in enumerate(f["without_grad"])]
        lines.append(textwrap.fill("parameters left without a gradient, per step: " + "; ".join(per_step), 100,
                                   initial_indent="  ", subsequent_indent="    "))
        lines.append(f"  every rank holds the same parameters: {f['ranks_agree']}; largest difference from one "
                     f"process on the global batch: {f['max_diff_reference']:.1e}")
    lines.append(f"DDP(model, static_graph=True), {SCHEDULES['alternate']}, fails:")
    lines += [textwrap.fill(line, 100, initial_indent="  ", subsequent_indent="  ")
              for line in summary["static_graph_message"].splitlines() if line.strip()]
    return "\n".join(lines)


def format_unused_verdict(summary: dict) -> str:
    """Each flag's extra cost per step in this run, paired step by step, by CPU and wall clock."""
    lines = []
    for flag, p in summary["cost"]["paired_cpu"].items():
        w = summary["cost"]["paired_wall"][flag]
        lines.append(f"{flag}: {p['median_ms']:+.3f} ms CPU per step ({100 * p['relative']:+.1f} %, "
                     f"median of {p['steps']} paired differences), slower in "
                     f"{100 * p['slower_fraction']:.0f} % of them; by the wall clock "
                     f"{w['median_ms']:+.3f} ms, slower in {100 * w['slower_fraction']:.0f} %")
    return "\n".join(lines)


def format_unused_cost(summary: dict) -> str:
    """Per wrapping, the median and quartiles of a step's time (the paired costs: the verdict)."""
    c = summary["cost"]
    spread = lambda t: f"{t['median_ms']:.2f} [{t['q1_ms']:.2f}, {t['q3_ms']:.2f}]"
    return text_table(["wrapping", "CPU of this thread", "wall clock"],
                      [(v, spread(c["cpu"][v]), spread(c["wall"][v])) for v in c["cpu"]],
                      f"{c['layers']} layers, one backward of each wrapping in turn; "
                      "per step, ms (median [quartiles]):")
