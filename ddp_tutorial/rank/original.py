"""The original demo's mistakes: each one is the original's version of one train.py function.

Every function here has the name and arguments of the train.py function it
gets wrong, and differs from it only by the mistake. ``config.MISTAKES`` lists
them (flag, what goes wrong, the fix, the notebook that measures it).

    python -m ddp_tutorial.train --bug forward-outside-no-sync   # runs original.micro_step
    print(diff("forward-outside-no-sync"))                        # the original vs the fix

``mistakes(bugs, train_module)`` is how ``train.main`` swaps them in for a run.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import os
from types import ModuleType
from typing import Iterable, List, Optional
from unittest import mock

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.config import MISTAKES, TRAIN_SCRIPT


# -- per-rank-data ------------------------------------------------------------
def make_inputs(size: int, seed: int, rank: Optional[int] = None) -> torch.Tensor:
    """The original: every rank draws its own random inputs, so the ranks train on different data.

    Args:
        size: number of samples.
        seed: the run's seed.
        rank: whose inputs; None: this process's RANK.
    """
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    return torch.randn(size, 10, generator=torch.Generator().manual_seed(seed + 1000 * (rank + 1)))


# -- no-set-epoch ---------------------------------------------------------------
def start_epoch(sampler: DistributedSampler, epoch: int) -> None:
    """The original never calls ``sampler.set_epoch(epoch)``: every epoch repeats epoch 0's order."""


# -- sync-schedule --------------------------------------------------------------
def sync_schedule(num_batches: int, accum_steps: int) -> List[bool]:
    """The original syncs when ``i % K == 0``: the first update follows a single micro-batch."""
    return [i % accum_steps == 0 for i in range(num_batches)]


# -- loss-not-scaled --------------------------------------------------------------
def loss_divisors(num_batches: int, accum_steps: int) -> List[int]:
    """The original divides no loss by K: the K accumulated gradients add up to K times the mean."""
    return [1] * num_batches


# -- forward-outside-no-sync --------------------------------------------------------
def micro_step(model: nn.Module, loss_fn, x, y, loss_divisor: int, sync: bool) -> torch.Tensor:
    """The original runs forward before entering ``no_sync()``, so DDP has already planned the all-reduce."""
    skip_sync = isinstance(model, DDP) and not sync  # a plain model has nothing to skip
    out = model(x)
    with model.no_sync() if skip_sync else contextlib.nullcontext():
        loss = loss_fn(out, y)
        (loss / loss_divisor).backward()
    return loss


# -- random-labels --------------------------------------------------------------
def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The original draws fresh random labels every step (``torch.rand_like``): nothing to learn."""
    return F.mse_loss(out, torch.rand_like(out))


# -- Selecting and showing them -------------------------------------------------------
def functions(bugs: Iterable[str]) -> List[str]:
    """The names of the train.py functions that the ``--bug`` names in ``bugs`` replace.

    Raises:
        ValueError: a name that is not a ``--bug`` of train.py.
    """
    replaced = {m.name: m.function for m in MISTAKES if m.function}
    unknown = sorted(set(bugs) - set(replaced))
    if unknown:
        raise ValueError(f"not a --bug of train.py: {unknown}; choose from {sorted(replaced)}")
    return [replaced[bug] for bug in bugs]


@contextlib.contextmanager
def mistakes(bugs: Iterable[str], lesson: ModuleType):
    """Within the block, ``lesson`` (train.py's module) calls the original's version of each
    function that ``bugs`` names; its own are back on exit, so nothing leaks into a later run.

    Args:
        bugs: ``--bug`` names, e.g. ``["sync-schedule"]``; empty: train.py as it is.
        lesson: the module to patch (``sys.modules[train.__name__]``, also when run as ``__main__``).
    """
    with contextlib.ExitStack() as stack:
        for name in functions(bugs):
            stack.enter_context(mock.patch.object(lesson, name, globals()[name]))
        yield


def diff(name: str, docstrings: bool = False) -> str:
    """The original's version of a function against train.py's, as a unified diff (``-`` original, ``+`` fix).

    Reads both files; imports nothing.

    Args:
        name: a ``--bug`` name ("forward-outside-no-sync") or the function it replaces ("micro_step").
        docstrings: keep the docstrings (they explain the mistake and the fix); by default only code.
    """
    replaced = {m.name: m.function for m in MISTAKES if m.function}
    function = replaced.get(name, name)
    if function not in replaced.values():
        raise ValueError(f"no original version of {name!r}: give a --bug name {sorted(replaced)} "
                         f"or a function {sorted(replaced.values())}")
    train_py = TRAIN_SCRIPT
    theirs, ours = (_function_lines(path, function, docstrings) for path in (__file__, train_py))
    return "".join(difflib.unified_diff(theirs, ours, f"original.{function}", f"train.{function}"))


def _function_lines(path: str, function: str, docstrings: bool) -> List[str]:
    """The lines of top-level function ``function`` in the file ``path``, without its docstring
    unless ``docstrings``."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    node = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == function)
    doc = node.body[0]
    is_doc = isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)
    drop = range(doc.lineno - 1, doc.end_lineno) if is_doc and not docstrings else range(0)
    lines = text.splitlines(keepends=True)
    return [lines[i] for i in range(node.lineno - 1, node.end_lineno) if i not in drop]
