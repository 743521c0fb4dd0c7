"""Notebook 11's overlap part: when each version's all-reduces ran against backward, the versions
beside torch's DDP, DDP's own logger, and find_unused_parameters' cost. No torch is imported here."""

from __future__ import annotations

import statistics
import textwrap
from typing import Dict, List

from ddp_tutorial.lessons import rank_results
from ddp_tutorial.lessons.table import text_table
from ddp_tutorial.runfolder import Run

#: The hand-made versions' keys in the lab's records; the names the tables print (and torch's DDP).
VERSIONS = ("naive", "flat", "overlap", "bucket")
NAMES = {"naive": "NaiveDDP", "flat": "FlatDDP", "overlap": "OverlapDDP", "bucket": "BucketDDP",
         "ddp": "torch DDP", "ddp_default": "DDP default"}


def records(run: Run, part: str) -> List[dict]:
    """Every rank's records of one part of the lab."""
    return [rec for recs in rank_results(run, part).values() for rec in recs]


def busy(intervals) -> float:
    """Length of the union of ``(start, end)`` intervals: time with at least one in progress."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def _step_numbers(step: dict) -> dict:
    """One step's times. ``exposed_ms``: last gradient to synced, what the step waited for.
    ``in_flight_ms``: time before the last gradient with an all-reduce launched and not completed
    (queued in gloo or waiting for the peer too). ``window_ms``: DDP's logger's overlap measure,
    first launch to last gradient."""
    last_grad, backward = max(step["ready"]), step["backward"]
    ars = step["all_reduces"]
    return {"exposed_ms": 1e3 * (step["synced"] - last_grad),
            "in_flight_ms": 1e3 * busy([(max(a, backward), min(b, last_grad)) for a, b, _ in ars]),
            "comm_ms": 1e3 * busy([(a, b) for a, b, _ in ars]),
            "launched_before_backward_end": sum(start < last_grad for start, _, _ in ars),
            "bytes_after_backward": sum(b for start, _, b in ars if start >= last_grad),
            "window_ms": 1e3 * max(0.0, last_grad - min(a[0] for a in ars)),
            "step_ms": 1e3 * (step["step_end"] - step["forward"]),
            "all_reduces": len(ars), "bytes": sum(b for _, _, b in ars)}


def overlap_summary(run: Run) -> Dict[str, dict]:
    """Per version and DDP: medians over the steps but the first (warm-up, DDP's one bucket) of both
    ranks, and ``least_exposed_ms``: other work on a shared CPU only adds to a step, so the least is
    the version's own cost. For DDP also ``logger``: its own overlap per iteration and running mean."""
    out: Dict[str, dict] = {}
    for rank, recs in rank_results(run, "overlap").items():
        for rec in recs:
            row = out.setdefault(rec["version"], {"per_step": [], "logger": {}})
            steps = rec["steps"]
            row["per_step"] += [_step_numbers(s) for s in steps[1:]]
            if "buckets" in rec:  # BucketDDP: the bytes of each tensor, per bucket
                row["buckets"] = rec["buckets"]
            elif "buckets" in steps[-1]:  # torch's DDP: (bytes, tensors) per bucket, its last step
                row["buckets"] = steps[-1]["buckets"]
            if "avg_backward_compute_comm_overlap_time" in rec:
                logged = [s["logger_overlap_ms"] for s in steps if "logger_overlap_ms" in s]
                row["logger"][rank] = {
                    "running_mean_ms": rec["avg_backward_compute_comm_overlap_time"] / 1e6,  # ns
                    "per_iteration_ms": logged,
                    # the same quantity from the lab's clocks, for the same iterations
                    "window_ms": [_step_numbers(s)["window_ms"] for s in steps[:len(logged)]],
                    "buckets_per_iteration": [len(s["buckets"]) for s in steps]}
    finals = records(run, "overlap_final")
    for version, row in out.items():
        row.update({k: statistics.median(s[k] for s in row["per_step"]) for k in row["per_step"][0]})
        row["least_exposed_ms"] = min(s["exposed_ms"] for s in row["per_step"])
        row["same_as_ddp"] = all(f["digests"][version] == f["digests"]["ddp"] for f in finals)
    return out


def ddp_overlap(summary: Dict[str, dict]) -> dict:
    """DDP's logger per iteration against the lab's clocks for the same iterations (2 on, medians
    of both ranks), iteration 1 alone, and the logger's running mean."""
    logger = list(summary["ddp"]["logger"].values())
    return {"logger_ms": statistics.median(v for r in logger for v in r["per_iteration_ms"][1:]),
            "clocks_ms": statistics.median(v for r in logger for v in r["window_ms"][1:]),
            "iterations": f"2-{len(logger[0]['per_iteration_ms'])}",
            "iteration1_ms": statistics.median(r["per_iteration_ms"][0] for r in logger),
            "running_mean_ms": statistics.median(r["running_mean_ms"] for r in logger),
            "buckets_per_iteration": logger[0]["buckets_per_iteration"]}


def format_side_by_side(summary: Dict[str, dict]) -> str:
    return text_table(["version", "step ms", "all-reduces", "KiB", "exposed ms", "in flight ms",
                       "launched in backward", "final = DDP's"],
                      [(NAMES[v], f"{s['step_ms']:.1f}", f"{s['all_reduces']:.0f}",
                        f"{s['bytes'] / 1024:.0f}", f"{s['exposed_ms']:.1f}",
                        f"{s['in_flight_ms']:.1f}",
                        f"{s['launched_before_backward_end']:.0f}", s["same_as_ddp"])
                       for v, s in summary.items()])


def describe_overlap(summary: Dict[str, dict]) -> str:
    """This run's side by side in sentences built from its numbers (their direction is the run's)."""
    least = {v: s["least_exposed_ms"] for v, s in summary.items()}
    flat, ov = summary["flat"], summary["overlap"]
    lines = [f"Exposed communication, least of {len(flat['per_step'])} steps: "
             + ", ".join(f"{NAMES[v]} {t:.1f} ms" for v, t in least.items()) + "."]
    for v in ("overlap", "bucket", "ddp"):
        s = summary[v]
        lines.append(
            f"{NAMES[v]} waited {'less' if least[v] < least['flat'] else 'more'} than FlatDDP after "
            f"backward ({least[v]:.1f} against {least['flat']:.1f} ms): it launched "
            f"{s['launched_before_backward_end']:.0f} of its {s['all_reduces']:.0f} all-reduces while "
            f"backward still had gradients to produce, and left {s['bytes_after_backward'] / 1024:.0f}"
            f" KiB of {s['bytes'] / 1024:.0f} to after the last gradient.")
    lines.append(
        f"OverlapDDP had an all-reduce in flight for {ov['in_flight_ms']:.1f} ms of backward "
        f"(median), {'more' if ov['in_flight_ms'] > flat['comm_ms'] else 'less'} than FlatDDP's "
        f"whole all-reduce of the same bytes ({flat['comm_ms']:.1f} ms): in flight counts each "
        "all-reduce from its launch, so also while it waits in gloo's queue behind the ones launched "
        "before it, and for the peer to launch it too; it is time during which communication could "
        "happen, not time spent moving bytes.")
    lines.append("Median step times in this run: " + ", ".join(
        f"{NAMES[v]} {summary[v]['step_ms']:.1f} ms"
        for v in sorted(summary, key=lambda v: summary[v]["step_ms"])) + " (fastest first).")
    return "\n".join(textwrap.fill(line, 110) for line in lines)


def timeline(run: Run, version: str, step: int = -1) -> Dict[int, dict]:
    """rank -> one step's events in ms from that rank's forward start: backward, each gradient
    ready, each all-reduce (launch, done), synced."""
    out = {}
    for rank, recs in rank_results(run, "overlap").items():
        for rec in recs:
            if rec["version"] == version:
                s = rec["steps"][step]
                ms = lambda t, t0=s["forward"]: 1e3 * (t - t0)  # noqa: E731
                out[rank] = {"backward": (ms(s["backward"]), ms(max(s["ready"]))),
                             "ready": [ms(t) for t in s["ready"]],
                             "all_reduces": [(ms(a), ms(b)) for a, b, _ in s["all_reduces"]],
                             "synced": ms(s["synced"]), "step_end": ms(s["step_end"])}
    return out


def find_unused_cost(run: Run) -> Dict[str, dict]:
    """DDP on the timing model with find_unused_parameters False and True: step time (median ms,
    both ranks) and the buckets (bytes, parameters) of its last step."""
    finals = records(run, "overlap_final")
    return {key: {"step_ms": 1e3 * statistics.median(
                      t for f in finals for t in f["find_unused_step_s"][key]),
                  "buckets": finals[0]["find_unused_buckets"][key]} for key in ("False", "True")}


def cap25_buckets(run: Run) -> list:
    """DDP's buckets (bytes, parameters) on the timing model with bucket_cap_mb=25, rebuilt."""
    return records(run, "overlap_final")[0]["cap25_buckets"]
