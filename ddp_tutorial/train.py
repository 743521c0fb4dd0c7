"""Train a small MLP with DistributedDataParallel, in five marked steps.

The same file runs one process or many, on CPU (gloo) or GPUs (nccl)::

    python -m ddp_tutorial.train                          # one plain process
    torchrun --nproc-per-node 4 -m ddp_tutorial.train     # 4 ranks on this machine
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 -m ddp_tutorial.train  # on each of 2 nodes

and from a notebook::

    run = ddp_tutorial.launch(ddp_tutorial.TRAIN_SCRIPT, 4, ["--epochs", "2"])

It reads torchrun's environment contract (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT); without it, it trains as a single process.

The five steps: (1) ``init_process_group``, (2) ``wrap_model``,
(3) ``make_loader``, (4) ``train_epoch`` (accumulation with ``no_sync``),
(5) ``teardown``. Each rank appends one JSON line per micro-step to
``<out>/rank<R>.jsonl``; rank 0 saves the final model to ``<out>/model.pt``.
``--bug NAME`` reproduces one mistake of the original demo, so it can be measured.
``--checkpoint PATH`` resumes from PATH if it exists and saves there, so a run
restarted by ``torchrun --max-restarts`` (or ``launch(max_restarts=...)``)
continues from its last checkpoint and ends exactly where an uninterrupted run ends.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import random
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

if __package__ in (None, ""):  # run as a file path: make the package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddp_tutorial import config  # noqa: E402
from ddp_tutorial.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from ddp_tutorial.metrics import MetricsWriter  # noqa: E402


@dataclass
class DistEnv:
    """Where this process sits in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = "none"
    device: torch.device = torch.device("cpu")

    @property
    def distributed(self) -> bool:
        return self.backend != "none"


def resolve_backend(backend: str) -> str:
    """``auto`` means nccl when CUDA is present, else gloo."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def pick_device(backend: str, local_rank: int, local_world_size: int) -> torch.device:
    """The device of this rank: ``cuda:LOCAL_RANK`` for nccl, CPU for gloo.

    Raises:
        RuntimeError: nccl without CUDA, or with fewer GPUs than ranks on this node.
    """
    if backend != "nccl":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("backend nccl needs CUDA, but torch.cuda.is_available() is False; "
                           "use --backend gloo (or auto) on CPU")
    gpus = torch.cuda.device_count()
    if gpus < local_world_size or local_rank >= gpus:
        raise RuntimeError(f"backend nccl needs one GPU per rank: this node runs {local_world_size} "
                           f"ranks but has {gpus} GPU(s); start at most {gpus} ranks per node")
    return torch.device("cuda", local_rank)


# -- Step 1 -------------------------------------------------------------------
def init_process_group(backend: str = "auto", timeout_s: float = 300.0) -> DistEnv:
    """Step 1: join the process group through the MASTER_ADDR:MASTER_PORT store.

    Every rank calls this; it returns once all WORLD_SIZE ranks have arrived.
    Without torchrun's variables it returns a single-process ``DistEnv``.
    """
    if "RANK" not in os.environ:
        return DistEnv()
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    backend = resolve_backend(backend)
    device = pick_device(backend, local_rank, local_world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # A short timeout turns a lost rank into an error instead of gloo's 30-minute wait.
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s),
                            store=restart_safe_store(timeout_s))
    return DistEnv(rank, world_size, local_rank, backend, device)


def restart_safe_store(timeout_s: float):
    """A fresh key space for a torchrun restart; None (the usual env:// store) otherwise.

    torchrun shares its rendezvous store with the workers and keeps it across
    restarts, so a restarted group would read the dead group's addresses
    (gloo then fails with "connectFullMesh ... Connect timeout"). A prefix per
    attempt hides them.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"ddp_tutorial/attempt{attempt}", store)


