"""Several pitfall scripts on one set of ranks: each script's ``body`` in turn, in one group.

    torchrun --standalone --nproc-per-node 2 ddp_tutorial/lessons/pitfalls/workers/pitfall_lab.py \
        batchnorm unused lr

Starting ranks (importing torch) costs more than these pitfalls: here they pay it once. Each
runs with its default flags and reports exactly as it does alone.
"""

import argparse
import importlib

from ddp_tutorial.lessons.pitfalls.workers.pitfall_common import run


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pitfalls", nargs="+", help="pitfall scripts to run, e.g. batchnorm unused")
    return p


def body(args, rank: int, world_size: int) -> None:
    for name in args.pitfalls:
        script = importlib.import_module(f"ddp_tutorial.lessons.pitfalls.workers.pitfall_{name}")
        script.body(script.parser().parse_args([]), rank, world_size)


if __name__ == "__main__":
    run(body, parser())
