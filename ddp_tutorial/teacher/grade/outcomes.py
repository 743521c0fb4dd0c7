"""What one check may use (``Limits``), what it gave (``Outcome``), and the cache of outcomes, keyed
by the file, the settings and ``kit_version()``: a second run checks only what is new or changed."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional

from ddp_tutorial.teacher.grade.report import write_atomic

PACKAGE_ROOT = Path(__file__).resolve().parents[2]

PASSED, FAILED, CRASHED, TIMED_OUT, NOT_SUBMITTED, REFUSED = (
    "passed", "failed", "crashed", "timed out", "not submitted", "not graded")


@dataclass
class Limits:
    """What one check may use: per process memory (RLIMIT_AS beyond what importing torch maps), file
    size, CPU; per check processes (its uid's RLIMIT_NPROC), /tmp and /dev/shm, output."""

    memory_bytes: int = 4 << 30
    processes: int = 512
    file_bytes: int = 64 << 20
    cpu_seconds: int = 600
    tmp_bytes: int = 512 << 20
    shm_bytes: int = 256 << 20
    output_bytes: int = 64 << 10


@dataclass
class Outcome:
    """One learner's result on one exercise: what the table, the CSV and the learner's section show."""

    learner: str
    exercise: str
    status: str
    summary: str = ""
    criteria: List[list] = field(default_factory=list)
    seconds: float = 0.0
    cached: bool = False
    log: str = ""


def kit_version() -> str:
    """A hash of the package's sources: a changed judge, harness or launcher re-checks everything."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        digest.update(str(path.relative_to(PACKAGE_ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def cache_key(exercise: str, source: bytes, kit: str, timeout: float, limits: Limits) -> str:
    settings = json.dumps({"exercise": exercise, "kit": kit, "timeout": timeout, "limits": asdict(limits)},
                          sort_keys=True)
    return hashlib.sha256(settings.encode() + b"\0" + source).hexdigest()


class Cache:
    """Results of earlier checks in ``<out>/.cache``, one JSON file per learner and exercise."""

    def __init__(self, out: Path):
        self.folder = out / ".cache"
        self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, learner: str, exercise: str) -> Path:
        return self.folder / f"{hashlib.sha256(learner.encode()).hexdigest()[:20]}-{exercise}.json"

    def get(self, learner: str, exercise: str, key: str) -> Optional[Outcome]:
        try:
            saved = json.loads(self._path(learner, exercise).read_text())
        except (OSError, ValueError):
            return None
        if saved.get("key") != key:
            return None
        return Outcome(**{**saved["outcome"], "cached": True})

    def put(self, outcome: Outcome, key: str) -> None:
        write_atomic(self._path(outcome.learner, outcome.exercise),
                     json.dumps({"key": key, "outcome": asdict(outcome)}))