# -- Step 2 -------------------------------------------------------------------
def wrap_model(model: nn.Module, env: DistEnv, bucket_cap_mb: float = 25.0) -> nn.Module:
    """Step 2: wrap the model in DDP.

    DDP broadcasts rank 0's parameters to every rank at construction and, in
    backward, all-reduces gradients bucket by bucket so every rank steps alike.
    """
    model = model.to(env.device)
    if not env.distributed:
        return model
    device_ids = [env.device.index] if env.device.type == "cuda" else None
    return DDP(model, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside a DDP wrapper (what to save, load or inspect)."""
    return model.module if isinstance(model, DDP) else model


# -- Step 3 -------------------------------------------------------------------
def make_loader(dataset, env: DistEnv, batch_size: int, seed: int):
    """Step 3: give each rank a disjoint shard of the same dataset.

    DistributedSampler permutes the indices with ``seed + epoch`` and hands
    rank r the indices ``perm[r::world_size]``. Call ``sampler.set_epoch(e)``
    every epoch, or every epoch repeats the same order.
    """
    sampler = DistributedSampler(dataset, num_replicas=env.world_size, rank=env.rank,
                                 shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    return loader, sampler


# -- Step 4 -------------------------------------------------------------------
def sync_schedule(num_batches: int, accum_steps: int, bug: bool = False):
    """For each micro-batch, whether it syncs and steps, and the loss divisor.

    Correct: sync on the last micro-batch of each window of K; a trailing
    partial window of r < K micro-batches still steps, with its loss divided by r.
    With ``bug`` (the original demo): sync when ``i % K == 0``, so the first
    update follows a single micro-batch.
    """
    plan = []
    for i in range(num_batches):
        if bug:
            plan.append((i % accum_steps == 0, accum_steps))
            continue
        window_start = i - i % accum_steps
        window = min(accum_steps, num_batches - window_start)
        plan.append((i == window_start + window - 1, window))
    return plan


def train_epoch(model, loader, optimizer, loss_fn, epoch: int, env: DistEnv, args, state: dict,
                metrics=None, timer=None, start_micro: int = 0):
    """Step 4: one epoch of gradient accumulation with ``no_sync``; returns the local losses.

    On the K-1 micro-batches that do not sync, forward *and* backward run
    inside ``model.no_sync()``: DDP decides in forward whether the coming
    backward all-reduces, so a forward outside the context skips nothing.
    ``start_micro`` skips the micro-batches a resumed checkpoint already trained on.
    """
    bugs = set(args.bug)
    plan = sync_schedule(len(loader), args.accum_steps, bug="sync-schedule" in bugs)
    use_no_sync = isinstance(model, DDP)
    losses = []
    for i, (x, y) in enumerate(loader):
        if i < start_micro:
            # Already trained before the checkpoint. The sampler's order depends only on
            # seed + epoch, so skipping here leaves exactly the samples that followed.
            continue
        sync, window = plan[i]
        step = state["step"]
        maybe_fail(args, env, step)
        x, y = x.to(env.device), y.to(env.device)
        t_start = time.time()
        t0 = time.perf_counter()
        straggle(args, state)
        t1 = time.perf_counter()
        if timer is not None:
            timer.start_step()
        skip_sync = use_no_sync and not sync
        if "forward-outside-no-sync" in bugs:  # the original: forward, then no_sync around backward
            out = model(x)
            t2 = time.perf_counter()
            with model.no_sync() if skip_sync else contextlib.nullcontext():
                loss, t3 = backward(out, y, x, loss_fn, window, bugs)
        else:
            with model.no_sync() if skip_sync else contextlib.nullcontext():
                out = model(x)
                t2 = time.perf_counter()
                loss, t3 = backward(out, y, x, loss_fn, window, bugs)
        if sync:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            state["optimizer_steps"] += 1
        t4 = time.perf_counter()
        state["step"] += 1
        losses.append(loss.item())
        if metrics is not None:
            sync_s, sync_offset_s, calls = timer.finish_step(t0) if timer else (0.0, None, 0)
            metrics.write({
                "kind": "step", "rank": env.rank, "attempt": state["attempt"], "epoch": epoch,
                "step": step, "micro": i, "sync": sync, "optimizer_step": sync,
                "loss": losses[-1], "t_start": t_start,
                "straggler_s": t1 - t0, "forward_s": t2 - t1, "backward_s": t3 - t2,
                "optimizer_s": t4 - t3, "step_s": t4 - t0,
                "sync_s": sync_s, "sync_offset_s": sync_offset_s, "allreduce_calls": calls,
            })
        if sync:  # only at the end of an accumulation window: no half-summed gradients to lose
            maybe_save_checkpoint(model, optimizer, args, env, state, epoch, i + 1, len(loader), metrics)
    return losses


# -- Checkpoint and resume ----------------------------------------------------
def checkpoint_state(model, optimizer, args, env: DistEnv, state: dict, epoch: int,
                     micro_done: int, num_batches: int) -> dict:
    """What a checkpoint holds: model, optimizer (momentum), and where training stands.

    ``micro_done`` micro-batches of ``epoch`` are trained; a finished epoch is
    stored as the start of the next one.
    """
    if micro_done >= num_batches:
        epoch, micro_done = epoch + 1, 0
    module = unwrap(model)
    return {"model": module.state_dict(), "optimizer": optimizer.state_dict(),
            "epoch": epoch, "micro": micro_done, "step": state["step"],
            "optimizer_steps": state["optimizer_steps"],
            # The position in an epoch names the same samples only for the same split.
            "world_size": env.world_size, "batch_size": args.batch_size,
            "accum_steps": args.accum_steps, "dataset_size": args.dataset_size, "seed": args.seed}


def maybe_save_checkpoint(model, optimizer, args, env: DistEnv, state: dict, epoch: int,
                          micro_done: int, num_batches: int, metrics=None) -> None:
    """After an optimizer step: rank 0 saves every ``--save-every`` steps and at epoch ends.

    Every rank takes the same decision (same step counts), then waits at a
    barrier, so no rank runs ahead of a checkpoint that is not yet on disk.
    """
    if not args.checkpoint:
        return
    due = bool(args.save_every) and state["optimizer_steps"] % args.save_every == 0
    if not (due or micro_done >= num_batches):
        return
    saved = checkpoint_state(model, optimizer, args, env, state, epoch, micro_done, num_batches)
    if env.rank == 0:
        save_checkpoint(saved, args.checkpoint)  # atomic: tmp file, fsync, os.replace
    if env.distributed:
        dist.barrier()
    if metrics is not None:
        metrics.write({"kind": "checkpoint", "rank": env.rank, "attempt": state["attempt"],
                       "step": state["step"], "epoch": saved["epoch"], "micro": saved["micro"],
                       "optimizer_steps": state["optimizer_steps"]})


def resume_from_checkpoint(model, optimizer, args, env: DistEnv, state: dict, metrics=None):
    """Load ``--checkpoint`` if it exists; returns (epoch, micro-batches done in it) to start from.

    Every rank loads the file itself, with ``map_location`` set to its own
    device (a checkpoint written from ``cuda:0`` must not land on ``cuda:0`` everywhere).

    Raises:
        ValueError: the checkpoint was made with another world size, batch size, K or dataset.
    """
    saved = load_checkpoint(args.checkpoint, map_location=env.device)
    if saved is None:
        return 0, 0
    now = {"world_size": env.world_size, "batch_size": args.batch_size,
           "accum_steps": args.accum_steps, "dataset_size": args.dataset_size, "seed": args.seed}
    differ = {k: (saved[k], v) for k, v in now.items() if saved[k] != v}
    if differ:
        raise ValueError(f"checkpoint {args.checkpoint} was made with different settings "
                         f"(saved, now): {differ}; its position in the epoch would name other "
                         "samples. Resume with the same settings, or start from a new --checkpoint")
    module = unwrap(model)
    module.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    state["step"], state["optimizer_steps"] = saved["step"], saved["optimizer_steps"]
    if metrics is not None:
        metrics.write({"kind": "resume", "rank": env.rank, "attempt": state["attempt"],
                       "step": saved["step"], "epoch": saved["epoch"], "micro": saved["micro"],
                       "optimizer_steps": saved["optimizer_steps"], "checkpoint": str(args.checkpoint)})
    if env.rank == 0:
        print(f"resumed from {args.checkpoint} (attempt {state['attempt']}): epoch {saved['epoch']}, "
              f"{saved['micro']} micro-batches done in it, step {saved['step']}", flush=True)
    return saved["epoch"], saved["micro"]


def backward(out, y, x, loss_fn, window: int, bugs: set):
    """Loss and backward for one micro-batch; returns (unscaled loss, end time)."""
    if "random-labels" in bugs:  # the original: fresh random targets each step
        y = torch.rand_like(out)
    loss = loss_fn(out, y)
    # Dividing by the window size makes K accumulated micro-batches sum to the
    # mean over the whole window, exactly like one batch K times larger.
    scaled = loss if "loss-not-scaled" in bugs else loss / window
    scaled.backward()
    t_end = time.perf_counter()
    return loss, t_end


def straggle(args, state: dict) -> None:
    """Sleep a random 0..straggler_ms ms, like the original demo's random sleep."""
    if args.straggler_ms > 0:
        time.sleep(state["rng"].uniform(0.0, args.straggler_ms) / 1e3)


def maybe_fail(args, env: DistEnv, step: int) -> None:
    """Fault injection for the launcher's tests and the notebooks' error demos.

    Fires on the first attempt only (TORCHELASTIC_RESTART_COUNT 0), like a
    transient fault: a restarted group gets past the step.
    """
    if args.fail_at_step is None or step != args.fail_at_step or env.rank != args.fail_rank:
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0:
        return
    print(f"injected failure ({args.fail_mode}) at step {step}", flush=True)
    if args.fail_mode == "raise":
        raise RuntimeError(f"injected failure on rank {env.rank} at step {step}")
    if args.fail_mode == "exit":
        sys.exit(3)
    while True:  # "hang": the other ranks wait for this one in their next all-reduce
        time.sleep(3600)


# -- Step 5 -------------------------------------------------------------------
def teardown() -> None:
    """Step 5: leave the process group, releasing its store connection and sockets."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# -- Sync timing --------------------------------------------------------------
class SyncTimer:
    """A DDP comm hook that all-reduces like DDP's default hook, and times it.

    ``sync_s`` of a step runs from the first bucket's all-reduce launch to the
    last one's completion: the wait for the slowest rank is inside it.
    """

    def __init__(self):
        self.process_group = None
        self.total_s = 0.0
        self.start_step()

    def start_step(self):
        self.calls, self.first_start, self.last_end = 0, None, None

    def finish_step(self, step_t0: float):
        """Returns (sync seconds, offset of sync start from step start, all-reduce calls)."""
        if self.calls == 0:
            return 0.0, None, 0
        sync_s = self.last_end - self.first_start
        self.total_s += sync_s
        return sync_s, self.first_start - step_t0, self.calls

    def _done(self, fut):
        self.last_end = time.perf_counter()
        return fut.value()[0]

    @staticmethod
    def hook(state: "SyncTimer", bucket):
        now = time.perf_counter()
        if state.calls == 0:
            state.first_start = now
        state.calls += 1
        group = state.process_group or dist.group.WORLD
        tensor = bucket.buffer()
        tensor.div_(group.size())  # as DDP's default allreduce_hook: average, then sum
        fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()
        return fut.then(state._done)


# -- Data and model -----------------------------------------------------------
class Model(nn.Module):
    """The original demo's MLP: 10 -> 100 -> 20."""

    def __init__(self, d_in: int = 10, hidden: int = 100, d_out: int = 20):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc2(self.relu(self.fc1(x)))


def make_dataset(size: int, seed: int, rank: int = 0, per_rank_bug: bool = False) -> TensorDataset:
    """Inputs and targets from a fixed, seeded teacher network, so the loss can fall.

    Every rank builds the same data from the shared seed; the sampler then
    splits it. With ``per_rank_bug`` each rank draws its own data, as the original did.
    """
    data_seed = seed + 1000 * (rank + 1) if per_rank_bug else seed
    g = torch.Generator().manual_seed(data_seed)
    x = torch.randn(size, 10, generator=g)
    teacher = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 20))
    tg = torch.Generator().manual_seed(seed + 1)  # one teacher for every rank
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=tg) * 0.5)
        y = teacher(x)
    return TensorDataset(x, y)


