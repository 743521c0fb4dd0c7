"""Notebook 10, beyond DDP: memory, ZeRO-1, FSDP2 and compressed gradients (no torch here).
``run_lab()`` measures all in one launch; the rest turns its records into the notebook's tables."""

from __future__ import annotations

from typing import Dict, List, Sequence

from ddp_tutorial.launcher import launch
from ddp_tutorial.lessons import rank_results
from ddp_tutorial.lessons.table import text_table
from ddp_tutorial.lessons.worker_scripts import worker_script
from ddp_tutorial.runfolder import Run

SCRIPT = worker_script(__file__, "sharding_lab.py")
PARTS = ("memory", "zero", "fsdp", "compress")
STRATEGIES = {"ddp": "DDP + Adam", "zero1": "DDP + ZeRO-1 (ZeroRedundancyOptimizer)",
              "fsdp": "FSDP2 (fully_shard)"}
KINDS = ("param_bytes", "grad_bytes", "state_bytes")
#: The ZeRO paper's (Rajbhandari et al., 2020) bytes per parameter of mixed-precision Adam: fp16
#: parameters and gradients, K = 12 of state (fp32 master copy, momentum, variance).
PAPER_MIXED_PRECISION = {"param_bytes": 2, "grad_bytes": 2, "state_bytes": 12}


def run_lab(parts: Sequence[str] = PARTS, world_size: int = 2, steps: int = 8) -> Run:
    """``sharding_lab.py``'s ``parts`` on ``world_size`` ranks (gloo, CPU)."""
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"no part(s) {unknown}; one of {', '.join(PARTS)}")
    return launch(SCRIPT, world_size, ["--parts", ",".join(parts), "--steps", str(steps)],
                  timeout=120, echo="none")


def _one(run: Run, part: str) -> Dict[int, dict]:
    """Rank -> its (single) record of ``part``."""
    found = rank_results(run, part)
    missing = [rank for rank, recs in found.items() if not recs]
    if missing:
        raise KeyError(f"rank(s) {missing} reported no part {part!r} in {run.run_dir}")
    return {rank: recs[-1] for rank, recs in found.items()}


# -- 1. Memory -------------------------------------------------------------------
def memory_table(run: Run) -> Dict[str, Dict[str, Dict[int, dict]]]:
    """model -> strategy -> rank -> what that rank held after one step."""
    table: Dict[str, Dict[str, Dict[int, dict]]] = {}
    for rank, recs in rank_results(run, "memory").items():
        for rec in recs:
            table.setdefault(rec["model"], {}).setdefault(rec["strategy"], {})[rank] = rec
    return table


def total_bytes(rec: dict) -> int:
    return sum(rec[k] for k in KINDS)


def format_memory(table: dict) -> str:
    """Per model and strategy, the bytes each rank holds, and the share of DDP's."""
    tables = []
    for model, strategies in table.items():
        ddp_total = total_bytes(strategies["ddp"][0])
        rows = [(STRATEGIES[strategy], rank, *(f"{rec[k]:,}" for k in KINDS),
                 f"{total_bytes(rec):,}", f"{total_bytes(rec) / ddp_total:.1%}")
                for strategy, ranks in strategies.items() for rank, rec in ranks.items()]
        title = f"{model} model, {strategies['ddp'][0]['model_elements']:,} parameters (float32):"
        tables.append(text_table(["strategy", "rank", "parameters", "gradients", "Adam state",
                                  "total", "of DDP"], rows, title))
    return "\n".join(tables)


def adam_state_bytes(elements: int, tensors: int, element_size: int = 4) -> int:
    """Adam's state: exp_avg and exp_avg_sq per element, one float32 ``step`` per tensor."""
    return 2 * element_size * elements + 4 * tensors


def bytes_per_parameter(table: dict, model: str = "wide") -> Dict[str, float]:
    """Rank 0's measured bytes per parameter under DDP: parameters, gradients, state."""
    rec = table[model]["ddp"][0]
    return {k: rec[k] / rec["model_elements"] for k in KINDS}


def zero_partition(table: dict, model: str) -> Dict[int, dict]:
    """Per rank under ZeRO-1: the parameters whose Adam state it holds, their elements, share."""
    ranks = table[model]["zero1"]
    sizes = ranks[0]["param_sizes"]
    out = {}
    for rank, rec in ranks.items():
        elements = sum(sizes[p] for p in rec["partition"])
        out[rank] = {"params": rec["partition"], "elements": elements,
                     "share": elements / sum(sizes.values()), "state_bytes": rec["state_bytes"]}
    return out


def greedy_partition(sizes: Dict[str, int], world_size: int) -> List[List[str]]:
    """ZeroRedundancyOptimizer's partition: largest tensor first, each to the emptiest rank
    (torch 2.13 ``_partition_parameters``: by ``numel`` descending, ties to the lowest rank)."""
    ranks, load = [[] for _ in range(world_size)], [0] * world_size
    for name, n in sorted(sizes.items(), key=lambda item: -item[1]):
        r = load.index(min(load))
        ranks[r].append(name)
        load[r] += n
    return ranks


