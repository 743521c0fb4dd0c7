"""Notebooks 01 and 02 (init_process_group, the DDP wrap): each helper launches a script of
``workers/`` or turns its ``Run`` into rows, so that a cell stays one call."""

from __future__ import annotations

from typing import Dict, List, Sequence

from ddp_tutorial.launcher import LaunchError, LaunchTimeout, WorkerError, launch
from ddp_tutorial.lessons.worker_scripts import worker_script
from ddp_tutorial.lessons import hold_port, rank_results
from ddp_tutorial.lessons.table import text_table

INIT_SCRIPT = worker_script(__file__, "init_demo.py")
WRAP_SCRIPT = worker_script(__file__, "wrap_demo.py")


# -- Notebook 01: init_process_group -------------------------------------------
def run_init_demo(world_size: int, echo: str = "none", extra_args: Sequence[str] = (),
                  **launch_kwargs):
    """Launch ``init_demo.py`` (time init, all_reduce rank + 1) with ``extra_args``; its ``Run``."""
    launch_kwargs.setdefault("timeout", 60)
    return launch(INIT_SCRIPT, world_size, list(extra_args), echo=echo, **launch_kwargs)


def init_rows(run) -> List[dict]:
    """Per rank, its report with init split: ``wait_s`` until the last rank called init (gloo
    returns to nobody before), ``setup_s`` after it (store handshake, connections)."""
    results = {rank: recs[-1] for rank, recs in rank_results(run).items()}
    last_arrival = max(r["arrive_time"] for r in results.values())
    return [{**r, "rank": rank, "wait_s": last_arrival - r["arrive_time"],
             "setup_s": r["done_time"] - last_arrival} for rank, r in sorted(results.items())]


def init_sweep(world_sizes: Sequence[int] = (1, 2, 4), echo: str = "none") -> Dict[int, List[dict]]:
    """Run ``init_demo.py`` once per world size; per world size, the ``init_rows``."""
    return {w: init_rows(run_init_demo(w, echo=echo)) for w in world_sizes}


def format_init_sweep(sweep: Dict[int, List[dict]]) -> str:
    """One row per rank and world size: all_reduce result and init time (= wait + setup)."""
    rows = [(w, r["rank"], f"{r['all_reduce_sum']:g}", w * (w + 1) // 2,
             *(f"{r[k] * 1e3:.1f}" for k in ("init_s", "wait_s", "setup_s")))
            for w, rs in sweep.items() for r in rs]
    return text_table(["world_size", "rank", "all_reduce(rank + 1)", "expected sum", "init ms",
                       "wait ms", "setup ms"], rows)


def threads_demo(world_size: int = 4, echo: str = "none") -> List[dict]:
    """``init_rows`` of a run in which rank 0 asks a fresh Python for torch's default threads."""
    return init_rows(run_init_demo(world_size, echo=echo, extra_args=["--probe-default-threads"]))


def threads_totals(rows: List[dict]) -> Dict[str, int]:
    """Threads of a ``threads_demo`` run's ranks: as launched, with torch's default; and CPUs."""
    default = rows[0]["default_threads"]
    return {"ranks": len(rows), "cpus": rows[0]["cpu_count"], "default_per_process": default,
            "with_default": len(rows) * default,
            "as_launched": sum(r["torch_threads"] for r in rows)}


def init_split(sweep: Dict[int, List[dict]]) -> Dict[int, Dict[str, float]]:
    """Per world size: the ranks' wait and setup summed, and the share spent waiting.
    Which is larger is a fact of one run: ranks that arrive apart wait, together they set up."""
    split = {}
    for world_size, rows in sweep.items():
        wait, setup = sum(r["wait_s"] for r in rows), sum(r["setup_s"] for r in rows)
        split[world_size] = {"wait_s": wait, "setup_s": setup,
                             "wait_share": wait / (wait + setup) if wait + setup > 0 else 0.0,
                             "arrival_spread_s": max(r["wait_s"] for r in rows)}
    return split


def format_init_split(split: Dict[int, Dict[str, float]]) -> str:
    """One line per world size: waiting against setup, and which was larger in this run."""
    lines = []
    for world_size, s in split.items():
        larger = "waiting" if s["wait_s"] > s["setup_s"] else "setup"
        lines.append(f"world_size {world_size}: the ranks waited {s['wait_s'] * 1e3:6.1f} ms and "
                     f"set up {s['setup_s'] * 1e3:6.1f} ms in all ({s['wait_share']:.0%} waiting; "
                     f"first to last arrival {s['arrival_spread_s'] * 1e3:.1f} ms): {larger} was "
                     "larger in this run")
    return "\n".join(lines)


def format_threads(rows: List[dict]) -> str:
    """Per rank of a ``threads_demo`` run: threads it runs; then torch's default and the totals."""
    totals = threads_totals(rows)
    lines = [f"rank {r['rank']}: runs {r['torch_threads']} torch thread(s)" for r in rows]
    lines.append(f"torch's default in a fresh process here: {totals['default_per_process']} "
                 f"thread(s) (the machine has {totals['cpus']} CPU(s))")
    lines.append(f"{totals['ranks']} ranks with torch's default: {totals['with_default']} threads "
                 f"for {totals['cpus']} CPU(s); with the launcher's setting: "
                 f"{totals['as_launched']}")
    return "\n".join(lines)

