"""Notebook helpers of lesson 09, the pitfalls lab: each mistake happens, is measured, then fixed.

Each pitfall has a worker script ``scripts/pitfall_<name>.py``. The helpers here
launch it (or, for the ones that must fail, catch the failure and return it)
and turn the ranks' reports into the numbers the notebook prints, plots and
asserts. No torch is imported here.

    lab = run_lab()                                       # pitfalls 1-3 and 5-7 on one set of 2 ranks
    bn = batchnorm_summary(lab)                           # 1. BatchNorm statistics per rank
    print(format_batchnorm(bn))
    mismatch = shape_mismatch(debug=True)                 # 8. a failure, caught and described
"""

from __future__ import annotations

import re
import statistics
import textwrap
import time
from typing import Dict, List, Optional, Sequence

from ddp_tutorial.launcher import LaunchError, launch, scripts_path
from ddp_tutorial.lessons import headline, script_source
from ddp_tutorial.runfolder import Run

PITFALLS = ("batchnorm", "unused", "checkpoint", "evaluation", "seeding", "lr", "clipping", "hang")


def script(name: str) -> str:
    """Path of the worker script of pitfall ``name`` (one of ``PITFALLS``)."""
    if name not in PITFALLS:
        raise ValueError(f"no pitfall {name!r}; one of {', '.join(PITFALLS)}")
    return scripts_path(f"pitfall_{name}.py")


def show(name: str, function: str) -> None:
    """Print the source of ``function`` in pitfall ``name``'s worker script (read, not imported)."""
    print(script_source(script(name), function))


# -- Launching ---------------------------------------------------------------------
def run_pitfall(name: str, world_size: int = 2, args: Sequence = (), timeout: float = 120.0,
                echo: str = "none", **launch_kwargs) -> Run:
    """Launch pitfall ``name``'s worker script on ``world_size`` ranks and return its ``Run``.

    Args:
        name: one of ``PITFALLS``.
        world_size: number of ranks.
        args: flags for the script (see its docstring).
        timeout: seconds before the launch counts as hung.
        echo: which ranks' output to print.
        **launch_kwargs: passed to ``launch`` (e.g. ``env``, ``backend``, ``run_dir``).
    """
    return launch(script(name), world_size, [str(a) for a in args], timeout=timeout, echo=echo,
                  **launch_kwargs)


#: The pitfalls that run on 2 ranks and finish: one launch runs them all (``run_lab``).
LAB = ("batchnorm", "unused", "checkpoint", "seeding", "lr", "clipping")


def run_lab(pitfalls: Sequence[str] = LAB, world_size: int = 2, timeout: float = 180.0, **launch_kwargs) -> Run:
    """Launch ``pitfall_lab.py``: the scripts of ``pitfalls`` one after another on the same ranks.

    Every script reports as it does alone, so each summary below reads this
    run as it would read the script's own. One start of the ranks instead of one per pitfall.
    """
    unknown = [p for p in pitfalls if p not in PITFALLS]
    if unknown:
        raise ValueError(f"no pitfall(s) {unknown}; one of {', '.join(PITFALLS)}")
    return launch(scripts_path("pitfall_lab.py"), world_size, list(pitfalls), timeout=timeout, echo="none",
                  **launch_kwargs)


def expect_failure(name: str, world_size: int = 2, args: Sequence = (), timeout: float = 120.0,
                   env: Optional[Dict[str, str]] = None) -> LaunchError:
    """Launch a run that must fail; return the ``LaunchError`` (with ``seconds``: how long it took).

    Raises:
        RuntimeError: the launch finished cleanly, so the pitfall did not happen.
    """
    t0 = time.monotonic()
    try:
        run_pitfall(name, world_size, args, timeout=timeout, env=env)
    except LaunchError as err:
        err.seconds = time.monotonic() - t0
        return err
    raise RuntimeError(f"pitfall_{name}.py {' '.join(map(str, args))} finished without failing")


def records(run: Run, pitfall: str, name: str, rank: int) -> List[dict]:
    """What ``rank`` reported for part ``name`` of ``pitfall``, in order."""
    return [rec for rec in run.results(rank) if rec.get("pitfall") == pitfall and rec.get("part") == name]


