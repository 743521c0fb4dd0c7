"""The harness of exercise "shard": the common harness, plus what a ZeRO-1 check must measure.

    python rank/bootstrap.py shard_harness.py shard SCRIPT

Runs SCRIPT under ``harness.run`` (its records, exit code and error as for
every exercise) with more observers installed around it:
ZeroRedundancyOptimizer's ``consolidate_state_dict`` and ``state_dict``
calls, the optimizer states ``torch.save`` writes, and the last optimizer
stepped. Then each rank reports ``shard_final``: the Adam state it holds, the
learning rate, its final parameters; rank 0 adds the parameters the original
DDP script reaches, replayed in one process the way DDP computes them.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.exercises.shard import LR
from ddp_tutorial.exercises.workers import harness, observers, reference, task
from ddp_tutorial.lessons.sharding.workers.sharding_common import nbytes, optimizer_state, state_tensors
from ddp_tutorial.rank import bootstrap
from ddp_tutorial.runfolder import report

# This module runs the script for the rank (through ``harness.run``): its frames are not the script's.
globals()[bootstrap.RUNS_THE_SCRIPT] = True


def optimizer_states_in(obj):
    """Every optimizer state dict (a dict with "state" and "param_groups") inside a saved object."""
    if isinstance(obj, dict):
        if "state" in obj and "param_groups" in obj:
            yield obj
        else:
            for value in obj.values():
                yield from optimizer_states_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from optimizer_states_in(value)


class ZeroObservers(observers.Observers):
    """What the common harness does not watch: ZeRO's calls, saved optimizer states, the last optimizer.

    ``patch`` and ``remove`` are the common harness's; ``install`` puts these observers in.
    """

    def __init__(self):
        super().__init__(seen=None, launcher=None)
        self.last_optimizer = None
        self.steps = 0  # steps of the script's own optimizer, not of ZeRO's inner Adam
        self.inner = set()  # ids of ZeRO's local optimizers
        self.consolidate_calls = 0
        self.state_dict_refused = None
        self.saved = []

    def install(self):
        zero_init = ZeroRedundancyOptimizer.__init__

        def observed_init(zero, *args, **kwargs):
            zero_init(zero, *args, **kwargs)
            self.inner.add(id(zero.optim))

        consolidate = ZeroRedundancyOptimizer.consolidate_state_dict

        def observed_consolidate(zero, *args, **kwargs):
            self.consolidate_calls += 1
            return consolidate(zero, *args, **kwargs)

        state_dict = ZeroRedundancyOptimizer.state_dict

        def observed_state_dict(zero):
            try:
                return state_dict(zero)
            except RuntimeError as err:  # not consolidated on this rank
                self.state_dict_refused = str(err).splitlines()[0]
                raise

        save = torch.save

        def observed_save(obj, f, *args, **kwargs):
            for state in optimizer_states_in(obj):
                tensors = [v for s in state["state"].values() for v in s.values() if isinstance(v, torch.Tensor)]
                self.saved.append({"params_with_state": len(state["state"]), "state_bytes": nbytes(tensors)})
            return save(obj, f, *args, **kwargs)

        def after_step(optimizer, args, kwargs):
            if id(optimizer) not in self.inner:  # ZeRO's own step follows its inner Adam's
                self.steps += 1
                self.last_optimizer = optimizer

        self.patch(ZeroRedundancyOptimizer, "__init__", observed_init)
        self.patch(ZeroRedundancyOptimizer, "consolidate_state_dict", observed_consolidate)
        self.patch(ZeroRedundancyOptimizer, "state_dict", observed_state_dict)
        self.patch(torch, "save", observed_save)  # the common harness wraps this one in turn
        self._hook = register_optimizer_step_post_hook(after_step)


def ddp_replay(world_size: int, seed: int = 0):
    """The DDP script with Adam in one process: final parameters, Adam's state bytes, steps.

    Each step computes every rank's gradient on that rank's rows (its
    DistributedSampler's order), divides by W and sums, as DDP's all-reduce
    does, then steps one Adam with lr=LR.
    """
    model = task.make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    dataset = task.make_dataset()
    x_all, y_all = dataset.tensors
    steps = 0
    for epoch in range(task.EPOCHS):
        orders = []
        for rank in range(world_size):
            sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        for start in range(0, len(orders[0]), task.BATCH_SIZE):
            summed = None
            for order in orders:
                rows = order[start:start + task.BATCH_SIZE]
                model.zero_grad(set_to_none=True)
                F.mse_loss(model(x_all[rows]), y_all[rows]).backward()
                grads = [p.grad / world_size for p in model.parameters()]
                summed = grads if summed is None else [a + b for a, b in zip(summed, grads)]
            for p, g in zip(model.parameters(), summed):
                p.grad = g
            optimizer.step()
            steps += 1
    return reference.flat_parameters(model.parameters()), nbytes(state_tensors(optimizer)), steps


def final_record(seen: ZeroObservers) -> dict:
    opt = seen.last_optimizer
    params = observers.optimizer_parameters(opt) if opt is not None else []
    record = {"event": "shard_final", "optimizer": type(opt).__name__ if opt is not None else None,
              "local_optimizer": type(optimizer_state(opt)).__name__ if opt is not None else None,
              "lr": opt.param_groups[0]["lr"] if opt is not None else None,
              "state_bytes": nbytes(state_tensors(opt)) if opt is not None else 0,
              "optimizer_steps": seen.steps, "param_tensors": len(params),
              "final_params": reference.flat_parameters(params) if params else None,
              "consolidate_calls": seen.consolidate_calls, "state_dict_refused": seen.state_dict_refused,
              "saved_optimizer_states": seen.saved}
    if int(os.environ.get("RANK", 0)) == 0:  # also after a failed script: the other criteria still say why
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        record["reference"], record["full_state_bytes"], record["reference_steps"] = ddp_replay(world_size)
    return record


def main(argv) -> None:
    if len(argv) != 2:
        sys.exit("usage: bootstrap.py shard_harness.py EXERCISE SCRIPT")
    seen = ZeroObservers()
    seen.install()
    failure = harness.run(argv[0], os.path.abspath(argv[1]))
    seen.remove()
    report(final_record(seen))
    harness.end_as_the_script_did(failure)


if __name__ == "__main__":
    main(sys.argv[1:])
