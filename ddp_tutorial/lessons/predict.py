"""Predict first: every notebook's questions, answered before a measurement on real ranks.

    exercises.ask("04-allreduces")          # prints the question, naming the variable to answer in
    my_count = None                         # the learner's answer
    exercises.reveal("04-allreduces", my_count, measured)   # the answer comes from the measurement
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple, Union


class Printed(str):
    """Text printed already: IPython calls ``_ipython_display_`` instead of echoing the value."""

    def _ipython_display_(self) -> None:
        pass


@dataclass(frozen=True)
class Verdict:
    """What ``reveal`` found (``correct`` None without a prediction); printed, not echoed."""

    qid: str
    prediction: Any
    answer: Any
    correct: Optional[bool]

    def _ipython_display_(self) -> None:
        pass  # reveal printed the verdict and why


@dataclass(frozen=True)
class Question:
    """Asked in ``notebook``, answered in ``variable``; ``answer`` (default: the measurement itself)
    and ``explain`` (text, or a function) of what was measured; ``choices``: letter -> choice."""

    notebook: str
    variable: str
    text: str
    explain: Union[str, Callable[[Any], str]]
    answer: Callable[[Any], Any] = lambda measured: measured
    choices: Optional[Dict[str, str]] = None


#: A failure "at once" comes within this fraction of the process-group timeout (as notebook 05).
AT_ONCE_FRACTION = 0.1


def _dead_peer_choice(measured: Tuple[Optional[float], float]) -> str:
    """(seconds until the survivor's all_reduce failed, or None; the run's timeout) -> letter."""
    seconds_to_error, timeout_s = measured
    if seconds_to_error is None:
        return "c"
    return "a" if seconds_to_error < AT_ONCE_FRACTION * timeout_s else "b"


QUESTIONS: Dict[str, Question] = {
    "01-all-reduce": Question(
        "01", "my_sum", "4 ranks each hold a tensor [rank + 1] and call dist.all_reduce on it "
                        "(op SUM, the default). What does rank 2 hold afterwards?",
        explain="all_reduce sums over all ranks and gives every rank the result, in place: "
                "1 + 2 + 3 + 4 = 10 on every rank, rank 2 included."),
    "01-wrong-world-size": Question(
        "01", "my_choice",
        "2 processes start, but both are told WORLD_SIZE=3. What happens in init_process_group?",
        choices={"a": "it raises at once: the world size does not match",
                 "b": "both wait for a third rank, until a timeout",
                 "c": "they carry on as a world of 2"},
        answer=lambda stuck_ranks: "b" if stuck_ranks == [0, 1] else "?",
        explain="The rendezvous waits until WORLD_SIZE ranks have registered; nothing tells the "
                "two that a third will never come, so only a timeout ends the wait."),
    "02-default-buckets": Question(
        "02", "my_buckets", "The deep model has about 1.8 MiB of gradients, and DDP is built with "
        "no bucket_cap_mb (its default). How many bucket all-reduces does each backward make, once "
        "DDP has rebuilt its buckets after the first iteration?",
        explain="With bucket_cap_mb=None DDP caps the first bucket at 1 MiB and the later ones at "
                "25 MiB: 1.8 MiB of gradients make 2 buckets, so 2 all-reduces. An explicit 25 "
                "gives 1."),
    "03-set-epoch": Question(
        "03", "my_choice", "Without sampler.set_epoch(epoch), does epoch 1 give a rank the same "
                           "samples, in the same order, as epoch 0?",
        choices={"a": "yes, the same order", "b": "no, a new shuffle"},
        answer=lambda orders_repeat: "a" if orders_repeat else "b",
        explain="The sampler shuffles with seed + epoch, and its epoch changes only in set_epoch."),
    "03-padding": Question(
        "03", "my_duplicates", "10 samples, 4 ranks, drop_last=False: how many indices does the "
                               "sampler hand out twice, so that every rank gets as many?",
        explain="Every rank gets ceil(10 / 4) = 3 indices: 12 in all for 10 samples, 2 of them "
                "twice."),
    "04-allreduces": Question(
        "04", "my_count", "2 ranks, K = 4, a model whose gradients fit one bucket, and the "
        "original's mistake: forward outside no_sync(), backward inside. How many bucket "
        "all-reduces does rank 0 run in its first 8 micro-steps?",
        explain="DDP decides in forward whether the coming backward all-reduces; no_sync() around "
                "backward alone comes too late, so every micro-step syncs: 8, not 2."),
    "05-dead-peer": Question(
        "05", "my_choice", "Rank 1 exits without a word while rank 0 waits in all_reduce (gloo, a "
                           "60 s process-group timeout). When does rank 0's all_reduce fail?",
        choices={"a": "at once, long before the timeout", "b": "when the 60 s timeout runs out",
                 "c": "never: it waits forever"},
        answer=_dead_peer_choice,
        explain="A dead process's sockets are closed by the operating system, and gloo's read "
                "fails at once. A peer that is alive but stuck gives no such signal: then only the "
                "timeout helps."),
}

# Notebooks 08 and 09: uneven inputs without Join, and whom monitored_barrier names.
def _uneven_choice(measured: Tuple[bool, Optional[str]]) -> str:
    """(the launch finished, the first failing rank's error line or None) -> letter."""
    finished, error = measured
    if finished:
        return "a"
    return "c" if error is not None and "Timed out" in error else "b"


def _monitored_choice(measured: Tuple[str, int]) -> str:
    """(the error rank 0 raised, the rank that never arrived) -> letter."""
    error, missing = measured
    if f"Rank {missing} failed to pass monitoredBarrier" in error:
        return "b"
    return "a" if "Rank " in error else "c"  # names a rank, but not the missing one: rank 0 itself


QUESTIONS["08-uneven"] = Question(
    "08", "my_choice",
    "2 ranks train with DDP and no Join: rank 0 has 4 batches, rank 1 has 6. The script set a 3 s "
    "process-group timeout. What happens after rank 0's 4th batch?",
    choices={"a": "rank 1 trains its last 2 batches alone, and both finish",
             "b": "rank 1 gets an error at once in its 5th batch: its partner is gone",
             "c": "nothing moves until the 3 s timeout ends the job with an error"},
    answer=_uneven_choice,
    explain="Every backward of DDP is an all-reduce that all ranks must join. Rank 0 is alive, "
            "waiting at the final barrier, so rank 1's all-reduce has no partner and no error "
            "either: the two wait on each other until the timeout.")
QUESTIONS["09-monitored"] = Question(
    "09", "my_choice",
    "Rank 1 of 2 never reaches the barrier. Rank 0 waits in dist.monitored_barrier(timeout=2 s) "
    "instead of dist.barrier(). Which rank does rank 0's error name?",
    choices={"a": "rank 0: the rank that raised", "b": "rank 1: the rank that did not arrive",
             "c": "none: like barrier, it says only that a receive timed out"},
    answer=_monitored_choice,
    explain="monitored_barrier has rank 0 wait for each other rank in turn, so rank 0 knows which "
            "one did not answer in time and names it; a plain barrier is one collective, and its "
            "error knows only that a receive timed out.")

# Notebook 10: ZeroRedundancyOptimizer hands out whole tensors.
QUESTIONS["10-zero-state"] = Question(
    "10", "my_choice",
    "2 ranks, the wide model (64 -> 256 -> 8: tensors of 16,384, 2,048, 256 and 8 elements) with "
    "ZeroRedundancyOptimizer(Adam). What share of DDP's Adam state does rank 0 hold?",
    choices={"a": "about half", "b": "much more than half", "c": "all of it"},
    answer=lambda share: "a" if abs(share - 0.5) < 0.01 else "b" if share < 0.999 else "c",
    explain="ZeroRedundancyOptimizer hands out whole parameters, largest first, each to the rank "
            "with the fewest elements so far: the 16,384-element weight goes to rank 0 alone (the "
            "share printed above), the other three to rank 1. FSDP2 cuts every tensor instead, and "
            "each rank holds exactly half.")


# Notebook 07: how many buckets a small cap makes.
QUESTIONS["07-buckets"] = Question(
    "07", "my_count",
    "The lab's model has 26 layers: Linear(10, 64), 24 x Linear(64, 64), Linear(64, 20), 407 KB of "
    "float32 gradients (each hidden layer 16.6 KB). Wrapped as DDP(model, bucket_cap_mb=0.05), "
    "0.05 MiB = 52.4 KB per bucket: how many all-reduces does each step make, once DDP has rebuilt "
    "its buckets after the first iteration?",
    explain="DDP fills a bucket with gradients in the order backward produces them and closes it "
            "at the first tensor that takes it to the cap or past it, so a bucket holds more than "
            "the cap: the output layer and 3 hidden layers (55 KB), then 4 hidden layers (67 KB) "
            "at a time, and the rest: 7 all-reduces, not 407 / 52.4 = 8 (that would need buckets "
            "of exactly the cap), nor 26 (one per layer) or 52 (one per tensor).")


# Notebook 11: a hand-made DDP against torch's, at a world size that does not divide exactly.
def _exact_w3_choice(measured: Tuple[float, float]) -> str:
    """(largest difference from torch's DDP, DDP's float32 rounding against float64) -> letter."""
    difference, rounding = measured
    return "a" if difference == 0 else "b" if difference <= rounding else "c"


def _exact_w3_why(measured: Tuple[float, float]) -> str:
    """Why, for the letter the measurement gives."""
    difference, rounding = measured
    letter = _exact_w3_choice(measured)
    if letter == "a":
        return ("The hand-made versions and torch's DDP ended bit-identical at W = 3 in this run: "
                "every 3-way sum happened to round the same way in every order they were taken.")
    if letter == "b":
        return (f"They differ by up to {difference:.1e}, less than float32's own rounding of this "
                f"training ({rounding:.1e}). A sum of 3 float32 numbers depends on its order, and "
                "gloo's order depends on how the tensor is cut (one gradient, a bucket, one flat "
                "tensor): versions that divide before the all-reduce, like DDP, differ from it "
                "too. With 2 ranks a sum has one order and halving is exact: bit-identical.")
    return (f"They differ by {difference:.1e}, more than float32's own rounding of this training "
            f"({rounding:.1e}): no order of summation explains that; one of them does not average "
            "the gradients.")


QUESTIONS["11-exact-w3"] = Question(
    "11", "my_choice",
    "3 ranks train the same model on the same batches for 5 SGD steps, once with torch's DDP and "
    "once with a DDP built by hand (for instance: all_reduce each gradient after backward, then "
    "divide by 3; section 2 shows it). Are the final parameters equal?",
    choices={"a": "yes, to the bit",
             "b": "no, but they differ by no more than float32's own rounding",
             "c": "no, they differ by much more: one of them is wrong"},
    answer=_exact_w3_choice,
    explain=_exact_w3_why)


def _question(qid: str) -> Question:
    if qid not in QUESTIONS:
        raise ValueError(f"no question {qid!r}; the questions are {sorted(QUESTIONS)}")
    return QUESTIONS[qid]


def _same(prediction, answer, multiple_choice: bool) -> bool:
    """A letter matches in any case and with parentheses; a number as a number ("10" == 10.0)."""
    if multiple_choice:
        return str(prediction).strip().strip("()").lower() == answer
    try:
        return float(prediction) == float(answer)
    except (TypeError, ValueError):
        return False


def ask(qid: str) -> Printed:
    """Print question ``qid`` and its choices, naming the variable to answer in; return the text."""
    q = _question(qid)
    lines = [f"Predict first ({qid}): {q.text}"]
    if q.choices:
        lines += [f"  ({letter}) {choice}" for letter, choice in q.choices.items()]
        what = "your letter, in quotes"
    else:
        what = "your number"
    lines.append(f"Answer in the next cell: replace None in `{q.variable} = None` with {what}.")
    text = "\n".join(lines)
    print(text)
    return Printed(text)


def reveal(qid: str, prediction, measured) -> Verdict:
    """Compare ``prediction`` (the learner's answer, or None) with the answer the question derives
    from ``measured``; print the verdict and why, and return it as a ``Verdict``."""
    q = _question(qid)
    answer = q.answer(measured)
    shown = f"({answer}) {q.choices[answer]}" if q.choices and answer in q.choices else str(answer)
    if prediction is None:
        verdict, result = f"no prediction given; measured: {shown}", None
    else:
        result = _same(prediction, answer, multiple_choice=bool(q.choices))
        verdict = f"{'✓' if result else '✗'} you predicted {prediction!r}; measured: {shown}"
        if q.choices and str(prediction).strip().strip("()").lower() not in q.choices:
            verdict += f" (answer with a letter: {', '.join(q.choices)})"
    why = q.explain(measured) if callable(q.explain) else q.explain
    print(f"{verdict}\n  {why}")
    return Verdict(qid, prediction, answer, result)