def part(run: Run, pitfall: str, name: str, rank: int = 0) -> dict:
    """The last record of part ``name`` of ``pitfall`` that ``rank`` reported (KeyError if none)."""
    found = records(run, pitfall, name, rank)
    if not found:
        raise KeyError(f"rank {rank} reported no part {name!r} of {pitfall!r} in {run.run_dir}")
    return found[-1]


def per_rank(run: Run, pitfall: str, name: str) -> Dict[int, dict]:
    """Rank -> its last record of part ``name`` of ``pitfall``, for the ranks that reported one."""
    found = {rank: records(run, pitfall, name, rank) for rank in range(run.world_size)}
    return {rank: recs[-1] for rank, recs in found.items() if recs}


def max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """Largest absolute difference between two equally long lists of numbers."""
    if len(a) != len(b):
        raise ValueError(f"lengths differ: {len(a)} vs {len(b)}")
    return max(abs(x - y) for x, y in zip(a, b))


def _agree(records: Dict[int, dict], key: str) -> bool:
    return len({str(rec[key]) for rec in records.values()}) == 1


# -- 1. BatchNorm ------------------------------------------------------------------
BATCHNORM_VARIANTS = {
    "no_sync": "plain BatchNorm, no buffer sync",
    "broadcast": "plain BatchNorm, DDP default",
    "allreduce": "all-reduced batch statistics",
    "syncbn": "SyncBatchNorm",
}


def batchnorm_summary(run: Run) -> dict:
    """What each BatchNorm variant left on each rank, against one process on the global batch.

    Per trained variant: ``running_mean`` per rank; the largest difference of the
    running statistics (means and variances) ``across_ranks`` and ``vs_reference``;
    ``params_vs_reference``; ``eval_across_ranks`` (eval-mode outputs on one
    validation batch); ``starts_equal`` (every forward began from the same
    buffers on every rank); ``rank0_vs_own_ema`` (rank 0's running mean against
    the running mean of its own batches alone). A refused variant has ``errors``.
    """
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
            "starts_equal": _agree(recs, "forward_start_means"),
            "rank0_vs_own_ema": max_abs_diff(recs[0]["running_mean"], recs[0]["own_ema"]),
        }
    return out


def format_batchnorm(summary: dict) -> str:
    """One line per variant: how far apart the ranks are, and how far from one process."""
    lines = [f"{summary['world_size']} ranks, torch {summary['torch']}, device {summary['device']}; "
             "largest absolute differences:",
             f"{'variant':<33}{'stats across':>13}{'stats vs one':>13}{'eval outputs':>13}{'params vs one':>14}",
             f"{'':<33}{'ranks':>13}{'process':>13}{'across ranks':>13}{'process':>14}"]
    for name, label in BATCHNORM_VARIANTS.items():
        v = summary[name]
        if "errors" in v:
            lines.append(f"{label:<33}refused on {summary['device']}: " + " / ".join(v["errors"]))
            continue
        lines.append(f"{label:<33}{v['across_ranks']:>13.2e}{v['vs_reference']:>13.2e}"
                     f"{v['eval_across_ranks']:>13.2e}{v['params_vs_reference']:>14.2e}")
    return "\n".join(lines)


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


# -- 2. Unused parameters ----------------------------------------------------------
def unused_indices(message: str) -> List[int]:
    """The indices in "Parameter indices which did not receive grad for rank N: i j ..."."""
    m = re.search(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)", message)
    return [int(i) for i in m.group(1).split()] if m else []


def timing_stats(values: Sequence[float]) -> dict:
    """Median and quartiles, in milliseconds."""
    q1, _, q3 = statistics.quantiles(values, n=4)
    return {"median_ms": 1e3 * statistics.median(values), "q1_ms": 1e3 * q1, "q3_ms": 1e3 * q3}


def paired_cost(run: Run, variant: str, clock: str = "cpu_s", baseline: str = "no flag") -> dict:
    """Per step, ``variant``'s time minus the baseline's, both taken in turn, pooled over ranks.

    Returns:
        ``median_ms`` of the differences, ``relative`` (that over the baseline's
        median), ``slower_fraction`` (share of steps where the variant took longer), ``steps``.
    """
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
                       "ranks_agree": _agree(recs, "digest"), "max_diff_reference": recs[0]["max_diff_reference"]}
    cost = per_rank(run, "unused", "cost")
    variants = list(cost[0]["cpu_s"])
    return {
        "error_step": err["step"], "error_first_line": err["first_line"], "error_message": err["message"],
        "unused_params": [names[i] for i in unused_indices(err["message"])], "param_names": names,
        **fixes,
        "static_graph_error": part(run, "unused", "static_graph_error")["first_line"],
        "cost": {"layers": cost[0]["layers"],
                 "cpu": {v: timing_stats([t for rec in cost.values() for t in rec["cpu_s"][v]]) for v in variants},
                 "wall": {v: timing_stats([t for rec in cost.values() for t in rec["wall_s"][v]]) for v in variants},
                 "paired_cpu": {v: paired_cost(run, v) for v in variants[1:]},
                 "paired_wall": {v: paired_cost(run, v, "wall_s") for v in variants[1:]}},
    }


