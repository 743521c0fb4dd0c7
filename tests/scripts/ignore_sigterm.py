"""Every rank ignores SIGTERM and sleeps: only SIGKILL, after the launcher's grace, stops it.

``--and-the-stacks-signal-on RANK``: that rank ignores the signal that asks for its stacks as
well, so it has none.
"""

import argparse
import os
import signal
import time

from ddp_tutorial import envvars

parser = argparse.ArgumentParser()
parser.add_argument("--and-the-stacks-signal-on", type=int, default=None)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if parser.parse_args().and_the_stacks_signal_on == int(os.environ.get("RANK", 0)):
    signal.signal(envvars.stacks_signal(), signal.SIG_IGN)
print("ignoring SIGTERM", flush=True)
while True:
    time.sleep(3600)