def launch_wrong_world_size(world_size: int = 2, claimed: int = 3, pg_timeout: float = 5.0,
                            timeout: float = 60.0) -> WorkerError:
    """Start ``world_size`` ranks told WORLD_SIZE=``claimed``; the ``WorkerError`` that ends them:
    each waits in init for a rank that never comes until its ``pg_timeout``, and the first to give
    up raises ``DistStoreError: wait timeout``."""
    try:
        run_init_demo(world_size, echo="all", env={"WORLD_SIZE": str(claimed)}, timeout=timeout,
                      extra_args=["--pg-timeout", str(pg_timeout)])
    except WorkerError as err:
        return err
    except LaunchTimeout as err:
        raise RuntimeError(f"{world_size} ranks told WORLD_SIZE={claimed} were still waiting at "
                           f"the {timeout} s deadline, past their {pg_timeout} s timeout") from err
    raise RuntimeError(f"{world_size} ranks told WORLD_SIZE={claimed} finished: expected a timeout "
                       "in init")


def ranks_stuck_in_init(err: LaunchError) -> List[int]:
    """Ranks whose output shows they called init_process_group and never returned from it."""
    return [rank for rank, lines in sorted(err.run.output.items())
            if any("calling init_process_group" in line for line in lines)
            and not any("init_process_group returned" in line for line in lines)]


def port_clash(world_size: int = 2, timeout: float = 60.0):
    """Launch on a port another job's store holds (a second run of the original on its 12345):
    rank 0 cannot host the store, and the launch fails fast. Returns (port, the WorkerError)."""
    with hold_port() as port:
        try:
            run_init_demo(world_size, master_port=port, timeout=timeout)
        except WorkerError as err:
            return port, err
    raise RuntimeError(f"the launch on port {port}, already taken, did not fail")


def is_address_in_use(err: WorkerError) -> bool:
    """Whether a rank failed because its port was taken (EADDRINUSE)."""
    text = err.traceback.lower()
    return "eaddrinuse" in text or "address already in use" in text


# -- Notebook 02: DDP(model) ---------------------------------------------------
def run_wrap_demo(world_size: int = 2, bucket_caps: Sequence[float] = (25, 1, 0.5, 0.25, 0.1),
                  echo: str = "rank0", **launch_kwargs):
    """Launch ``wrap_demo.py``: the broadcast, the averaged gradient, the deep model's buckets
    under each ``bucket_cap_mb`` of ``bucket_caps``."""
    launch_kwargs.setdefault("timeout", 120)
    args = ["--bucket-caps", *[str(c) for c in bucket_caps]]
    return launch(WRAP_SCRIPT, world_size, args, echo=echo, **launch_kwargs)


def broadcast_rows(run) -> List[dict]:
    """Per rank: parameter checksum and digest before and after ``DDP(model)``."""
    return [{k: v for k, v in recs[-1].items() if k not in ("kind", "part")}
            for recs in rank_results(run, "broadcast").values()]


def format_broadcast(rows: List[dict]) -> str:
    """One row per rank: checksum and short digest before and after the wrap."""
    header = ["rank", "checksum before", "digest before", "checksum after", "digest after"]
    return text_table(header,
                      [(r["rank"], f"{r['checksum_before']:+.6f}", r["digest_before"][:12],
                        f"{r['checksum_after']:+.6f}", r["digest_after"][:12]) for r in rows])


def gradient_check(run) -> dict:
    """Rank 0's comparison of the DDP gradient with one process on the whole batch,
    plus every rank's gradient checksum (they must agree: all ranks hold the average)."""
    per_rank = rank_results(run, "gradient")
    check = {k: v for k, v in per_rank[0][-1].items() if k not in ("kind", "rank", "part")}
    check["grad_checksums"] = [recs[-1]["grad_checksum"] for _, recs in sorted(per_rank.items())]
    return check


def bucket_rows(run, model: str = "deep", rank: int = 0) -> List[dict]:
    """Per ``bucket_cap_mb`` tried on ``model`` ("deep", "deep, DDP default" or "Model"): buckets,
    all-reduces of the first backward and of the last, after DDP rebuilt its buckets."""
    rows = []
    for rec in rank_results(run, "buckets")[rank]:
        if rec["model"] != model:
            continue
        calls = rec["allreduces_per_step"]
        rows.append({"bucket_cap_mb": rec["bucket_cap_mb"], "param_bytes": rec["param_bytes"],
                     "rebuilt_bucket_sizes": rec["rebuilt_bucket_sizes"],
                     "num_buckets": len(rec["rebuilt_bucket_sizes"]), "allreduces_first": calls[0],
                     "allreduces_per_step": calls[-1], "allreduces_all_steps": calls})
    return rows


def format_buckets(rows: List[dict]) -> str:
    """One row per bucket cap: bucket count, sizes in KiB, all-reduces of each backward."""
    return text_table(["bucket_cap_mb", "buckets", "sizes (KiB)", "all-reduces per backward"],
                      [("None" if r["bucket_cap_mb"] is None else f"{r['bucket_cap_mb']:g}",
                        r["num_buckets"],
                        ", ".join(f"{s / 1024:.0f}" for s in r["rebuilt_bucket_sizes"]),
                        r["allreduces_all_steps"]) for r in rows])
