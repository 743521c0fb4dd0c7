"""Join a gloo process group, report, then hold it until the file named by argv[1] exists.

While the ranks hold, a test can look at every socket the run has open.
"""

import datetime
import os
import sys
import time

import torch.distributed as dist

from ddp_tutorial.runfolder import report

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
report({"joined": True, "master_port": int(os.environ["MASTER_PORT"])})
release, deadline = sys.argv[1], time.monotonic() + 60
while not os.path.exists(release):  # the test creates it once it has looked
    if time.monotonic() > deadline:
        sys.exit("never released")
    time.sleep(0.02)
dist.barrier()
dist.destroy_process_group()
