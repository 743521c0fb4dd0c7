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
rank loads, with ``map_location`` set to its own device. Each save writes its
own temporary file (pid and a random part in the name) and never touches
another writer's. What a checkpoint must share with the run resuming from it
(``SETTINGS``) and the check of it live in ``ddp_tutorial.checkpoint_settings``,
without torch, so the kernel can refuse a wrong file before any process starts.
torch is imported only to save or load.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Dict, List, Optional

# The settings and their check are here too: ranks and tests import them from this module.
from ddp_tutorial.checkpoint_settings import (  # noqa: F401
    SETTINGS, CheckpointError, PathLike, check_settings, read_settings)


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
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Same folder as the target: os.replace is only atomic within one file system.
    # A name of its own (pid, random part): concurrent writers never share or remove one.
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # only our own: another writer's may be in progress
        raise
    _fsync_dir(path.parent)
    return path


def load_checkpoint(path: Optional[PathLike], map_location="cpu") -> Optional[Dict[str, Any]]:
    """The checkpoint at ``path``, its tensors moved to ``map_location``; None if there is none.

    Args:
        path: the checkpoint file (None or a missing file: no checkpoint).
        map_location: the device of this rank, e.g. ``"cpu"`` or ``"cuda:1"``, so a
            checkpoint written by rank 0 on ``cuda:0`` lands on each rank's own device.

    Raises:
        CheckpointError: the file is not something ``torch.save`` wrote.
    """
    import torch

    if path is None or not Path(path).is_file():
        return None
    try:
        # weights_only: a checkpoint is data; never run code from a file on load.
        return torch.load(path, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile) as exc:
        first = (str(exc).splitlines() or [""])[0][:200]
        raise CheckpointError(f"{str(path)!r} is not a checkpoint: torch.load cannot read it "
                              f"({type(exc).__name__}: {first})") from exc


