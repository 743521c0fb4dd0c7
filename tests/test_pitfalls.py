"""The pitfalls lab (notebook 09): each pitfall's wrong result and its fix, through real launches.

As in the notebook, one launch of ``pitfall_lab.py`` runs pitfalls 1-3 and 5-7 and is shared
by their tests (module-scoped fixtures); pitfall 4 has its own launch, and the failing
launches of pitfall 8 run in their own tests. What notebook 09 asserts itself (it runs in the
suite) is not asserted again here.
"""

import math

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from ddp_tutorial.lessons import pitfalls as lessons  # noqa: E402
from ddp_tutorial import plots  # noqa: E402

TIMEOUT = 180  # a busy 2-core machine: a deadline, not an expectation


def launch_once(tmp_path_factory, name, world_size=2, args=()):
    return lessons.run_pitfall(name, world_size, args, timeout=TIMEOUT, run_dir=tmp_path_factory.mktemp(name))


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """Pitfalls 1-3 and 5-7 in one launch of pitfall_lab.py, as notebook 09 runs them."""
    return lessons.run_lab(lessons.LAB, timeout=TIMEOUT, run_dir=tmp_path_factory.mktemp("lab"))


@pytest.fixture(scope="module")
def bn(lab):
    return lessons.batchnorm_summary(lab)


@pytest.fixture(scope="module")
def unused(lab):
    return lessons.unused_summary(lab)


@pytest.fixture(scope="module")
def ckpt(lab):
    return lessons.checkpoint_summary(lab)


@pytest.fixture(scope="module")
def evaluation(tmp_path_factory):
    return lessons.evaluation_rows(launch_once(tmp_path_factory, "evaluation", 4, ["--sizes", 9, 10, 12]))


@pytest.fixture(scope="module")
def seeding(lab):
    return lessons.seeding_summary(lab)


@pytest.fixture(scope="module")
def lr(lab):
    return lessons.lr_summary(lab)


@pytest.fixture(scope="module")
def clipping(lab):
    return lessons.clipping_summary(lab)


# -- 1. BatchNorm ------------------------------------------------------------------
def test_batchnorm_without_sync_trains_other_parameters_than_one_process(bn):
    assert bn["no_sync"]["params_vs_reference"] > 1e-3


def test_batchnorm_reports_the_buffer_sync_keyword_of_this_torch(bn):
    import inspect

    from torch.nn.parallel import DistributedDataParallel as DDP

    # torch 2.13's name for broadcast_buffers; torch 2.9 has only broadcast_buffers
    has_new_name = "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
    assert bn["keyword"] == ("forward_sync_buffers" if has_new_name else "broadcast_buffers")


def test_syncbatchnorm_refuses_cpu_in_ddp_and_in_forward(bn):
    assert bn["device"] == "cpu"
    ddp_error, forward_error = bn["syncbn"]["errors"]
    assert "only work with GPU modules" in ddp_error
    assert "expected input tensor to be on GPU" in forward_error


# -- 2. Unused parameters -----------------------------------------------------------
def test_static_graph_never_gives_the_unused_head_a_gradient(unused):
    assert unused["static_graph"]["without_grad"] == [["aux.weight", "aux.bias"]] * 6


def test_each_ddp_flag_is_timed_on_every_step_of_every_rank(unused):
    assert set(unused["cost"]["cpu"]) == {"no flag", "find_unused_parameters", "static_graph"}
    assert unused["cost"]["paired_cpu"]["find_unused_parameters"]["steps"] == 120


# -- 3. Saving and loading ----------------------------------------------------------
def test_ddp_state_dict_has_module_prefix_and_plain_load_refuses(ckpt):
    assert all(k.startswith("module.") for k in ckpt["saved_keys"])
    assert ckpt["error"].startswith("Error(s) in loading state_dict")
    assert ckpt["missing"] == ckpt["unexpected"] == len(ckpt["saved_keys"]) == 4
    assert ckpt["rescue_identical"] and ckpt["rescued_keys"] == [k[len("module."):] for k in ckpt["saved_keys"]]


def test_rank0_saves_unwrapped_and_every_rank_loads_identical(ckpt):
    assert ckpt["writers"] == [0]
    assert ckpt["identical"] == {0: True, 1: True}
    assert ckpt["saved_from"] == ["cpu"] and ckpt["loaded_on"] == {0: ["cpu"], 1: ["cpu"]}


# -- 4. Evaluation ------------------------------------------------------------------
def test_padding_skews_accuracy_and_real_counts_are_exact(evaluation):
    by_size = {r["size"]: r for r in evaluation}
    assert [by_size[s]["padding"] for s in (9, 10, 12)] == [3, 2, 0]
    for size in (9, 10):
        row = by_size[size]
        assert row["padded_counts"][1] == 12 and row["padded"] != row["true"]
        assert row["repeated"] == list(range(row["padding"]))  # repeats of the first samples
    for row in evaluation:
        assert row["fixed_counts"] == row["true_counts"] and row["fixed_counts"][1] == row["size"]
        assert row["fixed_on_every_rank"]
    assert by_size[12]["padded"] == by_size[12]["true"]  # no padding, nothing to fix


# -- 5. Seeding ----------------------------------------------------------------------
def test_dropout_masks_are_counted_for_every_sample_of_every_rank(seeding):
    assert seeding["dropout"]["same_seed"]["rows_per_step"] == 8


