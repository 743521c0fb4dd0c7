"""The performance lab from the command line: what DDP costs here, and how fast the kit itself is.
One table: notebook 07's lab (``lessons/performance/``), then the kit's own speed in the same run
(launch speed; in full mode the notebook suite, cold then warm; with --suite the README's pytest).
``ddp_tutorial/bench.py`` is the command (``--help``: the modes that run one thing). No torch
here."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Dict, Optional, Sequence

from ddp_tutorial import envvars
from ddp_tutorial.lessons.performance.costmodel import GB, ring_time, sweep_table
from ddp_tutorial.lessons.performance.measure import (
    accumulation_ratios, allreduce_sweep, ddp_lab, gpu_part, ms, plain_crosscheck, projection, size)
from ddp_tutorial.lessons.table import text_table
from ddp_tutorial.maintainer import launch_speed, record, suite


def run_bench(quick: bool = False, out: Optional[str] = None,
              notebooks: Optional[bool] = None) -> Dict:
    """Every measurement and its analysis, saved into ``out``; ``notebooks``: time the notebook
    suite (default: in full mode only)."""
    t0 = time.perf_counter()
    results: Dict = {"quick": quick, "section_seconds": {}}

    def timed(name, measure, *args, **kwargs):
        start = time.perf_counter()
        results[name] = measure(*args, **kwargs)
        results["section_seconds"][name] = time.perf_counter() - start

    timed("allreduce", allreduce_sweep, (2, 4), quick=quick)
    timed("crosscheck", plain_crosscheck, results["allreduce"])
    timed("ddp", ddp_lab, 2, quick=quick,  # not grad_view: nothing the bench prints reads it
          sections=["buckets", "overlap", "accumulation", "overhead", "fidelity"])
    results["accumulation"] = accumulation_ratios(results["ddp"]["accumulation"])
    results["projection"] = projection(results["allreduce"], results["ddp"])
    # quick: 2 ranks once (a 4-rank cold comparison costs 16 torch imports)
    timed("launch", launch_speed.launch_speed, 1 if quick else 3, world_size=2 if quick else 4)
    timed("gpu", gpu_part, quick)
    if notebooks if notebooks is not None else not quick:
        for name, env in (("notebooks_cold", {envvars.WARM: "0"}), ("notebooks", None)):
            timed(name, suite.notebook_rounds, timeout=600.0, echo=False, env=env)
    results["bench_seconds"] = time.perf_counter() - t0
    if out:
        save(results, out)
    return results


def save(results: Dict, out: str) -> None:
    """``bench.json`` and one PNG per figure into ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    from ddp_tutorial.lessons.performance import plots

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "bench.json").write_text(json.dumps(results, indent=1, default=str))
    for name, figure in (
            ("allreduce_sweep", plots.plot_allreduce_sweep(results["allreduce"]).figure),
            ("bucket_sweep", plots.plot_bucket_sweep(results["ddp"]["buckets"]).figure),
            ("overlap", plots.plot_overlap(results["ddp"]["overlap"]).figure),
            ("accumulation", plots.plot_accumulation(results["accumulation"]).figure),
            ("scaling_projection", plots.plot_scaling_grid(results["projection"]))):
        figure.savefig(folder / f"{name}.png", dpi=110, bbox_inches="tight")
        matplotlib.pyplot.close(figure)


def bucket_speedup(lab: Dict) -> float:
    """Backward's time at the worst bucket size over its time at the best."""
    times = [r["backward_s"] for r in lab["buckets"]]
    return max(times) / min(times)


def _fit(f: Dict, digits: int = 2, r2: bool = True) -> str:
    return (f"alpha = {f['alpha_s'] * 1e6:.1f} us, B = {f['bandwidth'] / GB:.{digits}f} GB/s"
            + f", R^2 = {f['r2']:.3f} (log t), {f['r2_linear']:.3f} (t)" * r2)


