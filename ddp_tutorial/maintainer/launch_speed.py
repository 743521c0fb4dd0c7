"""How fast the kit launches: ``launch`` against ``torchrun --standalone``, phase by phase, for
``python -m ddp_tutorial.bench``. No torch here."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from statistics import median
from typing import Dict, List, Optional

import psutil

from ddp_tutorial.launcher import launch, worker_script


def import_torch_seconds() -> float:
    """Wall seconds of ``python -c "import torch"``: what every rank pays before anything else."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - t0


def server_memory(pid: Optional[int]) -> Dict[str, float]:
    """The forkserver's resident memory (MB), its share of it (PSS, MB) and its thread count."""
    nan = float("nan")
    try:
        proc = psutil.Process(pid or -1)  # no server: ValueError
        pss = getattr(proc.memory_full_info(), "pss", None)  # None where the OS does not say (macOS)
        return {"rss_mb": proc.memory_info().rss / 2**20, "pss_mb": nan if pss is None else pss / 2**20,
                "threads": proc.num_threads()}
    except (psutil.Error, OSError, ValueError):  # none, gone, or not ours to read
        return {"rss_mb": nan, "pss_mb": nan, "threads": 0}


def warm_launch_speed(world_size: int = 4, repeats: int = 5, timeout: float = 120.0) -> Dict:
    """Warm ``launch`` of hello.py: the first (it may start the forkserver), the median of
    ``repeats`` after it, and the idle server's memory and threads."""
    hello = worker_script(__file__, "hello.py")
    times, modes = [], set()
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        run = launch(hello, world_size, timeout=timeout, echo="none", warm=True)
        times.append(time.perf_counter() - t0)
        modes.add(run.start_mode)
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    return {"warm_first_s": times[0], "warm_s": median(times[1:]), "warm_times": times[1:],
            "warm_modes": sorted(modes), "cold_reason": run.cold_reason,
            "server": server_memory(pid)}


def launch_speed(repeats: int = 3, world_size: int = 4, timeout: float = 120.0, warm_repeats: int = 5) -> Dict:
    """Cold ``launch`` vs ``torchrun --standalone`` on hello.py, in turns, medians of ``repeats``,
    then ``warm_launch_speed``: ``ratio`` cold / torchrun (target <= 0.5), ``warm_ratio`` (<= 0.2),
    ``fixed_ratio`` (``--wait-for-store``), ``floor_s`` (world_size imports on the cores)."""
    hello = worker_script(__file__, "hello.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(world_size), hello]
    times: Dict[str, List[float]] = {"launch": [], "torchrun": [], "fixed": []}
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
        t0 = time.perf_counter()
        launch(hello, world_size, ["--wait-for-store"], timeout=timeout, echo="none", warm=False)
        times["fixed"].append(time.perf_counter() - t0)
    warm = warm_launch_speed(world_size, warm_repeats, timeout)
    import_s = import_torch_seconds()
    cores = os.cpu_count() or 1
    med = {name: median(values) for name, values in times.items()}
    return {"launch_s": med["launch"], "torchrun_s": med["torchrun"], "ratio": med["launch"] / med["torchrun"],
            "fixed_s": med["fixed"], "fixed_ratio": med["fixed"] / med["torchrun"],
            "init_s": median(init_s), "import_torch_s": import_s,
            "floor_s": world_size * import_s / min(cores, world_size), "cores": cores,
            "world_size": world_size, "repeats": repeats,
            **warm, "warm_ratio": warm["warm_s"] / med["torchrun"]}


def describe(ln: Dict) -> List[str]:
    """The bench's lines on ``launch_speed``'s result: the ratios, the fork server, the floor."""
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
    lines.append(f"  with ranks waiting for rank 0's store before init: {ln['fixed_s']:.2f} s, "
                 f"ratio {ln['fixed_ratio']:.2f} to torchrun")
    return lines
