"""``python -m ddp_tutorial.maintainer``: the kit checks itself (see ``maintainer/suite.py``).

    python -m ddp_tutorial.maintainer --torch 2.15.0 --no-pip-config --tests notebooks tests/test_launcher.py
    python -m ddp_tutorial.maintainer --torch 2.15.0 --no-pip-config --download-only   # wheels only, for later
    python -m ddp_tutorial.maintainer --python 3.10 --tests tests/test_launcher.py   # the demo, then the tests
    python -m ddp_tutorial.maintainer --suite 6 --busy-core 2
    python -m ddp_tutorial.maintainer --notebooks 5 --busy-core 2
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from ddp_tutorial.maintainer import pythons, suite


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_tutorial.maintainer", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--suite", type=int, metavar="N",
                      help="run the README's `pytest` N times, each in a fresh git clone of the current commit")
    what.add_argument("--notebooks", type=int, metavar="N", help="run every notebook N times (pytest --nbmake)")
    parser.add_argument("--torch", metavar="VERSION",
                        help="test with this torch, in .venv-torch-VERSION (built once, kept); alone: "
                             "run the README's `pytest` there once")
    parser.add_argument("--python", metavar="X.Y",
                        help="alone: the demo and the README's `pytest` (or --tests) with Python X.Y, in "
                             ".venv-python-X.Y (built once, kept)")
    parser.add_argument("--busy-core", type=int, default=0, metavar="K",
                        help="the last K runs (or rounds) beside a process that keeps one core busy")
    parser.add_argument("--tests", nargs="+", default=[], metavar="PATH",
                        help="only these tests (pytest paths, e.g. notebooks tests/test_launcher.py)")
    parser.add_argument("--no-pip-config", action="store_true",
                        help="pip ignores its configuration files while it builds the venv (a machine's cap "
                             "on torch versions); its PIP_* variables still apply")
    parser.add_argument("--download-only", action="store_true",
                        help="with --torch: only download its wheels (.wheels-torch-VERSION), for a later "
                             "--torch VERSION to install without the network")
    parser.add_argument("--json", metavar="FILE",
                        help="also write the results as JSON (--suite, --notebooks)")
    args = parser.parse_args(argv)
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
