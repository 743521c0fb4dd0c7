"""Exercise "shard"'s own observers (``observe``); after the script each rank reports
``shard_final``, and rank 0 replays the DDP script as ``shard_reference``."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer as Zero

from ddp_tutorial.exercises.shard import LR
from ddp_tutorial.exercises.workers import reference, task
from ddp_tutorial.exercises.workers.observers import Observations, Observers, optimizer_parameters
from ddp_tutorial.lessons.sharding.workers.sharding_common import (
    nbytes, optimizer_state, state_tensors)
from ddp_tutorial.runfolder import report

#: The longest a rank whose script failed waits for the other ranks' reports before it exits.
REPORTS_WAIT_S = 10.0
#: Adam's moments, recorded by value (the task's model is small).
MOMENTS = ("exp_avg", "exp_avg_sq")


def optimizer_states_in(obj):
    """Every optimizer state dict ("state" and "param_groups") inside a saved object."""
    if isinstance(obj, dict) and "state" in obj and "param_groups" in obj:
        yield obj
    elif isinstance(obj, (dict, list, tuple)):
        for value in obj.values() if isinstance(obj, dict) else obj:
            yield from optimizer_states_in(value)


def param_state(state: dict) -> dict:
    """One parameter's Adam state as plain numbers: its step and its moments, flattened."""
    step = state.get("step")
    moments = [state[name] for name in MOMENTS if isinstance(state.get(name), torch.Tensor)]
    values = [x for m in moments for x in m.detach().reshape(-1).cpu().tolist()]
    return {"step": float(step) if step is not None else None, "values": values}


def saved_state(state_dict: dict) -> dict:
    """What an optimizer state dict holds, copied now: bytes, each parameter's state by index."""
    state = state_dict["state"]
    tensors = [v for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"params_with_state": len(state), "state_bytes": nbytes(tensors),
            "state": [[i, param_state(s)] for i, s in state.items() if isinstance(s, dict)]}


def observe(observers: Observers) -> None:
    """Observe ZeroRedundancyOptimizer's construction, ``consolidate_state_dict`` (and its target),
    ``state_dict``, and the optimizer states ``torch.save`` writes, as they were then."""
    seen = observers.seen
    zero_init, consolidate, state_dict = Zero.__init__, Zero.consolidate_state_dict, Zero.state_dict

    def observed_init(zero, *args, **kwargs):
        zero_init(zero, *args, **kwargs)
        seen.zeros.append(zero)  # zero.optim does not exist yet with overlap_with_ddp=True

    def observed_consolidate(zero, to=0):
        seen.consolidations.append({"to": to, "after_steps": seen.optimizer_steps})
        seen.consolidating = True
        try:
            return consolidate(zero, to)
        finally:
            seen.consolidating = False

    def observed_state_dict(zero):
        try:
            return state_dict(zero)
        except RuntimeError as err:  # not consolidated on this rank
            seen.state_dict_refused = {"message": str(err).splitlines()[0],
                                       "consolidated_to": [c["to"] for c in seen.consolidations]}
            raise

    save = torch.save

    def observed_save(obj, f, *args, **kwargs):
        if not seen.consolidating:
            seen.saved_optimizer_states.extend(
                {**saved_state(state), "after_steps": seen.optimizer_steps}
                for state in optimizer_states_in(obj))
        return save(obj, f, *args, **kwargs)

    for owner, name, replacement in (
            (Zero, "__init__", observed_init),
            (Zero, "consolidate_state_dict", observed_consolidate),
            (Zero, "state_dict", observed_state_dict), (torch, "save", observed_save),
            (torch.serialization, "save", observed_save)):
        observers.patch(owner, name, replacement)


def held_state(opt) -> list:
    """The Adam state this rank holds, as [index, state] pairs, indexed as ``state_dict()`` is."""
    index = {id(p): i for i, p in enumerate(optimizer_parameters(opt))}
    local = optimizer_state(opt)
    return [[index[id(p)], param_state(s)] for p, s in getattr(local, "state", {}).items()
            if id(p) in index and isinstance(s, dict)]


