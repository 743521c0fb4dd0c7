"""Lesson 11 (build DDP yourself): the kernel-side arithmetic, and the lab's claims on 2 real ranks.

The notebook runs the 4-rank lab (W = 2, 3, 4) and the hang; this file launches the lab once on 2 ranks
(module-scoped) and checks what must hold there, so a regression shows up outside nbmake too.
"""

from pathlib import Path

import pytest

from ddp_tutorial.lessons import predict
from ddp_tutorial.lessons import build_ddp as lessons
from ddp_tutorial.lessons import script_source


def test_busy_is_the_length_of_the_union_of_intervals():
    assert lessons.busy([]) == 0.0
    assert lessons.busy([(0, 1), (2, 3)]) == 2
    assert lessons.busy([(0, 2), (1, 3), (1.5, 2.5)]) == 3  # concurrent all-reduces count once
    assert lessons.busy([(0, 4), (1, 2)]) == 4
    assert lessons.busy([(3, 1)]) == 0.0  # an interval clipped to nothing


def test_a_step_splits_into_hidden_and_exposed_communication():
    # backward 0-10 ms, gradients ready at 2, 6, 10; all-reduces 3-5 and 7-12; synced at 12
    step = {"forward": -1.0, "backward": 0.0, "ready": [0.002, 0.006, 0.010], "synced": 0.012, "step_end": 0.013,
            "all_reduces": [(0.003, 0.005, 100), (0.007, 0.012, 100)]}
    n = lessons._step_numbers(step)
    assert n["in_flight_ms"] == pytest.approx(5.0) and n["exposed_ms"] == pytest.approx(2.0)
    assert n["launched_before_backward_end"] == 2 and n["window_ms"] == pytest.approx(7.0) and n["bytes"] == 200
    # a launch in the last gradient's hook comes after that gradient's (tensor hook) time: not during backward
    late = dict(step, all_reduces=[(0.003, 0.005, 100), (0.010, 0.012, 100)])
    assert lessons._step_numbers(late)["launched_before_backward_end"] == 1
    assert lessons._step_numbers(late)["bytes_after_backward"] == 100


def test_kernel_ms_matches_the_worker():
    from ddp_tutorial.lessons.build_ddp.workers import build_ddp_lab

    assert lessons.KERNEL_MS == build_ddp_lab.KERNEL_MS


def test_a_future_wait_is_not_named_work_wait():
    from ddp_tutorial import stacks

    dump = ('Current thread 0x1 (most recent call first):\n'
            '  File "/x/site-packages/torch/futures/__init__.py", line 80 in wait\n'
            '  File "/x/ddp_tutorial/lessons/build_ddp/workers/my_ddps.py", line 157 in finish_gradient_synchronization\n'
            '  File "/x/ddp_tutorial/rank/bootstrap.py", line 5 in run_rank\n')
    assert stacks.waiting_in(dump) == stacks.FUTURE_WAIT


def test_show_reads_classes_from_the_versions_script():
    source = script_source(lessons.VERSIONS_SCRIPT, "OverlapDDP")
    assert source.startswith("class OverlapDDP") and "register_post_accumulate_grad_hook" in source
    with pytest.raises(ValueError, match="no function"):
        script_source(lessons.VERSIONS_SCRIPT, "NoSuchDDP")


def test_the_w3_question_reads_the_measurement(capsys):
    q = predict.QUESTIONS["11-exact-w3"]
    assert [q.answer(m) for m in ((0.0, 4e-8), (1.5e-8, 4e-8), (1e-4, 4e-8))] == ["a", "b", "c"]
    # the explanation follows the measurement: a bit-identical run is not told "the last bits differ"
    assert "bit-identical" in q.explain((0.0, 4e-8)) and "order" in q.explain((1.5e-8, 4e-8))
    assert "1.5e-08" in q.explain((1.5e-8, 4e-8)) and "divides" not in q.explain((1.5e-8, 4e-8)).split(":")[0]
    assert predict.reveal("11-exact-w3", "yes", (1.5e-8, 4e-8)).correct is False
    assert "answer with a letter" in capsys.readouterr().out
    assert "your NaiveDDP" not in q.text


