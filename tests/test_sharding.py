"""Lesson 10 (sharding): the kernel-side arithmetic, and the lab's exact claims on 2 real ranks."""

import subprocess
import sys

import pytest

from ddp_tutorial.lessons import sharding as lessons


def test_the_kernel_side_imports_no_torch():
    code = "import sys; from ddp_tutorial.lessons import sharding; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_greedy_partition_hands_out_whole_tensors_largest_first():
    sizes = {"0.weight": 16384, "0.bias": 256, "2.weight": 2048, "2.bias": 8}
    assert lessons.greedy_partition(sizes, 2) == [["0.weight"], ["2.weight", "0.bias", "2.bias"]]
    assert lessons.greedy_partition({"a": 3, "b": 3, "c": 2, "d": 2}, 2) == [["a", "c"], ["b", "d"]]


def test_ring_bytes_give_the_papers_ratio():
    assert lessons.bus_factor("all_reduce", 2) == 1.0
    assert lessons.bus_factor("all_gather_single", 4) == lessons.bus_factor("reduce_scatter_single", 4) == 0.75
    assert lessons.ring_ratio(2) == lessons.ring_ratio(8) == 1.5


def test_the_calculator_reproduces_the_zero_papers_example():
    # Rajbhandari et al. 2020, figure 1: 7.5B parameters, 64 devices, mixed-precision Adam (K = 12).
    rows = lessons.calculator([7.5e9], 64, 80, lessons.PAPER_MIXED_PRECISION)
    gb = {r["strategy"]: round(r["gb_per_device"], 1) for r in rows}
    assert gb == {"DDP": 120.0, "ZeRO-1": 31.4, "ZeRO-2": 16.6, "FSDP (ZeRO-3)": 1.9}
    assert [r["fits"] for r in rows] == [False, True, True, True]


def test_an_unknown_part_is_refused_before_launching():
    with pytest.raises(ValueError, match="no part"):
        lessons.run_lab(parts=["memroy"])


def test_zero1_and_fsdp2_on_real_ranks():
    lab = lessons.run_lab(parts=["zero", "fsdp"], steps=2)
    zero, fsdp = lessons.zero_summary(lab), lessons.fsdp_summary(lab)
    assert zero["bit_identical_to_ddp"] and zero["partition"] == {0: ["0.weight"], 1: ["2.weight", "0.bias", "2.bias"]}
    assert sum(zero["state_bytes"].values()) == zero["ddp_state_bytes"]
    assert all(h["param_elements"] == 18696 // 2 for h in fsdp["held"].values())
    assert fsdp["max_diff_vs_ddp"] <= fsdp["ddp_vs_float64"]
    totals = lessons.comm_totals(lessons.comm_per_step(lab))
    assert totals["ddp"]["bytes"] == 4 * 18696
    assert totals["fsdp"]["bytes"] == 3 * 4 * 18696
    assert totals["fsdp"]["bus_bytes"] == 1.5 * totals["ddp"]["bus_bytes"]


def test_bench_prints_the_sharding_tables_behind_its_option(capsys):
    from ddp_tutorial import bench

    assert bench.main(["--sharding"]) == 0
    out = capsys.readouterr().out
    assert "FSDP2 (fully_shard)" in out and "1.50x" in out and "fp16_compress_hook" in out and "7B" in out
    with pytest.raises(SystemExit):
        bench.main(["--sharding", "--quick"])
