"""The lesson scripts of notebooks 01 and 02, checked through real launches.

One launch per script is shared by the tests of that script (module-scoped fixtures).
"""

import matplotlib

matplotlib.use("Agg")

import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

import ddp_tutorial  # noqa: E402
from ddp_tutorial import mistakes, plots  # noqa: E402
from ddp_tutorial import lessons as common  # noqa: E402
from ddp_tutorial.lessons import init_wrap as lessons  # noqa: E402
from conftest import processes_of_run  # noqa: E402


@pytest.fixture(scope="module")
def init_rows(tmp_path_factory):
    run = lessons.run_init_demo(2, run_dir=tmp_path_factory.mktemp("init"))
    return lessons.init_rows(run)


@pytest.fixture(scope="module")
def wrap_run(tmp_path_factory):
    return lessons.run_wrap_demo(2, bucket_caps=(25, 0.5, 0.1), echo="none", timeout=180,
                                 run_dir=tmp_path_factory.mktemp("wrap"))


# -- init_demo.py ----------------------------------------------------------------
def test_all_reduce_sums_rank_plus_one_on_every_rank(init_rows):
    assert [r["rank"] for r in init_rows] == [0, 1]
    assert [r["all_reduce_sum"] for r in init_rows] == [3.0, 3.0]


def test_no_rank_leaves_init_before_the_last_one_arrives(init_rows):
    assert all(r["setup_s"] >= 0 and r["wait_s"] >= 0 for r in init_rows)
    assert min(r["wait_s"] for r in init_rows) == 0.0  # the last to arrive waited for nobody


def test_default_process_group_timeouts_reported(init_rows):
    # PyTorch 2.13: gloo 30 min (constants.default_pg_timeout); nccl 10 min, None without nccl.
    assert all(r["default_pg_timeout_s"] == 1800 for r in init_rows)
    assert all(r["default_pg_nccl_timeout_s"] in (None, 600) for r in init_rows)


def test_threads_one_per_rank(init_rows):
    assert all(r["torch_threads"] == 1 for r in init_rows)
    assert all(r["default_threads"] is None for r in init_rows)  # asked for with --probe-default-threads


