"""Sets OMP_NUM_THREADS before importing torch (as a learner may), then reports torch's thread count."""

import os

os.environ["OMP_NUM_THREADS"] = "2"

import torch  # noqa: E402

from ddp_tutorial.runfolder import report  # noqa: E402

report({"threads": torch.get_num_threads()})
