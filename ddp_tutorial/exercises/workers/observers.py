"""The harness's observers: wrappers around the torch calls a DDP script makes, and what they saw.

``Observers.install`` puts them on torch, ``remove`` puts the originals back; ``Observations``
holds their counts (``as_record()``: the ``final`` record). Calls that happen once, or that a
rank may hang in, are ``report()``ed the moment they happen.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import sys
from urllib.parse import urlparse

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.utils.data
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.exercises.workers import reference
from ddp_tutorial.runfolder import report

#: Tensors up to this many elements are recorded by value in all-reduce records.
SMALL_TENSOR = 16
#: The collectives whose first argument is the tensor they work on.
TENSOR_FIRST = ("all_reduce", "broadcast", "reduce")


class LauncherMismatch(RuntimeError):
    """init_process_group was given a rendezvous, rank or world size other than the launcher's."""


def refuse_a_group_that_cannot_form(launcher, init_method, port, rank, world_size) -> None:
    """Raise ``LauncherMismatch`` where the arguments contradict the launcher's: such a rank would
    wait, until the deadline, for a store server or peers that never come."""
    if launcher["port"] is None:  # not under a launcher: nothing to contradict
        return
    if port not in ("store", "file", launcher["port"]):
        raise LauncherMismatch(
            f"init_process_group(init_method={init_method!r}) meets at port {port}, but the "
            f"launcher's rendezvous is MASTER_PORT={launcher['port']}; stopped here instead of "
            "waiting for a rendezvous that never comes")
    if rank not in (None, launcher["rank"]) or world_size not in (None, launcher["world_size"]):
        raise LauncherMismatch(
            f"init_process_group(rank={rank}, world_size={world_size}) in the process the launcher "
            f"made rank {launcher['rank']} of {launcher['world_size']}; stopped here instead of "
            "waiting for a group that cannot form")


class Observations:
    """What the observers saw in this rank; ``as_record()`` is the ``final`` report."""

    def __init__(self):
        self.ddp_wraps = []  # per DDP built: its parameters right after wrapping
        self.ddp_modules = []  # the modules those wrap
        self.bucket_allreduces = 0  # gradient buckets all-reduced, counted by the comm hook
        self.bucket_indices = set()
        self.ddp_forwards = 0
        self.no_sync_entries = 0
        self.optimizer_steps = 0
        self.params_per_step = []
        self.forwards_at_step = []  # ddp_forwards at each optimizer step: where windows end
        self.last_optimizer = None
        self.params_with_grad = 0  # the most parameters with a .grad at one optimizer step
        self.zero_grad_at = []  # ddp_forwards at each zero_grad() (an optimizer's or a module's)
        self.sampler_iterations = []
        self.loader_iterations = []
        self.saves = []
        self.collectives = 0  # the script's own collective calls (all_reduce, barrier, ...)
        self.ddp_attempts = 0  # DistributedDataParallel(...) calls, including ones that raised
        self.init_world_size = None
        self.zeros = []  # every ZeroRedundancyOptimizer built (its inner optimizer may come later)
        self.consolidations = []  # each consolidate_state_dict call: `to`, and after how many steps
        self.consolidating = False  # ZeRO's torch.save of a shard into a buffer: not a checkpoint
        self.state_dict_refused = None  # ZeRO's state_dict() raised: not consolidated on this rank
        self.saved_optimizer_states = []  # the optimizer states torch.save wrote, as they were then
        self.store = None  # exercise "shard": the group's store, kept past the script's destroy

    def inner_optimizers(self):
        """ZeRO's local optimizers: their steps are ZeRO's own, not the script's."""
        return {id(zero.optim) for zero in self.zeros if hasattr(zero, "optim")}

    def final_parameters(self):
        """The parameters the last stepped optimizer holds, else those of the first DDP model."""
        if self.last_optimizer is not None:
            return reference.flat_parameters(optimizer_parameters(self.last_optimizer))
        if self.ddp_modules:
            return reference.flat_parameters(self.ddp_modules[0].parameters())
        return None

    def optimizer_trains_ddp_model(self):
        """Whether the last stepped optimizer steps a module DDP wraps (None: no step or no DDP)"""
        if self.last_optimizer is None or not self.ddp_modules:
            return None
        wrapped = {id(p) for module in self.ddp_modules for p in module.parameters()}
        return all(id(p) in wrapped for p in optimizer_parameters(self.last_optimizer))

    def as_record(self):
        not_json = ("ddp_modules", "bucket_indices", "last_optimizer", "zeros", "store")
        kept = {k: v for k, v in vars(self).items() if k not in not_json}
        return {**kept, "optimizer_trains_ddp_model": self.optimizer_trains_ddp_model(),
                "buckets": len(self.bucket_indices), "final_params": self.final_parameters()}


