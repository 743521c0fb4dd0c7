"""The run folder, the one contract between the ranks and the kernel: writer, reader, ``Run``.

A launch claims a folder (``claim``, with ``CLAIM_FILE``) and tells every rank
where it is through one environment variable, ``envvars.RUN_DIR``.

Workers write ``<run_dir>/rank<R>.jsonl``, flushing every line, so a run that
fails still leaves every step it finished. Every record carries the restart
``attempt`` that wrote it (TORCHELASTIC_RESTART_COUNT), and a restarted attempt
appends on a fresh line even after a line torn by a crash. The notebook side
reads them with ``Run(run_dir)``, which counts each step once: the final
attempt's, plus the earlier steps it resumed from. No torch is imported here
unless a model is loaded.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from ddp_tutorial import envvars


#: The file ``launch`` claims its run folder with (``O_EXCL``): one launch per folder.
CLAIM_FILE = ".launch.json"
#: Where each rank leaves notes for ``launch``: when it failed, and its stacks when stopped
#: (written by ``rank/bootstrap.py``'s ``RankNotes``; the file names are its).
RANK_NOTES = ".ranks"


class RunFolderError(ValueError):
    """A run folder that cannot be used: a file, not empty, taken by another launch, not writable."""


def rank_run_dir(default: Optional[str] = None) -> Optional[str]:
    """In a rank: the run folder its launch gave it (``envvars.RUN_DIR``), else ``default``."""
    return os.environ.get(envvars.RUN_DIR, default)


class MetricsWriter:
    """Append JSON lines to one rank's metrics file, flushed as they go.

    Args:
        run_dir: the run folder.
        rank: this process's global rank.
        fresh: truncate an existing file (a new run) instead of appending (a restart).
        attempt: stored in every record without one; default ``envvars.restart_attempt()``.
    """

    def __init__(self, run_dir: str, rank: int, fresh: bool = True, attempt: Optional[int] = None):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, f"rank{rank}.jsonl")
        self.attempt = envvars.restart_attempt() if attempt is None else attempt
        self._file = open(self.path, "w" if fresh else "a", encoding="utf-8")
        if not fresh and _ends_mid_line(self.path):
            self._file.write("\n")  # the last writer died mid-line: do not glue our first record to it

    def write(self, record: Dict[str, Any]) -> None:
        record = record if "attempt" in record else {**record, "attempt": self.attempt}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()  # a crash a moment later must not lose this step

    def close(self) -> None:
        self._file.close()


_REPORTERS: Dict[str, MetricsWriter] = {}


def report(record: Dict[str, Any]) -> None:
    """From a worker script: append ``record`` to this rank's file in the launch's run folder.

    Demo scripts use it to hand results back to the notebook, where they show
    up in ``Run.results(rank)``. Uses ``envvars.RUN_DIR`` and RANK (set by
    ``launch``); without them it writes to ``runs/manual/rank0.jsonl``.
    """
    run_dir = rank_run_dir(os.path.join("runs", "manual"))
    rank = int(os.environ.get("RANK", 0))
    key = f"{run_dir}:{rank}"
    if key not in _REPORTERS:
        _REPORTERS[key] = MetricsWriter(run_dir, rank, fresh=envvars.restart_attempt() == 0)
    _REPORTERS[key].write({"kind": "result", "rank": rank, **record})


def _ends_mid_line(path: str) -> bool:
    """Whether the file is non-empty and its last byte is not a newline (a torn record)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def _rank_notes(run_dir, name: str, read) -> Dict[int, Any]:
    """rank -> ``read(path)`` of each note ``<run_dir>/.ranks/<name>`` (a glob ending in
    ``rank*.x``); a torn or unreadable note is as if the rank left none."""
    notes = {}
    for path in Path(run_dir, RANK_NOTES).glob(name):
        try:
            notes[int(path.stem.rsplit("rank", 1)[1])] = read(path)
        except (OSError, ValueError):
            continue
    return notes


def failure_notes(run_dir, attempt: int) -> Dict[int, Dict[str, Any]]:
    """rank -> ``{"failed_at": <time.monotonic()>, "exit_code": ...}`` of each rank of ``attempt``
    whose script raised or exited non-zero (a rank killed by a signal leaves none)."""
    name = f"failure-attempt{attempt}-rank*.json"
    return _rank_notes(run_dir, name, lambda p: json.loads(p.read_text()))


