"""How fast the kit itself launches: ``launch`` against ``torchrun --standalone``, phase by phase.

A self-check of the kit, not part of the lessons; the bench prints it
(``python -m ddp_tutorial.bench``). This module imports no torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from statistics import median
from typing import Dict, List

import psutil

from ddp_tutorial.launcher import launch, worker_script


def import_torch_seconds(repeats: int = 1) -> float:
    """Wall seconds of ``python -c "import torch"``: what every rank pays before it does anything."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        times.append(time.perf_counter() - t0)
    return median(times)


def launch_phases(run, t0: float, t1: float) -> Dict[str, float]:
    """Split one probe launch (``maintainer/workers/launch_probe.py``) into phases, in seconds.

    Args:
        run: the probe's ``Run``; each rank reported wall-clock timestamps.
        t0: ``time.time()`` when ``launch`` was called; t1: when it returned.
    """
    ranks = range(len(run.ranks))
    stamps = {k: [run.result(r, k) for r in ranks] for k in ("started", "imported", "joined", "finished")}
    return {"spawn": min(stamps["started"]) - t0,  # until the first rank runs its first line
            "import_torch": max(stamps["imported"]) - min(stamps["started"]),  # until the last has torch
            "join": max(stamps["joined"]) - max(stamps["imported"]),  # init_process_group after that
            "work": max(stamps["finished"]) - max(stamps["joined"]),  # all_reduce, barrier, destroy
            "exit": t1 - max(stamps["finished"])}  # interpreter teardown, reaping


def server_memory(pid: int) -> Dict[str, float]:
    """The forkserver's resident memory (MB), its share of it (PSS, MB) and its thread count."""
    nan = float("nan")
    try:
        proc = psutil.Process(pid)
        pss = getattr(proc.memory_full_info(), "pss", None)  # None where the OS does not say (macOS)
        return {"rss_mb": proc.memory_info().rss / 2**20, "pss_mb": nan if pss is None else pss / 2**20,
                "threads": proc.num_threads()}
    except (psutil.Error, OSError):  # gone, or not ours to read
        return {"rss_mb": nan, "pss_mb": nan, "threads": 0}


def warm_launch_speed(world_size: int = 4, repeats: int = 5, timeout: float = 120.0) -> Dict:
    """Warm ``launch`` of hello.py: the first (which starts the forkserver if none runs) and the
    median of ``repeats`` after it; then the idle server's memory and thread count."""
    hello = worker_script(__file__, "hello.py")
    t0 = time.perf_counter()
    run = launch(hello, world_size, timeout=timeout, echo="none", warm=True)
    first_s = time.perf_counter() - t0
    modes = {run.start_mode}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run = launch(hello, world_size, timeout=timeout, echo="none", warm=True)
        times.append(time.perf_counter() - t0)
        modes.add(run.start_mode)
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    return {"warm_first_s": first_s, "warm_s": median(times), "warm_times": times,
            "warm_modes": sorted(modes), "cold_reason": run.cold_reason,
            "server": server_memory(pid) if pid else {"rss_mb": float("nan"), "pss_mb": float("nan"),
                                                      "threads": 0}}


