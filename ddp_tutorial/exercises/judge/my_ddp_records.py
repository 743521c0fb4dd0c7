"""What every criterion of exercise "my_ddp" shares: its thresholds, the criteria's names, and the readers
of the records the harness (``workers/my_ddp_harness.py``) reports. No torch here."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from ddp_tutorial.exercises.runs import HarnessRun

#: Parameters closer than this to DDP's count as equal. Measured (notebook 11): W = 2 is bit-identical;
#: at W = 4 the order of the 4-way sum differs and the parameters differ by about 1.5e-8 after 5 steps.
TOLERANCE = 1e-6
#: Gradients closer than this to this rank's own (unsynchronised) ones are those: the same ops on the same
#: values give the same bits; another rank's batch moves them by about 1e-2.
SAME_GRAD = 1e-7
STEPS = 3
#: The caps the harness trains with, in bytes (its CAP_BYTES).
CAPS = (2**20, 900, 500)

RAN = "runs to the end on every rank, at W = 2 and W = 4"
BROADCAST = "construction: every rank starts from rank 0's parameters and buffers (a broadcast)"
SAME = (f"parameters after {STEPS} SGD steps equal torch's DDP within {TOLERANCE:g} (tied weights, a frozen bias, "
        "a requires_grad=False parameter, a buffer; caps of 1 MiB, 900 and 500 bytes)")
BUCKETS = ("buckets follow bucket_cap_mb: a new bucket once the next gradient would pass the cap (DDP's rule, "
           "closing a bucket once it reaches or passes the cap, passes too)")
OVERLAP = ("overlap: all-reduces launched with async_op=True while backward still had gradients to produce, "
           "waited for after it")
NO_SYNC = "no_sync() skips the all-reduce, and the next backward syncs the sum"
UNUSED = ("a trainable parameter no forward uses: an error on every rank (as torch's DDP raises), "
          "never un-averaged gradients in silence")
ORDER = "every rank calls the same collectives in the same order"


def events_by_rank(run: HarnessRun, event: str) -> Dict[int, List[dict]]:
    return {r: run.events(r, event) for r in run.ranks}


def bytes_text(n: int) -> str:
    return "1 MiB" if n == 2**20 else f"{n:,} bytes"


def caps_text(caps: Sequence[int]) -> str:
    names = [bytes_text(c) for c in caps]
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


def trainings(run: HarnessRun) -> Optional[Dict[int, List[dict]]]:
    trains = events_by_rank(run, "train")
    return None if any(len(t) < len(CAPS) for t in trains.values()) else trains
