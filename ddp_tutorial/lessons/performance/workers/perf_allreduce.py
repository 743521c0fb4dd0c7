"""Time ``dist.all_reduce`` over a sweep of tensor sizes, and a memcpy of the same sizes for scale:
per size ``ROUNDS`` rounds of calls that start together, each call timed on its own; ``seconds``
is the lower quartile of all calls (notebook 07 says why). On CUDA also ``cuda_sweep``, timed
with CUDA events on the GPU's own clock."""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from ddp_tutorial.lessons.performance.costmodel import FULL_SIZES, MB, QUICK_SIZES
from ddp_tutorial.lessons.performance.workers.perf_ddp import sync_device
from ddp_tutorial.runfolder import report
from ddp_tutorial.train import init_process_group

ROUNDS = 5


def timed_calls(call, count: int, device) -> list:
    """Seconds of each of ``count`` calls, waiting for the GPU (nccl returns before it finishes)."""
    times = []
    for _ in range(count):
        sync_device(device)
        t0 = time.perf_counter()
        call()
        sync_device(device)
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


def memcpy_bandwidth(nbytes: int, device) -> float:
    """Bytes/s of copying one tensor into another, best of 5: a ceiling for an all-reduce."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.zeros_like(src)  # zeros, not empty: the first write would count page faults
    return nbytes / min(timed_calls(lambda: dst.copy_(src), 5, device))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="every 4x in size, fewer calls")
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    env = init_process_group(args.backend)
    try:
        sweep, cuda_sweep = [], []
        for nbytes in sizes:
            tensor = torch.ones(nbytes // 4, dtype=torch.float32, device=env.device)
            # enough calls that a round lasts a few ms even for 1 KB, and few for 64 MB
            iters = max(2, min(40 if args.quick else 100, (4 if args.quick else 64) * MB // nbytes))
            for _ in range(2):  # warm-up: first calls set up buffers and connections
                dist.all_reduce(tensor)
            times = []
            for _ in range(ROUNDS):  # each round's calls start together
                dist.barrier()
                times += timed_calls(lambda: dist.all_reduce(tensor), iters, env.device)
            sweep.append({"world_size": env.world_size, "bytes": nbytes,
                          "seconds": statistics.quantiles(times, n=4)[0]})  # the lower quartile
            if env.device.type == "cuda":
                gpu_s = min(cuda_event_round(tensor, iters) for _ in range(ROUNDS))
                cuda_sweep.append({"world_size": env.world_size, "bytes": nbytes, "seconds": gpu_s})
        if env.rank == 0:
            # The copy rate at every size: bytes that fit in the caches copy faster than bytes
            # that must go through main memory, and the all-reduce's copies feel the same.
            memcpy = [{"bytes": n, "Bps": memcpy_bandwidth(n, env.device)} for n in sizes]
            report({"sweep": sweep, "cuda_sweep": cuda_sweep, "memcpy_Bps": memcpy[-1]["Bps"],
                    "memcpy_by_size": memcpy, "backend": env.backend})
            print(f"{env.backend} all-reduce sweep, {env.world_size} ranks: {len(sizes)} sizes, "
                  f"{sweep[0]['seconds'] * 1e3:.2f} ms at {sizes[0]} B, "
                  f"{sweep[-1]['seconds'] * 1e3:.1f} ms at {sizes[-1] // 1024 ** 2} MB", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
