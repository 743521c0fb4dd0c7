"""Lesson helpers behind what the notebooks say: the mistakes' diffs, the init split, loss scaling."""

import re

import pytest

from ddp_tutorial import config, lessons, mistakes
from ddp_tutorial.lessons import sampler_accumulation, init_wrap


def test_mistake_diff_shows_only_real_changes():
    for mistake in mistakes.MISTAKES:
        if not mistake.function:
            continue
        text = lessons.mistake_diff(mistake.name)
        assert text == lessons.mistake_diff(mistake.function)
        assert text.startswith(f"--- original.{mistake.function}\n+++ train.{mistake.function}\n")
        changed = [line for line in text.splitlines() if re.match(r"[-+](?![-+])", line)]
        assert changed, mistake.name
        removed = {line[1:] for line in changed if line[0] == "-"}
        added = {line[1:] for line in changed if line[0] == "+"}
        assert not removed & added, mistake.name
        assert '"""' not in text, "docstrings are left out"
    # typing's List[bool] (the original) and list[bool] (train.py) are one line, not a change
    schedule = lessons.mistake_diff("sync-schedule")
    assert " def sync_schedule(num_batches: int, accum_steps: int) -> list[bool]:" in schedule
    assert "-def sync_schedule" not in schedule and "+def sync_schedule" not in schedule
    assert "-    return [i % accum_steps == 0 for i in range(num_batches)]" in schedule
    # a comment at the end of the function is part of it
    assert "every epoch repeats epoch 0's order" in lessons.mistake_diff("no-set-epoch")
    assert "-    out = model(x)" in lessons.mistake_diff("forward-outside-no-sync")
    assert sampler_accumulation.mistake_diff is lessons.mistake_diff


def test_mistake_diff_refuses_an_unknown_name():
    with pytest.raises(ValueError, match="no original version"):
        lessons.mistake_diff("no-such-bug")


def _rows(arrivals, done):
    last = max(arrivals)
    return [{"wait_s": last - a, "setup_s": d - last} for a, d in zip(arrivals, done)]


def test_init_split_reports_which_part_was_larger():
    sweep = {2: _rows([0.0, 0.10], [0.12, 0.12]), 4: _rows([0.0, 0.0, 0.0, 0.01], [0.2, 0.2, 0.2, 0.2])}
    split = init_wrap.init_split(sweep)
    assert abs(split[2]["wait_s"] - 0.10) < 1e-12 and abs(split[2]["setup_s"] - 0.04) < 1e-12
    assert abs(split[2]["wait_share"] - 0.10 / 0.14) < 1e-12
    assert abs(split[4]["arrival_spread_s"] - 0.01) < 1e-12
    text = init_wrap.format_init_split(split).splitlines()
    assert text[0].endswith("waiting was larger in this run") and text[1].endswith("setup was larger in this run")
    assert init_wrap.init_split({1: _rows([0.0], [0.0])})[1]["wait_share"] == 0.0


def test_default_lr_is_train_py_default_and_window_means():
    assert sampler_accumulation.default_lr() == config.build_parser().parse_args([]).lr == 0.05
    assert sampler_accumulation.window_means([1, 2, 3, 4, 5], 2) == [1.5, 3.5, 5.0]


def test_script_function_runs_a_scripts_own_code_without_importing_it():
    from ddp_tutorial import train  # here only to compare: the kernel never imports it
    from ddp_tutorial.rank import original

    for path, module in ((config.TRAIN_SCRIPT, train), (lessons.ORIGINAL_SCRIPT, original)):
        schedule = lessons.script_function(path, "sync_schedule")
        assert schedule is not module.sync_schedule
        for n, k in ((10, 4), (8, 4), (5, 1), (7, 3), (1, 4)):
            assert schedule(n, k) == module.sync_schedule(n, k), (path, n, k)
    with pytest.raises(NameError):  # it needs the script's globals (torch): not for that
        lessons.script_function(lessons.ORIGINAL_SCRIPT, "loss_fn")(None, None)
    with pytest.raises(ValueError, match="no function"):
        lessons.script_function(config.TRAIN_SCRIPT, "no_such_function")
