"""Each rank prints a line, then rank 0 raises (a cheap failing launch, no torch)."""

import os

print(f"rank {os.environ['RANK']} starts", flush=True)
if os.environ["RANK"] == "0":
    raise RuntimeError("planned failure")
