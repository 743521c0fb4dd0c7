"""Notebook helpers of lesson 09, the pitfalls lab: each mistake happens, is measured, then fixed.

Each pitfall has a worker script ``workers/pitfall_<name>.py`` and, beside it, a
module ``<name>.py`` here that turns the ranks' reports into the numbers the
notebook prints, plots and asserts (``common.py`` launches the scripts, or, for
the ones that must fail, catches the failure and returns it). This package
gathers their names, so ``pitfalls.batchnorm_summary`` and the like work as one
module's. No torch is imported here.

    lab = run_lab()                                       # pitfalls 1-3 and 5-7 on one set of 2 ranks
    bn = batchnorm_summary(lab)                           # 1. BatchNorm statistics per rank
    print(format_batchnorm(bn))
    mismatch = shape_mismatch(debug=True)                 # 8. a failure, caught and described
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
    format_unused_cost, format_unused_error, format_unused_fixes, format_unused_verdict, paired_cost, timing_stats,
    unused_indices, unused_summary)
from ddp_tutorial.lessons.pitfalls.checkpoint import (  # noqa: F401
    checkpoint_summary, format_checkpoint)
from ddp_tutorial.lessons.pitfalls.evaluation import (  # noqa: F401
    evaluation_rows, format_evaluation)
from ddp_tutorial.lessons.pitfalls.seeding import (  # noqa: F401
    format_seeding, seeding_summary)
from ddp_tutorial.lessons.pitfalls.lr import (  # noqa: F401
    format_lr, lr_summary)
from ddp_tutorial.lessons.pitfalls.clipping import (  # noqa: F401
    clipping_summary, format_clipping)
from ddp_tutorial.lessons.pitfalls.hang import (  # noqa: F401
    failure_summary, format_failure, missing_rank, shape_mismatch)


# -- Recap -------------------------------------------------------------------------
def recap(bn: dict, unused: dict, ckpt: dict, evaluation: dict, seeding: dict, lr: dict, clipping: dict,
          hang: Dict[str, dict]) -> List[dict]:
    """Per pitfall, the measured symptom and the measured effect of the fix, as text: from the
    summaries above, one row of ``evaluation_rows``, and in ``hang`` the ``shape_mismatch`` and
    ``missing_rank`` results (``mismatch``, ``mismatch_detail``, ``barrier``, ``monitored``)."""
    fu = unused["cost"]["paired_cpu"]["find_unused_parameters"]
    sd, pd = seeding["dropout"]["same_seed"], seeding["dropout"]["per_rank_seed"]
    ss, ps = seeding["sampler"]["same_seed"], seeding["sampler"]["per_rank_seed"]
    fix_bn = bn["syncbn"] if "errors" not in bn["syncbn"] else bn["allreduce"]
    return [
        {"pitfall": "1 BatchNorm",
         "symptom": f"running stats differ across ranks by {bn['no_sync']['across_ranks']:.3f} and from one "
                    f"process by {bn['no_sync']['vs_reference']:.3f}; eval outputs differ by "
                    f"{bn['no_sync']['eval_across_ranks']:.3f}",
         "fix": f"global batch stats: {fix_bn['vs_reference']:.0e} from one process, "
                f"{fix_bn['across_ranks']:.0e} across ranks"},
        {"pitfall": "2 unused parameters",
         "symptom": f"step {unused['error_step']}: 'Expected to have finished reduction...' "
                    f"({', '.join(unused['unused_params'])})",
         "fix": f"find_unused_parameters: {unused['find_unused']['max_diff_reference']:.0e} from one process, "
                f"{fu['median_ms']:+.2f} ms CPU/step ({100 * fu['relative']:+.0f} %); static_graph when the unused "
                "set never changes"},
        {"pitfall": "3 save/load",
         "symptom": f"{ckpt['missing']} missing + {ckpt['unexpected']} unexpected keys ('module.' prefix)",
         "fix": f"rank 0 saves module.state_dict(), barrier, map_location: identical on "
                f"{sum(ckpt['identical'].values())}/{len(ckpt['identical'])} ranks"},
        {"pitfall": "4 evaluation",
         "symptom": f"{evaluation['size']} samples, {evaluation['world_size']} ranks: {evaluation['padded']:.4f} "
                    f"(every slot) / {evaluation['mean_of_means']:.4f} (mean of means) vs true {evaluation['true']:.4f}",
         "fix": f"(correct, count) over real samples: {evaluation['fixed_counts'][0]}/{evaluation['fixed_counts'][1]}"
                f" = {evaluation['fixed']:.4f}"},
        {"pitfall": "5 seeding",
         "symptom": f"one seed: {sd['distinct_per_step'][0]} distinct dropout masks of {sd['rows_per_step']}; "
                    f"sampler seed + rank: {ps['never']} of {seeding['dataset_size']} samples never seen",
         "fix": f"seed + rank after DDP: {pd['distinct_per_step'][0]} of {pd['rows_per_step']}; one sampler seed: "
                f"{ss['distinct']} of {seeding['dataset_size']} seen once"},
        {"pitfall": "6 learning rate",
         "symptom": f"W={lr['world_size']}, lr kept: final loss {lr['final_ratio']['kept']:.2f} x one process's",
         "fix": f"lr x {lr['world_size']} with warm-up: {lr['final_ratio']['scaled']:.2f} x"},
        {"pitfall": "7 clipping + accumulation",
         "symptom": f"clip every micro-step: params {clipping['wrong']['max_diff'][-1]:.1e} from one process",
         "fix": f"clip once after the all-reduce: {clipping['right']['max_diff'][-1]:.0e}"},
        {"pitfall": "8 hang",
         "symptom": f"shape mismatch: rank(s) {hang['mismatch']['aborted']} aborted in C++; stuck rank + barrier: "
                    "timeout naming no rank",
         "fix": "DETAIL: RuntimeError naming both shapes; monitored_barrier: "
                f"'{(hang['monitored']['error'] or '').split('Error: ', 1)[-1]}'"},
    ]


def format_recap(rows: List[dict]) -> str:
    lines = []
    for r in rows:
        lines += [r["pitfall"], textwrap.fill("symptom: " + r["symptom"], 110, initial_indent="  ",
                                              subsequent_indent="    "),
                  textwrap.fill("fix:     " + r["fix"], 110, initial_indent="  ", subsequent_indent="    ")]
    return "\n".join(lines)
