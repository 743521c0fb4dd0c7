"""Pitfall 8: debugging a hang: a shape mismatch, a missing rank, and what the messages say."""

from __future__ import annotations

import textwrap

from ddp_tutorial.launcher import LaunchError
from ddp_tutorial.lessons import headline
from ddp_tutorial.lessons.pitfalls.common import expect_failure


def failure_summary(err: LaunchError) -> dict:
    """Who failed first, how and with which words; per rank its ``headlines`` (None: stopped by
    the launcher) and ``reports``; ``aborted``: the ranks a C++ abort killed."""
    output = err.run.output if err.run else {}
    tb = getattr(err, "traceback", "")
    return {
        "kind": type(err).__name__, "rank": getattr(err, "rank", None),
        "exit_code": getattr(err, "exit_code", None), "error": headline(tb.splitlines()),
        "seconds": getattr(err, "seconds", None),
        "headlines": {r: headline(lines) for r, lines in sorted(output.items())},
        "aborted": [r for r, lines in sorted(output.items()) if any("terminate called" in ln for ln in lines)],
        "names_script_line": "pitfall_hang.py" in tb,
        "reports": {r: err.run.results(r) for r in sorted(output)} if err.run else {},
    }


def shape_mismatch(debug: bool, timeout: float = 120.0) -> dict:
    """All-reduce tensors of two shapes on 2 ranks (``debug``: TORCH_DISTRIBUTED_DEBUG=DETAIL)."""
    env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"} if debug else None
    return failure_summary(expect_failure("hang", 2, ["--case", "mismatch"], timeout=timeout, env=env))


def missing_rank(monitored: bool, wait_timeout: float = 2.0, timeout: float = 120.0) -> dict:
    """A barrier rank 1 never reaches, plain or ``monitored``; given up after ``wait_timeout`` s."""
    args = ["--case", "missing", "--wait-timeout", wait_timeout] + (["--monitored"] if monitored else [])
    return failure_summary(expect_failure("hang", 2, args, timeout=timeout))


def format_failure(summary: dict) -> str:
    s = summary
    lines = [f"{s['kind']} after {s['seconds']:.1f} s: rank {s['rank']} failed first (exit code "
             f"{s['exit_code']}); ranks aborted by C++: {s['aborted'] or 'none'}; its traceback "
             f"reaches the script: {s['names_script_line']}"]
    for rank, line in s["headlines"].items():
        lines.append(textwrap.fill(f"rank {rank}: {line or '(no error: stopped by the launcher)'}", 110,
                                   subsequent_indent="    "))
    return "\n".join(lines)
