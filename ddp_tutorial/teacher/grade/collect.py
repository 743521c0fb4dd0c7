"""Reading a class's submissions: one folder (or .zip) per learner, each file an exercise's script.
Links, files over ``MAX_FILE_BYTES`` and unreadable ones are refused, anything else skipped."""

from __future__ import annotations

import os
import stat
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from ddp_tutorial.exercises import NAMES

FILES = {f"{name}.py": name for name in NAMES}
#: A submitted file larger than this is not checked (a script for these exercises is a few KiB).
MAX_FILE_BYTES = 1 << 20


class LayoutError(ValueError):
    """SUBMISSIONS is not laid out as expected; the message says what was expected and found."""


@dataclass
class Submission:
    """One learner's files (exercise -> bytes), the refused (exercise -> why), what was skipped."""

    learner: str
    origin: str
    files: Dict[str, bytes] = field(default_factory=dict)
    refused: Dict[str, str] = field(default_factory=dict)
    skipped: List[str] = field(default_factory=list)


def expected_layout(root) -> str:
    return (f"expected {root}/<learner>/ (a folder, or <learner>.zip, per learner) holding any of "
            f"{', '.join(FILES)}")


def _read_file(path: Path) -> bytes:
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError("not a regular file")
        return f.read(MAX_FILE_BYTES + 1)


def _add(sub: Submission, name: str, data: Optional[bytes], why_not: Optional[str]) -> None:
    exercise = FILES[name]
    if why_not is None and len(data) > MAX_FILE_BYTES:
        why_not = f"larger than {MAX_FILE_BYTES >> 10} KiB"
    if why_not is not None:
        sub.refused[exercise] = f"{name}: {why_not}"
    else:
        sub.files[exercise] = data


def _from_folder(folder: Path, learner: str) -> Submission:
    sub = Submission(learner, str(folder))
    entries = sorted(os.scandir(folder), key=lambda e: e.name)
    wrappers = [e for e in entries if e.is_dir(follow_symlinks=False)]
    if not any(e.name in FILES for e in entries) and len(wrappers) == 1:
        inner = _from_folder(Path(wrappers[0].path), learner)  # a zip's or a platform's one extra folder
        inner.skipped = [e.name for e in entries if e is not wrappers[0]] + inner.skipped
        inner.origin = str(folder)
        return inner
    for entry in entries:
        if entry.name in FILES:
            if entry.is_symlink():
                _add(sub, entry.name, None, f"a symbolic link (to {os.readlink(entry.path)}), not a file: "
                                            "submit the file itself")
                continue
            try:
                _add(sub, entry.name, _read_file(Path(entry.path)), None)
            except OSError as exc:
                _add(sub, entry.name, None, f"cannot be read ({exc.strerror or exc})")
        else:
            kind = ("a symbolic link" if entry.is_symlink() else "a folder" if entry.is_dir() else
                    "not an exercise file")
            sub.skipped.append(f"{entry.name} ({kind})")
    return sub


def _from_zip(path: Path, learner: str) -> Submission:
    sub = Submission(learner, str(path))
    try:
        with zipfile.ZipFile(path) as archive:
            members = [m for m in archive.infolist() if not m.is_dir()]
            tops = {m.filename.split("/")[0] for m in members}
            prefix = ""
            if len(tops) == 1 and all("/" in m.filename for m in members):
                prefix = next(iter(tops)) + "/"  # one folder around everything
            for member in members:
                name = member.filename[len(prefix):] if member.filename.startswith(prefix) else member.filename
                if name not in FILES:
                    sub.skipped.append(f"{member.filename} (not an exercise file)")
                    continue
                if stat.S_ISLNK(member.external_attr >> 16):
                    _add(sub, name, None, "a symbolic link, not a file: submit the file itself")
                    continue
                with archive.open(member) as f:  # at most one byte too many: a zip bomb stops there
                    _add(sub, name, f.read(MAX_FILE_BYTES + 1), None)
    except (zipfile.BadZipFile, OSError) as exc:
        sub.skipped.append(f"{path.name} (not a readable zip: {exc})")
    return sub


def collect(root) -> List[Submission]:
    """Every learner's submission under ``root``, sorted by name; LayoutError if there is none."""
    root = Path(root)
    if not root.is_dir():
        raise LayoutError(f"{root} is not a folder: {expected_layout(root)}")
    entries = sorted(os.scandir(root), key=lambda e: (e.name.casefold(), e.name))
    loose = [e.name for e in entries if e.name in FILES]
    if loose:
        raise LayoutError(f"{expected_layout(root)}; found exercise files directly in {root}: {', '.join(loose)}. "
                          f"Is this one learner's folder? Put it in a folder named for the learner.")
    submissions, others = [], []
    for entry in entries:
        if entry.is_symlink():
            others.append(f"{entry.name} (a symbolic link, not followed)")
        elif entry.is_dir():
            submissions.append(_from_folder(Path(entry.path), entry.name))
        elif entry.name.lower().endswith(".zip"):
            submissions.append(_from_zip(Path(entry.path), entry.name[:-4]))
        else:
            others.append(f"{entry.name} (not a folder or a .zip)")
    names = [s.learner for s in submissions]
    for sub in submissions:
        if names.count(sub.learner) > 1 and sub.origin.endswith(".zip"):
            sub.learner += ".zip"
    if not any(s.files or s.refused for s in submissions):
        found = ", ".join([f"{s.learner}/ ({', '.join(s.skipped[:4]) or 'empty'})" for s in submissions[:4]]
                          + others[:4]) or "nothing"
        raise LayoutError(f"{expected_layout(root)}; found no exercise file in any learner's folder. Found: {found}")
    for other in others:
        print(f"skipped {root / other}", flush=True)
    return submissions
