"""The grader's outputs: report.html (the table, a section per learner, what the class got wrong),
report.csv (one row per learner, one column per exercise), results.json, and the terminal summary.

Everything a learner's file can influence (its messages, its name) is escaped: the report runs
no script and loads nothing (a Content-Security-Policy says so to the browser).
"""

from __future__ import annotations

import csv
import html
import json
import os
import time
from collections import Counter, defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List, Sequence

from ddp_tutorial.exercises import NAMES

MARK = {"passed": "✓", "failed": "✗", "crashed": "✗ crashed", "timed out": "✗ timed out",
        "not submitted": "—", "not graded": "not graded", "not checked": "not checked"}
STYLE = """body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;font-size:.85em}td,th{border:1px solid #ccc;padding:.3em .5em;vertical-align:top}
th{background:#f3f3f3;text-align:left}td.passed{background:#e6f4e6}td.failed,td.crashed{background:#fbeaea}
td.timed{background:#fff4dc}td.not{color:#888}.why{display:block;max-width:22em;font-size:.85em;color:#555}
pre{white-space:pre-wrap;font-size:.85em;background:#f8f8f8;padding:.4em;margin:.2em 0}
li.ok{color:#1a6b1a}li.no{color:#a11}li.nm{color:#777}"""


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def cell(outcome) -> str:
    """A CSV cell: the status, and for a failure its first line."""
    text = outcome.status + (f": {outcome.summary}" if outcome.summary and outcome.status != "passed" else "")
    return "'" + text if text[:1] in "=+-@\t\r" else text  # a spreadsheet must not run it as a formula


def mistakes_by_exercise(outcomes) -> Dict[str, Counter]:
    """exercise -> Counter of what went wrong: the first failed criterion's name (or the status)."""
    found: Dict[str, Counter] = defaultdict(Counter)
    for o in outcomes:
        if o.status in ("failed", "crashed", "timed out"):
            first = o.summary.split(":")[0] if o.status == "failed" else o.status
            found[o.exercise][first] += 1
    return found


def per_exercise_lines(subs, outcomes) -> List[str]:
    """One line per exercise a teacher reads in class: "sampler: 18 of 30 pass; 9 of 30 fail 'set_epoch' ..."."""
    lines = []
    learners = len(subs)
    wrong = mistakes_by_exercise(outcomes)
    for exercise in NAMES:
        mine = [o for o in outcomes if o.exercise == exercise]
        passed = sum(o.status == "passed" for o in mine)
        missing = sum(o.status == "not submitted" for o in mine)
        parts = [f"{passed} of {learners} pass"]
        parts += [f"{n} of {learners} {what if what in ('crashed', 'timed out') else 'fail: ' + what}"
                  for what, n in wrong[exercise].most_common()]
        if missing:
            parts.append(f"{missing} not submitted")
        lines.append(f"{exercise}: " + "; ".join(parts))
    return lines


def terminal_summary(subs, outcomes) -> str:
    return "\n".join(["", "per exercise:"] + ["  " + line for line in per_exercise_lines(subs, outcomes)])


def _td(outcome) -> str:
    klass = outcome.status.split()[0]
    why = f'<span class="why">{html.escape(outcome.summary)}</span>' if outcome.summary and outcome.status != "passed" else ""
    anchor = f'#learner-{_id(outcome.learner)}'
    return f'<td class="{klass}"><a href="{anchor}">{html.escape(MARK.get(outcome.status, outcome.status))}</a>{why}</td>'


def _id(learner: str) -> str:
    return "".join(c if c.isalnum() else f"_{ord(c):x}" for c in learner)


def html_report(subs, outcomes, seconds: float, settings: Dict) -> str:
    by = {(o.learner, o.exercise): o for o in outcomes}
    esc = html.escape
    rows = []
    for sub in subs:
        rows.append(f'<tr><th><a href="#learner-{_id(sub.learner)}">{esc(sub.learner)}</a></th>'
                    + "".join(_td(by[sub.learner, e]) for e in NAMES) + "</tr>")
    sections = []
    for sub in subs:
        parts = [f'<h3 id="learner-{_id(sub.learner)}">{esc(sub.learner)}</h3>',
                 f"<p>from {esc(os.path.basename(sub.origin))}"
                 + (f"; skipped: {esc(', '.join(sub.skipped))}" if sub.skipped else "") + "</p>"]
        for exercise in NAMES:
            o = by[sub.learner, exercise]
            mark = MARK.get(o.status, o.status)
            head = f"<h4>{esc(exercise)}: {esc(mark if o.status in mark else mark + ' ' + o.status)}"
            head += f" <small>({o.seconds:.0f} s{', from the cache' if o.cached else ''})</small></h4>" if o.seconds else "</h4>"
            parts.append(head)
            if o.criteria:
                items = []
                for name, ok, detail in o.criteria:
                    klass, mark = ("ok", "✓") if ok else ("nm", "·") if detail.startswith("not measured: ") else ("no", "✗")
                    items.append(f'<li class="{klass}">{mark} {esc(name)}<pre>{esc(detail)}</pre></li>')
                parts.append("<ul>" + "".join(items) + "</ul>")
            elif o.summary:
                parts.append(f"<pre>{esc(o.summary)}</pre>")
            if o.status == "crashed" and not o.criteria and o.log:
                parts.append(f"<details><summary>the check's output</summary><pre>{esc(o.log[-4000:])}</pre></details>")
        sections.append("\n".join(parts))
    summary = "".join(f"<li>{esc(line)}</li>" for line in per_exercise_lines(subs, outcomes))
    when = time.strftime("%Y-%m-%d %H:%M")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'">
<title>Exercise results: {len(subs)} learners</title><style>{STYLE}</style></head><body>
<h1>Exercise results: {len(subs)} learners</h1>
<p>Graded {esc(when)} in {seconds:.0f} s; each run's deadline {settings['timeout']:g} s; kit {esc(settings['kit'])}.
✓ passed; ✗ a criterion failed (its first line below the mark); ✗ crashed: the script stopped with an error on
a rank; ✗ timed out: stopped at the deadline; — not submitted. Each mark links to the learner's section.</p>
<table><tr><th>learner</th>{''.join(f'<th>{esc(e)}</th>' for e in NAMES)}</tr>
{chr(10).join(rows)}</table>
<h2>Per exercise</h2><ul>{summary}</ul>
<h2>Per learner</h2>
{chr(10).join(sections)}
</body></html>
"""


def write(out: Path, subs, outcomes, seconds: float, settings: Dict) -> Dict[str, Path]:
    """report.html, report.csv and results.json in ``out``; returns their paths."""
    by = {(o.learner, o.exercise): o for o in outcomes}
    paths = {"html": out / "report.html", "csv": out / "report.csv", "json": out / "results.json"}
    _write_atomic(paths["html"], html_report(subs, outcomes, seconds, settings))
    tmp = paths["csv"].with_name("report.csv.tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["learner", *NAMES])
        for sub in subs:
            writer.writerow([cell_text_safe(sub.learner)] + [cell(by[sub.learner, e]) for e in NAMES])
    os.replace(tmp, paths["csv"])
    results = {"settings": settings, "seconds": seconds,
               "learners": [{"learner": s.learner, "origin": s.origin, "skipped": s.skipped} for s in subs],
               "outcomes": [{k: v for k, v in asdict(o).items() if k != "log"} for o in outcomes]}
    _write_atomic(paths["json"], json.dumps(results, indent=1))
    return paths


def cell_text_safe(text: str) -> str:
    return "'" + text if text[:1] in "=+-@\t\r" else text