def ddp_replay(world_size: int, seed: int = 0):
    """The DDP script with Adam in one process: final parameters, Adam's state bytes, steps.
    Each rank's gradient on its rows, divided by W and summed, as DDP's all-reduce does."""
    model = task.make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    dataset = task.make_dataset()
    x_all, y_all = dataset.tensors
    steps = 0
    for epoch in range(task.EPOCHS):
        for batch in reference.micro_batches(dataset, world_size, epoch, seed):
            n = len(batch) // world_size  # the global micro-batch holds each rank's rows in turn
            summed = None
            for rows in (batch[i:i + n] for i in range(0, len(batch), n)):
                model.zero_grad(set_to_none=True)
                F.mse_loss(model(x_all[rows]), y_all[rows]).backward()
                grads = [p.grad / world_size for p in model.parameters()]
                summed = grads if summed is None else [a + b for a, b in zip(summed, grads)]
            for p, g in zip(model.parameters(), summed):
                p.grad = g
            optimizer.step()
            steps += 1
    return reference.flat_parameters(model.parameters()), nbytes(state_tensors(optimizer)), steps


def full_state_bytes(params) -> int:
    """Bytes of one whole Adam state for tensors shaped like ``params``."""
    copies = [torch.zeros_like(p, requires_grad=True) for p in params]
    for c in copies:
        c.grad = torch.zeros_like(c)
    adam = torch.optim.Adam(copies)
    adam.step()
    return nbytes(state_tensors(adam))


def final_record(seen: Observations) -> dict:
    """What this rank measured at the end, of the last stepped optimizer, else the last ZeRO."""
    opt = seen.last_optimizer or (seen.zeros[-1] if seen.zeros else None)
    params = optimizer_parameters(opt) if opt is not None else []
    local = optimizer_state(opt) if opt is not None else None
    # None: a ZeRO with overlap_with_ddp=True builds its local optimizer only in DDP's hook
    unbuilt = local is None or (local is opt and isinstance(opt, Zero))
    wrapped = {id(p) for module in seen.ddp_modules for p in module.parameters()}
    return {"event": "shard_final", "optimizer": type(opt).__name__ if opt is not None else None,
            "local_optimizer": None if unbuilt else type(local).__name__,
            "lr": opt.param_groups[0]["lr"] if opt is not None and opt.param_groups else None,
            "state_bytes": nbytes(state_tensors(opt)) if hasattr(local, "state") else 0,
            "optimizer_steps": seen.optimizer_steps, "param_tensors": len(params),
            "full_state_bytes": full_state_bytes(params) if params else 0,
            "final_params": reference.flat_parameters(params) if params else None,
            "held_state": held_state(opt) if hasattr(local, "state") else [],
            "trains_ddp_model": None if opt is None else bool(params) and all(
                id(p) in wrapped for p in params),
            "params_with_grad": seen.params_with_grad,
            "overlap_with_ddp": bool(getattr(opt, "_overlap_with_ddp", False)),
            "consolidations": seen.consolidations, "state_dict_refused": seen.state_dict_refused,
            "saved_optimizer_states": seen.saved_optimizer_states}


def report_after(seen: Observations, failed: bool) -> None:
    """``shard_final``, then rank 0's replay (after a failed script too); then mark this rank's
    reports written, and if its script failed wait (``REPORTS_WAIT_S`` at most) for the others'
    marks: its exit stops the group, and a peer's reports would be lost."""
    report(final_record(seen))  # first: a peer's failure stops this rank, the replay takes a while
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if rank == 0:
        params, state_bytes, steps = ddp_replay(world_size)
        report({"event": "shard_reference", "reference": params,
                "reference_state_bytes": state_bytes, "reference_steps": steps})
    if seen.store is None:  # the script never joined a group
        return
    try:
        seen.store.set(f"shard_reports/{rank}", "1")
        if failed:
            others = [f"shard_reports/{r}" for r in range(world_size) if r != rank]
            seen.store.wait(others, timedelta(seconds=REPORTS_WAIT_S))
    except Exception:  # noqa: BLE001 - timed out, or the store's host exited: end as the script did
        pass
