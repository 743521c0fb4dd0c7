"""The grader's record: what one check may use (``Limits``) and gave (``Outcome``), written to
report.html, report.csv (a row per learner) and results.json, which a rerun reads back: an outcome
whose ``cache_key`` (the file, the settings, ``kit_version()``) is unchanged is not checked again.
What a learner's file can influence is escaped: the page runs no script and loads nothing (CSP)."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List

from ddp_tutorial.exercises import NAMES

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
    log: str = ""  #: the end of the check's output
    key: str = ""  #: ``cache_key``: a rerun reuses the outcome while the key is the same


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


def earlier_outcomes(out: Path) -> Dict[tuple, dict]:
    """The outcomes of the last grading into ``out`` (its results.json), by learner and exercise."""
    try:
        saved = json.loads((out / "results.json").read_text(encoding="utf-8"))["outcomes"]
        return {(o["learner"], o["exercise"]): o for o in saved}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


MARK = {"passed": "✓", "failed": "✗", "crashed": "✗ crashed", "timed out": "✗ timed out",
        "not submitted": "—", "not graded": "not graded", "not checked": "not checked"}
STYLE = """body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;font-size:.85em}td,th{border:1px solid #ccc;padding:.3em .5em;vertical-align:top}
th{background:#f3f3f3;text-align:left}td.passed{background:#e6f4e6}td.failed,td.crashed{background:#fbeaea}
td.timed{background:#fff4dc}td.not{color:#888}.why{display:block;max-width:22em;font-size:.85em;color:#555}
pre{white-space:pre-wrap;font-size:.85em;background:#f8f8f8;padding:.4em;margin:.2em 0}
li.ok{color:#1a6b1a}li.no{color:#a11}li.nm{color:#777}"""


def write_atomic(path: Path, text: str) -> None:
    """``text`` into ``path``, never torn: an interrupted run leaves the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8", newline="")  # as written: the CSV's lines end in \r\n
    os.replace(tmp, path)


def cell(outcome) -> str:
    """A CSV cell: the status, and for a failure its first line."""
    failed = outcome.summary and outcome.status != "passed"
    return cell_text_safe(outcome.status + (f": {outcome.summary}" if failed else ""))


def per_exercise_lines(subs, outcomes) -> List[str]:
    """One line per exercise, for the class: "sampler: 18 of 30 pass; 9 of 30 fail: set_epoch ..."."""
    lines, n = [], len(subs)
    for exercise in NAMES:
        mine = [o for o in outcomes if o.exercise == exercise]
        # what went wrong: the first failed criterion, or the status
        wrong = Counter(o.summary.split(":")[0] if o.status == "failed" else o.status for o in mine
                        if o.status in ("failed", "crashed", "timed out"))
        missing = sum(o.status == "not submitted" for o in mine)
        lines.append(f"{exercise}: " + "; ".join(
            [f"{sum(o.status == 'passed' for o in mine)} of {n} pass"]
            + [f"{k} of {n} {what if what in ('crashed', 'timed out') else 'fail: ' + what}"
               for what, k in wrong.most_common()]
            + [f"{missing} not submitted"] * bool(missing)))
    return lines


def _id(learner: str) -> str:
    return "".join(c if c.isalnum() else f"_{ord(c):x}" for c in learner)


#: The page, by Jinja2 with autoescape: every text a learner's file can influence is escaped.
PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'">
<title>Exercise results: {{ subs|length }} learners</title><style>{{ style }}</style></head><body>
<h1>Exercise results: {{ subs|length }} learners</h1>
<p>Graded {{ when }} in {{ "%.0f"|format(seconds) }} s;
each run's deadline {{ "%g"|format(settings.timeout) }} s; kit {{ settings.kit }}.
✓ passed; ✗ a criterion failed (its first line below the mark); ✗ crashed: the script stopped
with an error on a rank; ✗ timed out: stopped at the deadline; — not submitted.
Each mark links to the learner's section.</p>
<table><tr><th>learner</th>{% for e in names %}<th>{{ e }}</th>{% endfor %}</tr>
{% for sub in subs %}<tr><th><a href="#learner-{{ id(sub.learner) }}">{{ sub.learner }}</a></th>
{%- for e in names %}{% set o = by[sub.learner, e] %}<td class="{{ o.status.split()[0] }}">
<a href="#learner-{{ id(sub.learner) }}">{{ mark.get(o.status, o.status) }}</a>
{%- if o.summary and o.status != "passed" %}<span class="why">{{ o.summary }}</span>{% endif %}</td>
{%- endfor %}</tr>
{% endfor %}</table>
<h2>Per exercise</h2><ul>{% for line in summary %}<li>{{ line }}</li>{% endfor %}</ul>
<h2>Per learner</h2>
{% for sub in subs %}<h3 id="learner-{{ id(sub.learner) }}">{{ sub.learner }}</h3>
<p>from {{ basename(sub.origin) }}
{%- if sub.skipped %}; skipped: {{ sub.skipped|join(", ") }}{% endif %}</p>
{% for e in names %}{% set o = by[sub.learner, e] %}{% set m = mark.get(o.status, o.status) %}
<h4>{{ e }}: {{ m if o.status in m else m ~ " " ~ o.status }}
{%- if o.seconds %} <small>({{ "%.0f"|format(o.seconds) }} s
{{- ", from the cache" if o.cached }})</small>{% endif %}</h4>
{% if o.criteria %}<ul>{% for name, ok, detail in o.criteria %}
{%- set k = "ok" if ok else ("nm" if detail.startswith("not measured: ") else "no") %}
<li class="{{ k }}">{{ {"ok": "✓", "nm": "·", "no": "✗"}[k] }} {{ name }}
<pre>{{ detail }}</pre></li>
{%- endfor %}</ul>{% elif o.summary %}<pre>{{ o.summary }}</pre>{% endif %}
{% if o.status == "crashed" and not o.criteria and o.log %}
<details><summary>the check's output</summary><pre>{{ o.log }}</pre></details>{% endif %}
{% endfor %}{% endfor %}
</body></html>
"""


def write(out: Path, subs, outcomes, seconds: float, settings: Dict) -> Dict[str, Path]:
    """report.html, report.csv and results.json in ``out``; returns their paths."""
    from jinja2 import Environment

    by = {(o.learner, o.exercise): o for o in outcomes}
    paths = {"html": out / "report.html", "csv": out / "report.csv", "json": out / "results.json"}
    write_atomic(paths["html"], Environment(autoescape=True).from_string(PAGE).render(
        subs=subs, by=by, names=NAMES, mark=MARK, id=_id, basename=os.path.basename, style=STYLE,
        summary=per_exercise_lines(subs, outcomes), seconds=seconds, settings=settings,
        when=time.strftime("%Y-%m-%d %H:%M")))
    table = io.StringIO()
    csv.writer(table).writerows([["learner", *NAMES]] + [
        [cell_text_safe(sub.learner)] + [cell(by[sub.learner, e]) for e in NAMES] for sub in subs])
    write_atomic(paths["csv"], table.getvalue())
    results = {"settings": settings, "seconds": seconds,
               "learners": [{"learner": s.learner, "origin": s.origin, "skipped": s.skipped} for s in subs],
               "outcomes": [asdict(o) for o in outcomes]}
    write_atomic(paths["json"], json.dumps(results, indent=1))
    return paths


def cell_text_safe(text: str) -> str:
    return "'" + text if text[:1] in "=+-@\t\r" else text  # a spreadsheet must not run a formula
