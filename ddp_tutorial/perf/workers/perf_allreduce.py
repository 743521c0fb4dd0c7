"""Time ``dist.all_reduce`` over a sweep of tensor sizes, and a memcpy of the same sizes for scale.

    python -c "import ddp_tutorial as d; d.launch(d.scripts_path('perf_allreduce.py'), 2, ['--quick'])"
    torchrun --standalone --nproc-per-node 4 ddp_tutorial/perf/workers/perf_allreduce.py

Each size: a few warm-up calls, then ``--rounds`` rounds of calls that start together
after a barrier, each call timed on its own. ``seconds`` is the lower quartile of
all calls: on a shared machine noise only ever adds time (a rank that is not scheduled
makes its peer wait), and a call that nobody disturbed is the one the cost model
describes. A whole-loop minimum is not robust enough here: one 40-call loop rarely
escapes every interruption on a busy 2-core machine. ``median_seconds`` is the median
call. Rank 0 reports ``sweep`` (one dict per size), ``memcpy_Bps`` (the bandwidth
ceiling of one copy of the largest size), ``memcpy_by_size`` (the copy rate at every
size), and on CUDA ``cuda_sweep`` timed with CUDA events on the GPU's own clock.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from ddp_tutorial.runfolder import report
from ddp_tutorial.perf.costmodel import FULL_SIZES, QUICK_SIZES
from ddp_tutorial.train import init_process_group


def iterations_for(nbytes: int, quick: bool) -> int:
    """Enough calls that a round lasts a few ms even for 1 KB, and few for 64 MB."""
    budget = 4 * 1024 ** 2 if quick else 64 * 1024 ** 2
    return max(2, min(40 if quick else 100, budget // nbytes))


def wall_clock_calls(tensor, iters: int, device) -> list:
    """Seconds of each of ``iters`` all-reduces, started together after a barrier."""
    dist.barrier()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dist.all_reduce(tensor)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # nccl returns before the GPU finishes
        times.append(time.perf_counter() - t0)
    return times


def cuda_event_round(tensor, iters: int) -> float:
    """Seconds of one all-reduce on the GPU's clock (CUDA events around the loop)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    start.record()
    for _ in range(iters):
        dist.all_reduce(tensor)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def memcpy_bandwidth(nbytes: int, device, repeats: int = 5) -> float:
    """Bytes/s of copying one tensor into another, best of ``repeats``: the ceiling no all-reduce beats."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.zeros_like(src)  # zeros, not empty: the first write would count page faults
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return nbytes / min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="every 4x in size, fewer calls")
    parser.add_argument("--sizes", type=int, nargs="*", default=None, help="bytes (default: the sweep)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per size (default 5)")
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    rounds = args.rounds
    env = init_process_group(args.backend)
    try:
        sweep, cuda_sweep = [], []
        for nbytes in sizes:
            tensor = torch.ones(nbytes // 4, dtype=torch.float32, device=env.device)
            iters = iterations_for(nbytes, args.quick)
            for _ in range(2):  # warm-up: first calls set up buffers and connections
                dist.all_reduce(tensor)
            times = [t for _ in range(rounds) for t in wall_clock_calls(tensor, iters, env.device)]
            sweep.append({"world_size": env.world_size, "bytes": nbytes,
                          "seconds": statistics.quantiles(times, n=4)[0],  # lower quartile
                          "median_seconds": statistics.median(times), "iters": iters})
            if env.device.type == "cuda":
                gpu_s = min(cuda_event_round(tensor, iters) for _ in range(rounds))
                cuda_sweep.append({"world_size": env.world_size, "bytes": nbytes, "seconds": gpu_s})
        if env.rank == 0:
            # The copy rate at every size: bytes that fit in the caches copy faster than bytes
            # that must go through main memory, and the all-reduce's copies feel the same.
            memcpy = [{"bytes": n, "Bps": memcpy_bandwidth(n, env.device)} for n in sizes]
            report({"sweep": sweep, "cuda_sweep": cuda_sweep, "memcpy_Bps": memcpy[-1]["Bps"],
                    "memcpy_by_size": memcpy,
                    "backend": env.backend, "device": str(env.device), "world_size": env.world_size})
            print(f"{env.backend} all-reduce sweep, {env.world_size} ranks: {len(sizes)} sizes, "
                  f"{sweep[0]['seconds'] * 1e3:.2f} ms at {sizes[0]} B, "
                  f"{sweep[-1]['seconds'] * 1e3:.1f} ms at {sizes[-1] // 1024 ** 2} MB", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