def format_table(results: Dict) -> str:
    """The bench's printed report: every measured figure and ratio."""
    sweep, fit, ddp = results["allreduce"], results["allreduce"]["fit"], results["ddp"]
    c, o, proj = results["crosscheck"], ddp["overlap"], results["projection"]
    alphas = ", ".join(f"{name} {a * 1e6:.0f} us" for name, a in proj["alphas"].items())
    lines = [
        text_table(["ranks", "size", "latency", "algbw GB/s", "busbw GB/s", "model"], [
            (r["world_size"], size(r["bytes"]), ms(r["seconds"]), f"{r['algbw_GBps']:.3f}",
             f"{r['busbw_GBps']:.3f}",
             ms(ring_time(r["bytes"], r["world_size"], fit["alpha_s"], fit["bandwidth"])))
            for r in sweep["table"]],
            f"== all-reduce sweep ({sweep['backend']}, ranks {sweep['world_sizes']}) =="),
        f"ring fit: {_fit(fit)}; memcpy ceiling {sweep['memcpy_Bps'] / GB:.1f} GB/s",
        *(f"  fit of {w} ranks alone: {_fit(f)}" for w, f in sweep["fit_by_world_size"].items()),
        f"cross-check at 16 MB, {c['world_size']} ranks: plain loop alone {ms(c['plain_s'])}, "
        f"sweep {ms(c['sweep_s'])} ({c['sweep_gap']:.0%} apart), fit {ms(c['fit_s'])} "
        f"({c['fit_gap']:.0%} apart); target <= 20%",
        f"== DDP ({ddp['backend']}, {ddp['world_size']} ranks, model of {ddp['param_tensors']} "
        f"tensors, {ddp['model_bytes'] / 1e3:.0f} KB) ==",
        f"compute per sample (1 rank, no comm): {ddp['compute']['s_per_sample'] * 1e6:.1f} us",
        text_table(["bucket_cap_mb", "all-reduces/step", "backward"], [
            (f"{r['bucket_cap_mb']:g}", f"{r['allreduce_calls_per_step']:.1f}", ms(r["backward_s"]))
            for r in ddp["buckets"]]),
        f"backward, worst bucket size / best: {bucket_speedup(ddp):.2f}x (the DDP paper: > 2x)",
        f"overlap (bucket_cap_mb {o['bucket_cap_mb']}): iteration DDP {ms(o['ddp_step_s'])}, "
        f"per-gradient all-reduce after backward {ms(o['per_gradient_step_s'])}, one flat "
        f"all-reduce {ms(o['flat_step_s'])}; DDP logger: backward compute "
        f"{ms(o['avg_backward_compute_time_s'])}, comm {ms(o['avg_backward_comm_time_s'])}, "
        f"overlap {ms(o['avg_backward_compute_comm_overlap_time_s'])}",
        text_table(["K", "straggler", "time/sample", "transfer + wait", "vs K=1: transfer/sample",
                    "bytes", "(1/K)"], [
            (r["accum_steps"], f"{r['straggler_ms']:g} ms", f"{r['s_per_sample'] * 1e6:.1f} us",
             f"{ms(r['transfer_s_per_optimizer_step'])} + {ms(r['wait_s_per_optimizer_step'])}",
             f"{r['comm_per_sample_vs_k1']:.2f}", f"{r['bytes_per_sample_vs_k1']:.3f}",
             f"{r['ideal']:.3f}") for r in results["accumulation"]],
            "accumulation: per optimizer step, transfer + wait; per sample against K=1, "
            "transfer time and bytes"),
        text_table(["job", "alpha", "K", "25 GB/s", "100 GB/s", "450 GB/s"], [
            (p["job"], p["alpha"], p["accum_steps"], *(
                f"{p[f'{g}GBps@256']:.0%} / {p[f'{g}GBps@1024']:.0%}" for g in (25, 100, 450)))
            for p in proj["key"]],
            f"== scaling projection: efficiency at 256 / 1024 workers (alpha: {alphas}; "
            "bucket 25 MB) =="),
        "assumptions: " + "; ".join(proj["assumptions"]),
        "== the kit's own speed (side by side, this run) ==",
        *launch_speed.describe(results["launch"])]
    ov, fi = ddp["overhead"], ddp["fidelity"]
    lines += [f"instrumentation: SyncTimer + JSON line per step vs plain DDP, taking turns step by "
              f"step: {1 + ov['overhead']:.3f}x, median step {ms(ov['instrumented_step_s'])} vs "
              f"{ms(ov['plain_step_s'])} over {ov['steps']} steps each ({ov['overhead']:+.1%}; "
              "target <= +5%)",
              f"sync-time fidelity: SyncTimer {ms(fi['synctimer_s'])} vs DDP logger "
              f"avg_backward_comm_time {ms(fi['ddp_logger_s'])}: ratio {fi['ratio']:.2f} "
              "(target within 25%)",
              *suite.describe_notebook_suite(results.get("notebooks"),
                                             results.get("notebooks_cold"))]
    gpu = results["gpu"]
    if "skipped" in gpu:
        lines.append(f"GPU: skipped, {gpu['skipped']}")
    else:
        g, lab = gpu["sweep"], gpu["ddp"]
        lines += [f"GPU: backend=auto picked {gpu['auto_picked']}; wall-clock fit "
                  f"{_fit(g['fit'], 1, False)}; CUDA-event fit {_fit(g['cuda_fit'], 1, False)}",
                  f"GPU DDP ({lab['backend']}): backward worst/best bucket size "
                  f"{bucket_speedup(lab):.2f}x; iteration DDP {ms(lab['overlap']['ddp_step_s'])}, "
                  f"per-gradient {ms(lab['overlap']['per_gradient_step_s'])}, flat "
                  f"{ms(lab['overlap']['flat_step_s'])}; sync fidelity ratio "
                  f"{lab['fidelity']['ratio']:.2f}",
                  *(f"  cuda events {r['world_size']} ranks {size(r['bytes'])}: "
                    f"{ms(r['seconds'])}, busbw {r['busbw_GBps']:.1f} GB/s"
                    for r in sweep_table(g["cuda_samples"]))]
    sections = ", ".join(f"{k} {v:.0f} s" for k, v in results["section_seconds"].items())
    lines.append(f"bench wall time: {results['bench_seconds']:.0f} s ({sections})")
    return "\n".join(lines)