def stacks_file(run_dir, attempt: int, rank: int) -> Path:
    """Where a rank writes its stacks; it exists once the rank can write them when asked."""
    return Path(run_dir, RANK_NOTES, f"stacks-attempt{attempt}-rank{rank}.txt")


def stack_notes(run_dir, attempt: int) -> Dict[int, str]:
    """rank -> every thread's Python stack (faulthandler's words) that the rank wrote when asked or stopped."""
    name = f"stacks-attempt{attempt}-rank*.txt"
    notes = _rank_notes(run_dir, name, lambda p: p.read_text(errors="replace"))
    return {rank: text for rank, text in notes.items() if text.strip()}


def drop_rank_notes_if_empty(run_dir) -> None:
    """After a run whose ranks all exited 0: no folder of notes is left if they wrote none."""
    try:
        Path(run_dir, RANK_NOTES).rmdir()
    except OSError:  # not there, or holds notes
        pass


def read_jsonl(path: Path) -> List[Dict[str, Any]]:
    """Records of one file; a torn line (the writer died mid-line) is skipped."""
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def attempt_of(record: Dict[str, Any]) -> int:
    """The restart attempt that wrote ``record`` (0 for records from before attempts were kept)."""
    attempt = record.get("attempt", 0)
    return attempt if isinstance(attempt, int) else 0


def counted(records: List[Dict[str, Any]], attempt: int) -> List[Dict[str, Any]]:
    """The step records that count for ``attempt``: its own, after the earlier ones it resumed from.

    An attempt that starts at step s (resumed from a checkpoint written at s)
    keeps the steps below s of the attempt before it, and so on back; steps an
    attempt repeated are counted once, from the later attempt. An attempt that
    starts from step 0 counts only itself.
    """
    by_attempt: Dict[int, List[Dict[str, Any]]] = {}
    for rec in records:
        by_attempt.setdefault(attempt_of(rec), []).append(rec)
    if attempt not in by_attempt:
        return []  # the attempt has not stepped yet: nothing of it to count
    kept: List[Dict[str, Any]] = []
    first = None  # the first step counted so far
    for a in sorted((a for a in by_attempt if a <= attempt), reverse=True):
        own = [r for r in by_attempt[a] if first is None or r.get("step", 0) < first]
        kept = own + kept
        if own:
            first = min(r.get("step", 0) for r in own)
        if first is not None and first <= 0:
            break
    return kept


