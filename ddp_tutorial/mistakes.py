"""The original demo's mistakes: the one catalogue of train.py's ``--bug`` choices and notebook
00's and the README's tables (the original's code: ``rank/original.py``). Standard library only."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional


@dataclass(frozen=True)
class Mistake:
    """One mistake: its name (``--bug NAME``), what goes wrong, the fix, the notebooks that measure
    it ("01, 05"), and the train.py function whose original version ``--bug NAME`` runs (None: a
    mistake in how the original launches, which the launcher fixes)."""

    name: str
    what: str
    fix: str
    notebooks: str
    function: Optional[str] = None


#: Every mistake of the original demo, in the order its code makes them.
MISTAKES = (
    Mistake("hard-coded-port", "MASTER_PORT=12345 for every run, so two jobs at once collide",
            "a free port per launch", "01, 05"),
    Mistake("default-threads",
            "8 processes with torch's default thread count each, on a small machine",
            "one torch thread per rank", "01"),
    Mistake("per-rank-data", "every rank draws its own random data",
            "one dataset from a seed all ranks share; the sampler splits it", "03", "make_inputs"),
    Mistake("no-set-epoch",
            "sampler.set_epoch(epoch) is never called, so every epoch repeats one order",
            "start_epoch calls it at the start of every epoch", "03", "start_epoch"),
    Mistake("random-labels", "fresh random labels every step, so there is nothing to learn",
            "targets from a fixed, seeded teacher network", "00, 04", "loss_fn"),
    Mistake("sync-schedule",
            "sync and step on step % K == 0, so the first update follows one micro-batch, an "
            "epoch's last micro-batches join the next epoch's first update, and the last epoch's "
            "are never applied",
            "sync on the last micro-batch of each window of K; a shorter last window still steps",
            "04", "sync_schedule"),
    Mistake("forward-outside-no-sync",
            "forward() runs outside no_sync(), so no_sync() skips nothing",
            "forward and backward both inside no_sync()", "04", "micro_step"),
    Mistake("loss-not-scaled",
            "the loss is not divided by K, so the accumulated gradient is K times too large",
            "each loss divided by its window's size: one K times larger batch, exactly",
            "04", "loss_divisors"),
)

#: The original's code, a file the kernel reads (``lessons.mistake_diff``) and never imports.
ORIGINAL_SCRIPT = str(Path(__file__).resolve().parent / "rank" / "original.py")
#: ``--bug NAME`` -> the train.py function whose original version it runs.
BUGS: Dict[str, str] = {m.name: m.function for m in MISTAKES if m.function}
