"""Checkpoints that survive a crash: written atomically, loaded on any device.

``save_checkpoint`` never leaves a half-written file under the checkpoint's
name: it writes a temporary file in the same folder, flushes and fsyncs it,
then renames it over the old checkpoint with ``os.replace`` (atomic on POSIX
and Windows when both names are on one file system) and fsyncs the folder so
the rename itself is on disk. A process killed at any moment leaves either the
previous complete checkpoint or none; ``load_checkpoint`` only ever reads the
final name, so a stray temporary file is never mistaken for a checkpoint.

    save_checkpoint({"model": model.state_dict(), "step": 12}, "runs/ckpt.pt")
    state = load_checkpoint("runs/ckpt.pt", map_location="cuda:0")  # None if there is none

In ``train.py`` only rank 0 saves, then every rank waits at a barrier; every
rank loads, with ``map_location`` set to its own device.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch

PathLike = Union[str, os.PathLike]


def temp_files(path: PathLike) -> List[Path]:
    """Temporary files of unfinished saves of ``path`` (left behind by a killed writer)."""
    path = Path(path)
    return sorted(path.parent.glob(f".{path.name}.*.tmp"))


def _fsync_dir(folder: Path) -> None:
    # The rename lives in the folder's entry table: fsync the folder so a power
    # loss right after os.replace cannot bring back the old name (POSIX only).
    if os.name != "posix":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(state: Dict[str, Any], path: PathLike) -> Path:
    """Write ``state`` to ``path`` atomically: temporary file, fsync, ``os.replace``, fsync folder.

    Args:
        state: what ``torch.save`` can store (tensors, numbers, dicts of them).
        path: the checkpoint file; its folder is created if needed.

    Returns:
        The checkpoint path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Same folder as the target: os.replace is only atomic within one file system.
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    for stale in temp_files(path):  # left by writers that were killed mid-save
        stale.unlink(missing_ok=True)
    return path


def load_checkpoint(path: Optional[PathLike], map_location: Union[str, torch.device] = "cpu"
                    ) -> Optional[Dict[str, Any]]:
    """The checkpoint at ``path``, its tensors moved to ``map_location``; None if there is none.

    Args:
        path: the checkpoint file (None or a missing file: no checkpoint).
        map_location: the device of this rank, e.g. ``"cpu"`` or ``"cuda:1"``, so a
            checkpoint written by rank 0 on ``cuda:0`` lands on each rank's own device.
    """
    if path is None or not Path(path).is_file():
        return None
    # weights_only: a checkpoint is data; never run code from a file on load.
    return torch.load(path, map_location=map_location, weights_only=True)
