"""The kit's self-check (notebook rounds) and the lab's exact measurements."""

import contextlib
import json

import pytest

import psutil

from ddp_tutorial.maintainer import bench
from ddp_tutorial.maintainer import suite
from ddp_tutorial.lessons.performance import measure


def _notebook(path, source):
    cell = {"cell_type": "code", "execution_count": None, "id": "c1", "metadata": {}, "outputs": [],
            "source": [source]}
    path.write_text(json.dumps({"cells": [cell], "metadata": {"kernelspec": {
        "display_name": "Python 3", "language": "python", "name": "python3"}},
        "nbformat": 4, "nbformat_minor": 5}))


def test_notebook_rounds_count_passes_per_notebook(tmp_path, monkeypatch):
    _notebook(tmp_path / "a_passes.ipynb", "assert 1 + 1 == 2")
    _notebook(tmp_path / "b_fails.ipynb", "assert False, 'a false claim'")
    # One round, marked busy: which rounds are busy is busy_schedule's (tested below), and the spinner
    # busy_core's (test_busy_core_spins_and_stops). Here it records that it was on for the round: a
    # real one would take a core from the other tests for the whole round.
    spins = []

    @contextlib.contextmanager
    def recorded_busy_core(on=True):
        spins.append(on)
        yield None

    monkeypatch.setattr(suite, "busy_core", recorded_busy_core)
    result = suite.notebook_rounds(rounds=1, busy_rounds=1, folder=str(tmp_path), echo=False)
    assert spins == [True]
    times = suite.notebook_times(result["runs"])
    (passes_name, passes), (fails_name, fails) = sorted(times.items())
    assert passes_name.endswith("a_passes.ipynb") and passes[:2] == (1, 1) and passes[2] > 0
    assert fails_name.endswith("b_fails.ipynb") and fails[:2] == (0, 1)
    assert "a false claim" in result["runs"][0]["cases"][fails_name]["report"]
    assert [r["busy_core"] for r in result["runs"]] == [True]
    table = suite.format_suite(result).splitlines()
    assert table[0].startswith(f"`pytest -n 0 --nbmake {tmp_path}` 1 times in place (1 beside a busy")
    assert any(line.split()[:4] == [fails_name, "passed", "0/1,", "median"] for line in table)
    assert f"{fails_name}: failed in 1 of 1 runs" in table
    assert suite.report(result) == 1


@pytest.mark.parametrize("rounds, busy, schedule", [
    (2, 1, [False, True]), (5, 2, [False, False, False, True, True]), (3, 0, [False] * 3),
    (2, 5, [True, True]), (1, -1, [False])])
def test_the_last_rounds_are_the_busy_ones(rounds, busy, schedule):
    assert suite.busy_schedule(rounds, busy) == schedule


def test_busy_core_spins_and_stops():
    with suite.busy_core() as pid:
        spinner = psutil.Process(pid)
        assert suite.SPIN in spinner.cmdline()
        assert spinner.status() == psutil.STATUS_RUNNING, "running, not waiting"
    assert not psutil.pid_exists(pid)  # stopped and reaped (a zombie would still exist)


def test_bench_cli_refuses_busy_core_without_notebooks(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--busy-core", "2"])
    assert "--busy-core goes with --notebooks N" in capsys.readouterr().err


def test_gradient_as_bucket_view_puts_every_grad_inside_a_bucket():
    rows = measure.ddp_lab(2, sections=["grad_view"], steps=2)["grad_view"]
    assert len(rows) == 4
    for r in rows:
        assert r["bucket_bytes"] >= r["grad_bytes"] > 0
        if r["gradient_as_bucket_view"]:  # views, with zero_grad(set_to_none=True) too
            assert r["grad_bytes_inside_buckets"] == r["grad_bytes"] and r["grad_storages"] == r["buckets"]
        else:  # a second copy of every gradient, beside the buckets
            assert r["grad_bytes_inside_buckets"] == 0 and r["grad_storages"] == 18
