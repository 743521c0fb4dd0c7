"""The performance lab: the cost-model arithmetic exactly, and the bench end to end in quick mode.

Timing targets are not checked here (a shared machine is noisy); the bench prints them as
ratios. These tests check that every fit and ratio is computed and finite, and the
counts that do not depend on timing.
"""

import math

import pytest

from ddp_tutorial.maintainer import bench
from ddp_tutorial.backend import gpu_count
from ddp_tutorial.lessons.performance import costmodel as perf, measure


# -- The cost model, on numbers made by the model itself -------------------------
def ring_samples(alpha_s, bandwidth, world_sizes=(2, 4), sizes=perf.FULL_SIZES):
    return [{"world_size": p, "bytes": n, "seconds": perf.ring_time(n, p, alpha_s, bandwidth)}
            for p in world_sizes for n in sizes]


def test_fit_recovers_alpha_and_bandwidth_of_exact_ring_times():
    fit = perf.fit_alpha_beta(ring_samples(300e-6, 1.5e9))
    assert fit["alpha_s"] == pytest.approx(300e-6, rel=1e-9)
    assert fit["bandwidth"] == pytest.approx(1.5e9, rel=1e-9)
    assert fit["r2"] == pytest.approx(1.0) and fit["r2_linear"] == pytest.approx(1.0)


def test_fit_weighs_small_sizes_so_noise_on_large_ones_does_not_erase_alpha():
    samples = ring_samples(500e-6, 1e9)
    for s in samples:
        if s["bytes"] >= 16 * perf.MB:
            s["seconds"] *= 1.1  # 10 % slower big transfers: the latency must survive
    fit = perf.fit_alpha_beta(samples)
    assert fit["alpha_s"] == pytest.approx(500e-6, rel=0.1)
    assert 0.9 < fit["r2"] < 1.0


def test_fit_needs_two_points_of_distributed_runs():
    with pytest.raises(ValueError, match="at least two"):
        perf.fit_alpha_beta([{"world_size": 1, "bytes": 1024, "seconds": 1e-3}] * 3)


def test_busbw_follows_nccl_tests_definition():
    # 1 GB in 1 s over 4 ranks: algbw 1 GB/s, busbw 1 GB/s * 2 * 3 / 4
    assert perf.algbw(1e9, 1.0) == 1e9
    assert perf.busbw(1e9, 1.0, 4) == pytest.approx(1.5e9)
    assert perf.busbw(1e9, 1.0, 2) == pytest.approx(1e9)
    row = perf.sweep_table([{"world_size": 4, "bytes": 2e9, "seconds": 2.0}])[0]
    assert row["algbw_GBps"] == pytest.approx(1.0) and row["busbw_GBps"] == pytest.approx(1.5)


def test_ring_time_latency_grows_with_ranks_and_bandwidth_term_saturates():
    assert perf.ring_time(0, 2, 1e-3, 1e9) == pytest.approx(2e-3)
    assert perf.ring_time(0, 4, 1e-3, 1e9) == pytest.approx(6e-3)
    big = [perf.ring_time(1e9, p, 0.0, 1e9) for p in (2, 4, 1024)]
    assert big == pytest.approx([1.0, 1.5, 2 * 1023 / 1024])
    assert perf.ring_time(1e9, 1, 1.0, 1.0) == 0.0


def test_projection_efficiency_falls_with_workers_and_rises_with_accumulation():
    grid = perf.projection_grid(alpha_s=20e-6, compute_s_per_sample=1e-3, model_bytes=100e6,
                                batch_per_worker=32, bandwidths_GBps=(25,), accum_steps=(1, 8))
    k1 = [r["efficiency"] for r in grid if r["accum_steps"] == 1]
    k8 = [r["efficiency"] for r in grid if r["accum_steps"] == 8]
    assert all(0 < e <= 1 for e in k1 + k8)
    assert k1 == sorted(k1, reverse=True)
    assert all(b >= a for a, b in zip(k1, k8))
    assert perf.efficiency_at(grid, 1024, accum_steps=8) == k8[-1]
    assert perf.efficiency_at(grid, 3) is None


