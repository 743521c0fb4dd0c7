"""The lab's records as the kernel reads them: each part's records per rank, and the versions' keys and
the names the tables print for them (beside torch's DDP). No torch is imported here."""

from __future__ import annotations

from typing import Dict, List

from ddp_tutorial.runfolder import Run

VERSIONS = ("naive", "flat", "overlap", "bucket")
NAMES = {"naive": "NaiveDDP", "flat": "FlatDDP", "overlap": "OverlapDDP", "bucket": "BucketDDP", "ddp": "torch DDP",
         "ddp_default": "DDP default"}


def part_records(run: Run, part: str) -> Dict[int, List[dict]]:
    return {rank: [r for r in run.results(rank) if r.get("part") == part] for rank in range(run.world_size)}
