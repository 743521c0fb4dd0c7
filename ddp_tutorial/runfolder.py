"""The run folder, the one contract between the ranks and the kernel: its formats, writers, ``Run``.
``launch`` claims it (``claim``) and names it to the ranks (``envvars.RUN_DIR``); each rank appends
JSON lines to ``rank<R>.jsonl``, tagged with its restart ``attempt``, and under ``launch`` leaves
notes in ``.ranks/`` (when it failed, its stacks); ``Run`` reads them back."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from ddp_tutorial import envvars
from ddp_tutorial.train_records import TrainRecords

#: The file ``launch`` claims its run folder with (``O_EXCL``): one launch per folder.
CLAIM_FILE = ".launch.json"
RANK_NOTES = ".ranks"


class RunFolderError(ValueError):
    """A run folder that cannot be used: a file, not empty, taken by another launch, read-only."""


def rank_run_dir(default: Optional[str] = None) -> Optional[str]:
    """In a rank: the run folder its launch gave it (``envvars.RUN_DIR``), else ``default``."""
    return os.environ.get(envvars.RUN_DIR, default)


# -- The ranks' side: metrics and notes ----------------------------------------------
class MetricsWriter:
    """Append JSON lines to one rank's metrics file, each flushed. ``fresh``: truncate (a new run)
    instead of appending (a restart); ``attempt``: default ``envvars.restart_attempt()``."""

    def __init__(self, run_dir: str, rank: int, fresh: bool = True, attempt: Optional[int] = None):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, f"rank{rank}.jsonl")
        self.attempt = envvars.restart_attempt() if attempt is None else attempt
        self._file = open(self.path, "w" if fresh else "a", encoding="utf-8")
        if self._file.tell():
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":  # the last writer died mid-line: do not glue ours to it
                    self._file.write("\n")

    def write(self, record: Dict[str, Any]) -> None:
        record = record if "attempt" in record else {**record, "attempt": self.attempt}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()  # a crash a moment later must not lose this step

    def close(self) -> None:
        self._file.close()


_REPORTERS: Dict[str, MetricsWriter] = {}


def report(record: Dict[str, Any]) -> None:
    """From a worker script: append ``record`` to this rank's file, for ``Run.results(rank)``
    (without ``launch``: ``runs/manual/rank0.jsonl``)."""
    run_dir = rank_run_dir(os.path.join("runs", "manual"))
    rank = int(os.environ.get("RANK", 0))
    key = f"{run_dir}:{rank}"
    if key not in _REPORTERS:
        _REPORTERS[key] = MetricsWriter(run_dir, rank, fresh=envvars.restart_attempt() == 0)
    _REPORTERS[key].write({"kind": "result", "rank": rank, **record})


def _note(run_dir, kind: str, attempt: int, rank) -> Path:
    """``.ranks/failure-attempt<A>-rank<R>.json`` or ``.ranks/stacks-attempt<A>-rank<R>.txt``."""
    suffix = "json" if kind == "failure" else "txt"
    return Path(run_dir, RANK_NOTES, f"{kind}-attempt{attempt}-rank{rank}.{suffix}")


def stacks_file(run_dir, attempt: int, rank: int) -> Path:
    """Where a rank writes its stacks; it exists once the rank can write them when asked."""
    return _note(run_dir, "stacks", attempt, rank)


def note_failure(run_dir, attempt: int, rank: int, record: Dict[str, Any]) -> None:
    """Write a rank's failure note (``{"failed_at": time.monotonic(), ...}``), never torn."""
    path = _note(run_dir, "failure", attempt, rank)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def _rank_notes(run_dir, kind: str, attempt: int, read) -> Dict[int, Any]:
    """rank -> ``read(path)`` of each note of ``kind``; a torn or unreadable note counts as none."""
    notes, pattern = {}, _note(run_dir, kind, attempt, "*")
    for path in pattern.parent.glob(pattern.name):
        with contextlib.suppress(OSError, ValueError):
            notes[int(path.stem.rsplit("rank", 1)[1])] = read(path)
    return notes


