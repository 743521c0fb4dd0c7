"""Checkpoints: the atomic save, the load, train.py's exact resume, and the check of a checkpoint
against the run that resumes from it. The kernel calls ``check_settings`` (standard library only)
before any process starts; the rest runs on the ranks and imports torch when called."""

from __future__ import annotations

import io
import os
import pickle
import tempfile
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

PathLike = Union[str, os.PathLike]
#: What must match between a checkpoint and the run resuming from it: the position in an epoch
#: names the same samples only for the same split.
SETTINGS = ("world_size", "batch_size", "accum_steps", "dataset_size", "seed")
#: Where training stands in a checkpoint (besides the model and the optimizer).
POSITION = ("epoch", "micro", "step", "optimizer_steps")
#: The largest pickle part ``read_settings`` reads (tensors are stored apart).
MAX_PICKLE_BYTES = 64 << 20


class CheckpointError(ValueError):
    """A file that is not a checkpoint, or a checkpoint of a run with other settings."""


def settings_of(args, world_size: int) -> Dict[str, Any]:
    """This run's values of ``SETTINGS``, from train.py's parsed flags and its world size."""
    values = dict(vars(args), world_size=world_size)
    return {k: values[k] for k in SETTINGS}


class _Placeholder:
    """Any object a checkpoint's pickle builds (tensors, storages, classes): nothing runs."""

    def __init__(self, *args, **kwargs):
        pass

    __setstate__ = __setitem__ = __init__  # take what the pickle sets, and keep none of it


class _SettingsUnpickler(pickle.Unpickler):
    """Unpickles plain data; every class and function it names becomes ``_Placeholder``."""

    def find_class(self, module, name):
        return OrderedDict if (module, name) == ("collections", "OrderedDict") else _Placeholder

    def persistent_load(self, pid):  # tensor storages live outside the pickle
        return _Placeholder()


def read_settings(path: PathLike) -> Dict[str, Any]:
    """A checkpoint's top-level numbers and strings, read without torch; CheckpointError if
    ``path`` is not a file ``torch.save`` wrote (a zip with a data.pkl)."""
    try:
        with zipfile.ZipFile(path) as z:
            pkl = [i for i in z.infolist() if ("/" + i.filename).endswith("/data.pkl")]
            if len(pkl) != 1 or pkl[0].file_size > MAX_PICKLE_BYTES:
                raise CheckpointError(f"{str(path)!r} is not a checkpoint: no torch.save data")
            state = _SettingsUnpickler(io.BytesIO(z.read(pkl[0]))).load()
    except CheckpointError:
        raise
    except Exception as exc:  # whatever a file that is not a checkpoint makes the unpickler do
        raise CheckpointError(f"{str(path)!r} is not a checkpoint: not a file torch.save wrote "
                              f"({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{str(path)!r} is not a checkpoint: it holds a "
                              f"{type(state).__name__}, not a dict of training state")
    return {k: v for k, v in state.items()
            if isinstance(k, str) and isinstance(v, (int, float, str))}


def check_settings(path: PathLike, now: Dict[str, Any], saved: Optional[dict] = None) -> None:
    """CheckpointError unless ``path`` is a training checkpoint made with ``now``'s settings: the
    kernel's check (``saved`` None: read without torch), and each rank's on what it loaded."""
    saved = read_settings(path) if saved is None else saved
    missing = [k for k in (*now, *POSITION) if k not in saved]
    if missing:
        raise CheckpointError(f"{str(path)!r} is not a training checkpoint: it has no "
                              f"{', '.join(missing)} (a model.pt, or another program's file?)")
    differ = ", ".join(f"{k} {saved[k]} (now {v})" for k, v in now.items() if saved[k] != v)
    if differ:
        raise CheckpointError(f"{str(path)!r} is a checkpoint of another run, made with {differ}: "
                              "its position in the epoch would name other samples. Resume with the "
                              "same settings, or start from a new --checkpoint")


def temp_files(path: PathLike) -> List[Path]:
    """Temporary files of unfinished saves of ``path`` (left behind by a killed writer)."""
    path = Path(path)
    return sorted(path.parent.glob(f".{path.name}.*.tmp"))


def save_checkpoint(state: Dict[str, Any], path: PathLike) -> Path:
    """Write ``state`` to ``path`` atomically: a crash leaves the previous checkpoint or none. The
    temporary file is in the same folder: ``os.replace`` is atomic only within one file system."""
    import torch  # here, not at the top: the kernel imports this module for check_settings

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp",
                                dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(name, path)
    except BaseException:
        Path(name).unlink(missing_ok=True)  # only our own: another writer's may be in progress
        raise
    folder = os.open(path.parent, os.O_RDONLY)  # fsync the folder too: the rename is on disk
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
    return path


def load_checkpoint(path: Optional[PathLike], map_location="cpu") -> Optional[Dict[str, Any]]:
    """The checkpoint at ``path`` (None or a missing file: None), its tensors on ``map_location``;
    CheckpointError if ``torch.save`` did not write it."""
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


def unwrap(model):
    """The plain model inside a DDP wrapper (what to save, load or inspect)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return model.module if isinstance(model, DDP) else model


class Checkpointer:
    """``--checkpoint PATH --save-every N`` (``flags``: train.py's): resume from PATH if it exists,
    save there as training goes. Holds no model: train.py drops its DDP model before step 5."""

    def __init__(self, path: PathLike, save_every: int, flags):
        self.path, self.save_every, self.flags = path, save_every, flags

    def resume(self, env, model, optimizer) -> Optional[Dict[str, Any]]:
        """Load the checkpoint (if any) into model and optimizer, onto this rank's own device (one
        written from ``cuda:0`` must not land on ``cuda:0`` everywhere); returns it, or None."""
        saved = load_checkpoint(self.path, map_location=env.device)
        if saved is None:
            return None
        check_settings(self.path, settings_of(self.flags, env.world_size), saved)
        unwrap(model).load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        return saved

    def save_if_due(self, env, model, optimizer, counters: Dict[str, int], epoch: int,
                    micro_done: int, num_batches: int) -> Optional[Dict[str, int]]:
        """After an optimizer step: rank 0 saves every ``save_every`` steps and at epoch ends, then
        all ranks meet, so none runs ahead of a checkpoint not yet on disk. Returns the saved
        ``POSITION``, or None."""
        import torch.distributed as dist

        due = bool(self.save_every) and counters["optimizer_steps"] % self.save_every == 0
        if not (due or micro_done >= num_batches):
            return None
        if micro_done >= num_batches:  # a finished epoch is stored as the start of the next one
            epoch, micro_done = epoch + 1, 0
        saved = {"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
                 "epoch": epoch, "micro": micro_done, **counters,
                 **settings_of(self.flags, env.world_size)}
        if env.rank == 0:
            save_checkpoint(saved, self.path)  # atomic: tmp file, fsync, os.replace
        if env.distributed:
            dist.barrier()
        return {k: saved[k] for k in POSITION}
