"""Where a launch's time goes: hello.py's work, with a wall-clock timestamp at each phase.

    python -c "import ddp_tutorial as d; d.launch(d.scripts_path('launch_probe.py'), 4)"
    ... launch_probe.py --wait-for-store    # the fix the bench measures

Each rank reports ``started`` (its first line ran), ``imported`` (torch loaded),
``joined`` (init_process_group returned) and ``finished`` (process group destroyed);
the bench sets them against the launch's start and end.

``--wait-for-store``: ranks other than 0 poll MASTER_PORT every 5 ms until rank 0's
store listens, and only then call init_process_group. Without it, a rank that reaches
init before rank 0 has its connection refused, and the store client backs off for
hundreds of ms before it tries again.
"""

import time

started = time.time()

import os  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ddp_tutorial.runfolder import report  # noqa: E402

imported = time.time()


def wait_for_store(host: str, port: int, timeout_s: float = 60.0, poll_s: float = 0.005) -> None:
    """Return once something listens on host:port (rank 0's store), trying every ``poll_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s:g} s") from None
            time.sleep(poll_s)


torch.set_num_threads(1)
if "--wait-for-store" in sys.argv and int(os.environ["RANK"]) != 0:
    wait_for_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
dist.init_process_group("gloo")
try:
    joined = time.time()
    x = torch.ones(1)
    dist.all_reduce(x)
    dist.barrier()
finally:
    dist.destroy_process_group()
report({"started": started, "imported": imported, "joined": joined, "finished": time.time(),
        "all_reduce_sum": x.item()})