def headline_numbers(results: Dict) -> Dict[str, float]:
    """The fits and ratios the bench exists to produce, by name."""
    fit, ddp, launch = results["allreduce"]["fit"], results["ddp"], results["launch"]
    return {
        "alpha_s": fit["alpha_s"], "bandwidth": fit["bandwidth"], "r2": fit["r2"],
        "crosscheck_gap": results["crosscheck"]["sweep_gap"], "bucket_speedup": bucket_speedup(ddp),
        "overlap_s": ddp["overlap"]["avg_backward_compute_comm_overlap_time_s"],
        "launch_ratio": launch["ratio"], "launch_warm_ratio": launch["warm_ratio"],
        "instrumentation_overhead": ddp["overhead"]["overhead"],
        "sync_fidelity_ratio": ddp["fidelity"]["ratio"],
        **{f"efficiency[{p['job']}, {p['alpha']}, K={p['accum_steps']}, {k}]": v
           for p in results["projection"]["key"] for k, v in p.items() if "@" in k},
    }


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_tutorial.bench",
                                     description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="fewer sizes, steps, repeats and ranks (about 30 s)")
    add("--out", default=None, help="folder for bench.json and the figures")
    add("--notebooks", nargs="?", type=_positive_int, const=0, default=None, metavar="N",
        help="alone: time one `pytest --nbmake notebooks/` round (default in full mode); with N: "
             "only run the notebook suite N times, and print how often each notebook passed")
    add("--no-notebooks", dest="notebooks", action="store_const", const=-1,
        help="do not time the notebook suite")
    add("--busy-core", nargs="?", type=int, const=-1, default=0, metavar="K",
        help="with --notebooks N: keep one core busy in the last K rounds (all without K)")
    add("--sharding", action="store_true",
        help="only notebook 10's measurements: bytes held and sent per rank under DDP, ZeRO-1, "
             "FSDP2, compressed gradients")
    add("--grade", nargs="?", type=_positive_int, const=30, default=None, metavar="LEARNERS",
        help="only grade a generated class (30 learners x every exercise by default) with --jobs "
             "1, then 2 (needs root: see docs/grading.md)")
    add("--grade-jobs", default="1,2", metavar="N,N",
        help="with --grade: the --jobs values to compare (default: 1,2)")
    add("--suite", action="store_true",
        help="after the table, run the README's `pytest` once in a fresh clone (about 10 min)")
    return record.main("ddp_tutorial.bench", parser, _main, argv)


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.suite and (args.grade is not None or args.sharding or (args.notebooks or 0) > 0):
        parser.error("--suite goes with the bench's table, not with --grade, --sharding or "
                     "--notebooks N")
    if args.grade is not None:
        from ddp_tutorial.teacher.grade import classbench  # lazily: only this mode needs it

        rows = classbench.run(args.grade, [int(n) for n in args.grade_jobs.split(",")])
        print(classbench.format_rows(rows), flush=True)
        return 0
    if args.sharding:
        if args.quick or args.out or args.notebooks is not None or args.busy_core:
            parser.error("--sharding goes alone")
        from ddp_tutorial.lessons import sharding  # lazily: only this mode needs it

        print(sharding.report(sharding.run_lab()), flush=True)
        return 0
    if args.notebooks is not None and args.notebooks > 0:  # N rounds of the notebook suite alone
        busy = args.notebooks if args.busy_core < 0 else args.busy_core
        return suite.report(suite.notebook_rounds(args.notebooks, busy))
    if args.busy_core:
        parser.error("--busy-core goes with --notebooks N")
    notebooks = None if args.notebooks is None else args.notebooks == 0
    results = run_bench(args.quick, args.out, notebooks)
    print(format_table(results), flush=True)
    if args.out:
        print(f"saved {Path(args.out) / 'bench.json'} and figures", flush=True)
    bad = [k for k, v in headline_numbers(results).items()
           if not (isinstance(v, (int, float)) and math.isfinite(v))]
    if bad:
        print(f"not finite: {', '.join(bad)}", file=sys.stderr)
    code = 1 if bad else 0
    if args.suite:  # the README's pytest, side by side with the table in one run
        code |= suite.report(suite.suite_runs(1))
    return code

