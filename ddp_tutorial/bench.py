"""The performance lab from the command line: what DDP costs here, and how fast the kit itself is.

    python -m ddp_tutorial.bench              # full: 2-3 minutes on 2 CPU cores, plus the notebook suite
    python -m ddp_tutorial.bench --quick      # fewer sizes, steps and ranks: about 30 s
    python -m ddp_tutorial.bench --out runs/bench
    python -m ddp_tutorial.bench --sharding   # only notebook 10's measurements: DDP, ZeRO-1, FSDP2, compression
    python -m ddp_tutorial.bench --notebooks 5 --busy-core 2   # only the notebook suite, 5 rounds
    python -m ddp_tutorial.bench --grade      # only the grader: 30 learners, --jobs 1, then 2

It prints one table: the all-reduce sweep and its α-β fit, buckets, overlap,
accumulation, the scaling projection (the lab: ``perf/``, which notebook 07 calls too),
and the kit's own speed, measured side by side in the same run by the maintainer's tools
(``maintainer/launch_speed.py``: launches cold, warm and by torchrun; ``maintainer/suite.py``:
in full mode the notebook suite with every launch cold, then warm). ``--grade`` is the
teacher's (``teacher/grade/classbench.py``). ``--out`` gets ``bench.json`` and the figures.
This module imports no torch: the measurements run in worker processes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Dict, Optional, Sequence

from ddp_tutorial.perf import costmodel as perf
from ddp_tutorial.perf.measure import (accumulation_ratios, allreduce_sweep, ddp_lab, gpu_part, plain_crosscheck,
                                       projection)
from ddp_tutorial.maintainer import suite
from ddp_tutorial.maintainer import launch_speed


# -- The whole bench ------------------------------------------------------------
def run_bench(quick: bool = False, out: Optional[str] = None, notebooks: Optional[bool] = None) -> Dict:
    """Every measurement, its analysis and (with ``out``) ``bench.json`` and the figures.

    Args:
        quick: the short version (tests, the notebook).
        out: folder for ``bench.json`` and the PNG figures (nothing saved if None).
        notebooks: time the notebook suite (default: only in full mode).
    """
    t0 = time.perf_counter()
    results: Dict = {"quick": quick, "section_seconds": {}}

    def timed(name, measure, *args, **kwargs):
        start = time.perf_counter()
        results[name] = measure(*args, **kwargs)
        results["section_seconds"][name] = time.perf_counter() - start

    timed("allreduce", allreduce_sweep, (2, 4), quick=quick)
    timed("crosscheck", plain_crosscheck, results["allreduce"])
    timed("ddp", ddp_lab, 2, quick=quick)
    results["accumulation"] = accumulation_ratios(results["ddp"]["accumulation"])
    results["projection"] = projection(results["allreduce"], results["ddp"])
    # Quick: one repeat on 2 ranks (a 4-rank cold comparison costs 4 torch imports per launch, 16 in all);
    # the full bench compares 4 ranks, 3 times.
    timed("launch", launch_speed.launch_speed, 1 if quick else 3, world_size=2 if quick else 4)
    timed("gpu", gpu_part, quick)
    if notebooks if notebooks is not None else not quick:
        timed("notebooks_cold", suite.notebook_suite, warm=False)  # as before warm launches
        timed("notebooks", suite.notebook_suite)
    results["bench_seconds"] = time.perf_counter() - t0
    if out:
        save(results, out)
    return results


def save(results: Dict, out: str) -> None:
    """``bench.json`` and one PNG per figure into ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    from ddp_tutorial.perf import plots as perf_plots

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "bench.json").write_text(json.dumps(results, indent=1, default=str))
    figures = {
        "allreduce_sweep.png": lambda: perf_plots.plot_allreduce_sweep(results["allreduce"]),
        "bucket_sweep.png": lambda: perf_plots.plot_bucket_sweep(results["ddp"]["buckets"]),
        "overlap.png": lambda: perf_plots.plot_overlap(results["ddp"]["overlap"]),
        "accumulation.png": lambda: perf_plots.plot_accumulation(results["accumulation"]),
        "scaling_projection.png": lambda: perf_plots.plot_scaling_grid(results["projection"]).axes[0],
        "scaling_projection_nccl_alpha.png":
            lambda: perf_plots.plot_scaling_projection(results["projection"], alpha="NCCL-class"),
    }
    for name, draw in figures.items():
        ax = draw()
        ax.figure.savefig(folder / name, dpi=110, bbox_inches="tight")
        matplotlib.pyplot.close(ax.figure)


