"""Notebook 09's helpers, the pitfalls lab: each mistake happens, is measured, then fixed.

Pitfall ``<name>`` runs ``workers/pitfall_<name>.py``; ``<name>.py`` here turns its reports into
what the notebook prints, plots and asserts. No torch is imported here.
"""

from __future__ import annotations

import textwrap
from typing import Dict, List

from ddp_tutorial.lessons import headline  # noqa: F401  (pitfall 8 names errors with it)
from ddp_tutorial.lessons.pitfalls.common import (  # noqa: F401
    LAB, PITFALLS, expect_failure, max_abs_diff, part, per_rank, ranks_agree, records, run_lab,
    run_pitfall, script, show)
from ddp_tutorial.lessons.pitfalls.batchnorm import (  # noqa: F401
    BATCHNORM_VARIANTS, batchnorm_summary, format_batchnorm, format_broadcast_buffers)
from ddp_tutorial.lessons.pitfalls.unused import (  # noqa: F401
    format_unused_cost, format_unused_error, format_unused_fixes, format_unused_verdict,
    unused_indices, unused_summary)
from ddp_tutorial.lessons.pitfalls.checkpoint import checkpoint_summary, format_checkpoint  # noqa
from ddp_tutorial.lessons.pitfalls.evaluation import evaluation_rows, format_evaluation  # noqa
from ddp_tutorial.lessons.pitfalls.seeding import format_seeding, seeding_summary  # noqa: F401
from ddp_tutorial.lessons.pitfalls.lr import format_lr, lr_summary  # noqa: F401
from ddp_tutorial.lessons.pitfalls.clipping import clipping_summary, format_clipping  # noqa: F401
from ddp_tutorial.lessons.pitfalls.hang import (  # noqa: F401
    failure_summary, format_failure, missing_rank, shape_mismatch)


# -- Recap -------------------------------------------------------------------------
def recap(bn: dict, unused: dict, ckpt: dict, evaluation: dict, seeding: dict, lr: dict,
          clipping: dict, hang: Dict[str, dict]) -> List[dict]:
    """Per pitfall, the measured symptom and fix as text (``evaluation``: one row; ``hang``:
    the ``mismatch`` and ``monitored`` failure summaries)."""
    fu = unused["cost"]["paired_cpu"]["find_unused_parameters"]
    sd, pd = seeding["dropout"]["same_seed"], seeding["dropout"]["per_rank_seed"]
    ss, ps = seeding["sampler"]["same_seed"], seeding["sampler"]["per_rank_seed"]
    fix_bn = bn["syncbn"] if "errors" not in bn["syncbn"] else bn["allreduce"]
    no_sync, ev, n = bn["no_sync"], evaluation, seeding["dataset_size"]
    rows = [
        ("1 BatchNorm",
         f"running stats differ across ranks by {no_sync['across_ranks']:.3f} and from one "
         f"process by {no_sync['vs_reference']:.3f}; eval outputs differ by "
         f"{no_sync['eval_across_ranks']:.3f}",
         f"global batch stats: {fix_bn['vs_reference']:.0e} from one process, "
         f"{fix_bn['across_ranks']:.0e} across ranks"),
        ("2 unused parameters",
         f"step {unused['error_step']}: 'Expected to have finished reduction...' "
         f"({', '.join(unused['unused_params'])})",
         f"find_unused_parameters: {unused['find_unused']['max_diff_reference']:.0e} from one "
         f"process, {fu['median_ms']:+.2f} ms CPU/step ({100 * fu['relative']:+.0f} %); "
         "static_graph when the unused set never changes"),
        ("3 save/load",
         f"{ckpt['missing']} missing + {ckpt['unexpected']} unexpected keys ('module.' prefix)",
         f"rank 0 saves module.state_dict(), barrier, map_location: identical on "
         f"{sum(ckpt['identical'].values())}/{len(ckpt['identical'])} ranks"),
        ("4 evaluation",
         f"{ev['size']} samples, {ev['world_size']} ranks: {ev['padded']:.4f} (every slot) / "
         f"{ev['mean_of_means']:.4f} (mean of means) vs true {ev['true']:.4f}",
         f"(correct, count) over real samples: {ev['fixed_counts'][0]}/{ev['fixed_counts'][1]} = "
         f"{ev['fixed']:.4f}"),
        ("5 seeding",
         f"one seed: {sd['distinct_per_step'][0]} distinct dropout masks of {sd['rows_per_step']}; "
         f"sampler seed + rank: {ps['never']} of {n} samples never seen",
         f"seed + rank after DDP: {pd['distinct_per_step'][0]} of {pd['rows_per_step']}; "
         f"one sampler seed: {ss['distinct']} of {n} seen once"),
        ("6 learning rate",
         f"W={lr['world_size']}, lr kept: final loss {lr['final_ratio']['kept']:.2f} x one "
         "process's",
         f"lr x {lr['world_size']} with warm-up: {lr['final_ratio']['scaled']:.2f} x"),
        ("7 clipping + accumulation",
         f"clip every micro-step: params {clipping['wrong']['max_diff'][-1]:.1e} from one process",
         f"clip once after the all-reduce: {clipping['right']['max_diff'][-1]:.0e}"),
        ("8 hang",
         f"shape mismatch: rank(s) {hang['mismatch']['aborted']} aborted in C++; "
         "stuck rank + barrier: timeout naming no rank",
         "DETAIL: RuntimeError naming both shapes; monitored_barrier: "
         f"'{(hang['monitored']['error'] or '').split('Error: ', 1)[-1]}'"),
    ]
    return [dict(zip(("pitfall", "symptom", "fix"), row)) for row in rows]

def format_recap(rows: List[dict]) -> str:
    lines = []
    for r in rows:
        lines.append(r["pitfall"])
        lines += [textwrap.fill(f"{key + ':':<9}{r[key]}", 110, initial_indent="  ",
                                subsequent_indent="    ") for key in ("symptom", "fix")]
    return "\n".join(lines)
