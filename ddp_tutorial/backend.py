"""Which process-group backend a rank uses: one rule, for train.py and the worker scripts.
``auto`` is nccl when every rank on this node can have its own GPU, else gloo (a one-GPU laptop
running 4 ranks trains on CPU instead of failing). Importing this module does not import torch.
"""

from __future__ import annotations

import os
from typing import Tuple

BACKENDS = ("auto", "gloo", "nccl")


def choose_backend(requested: str, gpus: int, local_world_size: int) -> Tuple[str, str]:
    """(backend, why) for ``requested`` on a node with ``gpus`` GPUs and ``local_world_size`` ranks;
    ValueError for an unknown backend, or nccl without one GPU per rank on this node."""
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {requested!r}")
    have = f"{gpus} GPU(s) for {local_world_size} rank(s) on this node"
    one_each = gpus >= local_world_size
    if requested == "gloo":
        return "gloo", f"asked for gloo ({have})"
    if requested == "nccl":
        if gpus == 0:
            raise ValueError("backend nccl needs CUDA GPUs, but this process sees none; "
                             "use --backend gloo (or auto) on CPU")
        if not one_each:
            raise ValueError(f"backend nccl needs one GPU per rank: this node runs "
                             f"{local_world_size} ranks but has {gpus} GPU(s); start at most "
                             f"{gpus} ranks per node, or use --backend auto to train on CPU")
        return "nccl", f"asked for nccl ({have})"
    if one_each:
        return "nccl", f"auto: {have}, one GPU per rank"
    if gpus == 0:
        return "gloo", "auto: no CUDA GPU visible, so CPU"
    return "gloo", f"auto: {have}, and nccl needs one GPU per rank"


def gpu_count() -> int:
    """CUDA devices this process can see; 0 without CUDA (imports torch)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def backend_for_this_node(requested: str = "auto") -> Tuple[str, str]:
    """``choose_backend`` for this process: its visible GPUs and torchrun's LOCAL_WORLD_SIZE."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    return choose_backend(requested, gpu_count(), ranks_here)