def format_unused_error(summary: dict) -> str:
    """The error as the ranks got it, and which parameters it was about."""
    wrapped = "\n".join(textwrap.fill(line, 100) for line in summary["error_message"].splitlines())
    return (f"plain DDP(model) failed at step {summary['error_step']} (steps 0, 2, 4 use the aux head):\n"
            f"{wrapped}\n\nparameter indices in the message -> names: {', '.join(summary['unused_params'])}")


def format_unused_fixes(summary: dict) -> str:
    """Per fix: which parameters had no gradient per step, and the match with one process."""
    lines = []
    for name in ("find_unused", "static_graph"):
        f = summary[name]
        skipped = ["-" if not names else "+".join(n.split(".")[0] for n in names) for names in f["without_grad"]]
        lines.append(f"{name:<13} schedule '{f['schedule']}': no gradient per step: {' '.join(skipped)}; "
                     f"ranks identical: {f['ranks_agree']}; vs one process: {f['max_diff_reference']:.1e}")
    lines.append(f"static_graph on the alternating schedule: {summary['static_graph_error'][:160]}...")
    return "\n".join(lines)


def format_unused_cost(summary: dict) -> str:
    """Medians per wrapping, then each flag's paired extra cost per step."""
    c = summary["cost"]
    lines = [f"{c['layers']} layers, one backward of each wrapping in turn; per step, ms (median [quartiles]):",
             f"{'wrapping':<24}{'CPU of this thread':>24}{'wall clock':>24}"]
    for v in c["cpu"]:
        cpu, wall = c["cpu"][v], c["wall"][v]
        lines.append(f"{v:<24}{cpu['median_ms']:>8.2f} [{cpu['q1_ms']:5.2f}, {cpu['q3_ms']:5.2f}]"
                     f"{wall['median_ms']:>10.2f} [{wall['q1_ms']:5.2f}, {wall['q3_ms']:5.2f}]")
    for v, p in c["paired_cpu"].items():
        w = c["paired_wall"][v]
        lines.append(f"{v}: {p['median_ms']:+.3f} ms CPU per step ({100 * p['relative']:+.1f} %), slower in "
                     f"{100 * p['slower_fraction']:.0f} % of {p['steps']} paired steps; wall {w['median_ms']:+.3f} ms "
                     f"({100 * w['relative']:+.1f} %)")
    return "\n".join(lines)


# -- 3. Saving and loading ---------------------------------------------------------
def checkpoint_summary(run: Run) -> dict:
    """The ``module.`` error, the rescue, and the right save/load on every rank."""
    wrong, rescue = part(run, "checkpoint", "wrong"), part(run, "checkpoint", "rescue")
    right = per_rank(run, "checkpoint", "right")
    return {"saved_keys": wrong["keys"], "error": wrong["error"], "message": wrong.get("message", ""),
            "missing": wrong.get("missing"), "unexpected": wrong.get("unexpected"),
            "rescued_keys": rescue["keys"], "rescue_identical": rescue["identical"],
            "writers": [r for r, rec in right.items() if rec["wrote"]],
            "loaded_keys": right[0]["keys"], "identical": {r: rec["identical"] for r, rec in right.items()},
            "saved_from": right[0]["saved_from"], "loaded_on": {r: rec["loaded_on"] for r, rec in right.items()}}


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
        "  loaded bit-identical on every rank: " + ", ".join(f"rank {r}: {v}" for r, v in s["identical"].items()),
        f"  saved from {s['saved_from']}; loaded onto " + ", ".join(f"rank {r}: {v}" for r, v in s["loaded_on"].items()),
    ])