def optimizer_parameters(optimizer):
    return [p for group in optimizer.param_groups for p in group["params"]]


def small_values(tensor):
    """The tensor's values as a list if it is small, else None (records stay small)."""
    if isinstance(tensor, torch.Tensor) and tensor.numel() <= SMALL_TENSOR:
        return tensor.detach().reshape(-1).cpu().tolist()
    return None


def dataset_fingerprint(dataset) -> str:
    """A hash of a TensorDataset's values (equal on two ranks iff they hold the same data)."""
    tensors = getattr(dataset, "tensors", None)
    if tensors is None:
        return f"{type(dataset).__name__} of {len(dataset)} items (not a TensorDataset: not hashed)"
    digest = hashlib.sha1()
    for t in tensors:
        digest.update(t.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def rendezvous_port(init_method, store):
    """The port the rendezvous of ``init_method`` goes to, "store", "file", or None if unknown."""
    if store is not None:
        return "store"
    url = urlparse(init_method or "env://")
    if url.scheme == "env":
        return os.environ.get("MASTER_PORT")
    if url.scheme == "tcp":
        return str(url.port) if url.port is not None else None
    return url.scheme or None


def called_from_torch() -> bool:
    """Whether the first caller outside this file is torch: torch's own collectives (Join's, whose
    Work DDP's reducer waits for in C++) count as done at once."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__", "").startswith("torch.")


class Observers:
    """Installs the observers on torch (``install``) and puts the originals back (``remove``)."""

    def __init__(self, seen: Observations, launcher: dict):
        self.seen = seen
        self.launcher = launcher  # port, rank, world_size as set by the launcher (port None: none)
        self._patched = []  # (owner, attribute, original)
        self._hook = None
        self._on_wait = {}  # id(work) -> (work, what to do the first time the script waits for it)

    def patch(self, owner, name, replacement):
        self._patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def before(self, owner, name, note):
        """Patch ``owner.name`` to call ``note`` with its arguments first."""
        original = getattr(owner, name)

        def observed(*args, **kwargs):
            note(*args, **kwargs)
            return original(*args, **kwargs)
        self.patch(owner, name, observed)

    def remove(self):
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def install(self, keep_store: bool = False):
        """The observers; ``keep_store``: keep the group's store past the script's destroy."""
        seen = self.seen
        self._observe_waits()
        self._observe_process_group(keep_store)
        self._observe_ddp()

        def after_step(optimizer, args, kwargs):
            if id(optimizer) in seen.inner_optimizers():  # ZeRO's own step follows its inner one's
                return
            seen.optimizer_steps += 1
            seen.forwards_at_step.append(seen.ddp_forwards)
            seen.last_optimizer = optimizer
            params = optimizer_parameters(optimizer)
            with_grad = sum(p.grad is not None for p in params)
            seen.params_with_grad = max(seen.params_with_grad, with_grad)
            seen.params_per_step.append(reference.flat_parameters(params))

        self._hook = register_optimizer_step_post_hook(after_step)

        sampler_iter = DistributedSampler.__iter__

        def observed_sampler_iter(sampler):
            indices = list(sampler_iter(sampler))
            seen.sampler_iterations.append({
                "epoch": sampler.epoch, "indices": indices, "seed": sampler.seed,
                "shuffle": sampler.shuffle, "num_replicas": sampler.num_replicas,
                "rank": sampler.rank, "dataset": dataset_fingerprint(sampler.dataset),
                "dataset_size": len(sampler.dataset)})
            return iter(indices)

        self.patch(DistributedSampler, "__iter__", observed_sampler_iter)

        self.before(torch.utils.data.DataLoader, "__iter__", lambda loader: (
            seen.loader_iterations.append({
                "dataset": dataset_fingerprint(loader.dataset), "batch_size": loader.batch_size,
                "sampler": type(loader.sampler).__name__, "forwards_before": seen.ddp_forwards})))
        for owner in (torch.optim.Optimizer, torch.nn.Module):
            self.before(owner, "zero_grad", lambda *_, **__: (
                seen.zero_grad_at.append(seen.ddp_forwards)))

        def note_save(obj, f, *args, **kwargs):
            if not seen.consolidating:
                path = isinstance(f, (str, os.PathLike))
                seen.saves.append({"path": os.path.abspath(f) if path else f"<{type(f).__name__}>"})

        for owner in (torch, torch.serialization):
            self.before(owner, "save", note_save)

    def _observe_waits(self):
        """``Work.wait`` observed on torch's class: a Work stays torch's own object (DDP's reducer
        casts Join's to its C++ type, which a Python wrapper is not)."""
        wait, on_wait = dist.Work.wait, self._on_wait

        def observed_wait(work, *args, **kwargs):
            result = wait(work, *args, **kwargs)  # a failed collective raises here, as unobserved
            entry = on_wait.pop(id(work), None)
            if entry is not None and entry[0] is work:
                entry[1]()
            return result

        self.patch(dist.Work, "wait", observed_wait)

    def _observe_process_group(self, keep_store: bool):
        seen, launcher = self.seen, self.launcher
        init = c10d.init_process_group
        signature = inspect.signature(init)

        def observed_init(*args, **kwargs):
            given = signature.bind(*args, **kwargs).arguments
            init_method = given.get("init_method")
            port = rendezvous_port(init_method, given.get("store"))
            rank, world_size = given.get("rank"), given.get("world_size")
            report({"event": "init_called", "backend": given.get("backend"),
                    "init_method": init_method, "rendezvous_port": port,
                    "launcher_port": launcher["port"], "rank_arg": rank, "world_size_arg": world_size})
            refuse_a_group_that_cannot_form(launcher, init_method, port, rank, world_size)
            init(*args, **kwargs)
            seen.init_world_size = dist.get_world_size()
            if keep_store:
                seen.store = c10d._get_default_store()
            report({"event": "init", "rank": dist.get_rank(), "world_size": dist.get_world_size(),
                    "backend": dist.get_backend()})

        def observed_collective(op, collective, takes_tensor=False):
            def observed(*args, **kwargs):
                seen.collectives += 1
                number = seen.collectives
                tensor = args[0] if takes_tensor and args else kwargs.get("tensor")
                values = small_values(tensor)
                # Written before it runs: a rank that waits here forever has said where.
                report({"event": "collective_enter", "op": op, "n": number, "input": values,
                        "async": bool(kwargs.get("async_op"))})
                work = collective(*args, **kwargs)

                def done():
                    report({"event": "collective", "op": op, "n": number, "input": values,
                            "output": small_values(tensor)})

                # async_op=True: done once the script waits (only then is the result in the tensor).
                # The Work goes back untouched, to the script and to torch alike.
                if work is not None and hasattr(work, "wait") and not called_from_torch():
                    self._on_wait[id(work)] = (work, done)
                else:
                    done()
                return work
            return observed

        wrapped = {"init_process_group": observed_init, **{
            op: observed_collective(op, getattr(c10d, op), op in TENSOR_FIRST) for op in (
                "all_reduce", "barrier", "broadcast", "reduce", "all_gather", "all_gather_object",
                "broadcast_object_list", "gather", "scatter", "reduce_scatter")}}
        for owner in (dist, c10d):
            for name, replacement in wrapped.items():
                self.patch(owner, name, replacement)
            # Written first: the peers may fail (and the launcher stop this rank) once it is gone.
            self.before(owner, "destroy_process_group", lambda *_, **__: (
                report({"event": "destroy", "initialized": dist.is_initialized()})))

    def _observe_ddp(self):
        seen = self.seen
        ddp_init = DistributedDataParallel.__init__

        def counting(hook):
            def counted(state, bucket):
                seen.bucket_allreduces += 1
                seen.bucket_indices.add(bucket.index())
                return hook(state, bucket)
            return counted

        register_comm_hook = DistributedDataParallel.register_comm_hook

        def observed_register_comm_hook(ddp, state, hook):  # the script's own: counted too
            register_comm_hook(ddp, state, counting(hook))
            ddp._harness_hooked = True

        def count_bucket_allreduces(ddp):  # DDP's default all-reduce, unless the script has a hook
            if not getattr(ddp, "_harness_hooked", False):
                register_comm_hook(ddp, ddp.process_group, counting(default_hooks.allreduce_hook))
                ddp._harness_hooked = True

        def observed_ddp_init(ddp, *args, **kwargs):
            seen.ddp_attempts += 1
            ddp_init(ddp, *args, **kwargs)  # broadcasts rank 0's parameters and buffers
            seen.ddp_modules.append(ddp.module)
            params = reference.flat_parameters(ddp.module.parameters())
            seen.ddp_wraps.append({"params_after_wrap": params})

        self.patch(DistributedDataParallel, "__init__", observed_ddp_init)
        self.patch(DistributedDataParallel, "register_comm_hook", observed_register_comm_hook)
        # A built-in hook is not counted; the script's choice stands.
        self.before(DistributedDataParallel, "_register_builtin_comm_hook",
                    lambda ddp, *_: setattr(ddp, "_harness_hooked", True))

        def note_forward(ddp, *args, **kwargs):
            count_bucket_allreduces(ddp)
            seen.ddp_forwards += 1

        def note_no_sync(ddp):
            seen.no_sync_entries += 1

        self.before(DistributedDataParallel, "forward", note_forward)
        self.before(DistributedDataParallel, "no_sync", note_no_sync)