def test_projection_step_adds_only_comm_that_backward_cannot_hide():
    # 4 buckets of 25 MB, lots of backward to hide them under: only the last bucket shows.
    point = perf.project_step(8, alpha_s=0.0, bandwidth=1e9, compute_s_per_sample=1.0, model_bytes=100 * perf.MB,
                              batch_per_worker=1)
    last = perf.ring_time(25 * perf.MB, 8, 0.0, 1e9)
    assert point["exposed_comm_s"] == pytest.approx(last)
    assert point["step_s"] == pytest.approx(1.0 + last)
    assert point["comm_s"] == pytest.approx(4 * last)


def test_accumulation_ratios_are_relative_to_k1_of_the_same_straggler_setting():
    rows = [{"accum_steps": k, "straggler_ms": s, "transfer_s_per_sample": (1.0 + s) / k,
             "allreduced_bytes_per_sample": 400.0 / k} for s in (0.0, 5.0) for k in (1, 2, 4)]
    ratios = measure.accumulation_ratios(rows)
    assert [r["comm_per_sample_vs_k1"] for r in ratios] == pytest.approx([1, 0.5, 0.25] * 2)
    assert [r["bytes_per_sample_vs_k1"] for r in ratios] == pytest.approx([1, 0.5, 0.25] * 2)
    assert [r["ideal"] for r in ratios] == pytest.approx([1, 0.5, 0.25] * 2)



# -- What notebook 07 prints about each measurement: the direction comes from the numbers -------------
def overlap_result(ddp_ms, flat_ms, *, cpu_ms=(12.0, 9.0, 30.0, 8.0), ranks=2, cores=2):
    ways = dict(zip(("ddp", "flat", "per_gradient", "none"), cpu_ms))
    wall = {"ddp": ddp_ms, "flat": flat_ms, "per_gradient": 40.0, "none": 5.0}
    result = {f"{w}_step_s": wall[w] / 1e3 for w in wall}
    result.update({f"{w}_cpu_s": c / 1e3 for w, c in ways.items()})
    result.update({"ddp_backward_s": 6e-3, "none_backward_s": 2e-3, "bucket_cap_mb": 0.05, "allreduces": 7,
                   "launched_before_last_gradient": 6, "avg_backward_compute_comm_overlap_time_s": 2e-3,
                   "avg_backward_comm_time_s": 5e-3, "ranks": ranks, "cores": cores})
    return result


def test_describe_overlap_says_who_won_from_the_numbers():
    lost = measure.describe_overlap(overlap_result(7.68, 4.31))
    assert "bucket_cap_mb=0.05: 7 all-reduces per step, 6 of them launched before backward" in lost
    assert "DDP lost to one flat all-reduce (1.78x slower)" in lost and "beat" not in lost
    assert "Fastest way to sync here: one flat all-reduce after backward" in lost
    assert "the same order" in lost and "cost more CPU time than one flat one" in lost
    assert "(+4.00 ms)" in lost  # DDP's CPU time over no communication, in ms
    assert "compute alone can fill every core" in lost
    won = measure.describe_overlap(overlap_result(4.0, 6.0, cpu_ms=(8.5, 9.0, 30.0, 8.0), cores=8))
    assert "DDP beat one flat all-reduce (1.50x faster)" in won and "lost" not in won
    assert "cost less CPU time" in won and "cores to spare" in won
    mixed = measure.describe_overlap(overlap_result(4.0, 6.0))  # more CPU, yet faster: the prediction fails
    assert "a different order" in mixed


def sweep_result(busbw_by_size, copy_by_size, bandwidth_GBps=1.0):
    table = [{"world_size": 2, "bytes": n, "busbw_GBps": b} for n, b in busbw_by_size.items()]
    return {"table": table, "fit": {"alpha_s": 50e-6, "bandwidth": bandwidth_GBps * perf.GB},
            "memcpy_by_size": [{"bytes": n, "Bps": c * perf.GB} for n, c in copy_by_size.items()]}


