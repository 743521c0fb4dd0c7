"""What each rank holds and sends under DDP, ZeRO-1, FSDP2 and compressed gradients. ``--parts``:
memory (bytes held after one step), zero and fsdp (beside DDP + Adam: each step's collectives, the
final gap), compress (DDP's comm hooks). Each rank trains on its rows of one seeded global batch."""
import inspect

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial import train
from ddp_tutorial.lessons.pitfalls.workers.pitfall_common import (
    digest, generator, max_diff, shard)
from ddp_tutorial.lessons.sharding.workers.sharding_common import (
    CollectiveLog, full_parameters, held, mlp, optimizer_state, run_parts)
from ddp_tutorial.runfolder import report

PARTS = ("memory", "zero", "fsdp", "compress")
ADAM_LR = 1e-3
#: 64 -> 256 -> 8, 18,696 parameters; every dimension even, so FSDP2 shards it exactly in half.
WIDE = (64, 256, 8)
log = CollectiveLog()


def kit_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return train.Model()


def wide_model(seed: int) -> nn.Module:
    return mlp(*WIDE, seed=seed)


MODELS = {"kit": (kit_model, 10, 20), "wide": (wide_model, WIDE[0], WIDE[2])}


def global_batch(seed: int, step: int, rows: int, d_in: int, d_out: int):
    """One step's global batch: inputs and the targets of a fixed random linear teacher."""
    g = generator(seed, step)
    x = torch.randn(rows, d_in, generator=g)
    teacher = torch.randn(d_in, d_out, generator=generator(seed, -1))
    return x, torch.tanh(x @ teacher) + 0.1 * torch.randn(rows, d_out, generator=g)


def rank_batch(args, step, rank, world_size, d_in=WIDE[0], d_out=WIDE[2]):
    x, y = global_batch(args.seed, step, args.batch_size * world_size, d_in, d_out)
    return shard(x, rank, world_size), shard(y, rank, world_size)


def ddp(model: nn.Module) -> DDP:
    """DDP whose all-reduces go through Python, so the log sees them (same result: ``compress``)."""
    wrapped = DDP(model)
    wrapped.register_comm_hook(None, default_hooks.allreduce_hook)
    return wrapped


def fsdp(model: nn.Module) -> nn.Module:
    """FSDP2 the recommended way: each Linear its own group (bottom-up), then the root."""
    for layer in model.children():
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def adam(params):
    return torch.optim.Adam(params, lr=ADAM_LR)


def zero(params):
    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, lr=ADAM_LR)


STRATEGIES = {"ddp": (ddp, adam), "zero1": (ddp, zero), "fsdp": (fsdp, adam)}


def train_step(model, optimizer, x, y) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def partition(model: nn.Module, optimizer) -> list:
    """The names of the parameters whose Adam state this rank's optimizer holds."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in optimizer_state(optimizer).param_groups for p in g["params"]]


# -- memory --------------------------------------------------------------------
def part_memory(args, rank, world_size):
    for model_name, (build, d_in, d_out) in MODELS.items():
        for strategy, (wrap, make_optimizer) in STRATEGIES.items():
            model = wrap(build(args.seed))
            optimizer = make_optimizer(model.parameters())
            # gradients kept after the step: the moment all three live at once
            train_step(model, optimizer, *rank_batch(args, 0, rank, world_size, d_in, d_out))
            sizes = {n: p.numel() for n, p in build(args.seed).named_parameters()}
            report({"part": "memory", "model": model_name, "strategy": strategy,
                    **held(model, optimizer), "model_elements": sum(sizes.values()),
                    "param_sizes": sizes,
                    "partition": partition(getattr(model, "module", model), optimizer)})


# -- zero ----------------------------------------------------------------------
def part_zero(args, rank, world_size):
    ref, z = ddp(wide_model(args.seed)), ddp(wide_model(args.seed))
    ref_opt, z_opt = adam(ref.parameters()), zero(z.parameters())
    per_step = []
    with log.recording():
        for step in range(args.steps):
            x, y = rank_batch(args, step, rank, world_size)
            train_step(ref, ref_opt, x, y)
            log.take()
            z_opt.zero_grad(set_to_none=True)
            F.mse_loss(z(x), y).backward()
            backward = log.take()
            z_opt.step()
            per_step.append({"backward": backward, "step": log.take()})
    params, ref_params = list(z.parameters()), list(ref.parameters())
    report({"part": "zero", "collectives": per_step, "steps": args.steps,
            "max_diff_vs_ddp": max_diff(params, ref_params), "digest": digest(params),
            "bit_identical_to_ddp": digest(params) == digest(ref_params),
            "state": held(z, z_opt), "ddp_state": held(ref, ref_opt),
            "partition": partition(z.module, z_opt)})


# -- fsdp ----------------------------------------------------------------------
class _Probe(torch.autograd.Function):
    """Identity that calls ``note`` in backward: while its layer's gradients are being computed."""

    @staticmethod
    def forward(ctx, x, note):
        ctx.note = note
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.note()
        return grad, None