@pytest.fixture(scope="module")
def lab():
    return lessons.run_lab(world_size=2, steps=3)


def test_every_version_broadcasts_and_equals_ddp_to_the_bit_on_two_ranks(lab):
    for version, row in lessons.construction(lab).items():
        assert row["ranks_differed_before"] and row["all_equal_rank0_after"], version
    exact = lessons.exactness(lab)
    assert list(exact) == [2]
    assert all(cell["bit_identical"] for cell in exact[2]["versions"].values()), exact
    assert exact[2]["ranks_agree"]


def test_all_reduces_per_step_and_buckets(lab):
    per_step = lessons.allreduces_per_step(lab, world_size=2)
    assert {v: r["all_reduces"] for v, r in per_step.items()} == {"naive": 6, "flat": 1, "overlap": 6,
                                                                   "bucket": 2, "ddp": 1}
    assert [r["all_reduces"] for r in lessons.buckets(lab, world_size=2).values()] == [1, 2, 3]
    # torch's DDP at the same caps: one bucket in iteration 1, then 1, 1 and 2, rebuilt in arrival order
    ddp = lessons.ddp_buckets(lab)
    assert [len(r["iterations"][0]["buckets"]) for r in ddp.values()] == [1, 1, 1]
    assert [len(r["iterations"][-1]["buckets"]) for r in ddp.values()] == [1, 1, 2]
    assert all(it["launch_order"] == sorted(it["launch_order"]) for r in ddp.values() for it in r["iterations"])
    exact = lessons.exactness(lab)[2]
    assert exact["ddp_default"]["bit_identical"] and exact["ddp_default"]["grads_differ"] == 0  # 1/2 is exact
    seen = lessons.buffers(lab)
    assert seen["ddp"]["seen"] == [1.0, 1.0] and seen["overlap"]["seen"] == [1.0, 2.0]


def test_hooks_launch_during_backward_and_no_sync_skips_them(lab):
    summary = lessons.overlap_summary(lab)
    assert summary["naive"]["launched_before_backward_end"] == 0
    assert summary["overlap"]["launched_before_backward_end"] >= summary["overlap"]["all_reduces"] - 2
    for version in ("bucket", "ddp"):  # 2 buckets; the last holds the first layer's gradients, which come last
        assert summary[version]["launched_before_backward_end"] == 1 == summary[version]["all_reduces"] - 1
    ov = lessons.ddp_overlap(summary)
    assert ov["buckets_per_iteration"][0] == 1 and ov["iteration1_ms"] < lessons.KERNEL_MS < ov["logger_ms"]
    # notebook 11's claim: in its least disturbed step, the overlapped version waits less after backward
    assert summary["overlap"]["least_exposed_ms"] < summary["naive"]["least_exposed_ms"], summary
    assert summary["naive"]["least_exposed_ms"] == min(s["exposed_ms"] for s in summary["naive"]["per_step"])
    assert all(s["same_as_ddp"] for s in summary.values())
    cases = lessons.cases(lab)
    assert cases["no_sync"]["overlap"]["all_reduces"] == [0, 0, 0, 6]
    assert cases["no_sync"]["bucket"]["all_reduces"] == [0, 0, 0, 2]
    assert all(row["max_diff"] == 0 for row in cases["no_sync"].values())
    assert cases["no_sync_placement"]["ddp"] == {"forward inside": 0, "backward inside": 1}  # forward decides
    assert cases["no_sync_placement"]["overlap"] == {"forward inside": 6, "backward inside": 0}  # backward does
    cost = lessons.find_unused_cost(lab)
    assert len(cost["False"]["buckets"]) == 2 and cost["True"]["buckets"] != cost["False"]["buckets"]  # no rebuild


def test_bucket_ddp_raises_when_its_all_reduce_fails():
    from ddp_tutorial import WorkerError, launch

    with pytest.raises(WorkerError) as info:
        launch(str(Path(__file__).parent / "scripts" / "bucket_peer_never_joins.py"), 2, echo="none", timeout=60)
    err = info.value
    assert err.rank == 0 and "finish_gradient_synchronization" in err.traceback
    assert "rank 0 returned" not in "\n".join(err.run.output[0])
