"""``python -m ddp_tutorial.maintainer.slurm start|demo|stop|status [--folder DIR]``: the local
cluster; ``demo`` submits a small 2-node job of train.py and prints the queue and its output."""

import argparse
import sys

from ddp_tutorial.maintainer.slurm import (DEFAULT_FOLDER, SBATCH_SCRIPT, ClusterError, LocalCluster,
                                          demo_job)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_tutorial.maintainer.slurm",
                                     description="A SLURM controller and two nodes on 127.0.0.1.")
    parser.add_argument("action", choices=["start", "demo", "stop", "status"])
    parser.add_argument("--folder", default=str(DEFAULT_FOLDER),
                        help=f"configuration, state and logs (default: {DEFAULT_FOLDER})")
    args = parser.parse_args(argv)
    cluster = LocalCluster(args.folder)
    try:
        if args.action == "start":
            cluster.start()
            print(f"up: nodes {', '.join(cluster.idle_nodes())} idle. Now:\n"
                  f"  export SLURM_CONF={cluster.conf}\n"
                  f"  sbatch --wait {SBATCH_SCRIPT} --epochs 2 --out runs/slurm\n"
                  f"and, to stop it: python -m ddp_tutorial.maintainer.slurm stop")
        elif args.action == "demo":
            print(demo_job(cluster))
        elif args.action == "stop":
            stopped = cluster.stop()
            print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")
        else:
            print(f"up, SLURM_CONF={cluster.conf}\n{cluster.squeue()}" if cluster.is_up()
                  else "not running")
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