# -- 2./3. Communication -----------------------------------------------------------
def bus_factor(op: str, world_size: int) -> float:
    """Bus bytes per byte of the full tensor (nccl-tests' doc/PERFORMANCE.md, "Bus bandwidth"):
    all-reduce 2(W-1)/W, all-gather and reduce-scatter (W-1)/W, broadcast 1 (its busiest link)."""
    if op == "broadcast":
        return 1.0
    return (2 if op == "all_reduce" else 1) * (world_size - 1) / world_size


def _summed(calls: List[dict], world_size: int) -> Dict[str, dict]:
    out: Dict[str, dict] = {}
    for c in calls:
        row = out.setdefault(c["op"], {"calls": 0, "bytes": 0, "bus_bytes": 0.0, "dtypes": set()})
        row["calls"] += 1
        row["bytes"] += c["bytes"]
        row["bus_bytes"] += c["bytes"] * bus_factor(c["op"], world_size)
        row["dtypes"].add(c["dtype"])
    return out


def comm_per_step(run: Run, step: int = 1, rank: int = 0) -> Dict[str, Dict[str, dict]]:
    """strategy -> collective -> calls, full-tensor bytes and bus bytes in training step ``step``,
    counted from the tensors each collective was given (step 1: a first step can differ)."""
    w = run.world_size
    zero, fsdp = (_one(run, part)[rank]["collectives"][step] for part in ("zero", "fsdp"))
    return {"ddp": _summed(fsdp["ddp"], w), "zero1": _summed(zero["backward"] + zero["step"], w),
            "fsdp": _summed(fsdp["forward"] + fsdp["backward"] + fsdp["step"], w)}


def comm_totals(comm: dict) -> Dict[str, dict]:
    """strategy -> total bytes and bus bytes per step."""
    return {s: {k: sum(r[k] for r in ops.values()) for k in ("bytes", "bus_bytes")}
            for s, ops in comm.items()}


def format_comm(comm: dict) -> str:
    rows = [(STRATEGIES[s], op, row["calls"], f"{row['bytes']:,}", f"{row['bus_bytes']:,.0f}")
            for s, ops in comm.items() for op, row in ops.items()]
    totals = comm_totals(comm)
    base = totals["ddp"]["bus_bytes"]
    against = ", ".join(f"{STRATEGIES[s].split(' (')[0]} {t['bus_bytes'] / base:.2f}x"
                        for s, t in totals.items())
    header = ["strategy", "collective", "calls", "bytes (full tensors)", "bus bytes"]
    return text_table(header, rows) + f"\nbus bytes (nccl-tests' rule), against DDP: {against}"


def zero_summary(run: Run) -> dict:
    """ZeRO-1 against DDP after the same steps: equal or not, per-rank state, what a step sends."""
    recs = _one(run, "zero")
    return {"steps": recs[0]["steps"],
            "bit_identical_to_ddp": all(r["bit_identical_to_ddp"] for r in recs.values()),
            "max_diff_vs_ddp": max(r["max_diff_vs_ddp"] for r in recs.values()),
            "ranks_agree": len({r["digest"] for r in recs.values()}) == 1,
            "state_bytes": {rank: r["state"]["state_bytes"] for rank, r in recs.items()},
            "ddp_state_bytes": recs[0]["ddp_state"]["state_bytes"],
            "partition": {rank: r["partition"] for rank, r in recs.items()}}


def fsdp_summary(run: Run) -> dict:
    """FSDP2 against DDP: what each rank holds, the layers whole while each ran, the results."""
    recs = _one(run, "fsdp")
    r0 = recs[0]
    return {"steps": r0["steps"], "held": {rank: r["held"] for rank, r in recs.items()},
            "unsharded_while_running": r0["unsharded_while_running"],
            "first_grad_max_diff": max(r["first_grad_max_diff"] for r in recs.values()),
            "max_diff_vs_ddp": max(r["max_diff_vs_ddp"] for r in recs.values()),
            "ddp_vs_float64": r0["ddp_vs_float64"]}


def format_unsharded(events: List[dict]) -> str:
    """A row per layer run: the layers then whole, and what was all-gathered so far."""
    rows = [(e["phase"], e["layer"],
             ", ".join(f"{name}: {n:,}" for name, n in e["unsharded"].items() if n) or "none",
             " + ".join(f"{n:,}" for n in e["all_gathered"])) for e in events]
    return text_table(["phase", "layer", "whole parameters registered",
                       "all-gathered so far in phase"], rows)


# -- 4. Compressed gradients -------------------------------------------------------
def compress_summary(run: Run, rank: int = 0) -> dict:
    """Per hook: all-reduce bytes and dtype per step, the loss curve, the distance to fp32."""
    rec = _one(run, "compress")[rank]
    out = {k: rec[k] for k in ("steps", "model_elements", "bf16_compress_hook_refused", "build")}
    out["hooks"] = {name: {"bytes_per_step": sorted({sum(c["bytes"] for c in s) for s in calls}),
                           "dtypes": sorted({c["dtype"] for s in calls for c in s}),
                           "losses": rec["losses"][name], "digest": rec["digests"][name],
                           "max_diff_vs_fp32": rec["max_diff_vs_fp32"][name]}
                    for name, calls in rec["collectives"].items()}
    return out