# -- 4. Evaluation -----------------------------------------------------------------
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
            "fixed_on_every_rank": _agree(recs, "real_counts"),
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
                  ""]
    lines.append(f"{'size':>5}{'padding':>8}{'mean of means':>15}{'every slot':>12}{'real only':>11}{'true':>8}")
    lines += [f"{r['size']:>5}{r['padding']:>8}{r['mean_of_means']:>15.4f}{r['padded']:>12.4f}"
              f"{r['fixed']:>11.4f}{r['true']:>8.4f}" for r in rows]
    return "\n".join(lines)


# -- 5. Seeding --------------------------------------------------------------------
def _coverage(sampler: Dict[int, dict], key: str, dataset_size: int) -> dict:
    seen = [i for rec in sampler.values() for i in rec[key]]
    distinct = len(set(seen))
    return {"seen": len(seen), "distinct": distinct, "twice_or_more": len(seen) - distinct,
            "never": dataset_size - distinct}


def _masks(dropout: Dict[int, dict], key: str) -> dict:
    steps = len(dropout[0][key])
    distinct = [len({row for rec in dropout.values() for row in rec[key][s]}) for s in range(steps)]
    rows = sum(len(rec[key][0]) for rec in dropout.values())
    bits = agree = 0
    for rank, rec in dropout.items():
        if rank == 0:
            continue
        for s in range(steps):
            for mine, theirs in zip(rec[key][s], dropout[0][key][s]):
                bits += len(mine)
                agree += sum(a == b for a, b in zip(mine, theirs))
    return {"distinct_per_step": distinct, "rows_per_step": rows, "agreement_with_rank0": agree / bits}


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
    s, lines = summary, []
    for key, label in (("same_seed", "one seed on every rank"), ("per_rank_seed", "seed + rank")):
        c, m, d = s["sampler"][key], s["dropout"][key], s["init_distinct"][key]
        lines += [f"{label}:",
                  f"  fresh models: {d} distinct of {s['world_size']}",
                  f"  sampler: {c['seen']} slots, {c['distinct']} distinct samples of {s['dataset_size']}; "
                  f"{c['twice_or_more']} seen twice or more, {c['never']} never",
                  f"  dropout masks per step: {m['distinct_per_step']} distinct of {m['rows_per_step']} samples; "
                  f"ranks agree on {100 * m['agreement_with_rank0']:.0f} % of the mask bits"]
    return "\n".join(lines)


# -- 6. Learning rate and global batch --------------------------------------------
def lr_summary(run: Run) -> dict:
    """Loss curves (loss on the whole set against samples seen) and their final ratios to W = 1."""
    c = part(run, "lr", "curves")
    curves = {k: c[k] for k in ("single", "kept", "scaled")}
    return {"world_size": c["world_size"], "batch_size": c["batch_size"],
            "global_batch": c["world_size"] * c["batch_size"], "lr": c["lr"], "scaled_lr": c["scaled_lr"],
            "warmup_steps": c["warmup_steps"], "samples": c["samples"], "curves": curves,
            "final": {k: v[-1] for k, v in curves.items()},
            "final_ratio": {k: v[-1] / curves["single"][-1] for k, v in curves.items() if k != "single"}}


def format_lr(summary: dict) -> str:
    s, w = summary, summary["world_size"]
    rows = [(f"one process, lr {s['lr']:g}", "single"), (f"{w} ranks, lr kept at {s['lr']:g}", "kept"),
            (f"{w} ranks, lr {s['scaled_lr']:g} after {s['warmup_steps']} warm-up steps", "scaled")]
    lines = [f"W = {w} ranks x b = {s['batch_size']} (K = 1): global batch {s['global_batch']}; "
             f"one process: batch {s['batch_size']}",
             f"final loss after {s['samples'][-1]} samples seen (and its ratio to one process's):"]
    for label, key in rows:
        ratio = f"  ({s['final_ratio'][key]:.2f} x)" if key != "single" else ""
        lines.append(f"  {label:<40}{s['final'][key]:.4f}{ratio}")
    return "\n".join(lines)


# -- 7. Clipping with accumulation -------------------------------------------------
def clipping_summary(run: Run) -> dict:
    """Per variant: distance from one process after each step, ranks agreeing, the norms clipped."""
    out = {}
    for name in ("right", "wrong"):
        recs = per_rank(run, "clipping", name)
        out[name] = {"max_diff": recs[0]["max_diff"], "ranks_agree": _agree(recs, "digest"),
                     "norms": {r: rec["norms"] for r, rec in recs.items()}}
    right = part(run, "clipping", "right")
    out["reference_norms"], out["max_norm"] = right["reference_norms"], right["max_norm"]
    return out