def watch_unsharded(layers: dict, events: list) -> None:
    """While each layer runs forward and backward, note which layers hold their whole parameters,
    and the phase's all-gathers so far (FSDP2 prefetches the next layer in backward)."""
    from torch.distributed.tensor import DTensor

    def snapshot(phase, name):
        # FSDP2 registers DTensors on a resharded module, plain tensors on an unsharded one.
        whole = {n: sum(p.numel() for p in m.parameters() if not isinstance(p, DTensor))
                 for n, m in layers.items()}
        gathered = [c["elements"] for c in log.calls if c["op"] == "all_gather_single"]
        events.append({"phase": phase, "layer": name, "unsharded": whole, "all_gathered": gathered})

    for name, layer in layers.items():
        forward = layer.forward  # called inside FSDP2's pre- and post-forward hooks

        def probed(x, name=name, forward=forward):
            snapshot("forward", name)
            x = _Probe.apply(x, lambda: snapshot("backward", name))
            return forward(x)

        layer.forward = probed


def one_process_float64(args, world_size):
    """Rank 0 alone: the same training in float64 on the whole global batch (nearly exact)."""
    model = wide_model(args.seed).double()
    optimizer = adam(model.parameters())
    for step in range(args.steps):
        x, y = global_batch(args.seed, step, args.batch_size * world_size, WIDE[0], WIDE[2])
        train_step(model, optimizer, x.double(), y.double())
    return [p.detach() for p in model.parameters()]


def part_fsdp(args, rank, world_size):
    ref, sharded = ddp(wide_model(args.seed)), fsdp(wide_model(args.seed))
    ref_opt, sharded_opt = adam(ref.parameters()), adam(sharded.parameters())
    layers = {f"{name} (Linear)": m for name, m in sharded.named_children()
              if isinstance(m, nn.Linear)}
    events, per_step, first_grads = [], [], None
    watch_unsharded(layers, events)
    with log.recording():
        for step in range(args.steps):
            x, y = rank_batch(args, step, rank, world_size)
            train_step(ref, ref_opt, x, y)
            ddp_calls = log.take()
            sharded_opt.zero_grad(set_to_none=True)
            # An input that requires grad: the first layer's probe then runs in backward too.
            out = sharded(x.detach().requires_grad_())
            forward = log.take()
            F.mse_loss(out, y).backward()
            backward = log.take()
            if step == 0:  # the reduce-scattered gradient shards, gathered, against DDP's
                first_grads = max_diff([p.grad.full_tensor() for p in sharded.parameters()],
                                       [p.grad for p in ref.parameters()])
                log.take()  # the measurement's all-gathers are not the step's
            sharded_opt.step()
            per_step.append({"ddp": ddp_calls, "forward": forward, "backward": backward,
                             "step": log.take()})
    params, ref_params = full_parameters(sharded), [p.detach() for p in ref.parameters()]
    record = {"part": "fsdp", "collectives": per_step, "steps": args.steps,
              "unsharded_while_running": events[:2 * len(layers)],
              "first_grad_max_diff": first_grads,
              "max_diff_vs_ddp": max_diff(params, ref_params), "held": held(sharded, sharded_opt)}
    if rank == 0:
        record["ddp_vs_float64"] = max_diff(ref_params, one_process_float64(args, world_size))
    report(record)


