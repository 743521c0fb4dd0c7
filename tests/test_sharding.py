"""Lesson 10 (sharding): the kernel-side arithmetic, and the lab's exact claims on 2 real ranks."""

import pytest

from ddp_tutorial.lessons import sharding as lessons


def test_greedy_partition_hands_out_whole_tensors_largest_first():
    sizes = {"0.weight": 16384, "0.bias": 256, "2.weight": 2048, "2.bias": 8}
    assert lessons.greedy_partition(sizes, 2) == [["0.weight"], ["2.weight", "0.bias", "2.bias"]]
    assert lessons.greedy_partition({"a": 3, "b": 3, "c": 2, "d": 2}, 2) == [["a", "c"], ["b", "d"]]


def test_bus_bytes_follow_nccl_tests_rule_and_give_the_papers_ratio():
    assert lessons.bus_factor("all_reduce", 2) == 1.0
    assert lessons.bus_factor("all_gather_single", 4) == lessons.bus_factor("reduce_scatter_single", 4) == 0.75
    assert lessons.bus_factor("broadcast", 2) == lessons.bus_factor("broadcast", 8) == 1.0  # busbw = algbw
    assert lessons.ring_ratio(2) == lessons.ring_ratio(8) == 1.5


def test_the_calculator_reproduces_the_zero_papers_example_in_gib():
    # Rajbhandari et al. 2020, figure 1: 7.5B parameters, 64 devices, mixed-precision Adam (K = 12), in GB (1e9).
    rows = lessons.calculator([7.5e9], 64, 80, lessons.PAPER_MIXED_PRECISION)
    gb = {r["strategy"]: round(r["gib_per_device"] * 2 ** 30 / 1e9, 1) for r in rows}
    assert gb == {"DDP": 120.0, "ZeRO-1": 31.4, "ZeRO-2": 16.6, "FSDP (ZeRO-3)": 1.9}
    assert [r["fits"] for r in rows] == [False, True, True, True]
    # An "80 GB" GPU holds 80 GiB: 83 GiB (89 GB) does not fit, whatever unit the GB of the label was.
    almost = lessons.calculator([83 * 2 ** 30 / 16], 1, 80, {"param_bytes": 4, "grad_bytes": 4, "state_bytes": 8})
    assert not almost[0]["fits"] and round(almost[0]["gib_per_device"]) == 83


CPU_WHEEL = {"torch": "2.13.0+cpu", "cuda": None, "hip": None, "nccl_available": False, "nccl_version": None,
             "xccl_available": False, "xpu_available": False}
CUDA_WHEEL = {**CPU_WHEEL, "torch": "2.14.1+cu130", "cuda": "13.0", "nccl_available": True,
              "nccl_version": [2, 27, 7]}
BUILDS = {"cpu wheel": CPU_WHEEL, "cuda wheel, no GPU needed": CUDA_WHEEL,
          "cuda, old nccl": {**CUDA_WHEEL, "nccl_version": [2, 9, 9]},
          "rocm": {**CPU_WHEEL, "hip": "6.3", "nccl_available": True, "nccl_version": [2, 21, 5]},
          "xpu with xccl": {**CPU_WHEEL, "xccl_available": True, "xpu_available": True},
          "xccl without an xpu": {**CPU_WHEEL, "xccl_available": True}}


@pytest.mark.parametrize("name", BUILDS)
def test_the_bf16_rule_is_torchs_own(name, monkeypatch):
    """The kit's rule against torch's ``_check_comm_hook`` on each build, faked where torch reads it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    import inspect

    # Which rule this torch has (2.6's has no XPU part), as the lab's ranks report it.
    build = {**BUILDS[name], "xpu_rule": "xccl" in inspect.getsource(DDP._check_comm_hook)}
    monkeypatch.setattr(torch.version, "cuda", build["cuda"])
    monkeypatch.setattr(torch.version, "hip", build["hip"])
    monkeypatch.setattr(dist, "is_nccl_available", lambda: build["nccl_available"])
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: tuple(build["nccl_version"] or (0, 0, 0)))
    monkeypatch.setattr(dist, "is_xccl_available", lambda: build["xccl_available"])
    monkeypatch.setattr(torch.xpu, "is_available", lambda: build["xpu_available"])

    class Unbuilt:  # _check_comm_hook reads nothing of the DDP object but its error path
        def _log_and_throw(self, err_type, msg):
            raise err_type(msg)

    try:
        DDP._check_comm_hook(Unbuilt(), default_hooks.bf16_compress_hook)
        accepted = True
    except TypeError:
        accepted = False
    assert lessons.bf16_hook_accepted(build) == accepted, name
    summary = {"build": build, "bf16_compress_hook_refused": "" if accepted else "BF16 all reduce ..."}
    assert ("accepts" in lessons.format_bf16_build(summary)) == accepted


def test_torch_2_6s_rule_has_no_xpu_part():
    xpu = BUILDS["xpu with xccl"]
    assert lessons.bf16_hook_accepted({**xpu, "xpu_rule": True}) and lessons.bf16_hook_accepted(xpu)
    assert not lessons.bf16_hook_accepted({**xpu, "xpu_rule": False})
    assert lessons.bf16_hook_accepted({**CUDA_WHEEL, "xpu_rule": False})  # CUDA with NCCL: both rules


def test_a_cuda_wheel_without_a_gpu_accepts_the_bf16_hook():
    # What notebook 10 once asserted everywhere ("refused") fails on the CUDA wheel pip gives on Linux.
    assert lessons.bf16_hook_accepted(CUDA_WHEEL) and not lessons.bf16_hook_accepted(CPU_WHEEL)


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
    assert "DDP + ZeRO-1 2.00x" in out  # a broadcast's bus bytes are the whole tensor
    with pytest.raises(SystemExit):
        bench.main(["--sharding", "--quick"])