def failure_notes(run_dir, attempt: int) -> Dict[int, Dict[str, Any]]:
    """rank -> its failure note (a rank killed by a signal leaves none)."""
    return _rank_notes(run_dir, "failure", attempt, lambda p: json.loads(p.read_text()))


def stack_notes(run_dir, attempt: int) -> Dict[int, str]:
    """rank -> every thread's Python stack (faulthandler's words) the rank wrote."""
    notes = _rank_notes(run_dir, "stacks", attempt, lambda p: p.read_text(errors="replace"))
    return {rank: text for rank, text in notes.items() if text.strip()}


def drop_rank_notes_if_empty(run_dir) -> None:
    """After a run whose ranks all exited 0: no folder of notes is left if they wrote none."""
    with contextlib.suppress(OSError):  # not there, or holds notes
        Path(run_dir, RANK_NOTES).rmdir()


# -- The kernel's side: reading a run --------------------------------------------------
def read_jsonl(path: Path) -> List[Dict[str, Any]]:
    """Records of one file; a torn line (the writer died mid-line) is skipped."""
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(line))
    return [r for r in records if isinstance(r, dict)]


def attempt_of(record: Dict[str, Any]) -> int:
    """The restart attempt that wrote ``record`` (0 if it does not say)."""
    attempt = record.get("attempt", 0)
    return attempt if isinstance(attempt, int) else 0


def counted(records: List[Dict[str, Any]], attempt: int) -> List[Dict[str, Any]]:
    """The step records that count for ``attempt``: an attempt resumed at step s keeps the steps
    below s of the attempt before it, and so on back; a repeated step counts once, the later."""
    kept: List[Dict[str, Any]] = []
    first = math.inf  # the first step counted so far
    for a in range(attempt, -1, -1):
        own = [r for r in records if attempt_of(r) == a and r.get("step", 0) < first]
        if a == attempt and not own:
            return []  # the attempt has not stepped yet: nothing of it to count
        kept = own + kept
        first = min([first, *(r.get("step", 0) for r in own)])
        if first <= 0:
            break
    return kept


class Run(TrainRecords):
    """The results of one launch, read from its run folder. A restarted run holds several
    attempts: ``Run`` shows the final one, its steps with the earlier ones it resumed from
    (``counted``); ``Run(run_dir, attempt=k)`` shows attempt k alone. Per rank: ``steps`` (its
    micro-steps in order), ``summaries`` (the final summary; none for a rank that died),
    ``events`` (the other records: ``checkpoint``, ``result``...), ``records`` (every record).
    ``launch`` fills in ``output``, ``exit_codes``, ``pids``, ``master_port``, ``wall_seconds``,
    ``start_mode`` ("warm" or "cold") and ``cold_reason``."""

    def __init__(self, run_dir, world_size: Optional[int] = None, attempt: Optional[int] = None):
        self.run_dir = Path(run_dir)
        self.output: Dict[int, List[str]] = {}
        self.exit_codes: Dict[int, Optional[int]] = {}
        self.pids: List[int] = []
        self.master_port = self.wall_seconds = self.start_mode = self.cold_reason = None
        self.records = {int(m[1]): read_jsonl(p) for p in sorted(self.run_dir.glob("rank*.jsonl"))
                        if (m := re.fullmatch(r"rank(\d+)\.jsonl", p.name))}
        self.attempts = sorted({attempt_of(r) for recs in self.records.values() for r in recs})
        self.attempt = (self.attempts or [0])[-1] if attempt is None else attempt
        self.steps: Dict[int, List[Dict[str, Any]]] = {}
        self.summaries: Dict[int, Dict[str, Any]] = {}
        self.events: Dict[int, List[Dict[str, Any]]] = {}
        for rank, recs in sorted(self.records.items()):
            steps = [r for r in recs if r.get("kind") == "step"]
            self.steps[rank] = (counted(steps, self.attempt) if attempt is None
                                else [r for r in steps if attempt_of(r) == attempt])
            own = [r for r in recs if attempt_of(r) == self.attempt and r.get("kind") != "step"]
            self.events[rank] = [r for r in own if r.get("kind") != "summary"]
            self.summaries.update({rank: r for r in own if r.get("kind") == "summary"})
        self.world_size = world_size if world_size is not None else len(self.ranks) or None

    @property
    def ranks(self) -> List[int]:
        return sorted(self.steps)

    def last_step(self, rank: int) -> Optional[int]:
        """The last micro-step ``rank`` finished, or None."""
        steps = self.steps.get(rank) or []
        return steps[-1]["step"] if steps else None

    def results(self, rank: int) -> List[Dict[str, Any]]:
        """Records a demo script sent with ``runfolder.report`` from ``rank``."""
        return [rec for rec in self.events.get(rank, []) if rec.get("kind") == "result"]

    def result(self, rank: int, key: str):
        """The value of ``key`` in the last result of ``rank`` that has it (KeyError if none)."""
        for rec in reversed(self.results(rank)):
            if key in rec:
                return rec[key]
        raise KeyError(f"rank {rank} reported no {key!r} in {self.run_dir}")

    def __repr__(self) -> str:
        return f"Run({str(self.run_dir)!r}, ranks={self.ranks})"


