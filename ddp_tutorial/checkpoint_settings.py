"""What a checkpoint must share with the run that resumes from it, read without torch.

Standard library only, so both sides use it: the kernel refuses a wrong
``--checkpoint`` before any process starts (``config.validate``), and the ranks
(``rank/checkpoint.py``) save the same ``SETTINGS`` and check the checkpoint they
load with the same ``check_saved_settings``. Reading runs
nothing from the file: every class its pickle names becomes a placeholder.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from collections import OrderedDict
from typing import Any, Dict, Union

PathLike = Union[str, os.PathLike]
#: What must match between a checkpoint and the run resuming from it: the
#: position in an epoch names the same samples only for the same split.
SETTINGS = ("world_size", "batch_size", "accum_steps", "dataset_size", "seed")
#: The largest pickle part of a checkpoint ``read_settings`` reads (tensors are stored apart).
MAX_PICKLE_BYTES = 64 << 20


class CheckpointError(ValueError):
    """A file that is not a checkpoint, or a checkpoint of a run with other settings."""


def settings_of(args, world_size: int) -> Dict[str, Any]:
    """This run's values of ``SETTINGS``, from train.py's parsed flags and its world size.

    Args:
        args: train.py's parsed flags (``config.parse``), or anything with their attributes.
        world_size: the run's number of ranks.
    """
    values = dict(vars(args), world_size=world_size)
    return {k: values[k] for k in SETTINGS}


class _Placeholder:
    """Stands for any object a checkpoint's pickle builds (tensors, storages, classes): nothing runs."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Placeholder()

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):
        pass


class _SettingsUnpickler(pickle.Unpickler):
    """Unpickles plain data; every class and function it names becomes a ``_Placeholder``."""

    def find_class(self, module, name):
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        return _Placeholder()

    def persistent_load(self, pid):  # tensor storages live outside the pickle
        return _Placeholder()


def read_settings(path: PathLike) -> Dict[str, Any]:
    """The top-level entries of a checkpoint that are plain numbers or strings, read without torch.

    Raises:
        CheckpointError: ``path`` is not a file ``torch.save`` wrote (a zip with a data.pkl).
    """
    try:
        with zipfile.ZipFile(path) as z:
            pkl = [i for i in z.infolist() if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
            if len(pkl) != 1 or pkl[0].file_size > MAX_PICKLE_BYTES:
                raise CheckpointError(f"{str(path)!r} is not a checkpoint: no torch.save data in it")
            data = z.read(pkl[0])
        state = _SettingsUnpickler(io.BytesIO(data)).load()
    except CheckpointError:
        raise
    except (OSError, zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError, TypeError,
            AttributeError, IndexError, KeyError) as exc:
        raise CheckpointError(f"{str(path)!r} is not a checkpoint: not a file torch.save wrote "
                              f"({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{str(path)!r} is not a checkpoint: it holds a {type(state).__name__}, "
                              "not a dict of training state")
    return {k: v for k, v in state.items() if isinstance(k, str) and isinstance(v, (int, float, str))}


def check_settings(path: PathLike, now: Dict[str, Any]) -> None:
    """Refuse ``path`` unless it is a training checkpoint made with the settings in ``now`` (read without torch).

    Args:
        path: an existing checkpoint file.
        now: this run's values of ``SETTINGS`` (world_size, batch_size, accum_steps, dataset_size, seed).

    Raises:
        CheckpointError: not a checkpoint, or one of a run with other settings (the message lists them).
    """
    check_saved_settings(path, read_settings(path), now)


def check_saved_settings(path: PathLike, saved: Dict[str, Any], now: Dict[str, Any]) -> None:
    """Refuse the checkpoint ``saved`` (read from ``path``) unless it was made with the settings in ``now``.

    The one check of a checkpoint against the run resuming from it: the kernel's,
    on the file read without torch (``check_settings``), and each rank's, on the
    checkpoint it loaded (``rank/checkpoint.py``).

    Args:
        path: where ``saved`` was read from (for the message).
        saved: the checkpoint's top-level entries.
        now: this run's values of ``SETTINGS``.

    Raises:
        CheckpointError: not a training checkpoint, or one of a run with other settings (the message lists them).
    """
    missing = [k for k in list(now) + ["epoch", "micro", "step"] if k not in saved]
    if missing:
        raise CheckpointError(f"{str(path)!r} is not a training checkpoint: it has no {', '.join(missing)} "
                              "(a model.pt, or another program's file?)")
    differ = {k: (saved[k], v) for k, v in now.items() if saved[k] != v}
    if differ:
        listed = ", ".join(f"{k} {a} (now {b})" for k, (a, b) in differ.items())
        raise CheckpointError(f"{str(path)!r} is a checkpoint of another run, made with {listed}: its "
                              "position in the epoch would name other samples. Resume with the same "
                              "settings, or start from a new --checkpoint")
