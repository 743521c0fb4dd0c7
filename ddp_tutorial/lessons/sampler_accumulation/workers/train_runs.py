"""Several runs of train.py in one launch, each ``train.main`` in a run folder of its own; steps 1
and 5 (join and leave the group) happen once. The argument maps a run's name to [ranks (all, or 1:
a plain process on rank 0), train.py's flags]; ``--schedule-demo`` runs ``schedule_demo.py`` last.

    torchrun --standalone --nproc-per-node 2 \
        ddp_tutorial/lessons/sampler_accumulation/workers/train_runs.py \
        '{"K=1": [2, ["--accum-steps", "1"]], "big batch": [1, ["--batch-size", "32"]]}'
"""

import json
import os
import re
import sys
from unittest import mock

import torch.distributed

from ddp_tutorial import train
from ddp_tutorial.lessons.sampler_accumulation.workers import schedule_demo
from ddp_tutorial.runfolder import rank_run_dir, report


def main() -> None:
    runs = json.loads(sys.argv[1])
    env = train.init_process_group(train.parse_flags([]).backend)  # step 1, once
    try:
        for name, (ranks, flags) in runs.items():
            if ranks not in (1, env.world_size):
                raise ValueError(f"run {name!r}: {ranks} ranks, launched on {env.world_size}")
            if env.rank >= ranks:
                continue
            sub = re.sub(r"[^\w.=-]+", "_", name)  # its folder, in the launch's run folder
            if env.rank == 0:
                print(f"-- run {name!r}: {ranks} rank(s), {' '.join(flags)}", flush=True)
                report({"run": name, "folder": sub})
            run_env = env if ranks > 1 else train.DistEnv()  # 1 rank: a plain process
            # train.main with the group joined above; it drops its DDP model before returning
            with mock.patch.object(train, "init_process_group", lambda *_: run_env), \
                    mock.patch.object(train, "teardown", lambda: None):
                train.main([*flags, "--out", os.path.join(rank_run_dir("runs/train_runs"), sub)])
        if sys.argv[2:] == ["--schedule-demo"]:  # on gloo, as alone: its model stays on the CPU
            gloo = torch.distributed.new_group(backend="gloo")
            args = schedule_demo.parser().parse_args([])
            schedule_demo.measure(args, env.rank, env.world_size, gloo)
    finally:
        train.teardown()  # step 5, once


if __name__ == "__main__":
    main()