class Run:
    """The results of one launch, read from its run folder.

    A run restarted after a failure (``max_restarts``, torchrun) holds records of
    several attempts. By default ``Run`` shows the final attempt: its summaries
    and events, and as steps the final attempt's plus the earlier steps it
    resumed from (``counted``), so every step is counted once and the step
    counts agree with the summary. ``Run(run_dir, attempt=k)`` shows attempt k alone.

    Attributes:
        run_dir: the folder holding ``rank<R>.jsonl`` and, after training, ``model.pt``.
        attempt: the attempt shown; ``attempts``: every attempt found in the files.
        steps: per rank, the list of micro-step records in order.
        summaries: per rank, the final summary record (missing for ranks that died).
        events: per rank, other records (e.g. ``checkpoint``, ``resume``, ``result``).
        records: per rank, every record of the file, of every attempt, in order.
        output: per rank, the lines the worker printed (filled in by ``launch``).
        wall_seconds: launch wall time (filled in by ``launch``).
        start_mode: "warm" (forked by the fork server) or "cold" (new processes), from the
            claim file; ``cold_reason``: why it started cold (filled in by ``launch``).
    """

    def __init__(self, run_dir, world_size: Optional[int] = None, attempt: Optional[int] = None):
        self.run_dir = Path(run_dir)
        self.requested_attempt = attempt
        self.attempt = 0
        self.attempts: List[int] = []
        self.steps: Dict[int, List[Dict[str, Any]]] = {}
        self.summaries: Dict[int, Dict[str, Any]] = {}
        self.events: Dict[int, List[Dict[str, Any]]] = {}
        self.records: Dict[int, List[Dict[str, Any]]] = {}
        self.output: Dict[int, List[str]] = {}
        self.wall_seconds: Optional[float] = None
        self.pids: List[int] = []  # worker pids (filled in by ``launch``)
        self.master_port: Optional[int] = None
        self.exit_codes: Dict[int, Optional[int]] = {}
        self.start_mode: Optional[str] = start_mode(self.run_dir)  # "warm" or "cold", as launch recorded
        self.cold_reason: Optional[str] = None  # why it started cold (filled in by ``launch``)
        self.reload()
        self.world_size = world_size if world_size is not None else len(self.ranks) or None

    def reload(self) -> "Run":
        """(Re)read every rank file in the run folder."""
        self.records = {}
        for path in sorted(self.run_dir.glob("rank*.jsonl")):
            m = re.fullmatch(r"rank(\d+)\.jsonl", path.name)
            if m:
                self.records[int(m.group(1))] = read_jsonl(path)
        self.attempts = sorted({attempt_of(r) for recs in self.records.values() for r in recs})
        final = self.attempts[-1] if self.attempts else 0
        self.attempt = final if self.requested_attempt is None else self.requested_attempt
        self.steps, self.summaries, self.events = {}, {}, {}
        for rank, recs in sorted(self.records.items()):
            steps = [r for r in recs if r.get("kind") == "step"]
            if self.requested_attempt is None:
                self.steps[rank] = counted(steps, self.attempt)
            else:
                self.steps[rank] = [r for r in steps if attempt_of(r) == self.attempt]
            own = [r for r in recs if attempt_of(r) == self.attempt and r.get("kind") != "step"]
            self.events[rank] = [r for r in own if r.get("kind") != "summary"]
            for rec in own:
                if rec.get("kind") == "summary":
                    self.summaries[rank] = rec
        return self

    @property
    def ranks(self) -> List[int]:
        return sorted(self.steps)

    def last_step(self, rank: int) -> Optional[int]:
        """The last micro-step ``rank`` finished, or None."""
        steps = self.steps.get(rank) or []
        return steps[-1]["step"] if steps else None

    def column(self, rank: int, key: str) -> List[Any]:
        """One field over all micro-steps of ``rank``, e.g. ``run.column(0, "loss")``."""
        return [rec[key] for rec in self.steps.get(rank, [])]

    def sync_steps(self, rank: int) -> List[Dict[str, Any]]:
        """Micro-steps of ``rank`` that synchronised gradients."""
        return [rec for rec in self.steps.get(rank, []) if rec["sync"]]

    def allreduce_calls(self, rank: int = 0) -> int:
        """Bucket all-reduces ``rank`` actually executed, counted by the comm hook."""
        return sum(rec["allreduce_calls"] for rec in self.steps.get(rank, []))

    def optimizer_steps(self, rank: int = 0) -> int:
        return sum(1 for rec in self.steps.get(rank, []) if rec["optimizer_step"])

    def mean_loss_curve(self) -> List[float]:
        """Mean over ranks of the local loss, per micro-step (ranks that finished it)."""
        n = min((len(s) for s in self.steps.values()), default=0)
        return [sum(self.steps[r][i]["loss"] for r in self.ranks) / len(self.ranks) for i in range(n)]

    def results(self, rank: int) -> List[Dict[str, Any]]:
        """Records a demo script sent with ``runfolder.report`` from ``rank``."""
        return [rec for rec in self.events.get(rank, []) if rec.get("kind") == "result"]

    def result(self, rank: int, key: str):
        """The value of ``key`` in the last result of ``rank`` that has it (KeyError if none)."""
        for rec in reversed(self.results(rank)):
            if key in rec:
                return rec[key]
        raise KeyError(f"rank {rank} reported no {key!r} in {self.run_dir}")

    def model_path(self) -> Path:
        return self.run_dir / "model.pt"

    def model_state(self):
        """The final ``state_dict`` rank 0 saved (loaded on CPU)."""
        import torch  # only here: reading metrics needs no torch

        return torch.load(self.model_path(), map_location="cpu", weights_only=True)

    def describe(self) -> str:
        """One line per rank: steps, last loss, total sync time."""
        lines = [f"run folder: {self.run_dir}"]
        for rank in self.ranks:
            steps = self.steps[rank]
            if not steps:
                lines.append(f"rank {rank}: no steps")
                continue
            sync = sum(s["sync_s"] for s in steps)
            lines.append(
                f"rank {rank}: {len(steps)} micro-steps, {self.optimizer_steps(rank)} optimizer steps, "
                f"loss {steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f}, "
                f"sync {sync * 1e3:.1f} ms in {self.allreduce_calls(rank)} all-reduces")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Run({str(self.run_dir)!r}, ranks={self.ranks})"