def format_clipping(summary: dict) -> str:
    s = summary
    lines = [f"clip_grad_norm_(max_norm={s['max_norm']}); global-batch gradient norm of one process per step: "
             + ", ".join(f"{n:.3f}" for n in s["reference_norms"])]
    for name, what in (("right", "clip once, after the all-reduce"), ("wrong", "clip every micro-step")):
        v = s[name]
        lines.append(f"{what:<32} params vs one process per step: "
                     + ", ".join(f"{d:.1e}" for d in v["max_diff"]) + f"; ranks identical: {v['ranks_agree']}")
    first = {r: ", ".join(f"{n:.3f}" for n in norms[0]) for r, norms in s["wrong"]["norms"].items()}
    lines.append("norms the wrong clips saw in step 0: " + "; ".join(f"rank {r}: {v}" for r, v in first.items()))
    return "\n".join(lines)


# -- 8. Debugging a hang -----------------------------------------------------------
def failure_summary(err: LaunchError) -> dict:
    """What a failed launch tells the learner: who failed, how, and with which words.

    Returns:
        ``kind`` (WorkerError or LaunchTimeout), ``rank``, ``exit_code`` and
        ``error`` (its error line) of the first failure, ``seconds``, per rank
        its ``headlines`` (its last error line; None for a rank the launcher
        stopped first) and ``reports``, ``aborted`` (ranks killed by a C++
        abort), ``names_script_line`` (the first failure's traceback reaches the worker script).
    """
    output = err.run.output if err.run else {}
    tb = getattr(err, "traceback", "")
    return {
        "kind": type(err).__name__, "rank": getattr(err, "rank", None), "exit_code": getattr(err, "exit_code", None),
        "error": headline(tb.splitlines()), "seconds": getattr(err, "seconds", None),
        "headlines": {r: headline(lines) for r, lines in sorted(output.items())},
        "aborted": [r for r, lines in sorted(output.items()) if any("terminate called" in ln for ln in lines)],
        "names_script_line": "pitfall_hang.py" in tb,
        "reports": {r: err.run.results(r) for r in sorted(output)} if err.run else {},
    }


def shape_mismatch(debug: bool, timeout: float = 120.0) -> dict:
    """All-reduce tensors of different shapes on 2 ranks; with ``debug``, under TORCH_DISTRIBUTED_DEBUG=DETAIL."""
    env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"} if debug else None
    return failure_summary(expect_failure("hang", 2, ["--case", "mismatch"], timeout=timeout, env=env))


def missing_rank(monitored: bool, wait_timeout: float = 2.0, timeout: float = 120.0) -> dict:
    """A barrier rank 1 never reaches, plain or ``monitored_barrier``; it gives up after ``wait_timeout`` s."""
    args = ["--case", "missing", "--wait-timeout", wait_timeout] + (["--monitored"] if monitored else [])
    return failure_summary(expect_failure("hang", 2, args, timeout=timeout))


def format_failure(summary: dict) -> str:
    s = summary
    lines = [f"{s['kind']} after {s['seconds']:.1f} s: rank {s['rank']} failed first (exit code {s['exit_code']}); "
             f"ranks aborted by C++: {s['aborted'] or 'none'}; its traceback reaches the script: "
             f"{s['names_script_line']}"]
    for rank, line in s["headlines"].items():
        lines.append(textwrap.fill(f"rank {rank}: {line or '(no error: stopped by the launcher)'}", 110,
                                   subsequent_indent="    "))
    return "\n".join(lines)


# -- Recap -------------------------------------------------------------------------
def recap(bn: dict, unused: dict, ckpt: dict, evaluation: dict, seeding: dict, lr: dict, clipping: dict,
          hang: Dict[str, dict]) -> List[dict]:
    """Per pitfall, the measured symptom and the measured effect of the fix, as text.

    Args:
        bn, unused, ckpt, seeding, lr, clipping: the summaries above.
        evaluation: one row of ``evaluation_rows``.
        hang: ``shape_mismatch`` and ``missing_rank`` results under keys
            ``mismatch``, ``mismatch_detail``, ``barrier``, ``monitored``.
    """
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