# -- compress ------------------------------------------------------------------
def bf16_hook(process_group, bucket):
    """``bf16_compress_hook``'s body under another name: ``DDP._check_comm_hook`` refuses the hook
    by its name on some builds, yet gloo all-reduces bfloat16 on every one."""
    return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)


HOOKS = {"no hook (DDP's C++ all-reduce)": None,
         "allreduce_hook (fp32)": default_hooks.allreduce_hook,
         "fp16_compress_hook": default_hooks.fp16_compress_hook,
         "bf16 (bf16_compress_hook's body)": bf16_hook}


def bf16_refusal() -> str:
    """What ``register_comm_hook(bf16_compress_hook)`` says on this build ("" if it accepts it)."""
    try:
        DDP(kit_model(0)).register_comm_hook(None, default_hooks.bf16_compress_hook)
    except TypeError as err:
        return str(err)
    return ""


def build_facts() -> dict:
    """What ``_check_comm_hook`` reads to decide on ``bf16_compress_hook``: the build, not devices;
    ``xpu_rule``: whether its source has the XPU part (2.13's does, 2.6's not)."""
    nccl = dist.is_nccl_available()
    xccl = hasattr(dist, "is_xccl_available") and dist.is_xccl_available()
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "hip": torch.version.hip,
            "nccl_available": nccl,
            "nccl_version": list(torch.cuda.nccl.version()) if nccl else None,
            "xccl_available": xccl, "xpu_available": bool(xccl and torch.xpu.is_available()),
            "xpu_rule": "xccl" in inspect.getsource(DDP._check_comm_hook)}


def part_compress(args, rank, world_size):
    x_all, y_all = train.make_dataset(train.make_inputs(512, args.seed), args.seed).tensors
    models, optimizers = {}, {}
    for name, hook in HOOKS.items():
        models[name] = DDP(kit_model(args.seed))
        if hook is not None:
            models[name].register_comm_hook(None, hook)
        optimizers[name] = torch.optim.SGD(models[name].parameters(), lr=0.05)
    rows = args.batch_size * world_size
    losses, calls = {name: [] for name in HOOKS}, {name: [] for name in HOOKS}
    with log.recording():
        for step in range(args.compress_steps):
            start = (step * rows) % len(x_all)
            x = shard(x_all[start:start + rows], rank, world_size)
            y = shard(y_all[start:start + rows], rank, world_size)
            for name, model in models.items():
                train_step(model, optimizers[name], x, y)
                calls[name].append(log.take())
                with torch.no_grad():
                    losses[name].append(float(F.mse_loss(model.module(x_all), y_all)))
    params = {name: list(m.parameters()) for name, m in models.items()}
    base = "allreduce_hook (fp32)"
    report({"part": "compress", "steps": args.compress_steps, "losses": losses,
            "collectives": calls, "digests": {name: digest(p) for name, p in params.items()},
            "max_diff_vs_fp32": {name: max_diff(p, params[base]) for name, p in params.items()},
            "model_elements": sum(p.numel() for p in params[base]),
            "bf16_compress_hook_refused": bf16_refusal(), "build": build_facts()})


if __name__ == "__main__":
    run_parts(__doc__, {part: globals()["part_" + part] for part in PARTS}, ",".join(PARTS),
              steps=8, compress_steps=60, batch_size=16)