def bf16_hook_accepted(build: dict) -> bool:
    """Whether torch 2.13's ``DDP._check_comm_hook`` accepts ``bf16_compress_hook`` on ``build``
    (the lab's ``build_facts``): CUDA or ROCm with NCCL >= 2.10, or XCCL with an XPU (2.6's rule:
    no XPU part, ``xpu_rule``). No GPU needed: Linux's default CUDA wheel accepts it."""
    cuda_or_rocm = build["cuda"] is not None or build["hip"] is not None
    nccl = bool(build["nccl_available"]) and tuple(build["nccl_version"] or ()) >= (2, 10)
    xpu = build.get("xpu_rule", True) and build["xccl_available"] and build["xpu_available"]
    return bool((cuda_or_rocm and nccl) or xpu)


def format_bf16_build(summary: dict) -> str:
    """One line: this build, what torch's rule expects, what ``register_comm_hook`` did."""
    b = summary["build"]
    nccl = ".".join(map(str, b["nccl_version"])) if b["nccl_version"] else "none"
    said = summary["bf16_compress_hook_refused"]
    return (f"torch {b['torch']}: CUDA {b['cuda'] or 'none'}, ROCm {b['hip'] or 'none'}, "
            f"NCCL {nccl}, XPU with XCCL {bool(b['xccl_available'] and b['xpu_available'])}"
            f"{'' if b.get('xpu_rule', True) else ' (a rule without an XPU part)'} -> the rule "
            f"{'accepts' if bf16_hook_accepted(b) else 'refuses'} bf16_compress_hook; "
            f"register_comm_hook " + (f"refused it: {said}" if said else "accepted it"))


def loss_gap(summary: dict, name: str, base: str = "allreduce_hook (fp32)") -> float:
    """Largest relative difference of ``name``'s loss curve from ``base``'s."""
    a, b = summary["hooks"][name]["losses"], summary["hooks"][base]["losses"]
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def format_compress(summary: dict) -> str:
    rows = [(name,
             "(in C++, not seen)" if h["bytes_per_step"] == [0]
             else f"{h['bytes_per_step'][0]:,} B",
             ",".join(h["dtypes"]) or "-", f"{h['losses'][-1]:.6f}", f"{h['max_diff_vs_fp32']:.2e}")
            for name, h in summary["hooks"].items()]
    return text_table(["hook", "all-reduced per step", "dtype", "final loss", "max |param - fp32|"],
                      rows)


# -- 5. The calculator -------------------------------------------------------------
GIB = 2 ** 30  # an "80 GB" GPU holds 80 GiB: memory is sold in powers of two


def calculator(model_params: Sequence[float], devices: int, memory_gib: float,
               per_param: Dict[str, float]) -> List[dict]:
    """Which strategies fit Ψ parameters on ``devices`` of ``memory_gib`` GiB: ``per_param`` bytes
    (as DDP holds them) times Ψ, what each strategy shards divided by N. A projection: activations,
    buffers, the framework and fragmentation are left out."""
    p, g, s = (per_param[k] for k in KINDS)
    n = devices
    per_device = {"DDP": p + g + s, "ZeRO-1": p + g + s / n, "ZeRO-2": p + (g + s) / n,
                  "FSDP (ZeRO-3)": (p + g + s) / n}
    return [{"params": psi, "strategy": strategy, "bytes_per_param": b,
             "gib_per_device": psi * b / GIB, "fits": psi * b / GIB <= memory_gib}
            for psi in model_params for strategy, b in per_device.items()]


def format_calculator(rows: List[dict], devices: int, memory_gib: float, title: str = "") -> str:
    rows = [(f"{r['params'] / 1e9:g}B" if r["params"] >= 1e9 else f"{r['params'] / 1e6:g}M",
             r["strategy"], f"{r['bytes_per_param']:.2f}", f"{r['gib_per_device']:.1f}",
             "yes" if r["fits"] else "no") for r in rows]
    return text_table(["model", "strategy", "bytes/param", f"GiB per device (of {memory_gib:g})",
                       f"fits on {devices}?"], rows, title)


def ring_ratio(world_size: int) -> float:
    """The ZeRO paper's FSDP/DDP traffic ratio (section 7.2.2, 3Ψ against 2Ψ), in bus bytes."""
    return 3 * bus_factor("all_gather_single", world_size) / bus_factor("all_reduce", world_size)


def report(run: Run) -> str:
    """The lab's tables as text (``python -m ddp_tutorial.bench --sharding`` prints it)."""
    memory = memory_table(run)
    sections = [format_memory(memory), format_comm(comm_per_step(run))]
    if rank_results(run, "compress")[0]:
        sections.append(format_compress(compress_summary(run)))
    rows = calculator([1e9, 7e9], 8, 80, bytes_per_parameter(memory))
    sections.append(format_calculator(rows, 8, 80, "projection (activations left out), float32 "
                                                   "Adam as measured:"))
    return "\n\n".join(sections)
