"""Checkpoints that survive a crash, and the exact resume from them.

``save_checkpoint`` never leaves a half-written file under the checkpoint's
name: it writes a temporary file in the same folder, flushes and fsyncs it,
then renames it over the old checkpoint with ``os.replace`` (atomic on POSIX
and Windows when both names are on one file system) and fsyncs the folder so
the rename itself is on disk. A process killed at any moment leaves either the
previous complete checkpoint or none; ``load_checkpoint`` only ever reads the
final name, so a stray temporary file is never mistaken for a checkpoint.

    save_checkpoint({"model": model.state_dict(), "step": 12}, "runs/ckpt.pt")
    state = load_checkpoint("runs/ckpt.pt", map_location="cuda:0")  # None if there is none

``Checkpointer`` is what train.py's ``--checkpoint``/``--save-every`` do, through
``Instrument`` (``rank/instrument.py``): every rank loads the checkpoint itself,
with ``map_location`` set to its own device (``resume_from_checkpoint``); only
rank 0 saves, then every rank waits at a barrier (``save_if_due``). Each save
writes its own temporary file (pid and a random part in the name) and never
touches another writer's. What a checkpoint must share with the run resuming
from it (``SETTINGS``) and the check of it live in ``ddp_tutorial.checkpoint_settings``,
without torch, so the kernel can refuse a wrong file before any process starts.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial.checkpoint_settings import CheckpointError, PathLike, check_saved_settings, settings_of


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
    if path is None or not Path(path).is_file():
        return None
    try:
        # weights_only: a checkpoint is data; never run code from a file on load.
        return torch.load(path, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile) as exc:
        first = (str(exc).splitlines() or [""])[0][:200]
        raise CheckpointError(f"{str(path)!r} is not a checkpoint: torch.load cannot read it "
                              f"({type(exc).__name__}: {first})") from exc




# -- What a training checkpoint holds, and the resume from it ----------------------
def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside a DDP wrapper (what to save, load or inspect)."""
    return model.module if isinstance(model, DDP) else model


def checkpoint_state(model, optimizer, settings: Dict[str, Any], counters: Dict[str, int], epoch: int,
                     micro_done: int, num_batches: int) -> Dict[str, Any]:
    """What a checkpoint holds: model, optimizer (momentum), and where training stands.

    Args:
        model: the (wrapped) model.
        optimizer: its optimizer.
        settings: this run's values of ``checkpoint_settings.SETTINGS``.
        counters: ``step`` (micro-steps done) and ``optimizer_steps``.
        epoch: the epoch being trained.
        micro_done: micro-batches of ``epoch`` trained; a finished epoch is stored
            as the start of the next one.
        num_batches: micro-batches per epoch.
    """
    if micro_done >= num_batches:
        epoch, micro_done = epoch + 1, 0
    return {"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
            "epoch": epoch, "micro": micro_done, "step": counters["step"],
            "optimizer_steps": counters["optimizer_steps"], **settings}


def resume_from_checkpoint(path, model, optimizer, settings: Dict[str, Any], device) -> Optional[Dict]:
    """Load ``path`` into model and optimizer if it exists; returns the checkpoint, or None.

    Every rank loads the file itself, with ``map_location`` set to its own
    device (a checkpoint written from ``cuda:0`` must not land on ``cuda:0`` everywhere).

    Raises:
        CheckpointError: not a training checkpoint, or one made with other settings
            (world size, batch size, K, ...): its position in the epoch would name other samples.
    """
    saved = load_checkpoint(path, map_location=device)
    if saved is None:
        return None
    check_saved_settings(path, saved, settings)
    unwrap(model).load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    return saved


class Checkpointer:
    """``--checkpoint PATH --save-every N``: resume from PATH if it exists, save there as training goes.

    Holds no reference to the model: train.py drops its DDP model (and with it the
    process group) before step 5, and each call is given the model it works on.

    Args:
        path: the checkpoint file.
        save_every: also save every N optimizer steps (0: at epoch ends only).
        flags: train.py's parsed flags, for the checkpoint's ``SETTINGS`` (``settings_of``).
    """

    def __init__(self, path: PathLike, save_every: int, flags):
        self.path, self.save_every, self.flags = path, save_every, flags

    def resume(self, env, model, optimizer) -> Optional[Dict[str, Any]]:
        """Load the checkpoint into ``model`` and ``optimizer``, if there is one; returns it, or None.

        Args:
            env: step 1's ``DistEnv`` (the world size to match, the device to load onto).
        """
        return resume_from_checkpoint(self.path, model, optimizer, settings_of(self.flags, env.world_size),
                                      env.device)

    def save_if_due(self, env, model, optimizer, counters: Dict[str, int], epoch: int, micro_done: int,
                    num_batches: int) -> Optional[Tuple[int, int]]:
        """Rank 0 saves every ``save_every`` optimizer steps and at epoch ends; all ranks then meet.

        Called right after an optimizer step. Every rank takes the same decision
        (same step counts), then waits at a barrier, so no rank runs ahead of a
        checkpoint that is not yet on disk. Returns the (epoch, micro-batch) a
        resume from the saved checkpoint starts at, or None when nothing was saved.
        """
        due = bool(self.save_every) and counters["optimizer_steps"] % self.save_every == 0
        if not (due or micro_done >= num_batches):
            return None
        saved = checkpoint_state(model, optimizer, settings_of(self.flags, env.world_size), counters, epoch,
                                 micro_done, num_batches)
        if env.rank == 0:
            save_checkpoint(saved, self.path)  # atomic: tmp file, fsync, os.replace
        if env.distributed:
            dist.barrier()
        return saved["epoch"], saved["micro"]