def param_checksum(model: nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def ddp_logging(model) -> dict:
    """DDP's own counters: times in ns, bucket sizes (empty without DDP)."""
    if not isinstance(model, DDP):
        return {}
    data = model._get_ddp_logging_data()
    keys = ["avg_backward_comm_time", "avg_backward_compute_time",
            "avg_backward_compute_comm_overlap_time", "avg_forward_compute_time",
            "bucket_sizes", "rebuilt_bucket_sizes", "num_buckets_reduced"]
    return {k: data[k] for k in keys if k in data}


def main(argv=None) -> int:
    parser = config.build_parser()
    args = parser.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    try:
        config.validate(args, world_size)
    except config.ConfigError as exc:
        parser.error(str(exc))
    if args.threads > 0:
        torch.set_num_threads(args.threads)  # N ranks x all cores each would thrash a small machine

    env = init_process_group(args.backend, args.pg_timeout)  # step 1
    try:
        return run_training(args, env)
    finally:
        teardown()  # step 5, even when a step above raised


def run_training(args, env: DistEnv) -> int:
    bugs = set(args.bug)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    torch.manual_seed(args.seed)  # same init everywhere (DDP would broadcast rank 0's anyway)
    model = wrap_model(Model(), env, args.bucket_cap_mb)  # step 2
    timer = None
    if isinstance(model, DDP) and not args.no_metrics:
        timer = SyncTimer()
        model.register_comm_hook(timer, SyncTimer.hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    dataset = make_dataset(args.dataset_size, args.seed, env.rank, "per-rank-data" in bugs)
    loader, sampler = make_loader(dataset, env, args.batch_size, args.seed)  # step 3
    metrics = None if args.no_metrics else MetricsWriter(args.out, env.rank, fresh=attempt == 0)
    state = {"step": 0, "optimizer_steps": 0, "attempt": attempt,
             "rng": random.Random(args.seed * 7919 + env.rank)}
    start_epoch, start_micro = resume_from_checkpoint(model, optimizer, args, env, state, metrics)
    n = len(loader)
    if n % args.accum_steps and env.rank == 0:
        print(f"note: {n} micro-batches per epoch is not a multiple of K={args.accum_steps}; "
              f"the last window steps after {n % args.accum_steps}", flush=True)
    if env.rank == 0:  # one rank speaks for the group until the per-rank summary at the end
        print(f"start: backend={env.backend} device={env.device} world_size={env.world_size}, "
              f"{n} micro-batches of {args.batch_size} per rank per epoch, K={args.accum_steps}"
              + (f", bugs={sorted(bugs)}" if bugs else ""), flush=True)
    loss_fn = nn.MSELoss()
    t_train = time.perf_counter()
    losses = []
    for epoch in range(start_epoch, args.epochs):
        if "no-set-epoch" not in bugs:
            sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        losses = train_epoch(model, loader, optimizer, loss_fn, epoch, env, args, state, metrics, timer,
                             start_micro=start_micro if epoch == start_epoch else 0)
        if env.rank == 0:
            print(f"epoch {epoch}: mean local loss {sum(losses) / max(len(losses), 1):.4f}, "
                  f"{state['optimizer_steps']} optimizer steps so far", flush=True)
    wall = time.perf_counter() - t_train
    module = unwrap(model)
    if env.rank == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save({k: v.cpu() for k, v in module.state_dict().items()},
                   os.path.join(args.out, "model.pt"))
    if metrics is not None:
        metrics.write({"kind": "summary", "rank": env.rank, "world_size": env.world_size,
                       "backend": env.backend, "device": str(env.device), "bugs": sorted(bugs),
                       "micro_steps": state["step"], "optimizer_steps": state["optimizer_steps"],
                       "train_seconds": wall, "threads": torch.get_num_threads(),
                       "param_checksum": param_checksum(module),
                       "ddp_logging": ddp_logging(model)})
        metrics.close()
    sync_ms = timer.total_s * 1e3 if timer else 0.0
    print(f"done: {state['step']} micro-steps, {state['optimizer_steps']} optimizer steps, "
          f"final loss {losses[-1] if losses else float('nan'):.4f}, {wall:.2f} s, "
          f"of which sync {sync_ms:.0f} ms", flush=True)
    return 0


if __name__ == "__main__":
    from ddp_tutorial._bootstrap import exit_without_teardown

    # After a finished run, leave without the interpreter's teardown: gloo's objects
    # destroyed that late can abort the process, failing a run that succeeded.
    exit_without_teardown(main())