# -- The table ------------------------------------------------------------------
def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def format_table(results: Dict) -> str:
    """The bench's printed report: every measured figure and ratio, one line each."""
    lines = []
    add = lines.append
    sweep, fit = results["allreduce"], results["allreduce"]["fit"]
    add(f"== all-reduce sweep ({sweep['backend']}, ranks {sweep['world_sizes']}) ==")
    add(f"{'ranks':>5} {'size':>9} {'latency':>10} {'algbw GB/s':>11} {'busbw GB/s':>11} {'model':>10}")
    for row in sweep["table"]:
        model_s = perf.ring_time(row["bytes"], row["world_size"], fit["alpha_s"], fit["bandwidth"])
        add(f"{row['world_size']:>5} {_size(row['bytes']):>9} {_ms(row['seconds']):>10} "
            f"{row['algbw_GBps']:>11.3f} {row['busbw_GBps']:>11.3f} {_ms(model_s):>10}")
    add(f"ring fit: alpha = {fit['alpha_s'] * 1e6:.1f} us per message, B = {fit['bandwidth'] / perf.GB:.2f} GB/s, "
        f"R^2 = {fit['r2']:.3f} (log t), {fit['r2_linear']:.3f} (t); memcpy ceiling "
        f"{sweep['memcpy_Bps'] / perf.GB:.1f} GB/s")
    for world_size, f in sorted(sweep.get("fit_by_world_size", {}).items()):
        add(f"  fit of {world_size} ranks alone: alpha = {f['alpha_s'] * 1e6:.1f} us, B = "
            f"{f['bandwidth'] / perf.GB:.2f} GB/s, R^2 = {f['r2']:.3f} (log t), {f['r2_linear']:.3f} (t)")
    c = results["crosscheck"]
    add(f"cross-check at 16 MB, {c['world_size']} ranks: plain loop alone {_ms(c['plain_s'])}, sweep "
        f"{_ms(c['sweep_s'])} ({c['sweep_gap']:.0%} apart), fit {_ms(c['fit_s'])} ({c['fit_gap']:.0%} apart); "
        f"target <= 20%")
    ddp = results["ddp"]
    add(f"== DDP ({ddp['backend']}, {ddp['world_size']} ranks, model of {ddp['param_tensors']} tensors, "
        f"{ddp['model_bytes'] / 1e3:.0f} KB) ==")
    add(f"compute per sample (1 rank, no comm): {ddp['compute']['s_per_sample'] * 1e6:.1f} us")
    buckets = ddp["buckets"]
    for row in buckets:
        add(f"bucket_cap_mb {row['bucket_cap_mb']:>7g}: {row['allreduce_calls_per_step']:>5.1f} all-reduces/step, "
            f"backward {_ms(row['backward_s'])}")
    slowest = max(r["backward_s"] for r in buckets)
    fastest = min(r["backward_s"] for r in buckets)
    add(f"backward, worst bucket size / best: {slowest / fastest:.2f}x (the DDP paper: > 2x)")
    o = ddp["overlap"]
    add(f"overlap (bucket_cap_mb {o['bucket_cap_mb']}): iteration DDP {_ms(o['ddp_step_s'])}, per-gradient "
        f"all-reduce after backward {_ms(o['per_gradient_step_s'])}, one flat all-reduce "
        f"{_ms(o['flat_step_s'])}; DDP logger: backward compute {_ms(o['avg_backward_compute_time_s'])}, "
        f"comm {_ms(o['avg_backward_comm_time_s'])}, overlap {_ms(o['avg_backward_compute_comm_overlap_time_s'])}")
    add("accumulation: K  straggler  time/sample  per optimizer step: transfer + wait"
        "   per sample vs K=1: transfer time, bytes (1/K)")
    for row in results["accumulation"]:
        add(f"{'':>12}{row['accum_steps']:>3} {row['straggler_ms']:>7g} ms {row['s_per_sample'] * 1e6:>9.1f} us "
            f"{_ms(row['transfer_s_per_optimizer_step']):>20} + {_ms(row['wait_s_per_optimizer_step']):<9} "
            f"{row['comm_per_sample_vs_k1']:>14.2f}, {row['bytes_per_sample_vs_k1']:.3f} ({row['ideal']:.3f})")
    proj = results["projection"]
    alphas = ", ".join(f"{name} {a * 1e6:.0f} us" for name, a in proj["alphas"].items())
    add(f"== scaling projection: efficiency at 256 / 1024 workers (alpha: {alphas}; bucket 25 MB) ==")
    add(f"{'job':<28} {'alpha':<11} {'K':>2} {'25 GB/s':>13} {'100 GB/s':>13} {'450 GB/s':>13}")
    for point in proj["key"]:
        cells = [f"{point[f'{g}GBps@256']:.0%} / {point[f'{g}GBps@1024']:.0%}" for g in (25, 100, 450)]
        add(f"{point['job']:<28} {point['alpha']:<11} {point['accum_steps']:>2} "
            + " ".join(f"{c:>13}" for c in cells))
    add("assumptions: " + "; ".join(proj["assumptions"]))
    add("== the kit's own speed (side by side, this run) ==")
    lines += launch_speed.describe(results["launch"])
    ov = ddp["overhead"]
    add(f"instrumentation: SyncTimer + JSON line per step vs plain DDP, taking turns step by step: "
        f"{1 + ov['overhead']:.3f}x, median step {_ms(ov['instrumented_step_s'])} vs "
        f"{_ms(ov['plain_step_s'])} over {ov['steps']} steps each ({ov['overhead']:+.1%}; target <= +5%)")
    fi = ddp["fidelity"]
    add(f"sync-time fidelity: SyncTimer {_ms(fi['synctimer_s'])} vs DDP logger avg_backward_comm_time "
        f"{_ms(fi['ddp_logger_s'])}: ratio {fi['ratio']:.2f} (target within 25%)")
    lines += suite.describe_notebook_suite(results.get("notebooks"), results.get("notebooks_cold"))
    gpu = results["gpu"]
    if "skipped" in gpu:
        add(f"GPU: skipped, {gpu['skipped']}")
    else:
        g = gpu["sweep"]
        add(f"GPU: backend=auto picked {gpu['auto_picked']}; wall-clock fit alpha = "
            f"{g['fit']['alpha_s'] * 1e6:.1f} us, B = {g['fit']['bandwidth'] / perf.GB:.1f} GB/s; CUDA-event fit "
            f"alpha = {g['cuda_fit']['alpha_s'] * 1e6:.1f} us, B = {g['cuda_fit']['bandwidth'] / perf.GB:.1f} GB/s")
        lab = gpu["ddp"]
        best = min(r["backward_s"] for r in lab["buckets"])
        add(f"GPU DDP ({lab['backend']}): backward worst/best bucket size "
            f"{max(r['backward_s'] for r in lab['buckets']) / best:.2f}x; iteration DDP "
            f"{_ms(lab['overlap']['ddp_step_s'])}, per-gradient {_ms(lab['overlap']['per_gradient_step_s'])}, "
            f"flat {_ms(lab['overlap']['flat_step_s'])}; sync fidelity ratio {lab['fidelity']['ratio']:.2f}")
        for row in perf.sweep_table(g["cuda_samples"]):
            add(f"  cuda events {row['world_size']} ranks {_size(row['bytes']):>7}: {_ms(row['seconds'])}, "
                f"busbw {row['busbw_GBps']:.1f} GB/s")
    sections = ", ".join(f"{k} {v:.0f} s" for k, v in results["section_seconds"].items())
    add(f"bench wall time: {results['bench_seconds']:.0f} s ({sections})")
    return "\n".join(lines)


