"""Lessons 03-05: the sampler demo, no_sync accumulation counts and equivalence, teardown.

Each launch is shared by the tests of one module-scoped fixture, so the file
stays cheap; the pure helpers are tested on hand-made records.
"""

import json
import math
import os

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

import ddp_tutorial  # noqa: E402
from ddp_tutorial import lessons as common  # noqa: E402
from ddp_tutorial.lessons import sampler_accumulation as lessons, teardown  # noqa: E402
from ddp_tutorial import plots  # noqa: E402
from ddp_tutorial.runfolder import Run  # noqa: E402
from ddp_tutorial.lessons.sampler_accumulation.workers import sampler_demo  # noqa: E402
from ddp_tutorial.rank import original  # noqa: E402

# Sizes unlike the notebook's, so nothing depends on its numbers.
WORLD, SIZE, EPOCHS, PAD_SIZE, SEED = 3, 12, 2, 10, 0


@pytest.fixture(scope="module")
def launch_in_tmp(tmp_path_factory):
    """Calls a launching function with its runs under a temporary folder."""
    def call(fn, *args, **kwargs):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("DDP_TUTORIAL_RUNS", str(tmp_path_factory.mktemp("runs")))
            return fn(*args, **kwargs)
    return call


@pytest.fixture(scope="module")
def sampler_run(launch_in_tmp):
    return launch_in_tmp(lessons.run_sampler_demo, world_size=WORLD, dataset_size=SIZE, epochs=EPOCHS,
                         padding_size=PAD_SIZE, echo="none")


@pytest.fixture(scope="module")
def accumulation_runs(launch_in_tmp):
    """2 ranks x b4 x K4 (fixed and forward-outside), 1 process x b32, the schedule demo: one launch."""
    return launch_in_tmp(lessons.train_runs, 2, {
        "fixed": lessons.train_args(4, dataset_size=128),
        "outside": lessons.train_args(4, "--bug", "forward-outside-no-sync", dataset_size=128),
        "big_batch": lessons.train_args(1, batch_size=32, dataset_size=128),
    }, one_process=["big_batch"], schedule_demo=True, echo="none")


@pytest.fixture(scope="module")
def teardown_run(launch_in_tmp):
    return launch_in_tmp(teardown.run_teardown_demo, world_size=2, echo="none")


