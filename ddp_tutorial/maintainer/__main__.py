"""``python -m ddp_tutorial.maintainer``: the kit checks itself (``suite.py``; docs/torch-versions.md)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from ddp_tutorial.maintainer import pythons, record, suite


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_tutorial.maintainer", description=__doc__)
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--suite", type=int, metavar="N",
                      help="the README's `pytest` N times, each in a fresh clone of the commit")
    what.add_argument("--notebooks", type=int, metavar="N", help="every notebook N times (nbmake)")
    add = parser.add_argument
    add("--torch", metavar="VERSION", help="with this torch, in .venv-torch-VERSION (built once); "
        "alone: the README's `pytest` there")
    add("--python", metavar="X.Y", help="alone: the demo and the README's `pytest` (or --tests) in "
        ".venv-python-X.Y (built once)")
    add("--busy-core", type=int, default=0, metavar="K",
        help="the last K runs (or rounds) beside a process that keeps one core busy")
    add("--tests", nargs="+", default=[], metavar="PATH", help="only these pytest paths")
    add("--no-pip-config", action="store_true",
        help="pip ignores its configuration files (a machine's cap on torch versions)")
    add("--download-only", action="store_true",
        help="with --torch: only download its wheels, for a later --torch to install offline")
    add("--json", metavar="FILE", help="also write the results as JSON (--suite, --notebooks)")
    return record.main("ddp_tutorial.maintainer", parser, _main, argv)


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.download_only:
        if args.torch is None or args.suite is not None or args.notebooks is not None or args.tests:
            parser.error("--download-only goes with --torch VERSION alone")
        pythons.download_torch(args.torch, suite.checkout(), args.no_pip_config)
        return 0
    if args.python is not None:
        if args.torch or args.suite is not None or args.notebooks is not None:
            parser.error("--python goes alone (with --tests, --no-pip-config)")
        venv = pythons.python_venv(args.python, suite.checkout(), args.no_pip_config)
        return suite.check_venv(venv, args.tests, demo=True)
    if args.suite is None and args.notebooks is None:
        if args.torch is None:
            parser.error("say what to run: --torch VERSION, --suite N or --notebooks N")
        venv = pythons.torch_venv(args.torch, suite.checkout(), args.no_pip_config)
        return suite.check_venv(venv, args.tests)
    if args.suite is not None:
        if args.suite < 1 or args.busy_core < 0:
            parser.error("--suite needs N >= 1 and --busy-core K >= 0")
        return suite.report(suite.suite_runs(args.suite, args.busy_core, args.tests, args.torch,
                                             args.no_pip_config), args.json)
    if args.torch or args.tests:
        parser.error("--notebooks runs every notebook with this torch: for another, use --torch VERSION "
                     "--tests notebooks")
    return suite.report(suite.notebook_rounds(args.notebooks, args.busy_core), args.json)


if __name__ == "__main__":
    sys.exit(main())