# -- The launcher's side: claiming a run folder --------------------------------------
def check_folder(path: Path, name: str, empty: bool = True) -> None:
    """Refuse a folder that is a file, is not ``empty``, or cannot be made (creates nothing)."""
    if path.exists() and not path.is_dir():
        raise RunFolderError(f"{name} {str(path)!r} is a file: give a folder (new or empty)")
    if path.is_dir():
        if empty and any(path.iterdir()):
            raise RunFolderError(f"{name} {str(path)!r} is not empty: each launch needs its own "
                                 "folder, so no earlier results are overwritten")
        existing = path
    else:
        existing = next(p for p in path.absolute().parents if p.exists())
        if not existing.is_dir():
            raise RunFolderError(f"{name} {str(path)!r} cannot be made: {str(existing)!r} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunFolderError(f"{name} {str(path)!r} cannot be written: no write permission "
                             f"on {str(existing)!r}")


def note_start(path: Path, attempt: int, mode: str, cold_reason: Optional[str], pids: List[int]) -> None:
    """Add how attempt ``attempt`` started ("warm" or "cold", and why cold) and its ranks' pids
    (each leads its process group) to the claim file.

    Written to a temporary file and renamed over the claim, so the claim never disappears.
    """
    claim_path = Path(path) / CLAIM_FILE
    info = json.loads(claim_path.read_text())
    info.update(start_mode=mode, cold_reason=cold_reason)
    info.setdefault("pids", {})[str(attempt)] = list(pids)
    tmp = claim_path.with_name(f"{CLAIM_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, claim_path)


def start_mode(path) -> Optional[str]:
    """How the latest attempt of the run in ``path`` started ("warm", "cold"), or None if not told."""
    try:
        return json.loads((Path(path) / CLAIM_FILE).read_text()).get("start_mode")
    except (OSError, ValueError):
        return None


def claim(run_dir, stem: str, name: str, info: Dict[str, object]) -> Path:
    """Make (or take the empty) run folder and claim it, so no second launch can take it too.

    The claim is ``CLAIM_FILE`` created with ``O_EXCL``: of two launches given the
    same folder at once, exactly one creates it; the other is refused.

    Args:
        run_dir: the folder asked for; None makes a new one under ``runs/`` (or $DDP_TUTORIAL_RUNS).
        stem: the script's name, for the new folder's name.
        name: what the folder was given as (``"run_dir"``, ``"--out"``), for the errors.
        info: written into the claim file, with the launcher's pid and the start time.

    Raises:
        RunFolderError: the folder is a file, not empty, taken, or cannot be made.
    """
    if run_dir is None:
        root = Path(os.environ.get(envvars.RUNS_ROOT, "runs"))
        check_folder(root, envvars.RUNS_ROOT, empty=False)
        try:
            root.mkdir(parents=True, exist_ok=True)
            path = Path(tempfile.mkdtemp(prefix=f"{time.strftime('%Y%m%d-%H%M%S')}-{stem}-", dir=root))
        except OSError as exc:
            raise RunFolderError(f"cannot make a run folder under {str(root)!r}: {exc}") from None
    else:
        path = Path(os.fspath(run_dir))  # as given: train.py does not expand ~ either
        check_folder(path, name)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunFolderError(f"{name} {str(path)!r} cannot be made: {exc}") from None
    try:
        fd = os.open(path / CLAIM_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise RunFolderError(f"{name} {str(path)!r} is taken by another launch") from None
    with os.fdopen(fd, "w") as f:
        json.dump({**info, "launcher_pid": os.getpid(), "started": time.time()}, f)
    if any(p.name != CLAIM_FILE for p in path.iterdir()):  # written to between our check and claim
        (path / CLAIM_FILE).unlink()
        raise RunFolderError(f"{name} {str(path)!r} is not empty: another program writes there")
    return path.resolve()