# -- The launcher's side: claiming a run folder --------------------------------------
def claim(run_dir, stem: str, name: str, info: Dict[str, object]) -> Path:
    """Make (or take the empty) run folder and claim it with ``CLAIM_FILE``, created ``O_EXCL``:
    of two launches given one folder, exactly one gets it. ``run_dir`` None: a new folder under
    ``runs/`` (or $DDP_TUTORIAL_RUNS) named after ``stem``; ``name``: ``run_dir``'s, for errors."""
    if run_dir is None:  # the folder to make a new one in
        name, path = envvars.RUNS_ROOT, Path(os.environ.get(envvars.RUNS_ROOT, "runs"))
    else:
        path = Path(os.fspath(run_dir))  # as given: train.py does not expand ~ either
    where = f"{name} {str(path)!r}"
    if path.exists() and not path.is_dir():
        raise RunFolderError(f"{where} is a file: give a folder (new or empty)")
    if run_dir is not None and path.is_dir() and any(path.iterdir()):
        raise RunFolderError(f"{where} is not empty: each launch needs its own folder, so no "
                             "earlier results are overwritten")
    existing = next(p for p in [path, *path.absolute().parents] if p.exists())
    if not existing.is_dir():
        raise RunFolderError(f"{where} cannot be made: {str(existing)!r} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunFolderError(f"{where} cannot be written: no write permission on {str(existing)!r}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        if run_dir is None:
            prefix = f"{time.strftime('%Y%m%d-%H%M%S')}-{stem}-"
            path = Path(tempfile.mkdtemp(prefix=prefix, dir=path))
        fd = os.open(path / CLAIM_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise RunFolderError(f"{where} is taken by another launch") from None
    except OSError as exc:
        raise RunFolderError(f"{where} cannot be made: {exc}") from None
    with os.fdopen(fd, "w") as f:
        json.dump({**info, "launcher_pid": os.getpid(), "started": time.time()}, f)
    if any(p.name != CLAIM_FILE for p in path.iterdir()):  # written to between our check and claim
        (path / CLAIM_FILE).unlink()
        raise RunFolderError(f"{where} is not empty: another program writes there")
    return path.resolve()


def note_start(path: Path, attempt: int, mode: str, cold_reason: Optional[str],
               pids: List[int]) -> None:
    """Add to the claim file how ``attempt`` started and its ranks' pids (group leaders)."""
    claim_path = Path(path) / CLAIM_FILE
    info = json.loads(claim_path.read_text())
    info.update(start_mode=mode, cold_reason=cold_reason)
    info.setdefault("pids", {})[str(attempt)] = list(pids)
    tmp = claim_path.with_name(f"{CLAIM_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, claim_path)