def test_describe_sweep_reports_a_peak_in_the_middle_and_the_fall_after_it():
    text = measure.describe_sweep(sweep_result({perf.KB: 0.01, perf.MB: 2.13, 64 * perf.MB: 0.96},
                                               {perf.KB: 1.0, perf.MB: 20.0, 64 * perf.MB: 5.0}, 1.86))
    assert "peak, 2.13 GB/s at 1 MiB, then fell to 0.96 GB/s at 64 MiB" in text
    assert "the peak is above it, the largest size below it" in text
    assert "lies below the model's line" in text and "the copy slowed down with size too" in text
    flat = measure.describe_sweep(sweep_result({perf.KB: 0.01, perf.MB: 0.5, 64 * perf.MB: 0.9},
                                               {perf.KB: 1.0, perf.MB: 5.0, 64 * perf.MB: 5.0}, 0.8))
    assert "0.90 GB/s at 64 MiB (the largest size)" in flat and "fell" not in flat and "slowed" not in flat


def test_describe_buckets_names_every_step_where_time_rose():
    rows = [{"bucket_cap_mb": cap, "allreduce_calls_per_step": n, "cpu_s": cpu / 1e3, "backward_s": wall / 1e3}
            for cap, n, cpu, wall in ((0.01, 26, 20.0, 16.1), (0.05, 7, 12.0, 28.1), (25.0, 1, 8.0, 11.8))]
    text = measure.describe_buckets(rows, {"alpha_s": 50e-6, "bandwidth": 1e9})
    assert "CPU time fell at every step of the cap" in text
    assert "Backward's wall time did not fall at every step: 0.05 (28.10 ms) above 0.01 (16.10 ms)" in text
    assert "25 extra all-reduces at 2.50 ms of latency" in text


def test_describe_accumulation_says_when_the_time_rose_against_the_bytes():
    rows = [{"accum_steps": k, "straggler_ms": 0.0, "comm_per_sample_vs_k1": t, "bytes_per_sample_vs_k1": 1 / k,
             "ideal": 1 / k, "transfer_s_per_optimizer_step": 1e-3, "wait_s_per_optimizer_step": 2e-3}
            for k, t in ((1, 1.0), (2, 4.5), (4, 0.3), (8, 0.2))]
    text = measure.describe_accumulation(rows)
    assert "no straggler" in text and "K=8 0.125" in text and "it rose at K=2, against the bytes" in text
    assert "the wait is larger than the transfer" in text
    for row in rows:
        row["comm_per_sample_vs_k1"] = row["ideal"]
    assert "it fell at every K" in measure.describe_accumulation(rows)


@pytest.mark.parametrize("overhead, says", [(-0.297, "30% faster; instrumentation only adds work"),
                                            (0.02, "Within the bench's 5% target"), (0.08, "Above the bench's 5%")])
def test_describe_overhead_comments_on_every_ratio(overhead, says):
    text = measure.describe_overhead({"overhead": overhead, "steps": 30})
    assert f"{1 + overhead:.3f}" in text and says in text


def test_describe_projection_prints_the_alpha_it_used():
    sweep = {"fit": {"alpha_s": 47e-6}}
    lab = {"model_bytes": 407376, "compute": {"s_per_sample": 2e-4, "batch_size": 32}}
    text = measure.describe_projection(measure.projection(sweep, lab))
    assert text.startswith("alpha fitted here: 47 us per message, 5x the NCCL-class 10 us.")
    assert "K=8 against K=1: efficiency higher in every case" in text


