"""How fast the kit launches: ``launch`` against ``torchrun --standalone``, phase by phase, for
``python -m ddp_tutorial.bench``. No torch here."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import time
from multiprocessing import forkserver
from statistics import median
from typing import Dict, List, Optional

import psutil

from ddp_tutorial.launcher import launch
from ddp_tutorial.lessons.worker_scripts import worker_script


def server_memory(pid: Optional[int]) -> Dict[str, float]:
    """The forkserver's resident memory (MB), its share of it (PSS, MB) and its thread count."""
    try:
        proc = psutil.Process(pid or -1)  # no server: ValueError
        info = proc.memory_full_info()  # PSS: not where the OS does not say (macOS)
        return {"rss_mb": info.rss / 2**20, "pss_mb": getattr(info, "pss", math.nan) / 2**20,
                "threads": proc.num_threads()}
    except (psutil.Error, OSError, ValueError):  # none, gone, or not ours to read
        return {"rss_mb": math.nan, "pss_mb": math.nan, "threads": 0}


def _timed(call, *args, **kwargs) -> tuple:
    """The wall time of ``call(*args, **kwargs)``, and what it returned."""
    t0 = time.perf_counter()
    result = call(*args, **kwargs)
    return time.perf_counter() - t0, result


def launch_speed(repeats: int = 3, world_size: int = 4, timeout: float = 120.0) -> Dict:
    """Cold ``launch`` vs ``torchrun --standalone`` on hello.py, in turns, medians of ``repeats``;
    then warm: the first (it may start the forkserver), the median of 5 after it, the idle server.
    ``ratio`` cold / torchrun (target <= 0.5), ``warm_ratio`` (<= 0.2), ``floor_s`` (world_size
    imports of torch on the cores)."""
    hello = worker_script(__file__, "hello.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(world_size), hello]
    launch_times, torchrun_times, init_s = [], [], []
    for _ in range(repeats):
        seconds, run = _timed(launch, hello, world_size, timeout=timeout, echo="none", warm=False)
        launch_times.append(seconds)
        init_s += [run.result(r, "init_s") for r in range(world_size)]
        # torchrun's own log files go to a folder removed after the run
        with tempfile.TemporaryDirectory(prefix="ddp-torchrun-logs-") as logs:
            torchrun_times.append(_timed(
                subprocess.run, torchrun, check=True, capture_output=True, timeout=timeout,
                env={**os.environ, "OMP_NUM_THREADS": "1", "PET_LOG_DIR": logs})[0])
    warm_times, warm_runs = zip(*(_timed(launch, hello, world_size, timeout=timeout, echo="none",
                                         warm=True) for _ in range(6)))
    server = server_memory(getattr(forkserver._forkserver, "_forkserver_pid", None))
    # what every rank pays before anything else
    import_s = _timed(subprocess.run, [sys.executable, "-c", "import torch"], check=True)[0]
    cores = os.cpu_count() or 1
    launch_s, torchrun_s = median(launch_times), median(torchrun_times)
    warm_s = median(warm_times[1:])
    return {"launch_s": launch_s, "torchrun_s": torchrun_s, "ratio": launch_s / torchrun_s,
            "init_s": median(init_s), "import_torch_s": import_s,
            "floor_s": world_size * import_s / min(cores, world_size), "cores": cores,
            "world_size": world_size, "repeats": repeats, "warm_first_s": warm_times[0],
            "warm_s": warm_s, "warm_times": list(warm_times[1:]), "server": server,
            "warm_modes": sorted({run.start_mode for run in warm_runs}),
            "warm_ratio": warm_s / torchrun_s}


def describe(ln: Dict) -> List[str]:
    """The bench's lines on ``launch_speed``'s result: the ratios, the fork server, the floor."""
    sv = ln["server"]
    return [f"launch: launch() cold {ln['launch_s']:.2f} s, warm {ln['warm_s']:.2f} s (median of "
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