def _size(nbytes: float) -> str:
    for unit, scale in (("MB", perf.MB), ("KB", perf.KB)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def headline_numbers(results: Dict) -> Dict[str, float]:
    """The fits and ratios the bench exists to produce, by name (tests check they are finite)."""
    fit, ddp = results["allreduce"]["fit"], results["ddp"]
    buckets = ddp["buckets"]
    return {
        "alpha_s": fit["alpha_s"], "bandwidth": fit["bandwidth"], "r2": fit["r2"],
        "crosscheck_gap": results["crosscheck"]["sweep_gap"],
        "bucket_speedup": max(r["backward_s"] for r in buckets) / min(r["backward_s"] for r in buckets),
        "overlap_s": ddp["overlap"]["avg_backward_compute_comm_overlap_time_s"],
        "launch_ratio": results["launch"]["ratio"], "launch_fixed_ratio": results["launch"]["fixed_ratio"],
        "launch_warm_ratio": results["launch"]["warm_ratio"],
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
    parser = argparse.ArgumentParser(prog="python -m ddp_tutorial.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, steps, repeats and ranks (about 30 s)")
    parser.add_argument("--out", default=None, help="folder for bench.json and the figures")
    parser.add_argument("--notebooks", nargs="?", type=_positive_int, const=0, default=None, metavar="N",
                        help="alone: time one `pytest --nbmake notebooks/` round in the bench (the default "
                             "in full mode); with N: skip the rest and run the notebook suite N times, "
                             "printing how often each notebook passed")
    parser.add_argument("--no-notebooks", dest="notebooks", action="store_const", const=-1,
                        help="do not time the notebook suite")
    parser.add_argument("--busy-core", nargs="?", type=int, const=-1, default=0, metavar="K",
                        help="with --notebooks N: keep one core busy during the last K rounds "
                             "(all rounds without K), as on a shared classroom server")
    parser.add_argument("--sharding", action="store_true",
                        help="alone: skip the rest and print notebook 10's measurements on 2 ranks: bytes "
                             "held per rank and sent per step under DDP, ZeRO-1 and FSDP2, compressed gradients")
    parser.add_argument("--grade", nargs="?", type=_positive_int, const=30, default=None, metavar="LEARNERS",
                        help="alone: skip the rest and grade a generated class (30 learners x every exercise by "
                             "default) with --jobs 1, then 2 (needs root: see docs/grading.md)")
    parser.add_argument("--grade-jobs", default="1,2", metavar="N,N",
                        help="with --grade: the --jobs values to compare (default: 1,2)")
    args = parser.parse_args(argv)
    if args.grade is not None:
        from ddp_tutorial.teacher.grade import classbench  # only here: the rest of the bench does not need it

        rows = classbench.run(args.grade, [int(n) for n in args.grade_jobs.split(",")])
        print(classbench.format_rows(rows), flush=True)
        return 0
    if args.sharding:
        if args.quick or args.out or args.notebooks is not None or args.busy_core:
            parser.error("--sharding goes alone")
        from ddp_tutorial.lessons import sharding  # only here: the rest of the bench does not need it

        print(sharding.report(sharding.run_lab()), flush=True)
        return 0
    if args.notebooks is not None and args.notebooks > 0:  # N rounds of the notebook suite, nothing else
        busy = args.notebooks if args.busy_core < 0 else args.busy_core
        return suite.report(suite.notebook_rounds(args.notebooks, busy))
    if args.busy_core:
        parser.error("--busy-core goes with --notebooks N")
    results = run_bench(args.quick, args.out, None if args.notebooks is None else args.notebooks == 0)
    print(format_table(results), flush=True)
    if args.out:
        print(f"saved {Path(args.out) / 'bench.json'} and figures", flush=True)
    bad = [k for k, v in headline_numbers(results).items() if not _finite(v)]
    if bad:
        print(f"not finite: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
