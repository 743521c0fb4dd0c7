"""Pitfall 3: saving and loading a DDP model: the ``module.`` prefix, who saves, map_location."""

from __future__ import annotations

from ddp_tutorial.lessons.pitfalls.common import part, per_rank
from ddp_tutorial.runfolder import Run


def checkpoint_summary(run: Run) -> dict:
    """The ``module.`` error, the rescue, and the right save/load on every rank."""
    wrong, rescue = part(run, "checkpoint", "wrong"), part(run, "checkpoint", "rescue")
    right = per_rank(run, "checkpoint", "right")
    return {"saved_keys": wrong["keys"], "error": wrong["error"], "message": wrong.get("message", ""),
            "missing": wrong.get("missing"), "unexpected": wrong.get("unexpected"),
            "rescued_keys": rescue["keys"], "rescue_identical": rescue["identical"],
            "writers": [r for r, rec in right.items() if rec["wrote"]], "loaded_keys": right[0]["keys"],
            "saved_from": right[0]["saved_from"],
            **{key: {r: rec[key] for r, rec in right.items()} for key in ("identical", "loaded_on")}}


def format_checkpoint(summary: dict) -> str:
    s = summary
    message = "\n".join("    " + line.strip() for line in s["message"].splitlines()[1:3])
    return "\n".join([
        f"ddp.state_dict() keys: {s['saved_keys']}",
        f"plain_model.load_state_dict(...): RuntimeError: {s['error']}\n{message}",
        f"  -> {s['missing']} missing and {s['unexpected']} unexpected keys",
        f"after consume_prefix_in_state_dict_if_present: keys {s['rescued_keys']}, "
        f"bit-identical to the trained model: {s['rescue_identical']}",
        f"the right way: written by rank(s) {s['writers']}; keys {s['loaded_keys']}",
        "  loaded bit-identical on every rank: "
        + ", ".join(f"rank {r}: {v}" for r, v in s["identical"].items()),
        f"  saved from {s['saved_from']}; loaded onto "
        + ", ".join(f"rank {r}: {v}" for r, v in s["loaded_on"].items()),
    ])
