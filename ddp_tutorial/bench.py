"""``python -m ddp_tutorial.bench``: what DDP costs here and how fast the kit is; the command only,
the bench is the maintainer's (``maintainer/bench.py``; docs/measured.md)."""

import sys

from ddp_tutorial.maintainer.bench import main

if __name__ == "__main__":
    sys.exit(main())