def launch_speed(repeats: int = 3, world_size: int = 4, timeout: float = 120.0, warm_repeats: int = 5) -> Dict:
    """Cold ``launch`` vs ``torchrun --standalone`` on hello.py, alternating, medians of ``repeats``
    each; then warm ``launch`` (``warm_launch_speed``, median of ``warm_repeats``).

    Each repeat also launches ``launch_probe.py`` twice, cold, as is and with ranks
    waiting for rank 0's store before init (``--wait-for-store``), to show where the time goes.

    Returns:
        ``launch_s`` (cold), ``torchrun_s``, ``ratio`` (cold / torchrun, target <= 0.5),
        ``warm_s``, ``warm_first_s``, ``warm_ratio`` (warm / torchrun, target <= 0.2),
        ``warm_modes``, ``server`` (the idle forkserver's ``rss_mb``, ``pss_mb``, ``threads``), ``fixed_s`` and
        ``fixed_ratio`` (the probe with the store wait), ``phases`` and ``fixed_phases``
        (``launch_phases`` medians), the ranks' median ``init_s`` under launch,
        ``import_torch_s`` and ``floor_s`` (world_size imports shared by the cores).
    """
    hello, probe = worker_script(__file__, "hello.py"), worker_script(__file__, "launch_probe.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(world_size), hello]
    times: Dict[str, List[float]] = {"launch": [], "torchrun": [], "probe": [], "fixed": []}
    phases: Dict[str, List[Dict[str, float]]] = {"probe": [], "fixed": []}
    init_s: List[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run = launch(hello, world_size, timeout=timeout, echo="none", warm=False)
        times["launch"].append(time.perf_counter() - t0)
        init_s += [run.result(r, "init_s") for r in range(world_size)]
        with tempfile.TemporaryDirectory(prefix="ddp-torchrun-logs-") as logs:  # torchrun's own files, removed
            t0 = time.perf_counter()
            subprocess.run(torchrun, check=True, capture_output=True, timeout=timeout,
                           env={**os.environ, "OMP_NUM_THREADS": "1", "PET_LOG_DIR": logs})
            times["torchrun"].append(time.perf_counter() - t0)
        for name, flags in (("probe", []), ("fixed", ["--wait-for-store"])):
            wall0, t0 = time.time(), time.perf_counter()
            run = launch(probe, world_size, flags, timeout=timeout, echo="none", warm=False)
            times[name].append(time.perf_counter() - t0)
            phases[name].append(launch_phases(run, wall0, time.time()))
    warm = warm_launch_speed(world_size, warm_repeats, timeout)
    import_s = import_torch_seconds()
    cores = os.cpu_count() or 1
    med = {name: median(values) for name, values in times.items()}
    return {"launch_s": med["launch"], "torchrun_s": med["torchrun"], "ratio": med["launch"] / med["torchrun"],
            "probe_s": med["probe"], "fixed_s": med["fixed"], "fixed_ratio": med["fixed"] / med["torchrun"],
            "phases": {k: median([p[k] for p in phases["probe"]]) for k in phases["probe"][0]},
            "fixed_phases": {k: median([p[k] for p in phases["fixed"]]) for k in phases["fixed"][0]},
            "init_s": median(init_s), "import_torch_s": import_s,
            "floor_s": world_size * import_s / min(cores, world_size), "cores": cores,
            "world_size": world_size, "repeats": repeats,
            **warm, "warm_ratio": warm["warm_s"] / med["torchrun"]}


def describe(ln: Dict) -> List[str]:
    """The bench's lines on ``launch_speed``'s result: the ratios, the fork server, the phases."""
    sv = ln["server"]
    lines = [f"launch: launch() cold {ln['launch_s']:.2f} s, warm {ln['warm_s']:.2f} s (median of "
             f"{len(ln['warm_times'])} after a first of {ln['warm_first_s']:.2f} s; started "
             f"{'/'.join(ln['warm_modes'])}), torchrun --standalone {ln['torchrun_s']:.2f} s, "
             f"{ln['world_size']} ranks of hello.py: cold ratio {ln['ratio']:.2f} (target <= 0.5), "
             f"warm ratio {ln['warm_ratio']:.2f} (target <= 0.2); cold (macOS's default) / warm "
             f"{ln['launch_s'] / ln['warm_s']:.1f}x",
             f"  fork server, idle: RSS {sv['rss_mb']:.0f} MB (PSS {sv['pss_mb']:.0f} MB), "
             f"{sv['threads']} thread(s)",
             f"  cold ranks: init_process_group {ln['init_s'] * 1e3:.0f} ms (median); import torch "
             f"{ln['import_torch_s']:.2f} s, floor {ln['floor_s']:.2f} s "
             f"({ln['world_size']} imports on {min(ln['cores'], ln['world_size'])} cores)"]
    for label, key, total in (("as is", "phases", ln["probe_s"]),
                              ("with the store wait", "fixed_phases", ln["fixed_s"])):
        parts = ", ".join(f"{k} {v:.2f}" for k, v in ln[key].items())
        lines.append(f"  where it goes, probe {label}: {total:.2f} s = {parts} s")
    lines.append(f"  with ranks waiting for rank 0's store before init: {ln['fixed_s']:.2f} s, "
                 f"ratio {ln['fixed_ratio']:.2f} to torchrun")
    return lines