def fresh_process_default_threads() -> int:
    """What torch picks in a plain new Python without OMP_NUM_THREADS: the demo must show this."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                         env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.parametrize("warm", ["1", "0"], ids=["warm", "cold"])
def test_threads_demo_shows_torchs_real_default_in_every_start_mode(warm, monkeypatch):
    monkeypatch.setenv("DDP_TUTORIAL_WARM", warm)
    rows = lessons.threads_demo(world_size=2)
    default = fresh_process_default_threads()
    assert rows[0]["default_threads"] == default
    totals = lessons.threads_totals(rows)
    assert totals == {"ranks": 2, "cpus": rows[0]["cpu_count"], "default_per_process": default,
                      "with_default": 2 * default, "as_launched": 2}
    text = lessons.format_threads(rows)
    assert f"torch's default in a fresh process here: {default} thread(s)" in text
    assert f"2 ranks with torch's default: {2 * default} threads" in text


def test_wrong_world_size_ends_at_the_process_group_timeout_with_both_ranks_stuck_in_init():
    started = time.monotonic()
    err = lessons.launch_wrong_world_size(world_size=2, claimed=3, pg_timeout=3)  # caught and returned
    assert isinstance(err, ddp_tutorial.WorkerError) and err.exit_code == 1
    assert "DistStoreError: wait timeout after 3000ms" in common.error_line(err)
    assert lessons.ranks_stuck_in_init(err) == [0, 1]
    assert 3 <= time.monotonic() - started < 60, "ended by the 3 s timeout, not by launch's deadline"
    assert not processes_of_run(err.run.run_dir)


def test_taken_port_fails_fast_with_address_in_use():
    port, err = lessons.port_clash(world_size=1)
    assert err.rank == 0
    assert lessons.is_address_in_use(err)
    assert str(port) in err.traceback


# -- wrap_demo.py ----------------------------------------------------------------
def test_ddp_broadcasts_rank0_parameters(wrap_run):
    rows = lessons.broadcast_rows(wrap_run)
    assert rows[0]["digest_before"] != rows[1]["digest_before"]
    assert rows[0]["digest_after"] == rows[1]["digest_after"] == rows[0]["digest_before"]
    assert rows[1]["checksum_after"] == rows[0]["checksum_before"]


def test_ddp_gradient_equals_single_process_gradient_on_the_global_batch(wrap_run):
    check = lessons.gradient_check(wrap_run)
    assert check["allclose"]
    assert check["max_abs_diff"] < 1e-5
    assert check["local_max_abs_diff"] > 1e-3  # the local gradient alone is clearly different
    assert check["grad_checksums"][0] == check["grad_checksums"][1]


def test_tutorial_model_fits_one_bucket(wrap_run):
    (row,) = lessons.bucket_rows(wrap_run, model="Model")
    assert row["param_bytes"] == 3120 * 4
    assert row["rebuilt_bucket_sizes"] == [row["param_bytes"]]
    assert row["allreduces_per_step"] == 1


def test_one_allreduce_per_bucket_and_more_as_the_cap_shrinks(wrap_run):
    rows = sorted(lessons.bucket_rows(wrap_run, model="deep"), key=lambda r: -r["bucket_cap_mb"])
    assert [r["bucket_cap_mb"] for r in rows] == [25, 0.5, 0.1]
    for r in rows:
        assert r["allreduces_all_steps"][1:] == [r["num_buckets"]] * (len(r["allreduces_all_steps"]) - 1)
        assert sum(r["rebuilt_bucket_sizes"]) == r["param_bytes"]
    counts = [r["num_buckets"] for r in rows]
    assert counts[0] == 1 and counts == sorted(counts) and counts[-1] > counts[1] > counts[0]


def test_ddp_default_is_not_bucket_cap_25(wrap_run):
    # bucket_cap_mb=None: a first bucket of dist._DEFAULT_FIRST_BUCKET_BYTES (1 MiB), then 25 MiB.
    (default,) = lessons.bucket_rows(wrap_run, model="deep, DDP default")
    (explicit,) = [r for r in lessons.bucket_rows(wrap_run, model="deep") if r["bucket_cap_mb"] == 25]
    assert default["bucket_cap_mb"] is None
    assert default["num_buckets"] == 2 and default["rebuilt_bucket_sizes"][0] >= 2 ** 20
    assert sum(default["rebuilt_bucket_sizes"]) == default["param_bytes"]
    assert explicit["num_buckets"] == 1


def test_every_rank_sees_the_same_buckets(wrap_run):
    assert lessons.bucket_rows(wrap_run, rank=0) == lessons.bucket_rows(wrap_run, rank=1)


# -- helpers without a launch ------------------------------------------------------
def test_every_bug_flag_has_a_lesson():
    names = {m.name for m in mistakes.MISTAKES}
    assert {"hard-coded-port", "default-threads"} <= names
    table = common.format_mistakes()
    assert all(name in table for name in names)


def test_the_readme_table_of_mistakes_is_built_from_the_one_list():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert common.mistakes_markdown() in readme
    assert all(f"`--bug {name}`" in readme for name in mistakes.BUGS)


def test_script_source_reads_without_importing():
    src = common.script_source(lessons.WRAP_SCRIPT, "broadcast_and_gradient")
    assert src.startswith("def broadcast_and_gradient") and "DDP(model)" in src
    with pytest.raises(ValueError):
        common.script_source(lessons.WRAP_SCRIPT, "no_such_function")


def test_plots_label_their_axes(init_rows, wrap_run):
    ax = plots.plot_init_times({2: init_rows})
    assert ax.get_xlabel() and ax.get_ylabel() and ax.get_legend() is not None
    ax = plots.plot_allreduces_vs_bucket_cap(lessons.bucket_rows(wrap_run))
    assert ax.get_xscale() == "log" and ax.get_legend() is not None
    matplotlib.pyplot.close("all")