def test_sampler_needs_one_seed_on_every_rank(seeding):
    assert seeding["sampler"]["same_seed"] == {"seen": 16, "distinct": 16, "twice_or_more": 0, "never": 0}


# -- 6. Learning rate -----------------------------------------------------------------
def test_lr_scaling_follows_the_global_batch_at_every_step(lr):
    assert lr["global_batch"] == 16 and lr["scaled_lr"] == pytest.approx(0.2)
    assert len(lr["samples"]) == 96 and lr["samples"][-1] == 3 * 512


# -- 7. Clipping ----------------------------------------------------------------------
def test_clipping_reports_every_step_and_every_micro_step_clip(clipping):
    assert len(clipping["right"]["max_diff"]) == 4
    assert all(len(norms) == 4 for norms in clipping["wrong"]["norms"][0])  # one clip per micro-step


# -- 8. Debugging a hang --------------------------------------------------------------
#: What gloo's C++ says when a rank receives more than it expects: torch 2.13's gloo, then torch 2.6's (kept for any gloo that words it so).
GLOO_SIZE_CHECKS = ("Received data size doesn't match expected size", "op.preamble.length <= op.nbytes")


def test_shape_mismatch_aborts_in_cpp_without_debug():
    failure = lessons.shape_mismatch(debug=False, timeout=TIMEOUT)
    assert failure["kind"] == "WorkerError"
    assert failure["aborted"] == [0]  # the rank with the smaller tensor receives more than it expects
    # printed before it died: gloo's own check, worded by the gloo inside this torch
    assert any(words in failure["headlines"][0] for words in GLOO_SIZE_CHECKS), failure["headlines"][0]


def test_shape_mismatch_names_both_shapes_with_detail():
    failure = lessons.shape_mismatch(debug=True, timeout=TIMEOUT)
    assert "Detected mismatch between collectives" in failure["error"] and "Tensor shapes" in failure["error"]
    assert "TensorShape=[4]" in failure["error"] and "TensorShape=[5]" in failure["error"]
    for line in failure["headlines"].values():  # a rank stopped by the launcher first has none
        assert line is None or "Tensor shapes" in line
    assert [r["debug"] for r in failure["reports"][0]] == ["DETAIL"]


def test_the_rank_stuck_before_a_barrier_is_stopped_by_the_launcher():
    failure = lessons.missing_rank(monitored=False, timeout=TIMEOUT)
    assert failure["headlines"][1] is None  # rank 1 was stuck, then stopped by the launcher


# -- The lab runner -----------------------------------------------------------------------
def test_a_script_alone_reports_what_it_reports_in_the_lab(tmp_path_factory, ckpt, seeding):
    alone = launch_once(tmp_path_factory, "checkpoint")
    assert lessons.checkpoint_summary(alone) == ckpt
    with pytest.raises(KeyError):  # each run holds only the pitfalls it ran
        lessons.seeding_summary(alone)


def test_lab_refuses_unknown_pitfalls():
    with pytest.raises(ValueError, match="no_such"):
        lessons.run_lab(["batchnorm", "no_such"])


# -- Helpers without a launch ------------------------------------------------------------
def test_unused_indices_and_headline_parse_torch_messages():
    msg = "...\nParameter indices which did not receive grad for rank 1: 4 5\n In addition, ..."
    assert lessons.unused_indices(msg) == [4, 5]
    assert lessons.unused_indices("no indices here") == []
    lines = ["Traceback (most recent call last):", "  File x", "RuntimeError: boom", " Original exception: "]
    assert lessons.headline(lines) == "RuntimeError: boom"
    assert lessons.headline(["  what():  [enforce fail at pair.cc] size"]).startswith("what():")
    assert lessons.headline(["all fine"]) is None


def test_script_names_and_diffs_refuse_bad_input():
    with pytest.raises(ValueError):
        lessons.script("no_such_pitfall")
    with pytest.raises(ValueError):
        lessons.max_abs_diff([1.0], [1.0, 2.0])
    assert lessons.max_abs_diff([1.0, -2.0], [1.5, -2.0]) == 0.5


def test_expect_failure_complains_when_the_launch_succeeds():
    with pytest.raises(RuntimeError, match="finished without failing"):
        lessons.expect_failure("evaluation", 1, ["--sizes", 3], timeout=TIMEOUT)


def test_recap_has_every_pitfall_with_measured_numbers(bn, unused, ckpt, evaluation, seeding, lr, clipping):
    hang = {"mismatch": {"aborted": [0]}, "monitored": {"error": "RuntimeError: [Rank 0]: Rank 1 failed"}}
    rows = lessons.recap(bn, unused, ckpt, evaluation[1], seeding, lr, clipping, hang)
    assert [r["pitfall"][0] for r in rows] == [str(i) for i in range(1, 9)]
    assert all(r["symptom"] and r["fix"] for r in rows)
    text = lessons.format_recap(rows)
    assert f"{lr['final_ratio']['kept']:.2f}" in text and "Rank 1 failed" in text


def test_plots_label_their_axes(bn, unused, evaluation, lr, clipping):
    for ax in (plots.plot_batchnorm_stats(bn), plots.plot_unused_cost(unused), plots.plot_eval_error(evaluation),
               plots.plot_lr_curves(lr), plots.plot_clipping_drift(clipping)):
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title() and ax.get_legend() is not None
    ax = plots.plot_clipping_drift(clipping)
    assert ax.get_yscale() == "log" and all(math.isfinite(y) for y in ax.get_lines()[0].get_ydata())
    matplotlib.pyplot.close("all")