# -- sampler_demo.py ---------------------------------------------------------------
def test_orders_are_the_strided_shuffle_and_set_epoch_reshuffles(sampler_run):
    with_epoch = lessons.sampler_orders(sampler_run, set_epoch=True)
    without = lessons.sampler_orders(sampler_run, set_epoch=False)
    assert len(with_epoch) == len(without) == EPOCHS
    for epoch in range(EPOCHS):
        perm = torch.randperm(SIZE, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
        assert with_epoch[epoch] == {r: perm[r::WORLD] for r in range(WORLD)}
    assert not lessons.orders_repeat(with_epoch)
    assert lessons.orders_repeat(without)
    assert lessons.shards_partition(with_epoch, SIZE) == [True] * EPOCHS
    assert lessons.shards_partition(without, SIZE) == [True] * EPOCHS


def test_shards_partition_detects_overlap_and_gaps():
    assert lessons.shards_partition([{0: [0, 2], 1: [1, 3]}], 4) == [True]
    assert lessons.shards_partition([{0: [0, 1], 1: [1, 3]}], 4) == [False]  # 1 twice, 2 never
    assert lessons.shards_partition([{0: [0], 1: [1]}], 3) == [False]  # 2 never
    assert lessons.orders_repeat([{0: [1, 0]}, {0: [1, 0]}])
    assert not lessons.orders_repeat([{0: [1, 0]}, {0: [0, 1]}])


def test_padding_duplicates_and_drop_last_drops(sampler_run):
    report = lessons.padding_report(sampler_run)
    assert report["world_size"] == WORLD and report["dataset_size"] == PAD_SIZE
    assert all(len(v) == math.ceil(PAD_SIZE / WORLD) for v in report["kept"].values())
    assert all(len(v) == PAD_SIZE // WORLD for v in report["drop_last"].values())
    assert report["duplicated"] == report["expected_duplicated"] == 2  # 3 x 4 = 12 for 10
    assert report["dropped"] == report["expected_dropped"] == 1  # 3 x 3 = 9 of 10
    assert report["missing_with_padding"] == 0 and report["duplicated_in_drop_last"] == 0


def test_fingerprints_show_one_shared_dataset_or_one_per_rank(sampler_run):
    shared = lessons.dataset_fingerprints(sampler_run, per_rank_bug=False)
    local = sampler_demo.fingerprint(64, SEED, rank=0, per_rank_bug=False)
    assert {fp["digest"] for fp in shared.values()} == {local["digest"]}
    assert lessons.distinct_datasets(sampler_run, per_rank_bug=True) == WORLD
    per_rank = lessons.dataset_fingerprints(sampler_run, per_rank_bug=True)
    x1 = original.make_inputs(64, SEED, rank=1)
    assert per_rank[1]["first_row"] == [round(v, 4) for v in x1[0, :4].tolist()]


def test_print_helpers_and_heatmap(sampler_run, capsys):
    orders = lessons.sampler_orders(sampler_run)
    lessons.print_orders(orders, "title")
    lessons.print_padding(lessons.padding_report(sampler_run))
    lessons.print_fingerprints(sampler_run)
    out = capsys.readouterr().out
    assert f"epoch {EPOCHS - 1} rank {WORLD - 1}" in out and "2 sample(s) appear twice" in out
    ax = plots.plot_sampler_orders(orders, SIZE)
    grid = ax.images[0].get_array()
    assert grid.shape == (EPOCHS * WORLD, SIZE)
    # each column is filled exactly once per epoch
    assert (grid.count(axis=0) == EPOCHS).all()


# -- no_sync accumulation -----------------------------------------------------------
def test_forward_inside_no_sync_all_reduces_once_per_optimizer_step(accumulation_runs):
    rows = {r["run"]: r for r in lessons.allreduce_table(
        {"fixed": accumulation_runs["fixed"], "outside": accumulation_runs["outside"]})}
    buckets = rows["fixed"]["buckets"]
    assert buckets >= 1
    assert rows["fixed"]["micro_steps"] == rows["outside"]["micro_steps"] == 128 // 2 // 4
    assert rows["fixed"]["optimizer_steps"] == rows["outside"]["optimizer_steps"] == 16 // 4
    assert rows["fixed"]["allreduces_per_optimizer_step"] == buckets
    assert rows["outside"]["allreduces_per_optimizer_step"] == 4 * buckets
    assert lessons.optimizer_step_micros(accumulation_runs["fixed"]) == [3, 7, 11, 15]


def test_accumulation_equals_the_big_batch(accumulation_runs):
    fixed = accumulation_runs["fixed"].model_state()
    big = accumulation_runs["big_batch"].model_state()
    assert lessons.params_match(fixed, big, atol=1e-5)
    assert lessons.max_param_difference(fixed, big) < 1e-5
    # forward outside no_sync wastes all-reduces but computes the same thing
    assert lessons.params_match(accumulation_runs["outside"].model_state(), big, atol=1e-5)
    nudged = {k: v + 1e-3 for k, v in big.items()}
    assert not lessons.params_match(nudged, big, atol=1e-5)


def test_planned_schedule_with_and_without_the_off_by_one(capsys):
    assert lessons.planned_step_micros(10, 4, bug=True) == [0, 4, 8]
    assert lessons.planned_step_micros(10, 4) == [3, 7, 9]  # the partial last window steps too
    lessons.show_sync_schedule(8, 4)
    out = capsys.readouterr().out
    assert "S...S..." in out and "...S...S" in out


def _fake_run(run_dir, delays_ms, sync_every, allreduce_s=0.001):
    """A 2-rank run folder with given straggler delays, syncing every ``sync_every`` steps."""
    for rank, delays in enumerate(delays_ms):
        with open(run_dir / f"rank{rank}.jsonl", "w") as f:
            for step, delay in enumerate(delays):
                sync = (step + 1) % sync_every == 0
                f.write(json.dumps({
                    "kind": "step", "rank": rank, "step": step, "micro": step, "sync": sync,
                    "optimizer_step": sync, "t_start": 100.0 + step, "straggler_s": delay / 1e3,
                    "sync_s": allreduce_s if sync else 0.0, "allreduce_calls": int(sync),
                    "sync_offset_s": delay / 1e3 if sync else None}) + "\n")
    return Run(run_dir)


def test_straggler_wait_cancels_inside_a_window(tmp_path):
    delays = [[10, 0, 10, 0], [0, 10, 0, 10]]
    (tmp_path / "k1").mkdir(), (tmp_path / "k4").mkdir()
    k1 = _fake_run(tmp_path / "k1", delays, 1)
    k4 = _fake_run(tmp_path / "k4", delays, 4)
    assert lessons.straggler_wait_seconds(k1) == pytest.approx(0.040)  # 10 ms waited each step
    assert lessons.straggler_wait_seconds(k4) == pytest.approx(0.0)  # both slept 20 ms in the window
    assert lessons.sync_seconds_per_micro_step(k1) == pytest.approx(0.001)
    assert lessons.sync_seconds_per_micro_step(k4) == pytest.approx(0.00025)
    alignment = lessons.sync_alignment(k1)
    assert alignment["sync_steps"] == 4 and alignment["median_arrival_spread_ms"] == pytest.approx(10.0)
    ax = plots.plot_sync_per_micro_step({"K=1": k1, "K=4": k4})
    heights = sorted(round(p.get_height(), 6) for p in ax.patches)
    assert heights == [0.25, 0.25, 0.25, 1.0, 1.0, 1.0]


# -- teardown ------------------------------------------------------------------------
def test_second_init_fails_until_destroy(teardown_run):
    results = teardown.teardown_results(teardown_run)
    assert sorted(results) == [0, 1]
    for result in results.values():
        assert result["second_init_error"]["type"] == "ValueError"
        assert "twice" in result["second_init_error"]["message"]
        assert result["initialized_after_reinit"] and result["reinit_all_reduce"] == 3.0


def test_nothing_is_left_after_a_run(teardown_run):
    after = common.leftovers(teardown_run)
    assert len(after["pids"]) == 2 and after["alive_pids"] == []
    assert after["port_free"]


def test_port_check_and_worker_check():
    with common.hold_port() as port:
        assert not common.port_can_be_bound(port)
    assert common.port_can_be_bound(port)
    assert not common.worker_alive(os.getpid())  # alive, but not a launcher worker
    assert not common.worker_alive(2 ** 22 + 1)  # above Linux's pid limit: no such process


def test_a_surviving_gloo_rank_fails_at_once_when_its_peer_is_gone():
    report = teardown.peer_gone(world_size=2, pg_timeout=60)
    assert report["error_type"] == "RuntimeError", report
    assert "peer" in report["error"].lower(), report  # "Connection closed by peer" / "reset by peer"
    assert report["seconds_to_error"] < report["pg_timeout_s"] / 10, report


def test_schedule_demo_names_the_micro_batches_each_step_applies(accumulation_runs):
    demo = lessons.schedules(accumulation_runs)
    original, fixed = demo["original"], demo["fixed"]
    assert lessons.applied_micro_batches(original) == [[(0, 0)], [(0, 1), (0, 2), (0, 3), (0, 4)],
                                                      [(0, 5), (1, 0)], [(1, 1), (1, 2), (1, 3), (1, 4)]]
    assert original["lost"] == [[[0, 1, 5]], [[1, 1, 5]]]
    assert lessons.applied_micro_batches(fixed) == [[(0, 0), (0, 1), (0, 2), (0, 3)], [(0, 4), (0, 5)],
                                                   [(1, 0), (1, 1), (1, 2), (1, 3)], [(1, 4), (1, 5)]]
    assert fixed["lost"] == [[], []]


def test_crashing_rank_is_reported_and_nothing_survives(launch_in_tmp):
    with pytest.raises(ddp_tutorial.WorkerError) as info:
        launch_in_tmp(ddp_tutorial.launch, ddp_tutorial.TRAIN_SCRIPT, 2, lessons.train_args(
            1, "--fail-at-step", "3", "--fail-rank", "1", dataset_size=64), echo="none")
    crash = info.value
    assert crash.rank == 1 and "injected failure on rank 1 at step 3" in crash.traceback
    after = common.leftovers(crash.run)
    assert after["alive_pids"] == [] and after["port_free"]
