"""Notebook 09's pitfalls lab: each mistake happens, is measured, then fixed. Pitfall ``<name>``
runs ``workers/pitfall_<name>.py``; here its reports become what the notebook prints, plots and
asserts (pitfall 2's in ``unused.py``; ``common.py`` launches them). No torch is imported here."""

from __future__ import annotations

import textwrap
from typing import Dict, List

from ddp_tutorial.launcher import LaunchError
from ddp_tutorial.lessons import headline
from ddp_tutorial.lessons.pitfalls.common import (  # noqa: F401
    LAB, PITFALLS, expect_failure, max_abs_diff, part, per_rank, ranks_agree, records, run_lab,
    run_pitfall, script, show)
from ddp_tutorial.lessons.pitfalls.unused import (  # noqa: F401
    format_unused_cost, format_unused_error, format_unused_fixes, format_unused_verdict,
    unused_indices, unused_summary)
from ddp_tutorial.lessons.table import text_table
from ddp_tutorial.runfolder import Run


# -- Pitfall 1: BatchNorm statistics are per rank; a broadcast, an all-reduce and SyncBatchNorm --
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


# -- Pitfall 3: saving and loading a DDP model: the ``module.`` prefix, who saves, map_location --
def checkpoint_summary(run: Run) -> dict:
    """The ``module.`` error, the rescue, and the right save/load on every rank."""
    wrong, rescue = part(run, "checkpoint", "wrong"), part(run, "checkpoint", "rescue")
    right = per_rank(run, "checkpoint", "right")
    return {"saved_keys": wrong["keys"], "error": wrong["error"], "message": wrong.get("message", ""),
            "missing": wrong.get("missing"), "unexpected": wrong.get("unexpected"),
            "rescued_keys": rescue["keys"], "rescue_identical": rescue["identical"],
            "writers": [r for r, rec in right.items() if rec["wrote"]], "loaded_keys": right[0]["keys"],
            "saved_from": right[0]["saved_from"],
            **{key: {r: rec[key] for r, rec in right.items()} for key in ("identical", "loaded_on")}}


def format_checkpoint(summary: dict) -> str:
    s = summary
    message = "\n".join("    " + line.strip() for line in s["message"].splitlines()[1:3])
    return "\n".join([
        f"ddp.state_dict() keys: {s['saved_keys']}",
        f"plain_model.load_state_dict(...): RuntimeError: {s['error']}\n{message}",
        f"  -> {s['missing']} missing and {s['unexpected']} unexpected keys",
        f"after consume_prefix_in_state_dict_if_present: keys {s['rescued_keys']}, "
        f"bit-identical to the trained model: {s['rescue_identical']}",
        f"the right way: written by rank(s) {s['writers']}; keys {s['loaded_keys']}",
        "  loaded bit-identical on every rank: "
        + ", ".join(f"rank {r}: {v}" for r, v in s["identical"].items()),
        f"  saved from {s['saved_from']}; loaded onto "
        + ", ".join(f"rank {r}: {v}" for r, v in s["loaded_on"].items()),
    ])


# -- Pitfall 4: evaluation skewed by the sampler's padding, and the exact (correct, count) fix --
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


# -- Pitfall 5: one seed or one per rank: dropout masks, sampler orders and the model's start ---
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


# -- Pitfall 6: the learning rate for a W times larger global batch, with warm-up ---------------
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


# -- Pitfall 7: gradient clipping with accumulation: once, after the all-reduce -----------------
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


# -- Pitfall 8: debugging a hang: a shape mismatch, a missing rank, and what the messages say ---
def failure_summary(err: LaunchError) -> dict:
    """Who failed first, how and with which words; per rank its ``headlines`` (None: stopped by
    the launcher) and ``reports``; ``aborted``: the ranks a C++ abort killed."""
    output = err.run.output if err.run else {}
    tb = getattr(err, "traceback", "")
    return {
        "kind": type(err).__name__, "rank": getattr(err, "rank", None),
        "exit_code": getattr(err, "exit_code", None), "error": headline(tb.splitlines()),
        "seconds": getattr(err, "seconds", None),
        "headlines": {r: headline(lines) for r, lines in sorted(output.items())},
        "aborted": [r for r, lines in sorted(output.items()) if any("terminate called" in ln for ln in lines)],
        "names_script_line": "pitfall_hang.py" in tb,
        "reports": {r: err.run.results(r) for r in sorted(output)} if err.run else {},
    }


def shape_mismatch(debug: bool, timeout: float = 120.0) -> dict:
    """All-reduce tensors of two shapes on 2 ranks (``debug``: TORCH_DISTRIBUTED_DEBUG=DETAIL)."""
    env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"} if debug else None
    return failure_summary(expect_failure("hang", 2, ["--case", "mismatch"], timeout=timeout, env=env))


def missing_rank(monitored: bool, wait_timeout: float = 2.0, timeout: float = 120.0) -> dict:
    """A barrier rank 1 never reaches, plain or ``monitored``; given up after ``wait_timeout`` s."""
    args = ["--case", "missing", "--wait-timeout", wait_timeout] + (["--monitored"] if monitored else [])
    return failure_summary(expect_failure("hang", 2, args, timeout=timeout))


def format_failure(summary: dict) -> str:
    s = summary
    lines = [f"{s['kind']} after {s['seconds']:.1f} s: rank {s['rank']} failed first (exit code "
             f"{s['exit_code']}); ranks aborted by C++: {s['aborted'] or 'none'}; its traceback "
             f"reaches the script: {s['names_script_line']}"]
    for rank, line in s["headlines"].items():
        lines.append(textwrap.fill(f"rank {rank}: {line or '(no error: stopped by the launcher)'}", 110,
                                   subsequent_indent="    "))
    return "\n".join(lines)


# -- Recap --------------------------------------------------------------------------------------
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