def test_the_lab_figures_start_at_zero_and_name_real_settings():
    import matplotlib

    matplotlib.use("Agg")
    from ddp_tutorial.lessons.performance import plots

    rows = [{"bucket_cap_mb": c, "allreduce_calls_per_step": n, "cpu_s": 0.02, "backward_s": 0.03, "steps": 16}
            for c, n in ((0.001, 26), (25.0, 1))]
    ax = plots.plot_bucket_sweep(rows)
    assert ax.get_ylim()[0] == 0 and "bigger buckets" not in ax.get_title()
    ax = plots.plot_overlap(overlap_result(7.68, 4.31))
    assert all(a.get_xlim()[0] == 0 for a in ax.figure.axes)
    acc = measure.accumulation_ratios([{"accum_steps": k, "straggler_ms": 0.0, "transfer_s_per_sample": 1e-3 / k,
                                        "allreduced_bytes_per_sample": 400.0 / k} for k in (1, 2, 4, 8)])
    labels = plots.plot_accumulation(acc).get_legend_handles_labels()[1]
    assert not any("up to 0 ms" in label for label in labels) and any("no straggler" in label for label in labels)
    proj = measure.projection({"fit": {"alpha_s": 47e-6}},
                              {"model_bytes": 407376, "compute": {"s_per_sample": 2e-4, "batch_size": 32}})
    fig = plots.plot_scaling_grid(proj)
    titles = [a.get_title() for a in fig.axes]
    assert sum("K = 8" in t for t in titles) == 2 and sum("K = 1" in t for t in titles) == 2
    assert not fig.texts, "no footnote under the figure: the notebook prints the assumptions"
    matplotlib.pyplot.close("all")

# -- The bench, end to end, quick ------------------------------------------------
@pytest.fixture(scope="module")
def quick_bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    results = bench.run_bench(quick=True, out=str(out), notebooks=False)
    return results, out


def test_quick_bench_computes_every_fit_and_ratio(quick_bench):
    results, _ = quick_bench
    numbers = bench.headline_numbers(results)
    not_finite = {k: v for k, v in numbers.items() if not (isinstance(v, float) and math.isfinite(v))}
    assert not not_finite
    assert numbers["alpha_s"] > 0 and numbers["bandwidth"] > 0
    assert numbers["launch_ratio"] > 0 and numbers["sync_fidelity_ratio"] > 0
    launch = results["launch"]
    assert numbers["launch_warm_ratio"] > 0 and launch["warm_modes"] == ["warm"] and len(launch["warm_times"]) == 5
    assert launch["server"]["threads"] == 1 and launch["server"]["rss_mb"] > 0
    fits = results["allreduce"]["fit_by_world_size"]
    assert sorted(fits) == [2, 4]
    for fit in fits.values():
        assert all(math.isfinite(fit[k]) for k in ("alpha_s", "bandwidth", "r2"))


def test_quick_bench_sweeps_every_size_for_both_world_sizes(quick_bench):
    results, _ = quick_bench
    sweep = results["allreduce"]
    assert [(r["world_size"], r["bytes"]) for r in sweep["table"]] == \
        [(p, n) for p in (2, 4) for n in perf.QUICK_SIZES]
    assert all(r["seconds"] > 0 and r["busbw_GBps"] > 0 for r in sweep["table"])
    assert sweep["memcpy_Bps"] > 0
    assert results["crosscheck"]["plain_s"] > 0 and results["crosscheck"]["sweep_s"] > 0


def test_quick_bench_counts_that_do_not_depend_on_timing(quick_bench):
    # the bucket and all-reduce counts themselves: notebook 07 asserts them on the same lab
    for row in quick_bench[0]["accumulation"]:
        assert row["optimizer_steps"] * row["accum_steps"] == row["micro_steps"]


def test_quick_bench_prints_a_table_and_saves_figures(quick_bench):
    results, out = quick_bench
    table = bench.format_table(results)
    for needle in ("ring fit: alpha", "fit of 2 ranks alone", "fit of 4 ranks alone", "cross-check at 16 MB", "bucket_cap_mb", "overlap", "accumulation",
                   "scaling projection", "launch: launch()", "fork server, idle: RSS", "instrumentation:", "sync-time fidelity:", "GPU:"):
        assert needle in table
    saved = {p.name for p in out.iterdir()}
    assert {"bench.json", "allreduce_sweep.png", "bucket_sweep.png", "overlap.png", "accumulation.png",
            "scaling_projection.png"} <= saved


def test_gpu_part_skips_with_a_reason_without_gpus(quick_bench):
    results, _ = quick_bench
    if gpu_count() >= 2:
        assert results["gpu"]["auto_picked"] == "nccl"
        assert all(math.isfinite(v) for v in (results["gpu"]["sweep"]["cuda_fit"]["alpha_s"],
                                              results["gpu"]["sweep"]["cuda_fit"]["bandwidth"]))
    else:
        assert "GPU" in results["gpu"]["skipped"]
