"""The kit's self-check (notebook rounds) and the lab's exact measurements."""

import contextlib
import json

import pytest

from ddp_tutorial import bench, maintainer
from ddp_tutorial.launcher import procinfo
from ddp_tutorial.perf import measure


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

    monkeypatch.setattr(maintainer, "busy_core", recorded_busy_core)
    result = maintainer.notebook_rounds(rounds=1, busy_rounds=1, folder=str(tmp_path), echo=False)
    assert spins == [True]
    assert result["per_notebook"]["a_passes.ipynb"]["passes"] == 1
    assert result["per_notebook"]["b_fails.ipynb"]["passes"] == 0
    assert "a false claim" in result["rounds"][0]["results"]["b_fails.ipynb"]["error"]
    assert (result["passed"], result["runs"]) == (1, 2)
    assert [r["busy_core"] for r in result["rounds"]] == [True]
    table = maintainer.format_rounds(result)
    assert "1/2 notebook runs passed" in table and "b_fails.ipynb" in table


@pytest.mark.parametrize("rounds, busy, schedule", [
    (2, 1, [False, True]), (5, 2, [False, False, False, True, True]), (3, 0, [False] * 3),
    (2, 5, [True, True]), (1, -1, [False])])
def test_the_last_rounds_are_the_busy_ones(rounds, busy, schedule):
    assert maintainer.busy_schedule(rounds, busy) == schedule


def test_busy_core_spins_and_stops():
    with maintainer.busy_core() as pid:
        assert maintainer.SPIN in procinfo.cmdline(pid)
        assert procinfo.state(pid) == "running", "running, not waiting"
    assert procinfo.state(pid) is None  # stopped and reaped (a zombie is "zombie")


def test_bench_cli_refuses_busy_core_without_notebooks(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--busy-core", "2"])
    assert "--busy-core goes with --notebooks N" in capsys.readouterr().err


def test_gradient_as_bucket_view_puts_every_grad_inside_a_bucket():
    rows = measure.grad_view(world_size=2, steps=2)
    assert len(rows) == 4
    for r in rows:
        assert r["bucket_bytes"] >= r["grad_bytes"] > 0
        if r["gradient_as_bucket_view"]:  # views, with zero_grad(set_to_none=True) too
            assert r["grad_bytes_inside_buckets"] == r["grad_bytes"] and r["grad_storages"] == r["buckets"]
        else:  # a second copy of every gradient, beside the buckets
            assert r["grad_bytes_inside_buckets"] == 0 and r["grad_storages"] == 18
