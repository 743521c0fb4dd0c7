"""What exercise "my_ddp"'s harness sees of the learner's collectives: ``Lockstep`` compares the
ranks' calls, ``Watch`` records each, ``summary`` gives one step's numbers to the judge."""

from __future__ import annotations

import contextlib
import inspect
import json

import torch
import torch.distributed as dist

from ddp_tutorial.runfolder import report

#: The collectives of torch.distributed the class may call; all are recorded, and compared across ranks.
COLLECTIVES = ("all_reduce", "broadcast", "barrier", "reduce", "all_gather", "all_gather_into_tensor",
               "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "all_to_all", "all_to_all_single",
               "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
               "send", "recv", "isend", "irecv")


class MismatchedCollectives(RuntimeError):
    """The ranks called different collectives at one point of a segment (a construction, a step)."""


class Lockstep:
    """The ranks' collectives compared through the store (the group may be stuck), per segment:
    before each collective and at the segment's end every rank posts its calls and reads its
    peers'; where they differ it reports ``mismatch`` and raises, instead of at gloo's timeout."""

    def __init__(self, store, rank: int, world_size: int):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.name, self.last, self.index, self.calls = None, None, 0, []

    @contextlib.contextmanager
    def segment(self, name: str):
        self.index, self.name, self.last, self.calls = self.index + 1, name, name, []
        report({"event": "segment", "name": name})  # where a rank that hangs or crashes was
        try:
            yield
            self.compare(None)
        finally:
            self.name = None

    def compare(self, call) -> None:
        """Post this rank's calls with ``call`` (None: the segment's end), wait for the peers'."""
        at, mine = len(self.calls), self.calls + ([call] if call else [])
        keys = [f"my_ddp_lockstep/{self.index}/{at}/{r}" for r in range(self.world_size)]
        self.store.set(keys[self.rank], json.dumps(mine))
        self.store.wait(keys)
        seqs = {r: json.loads(self.store.get(k)) for r, k in enumerate(keys)}
        if any(seq != mine for seq in seqs.values()):
            report({"event": "mismatch", "segment": self.name, "index": at,
                    "peers": {str(r): s for r, s in seqs.items()}})
            raise MismatchedCollectives(f"in {self.name}, collective #{at + 1} differs")
        self.calls = mine


class Watch:
    """Every collective of the learner's class on the default group while a segment runs; an async
    one's Work is torch's own, watched through ``Work.wait`` and ``Work.get_future``."""

    def __init__(self, lockstep: Lockstep):
        self.lockstep = lockstep
        self.calls, self.params, self.produced = [], [], set()
        self.in_backward = False
        self.pending = {}  # id(work) -> (work, record): kept alive, so an id is never reused within a step
        for op in COLLECTIVES:
            if hasattr(dist, op):
                setattr(dist, op, self._observed(op, getattr(dist, op)))
        work = dist.Work
        self._wait, self._get_future = work.wait, work.get_future
        watch = self

        def wait(w, *args, **kwargs):
            result = watch._wait(w, *args, **kwargs)  # an error in the collective raises here, as torch's does
            watch.waited(w)
            return result

        def get_future(w):
            entry = watch.pending.get(id(w))
            if entry is not None and entry[0] is w:
                entry[1]["future"] = True  # a future the learner waits for, or chains: not ours to see
            return watch._get_future(w)

        work.wait, work.get_future = wait, get_future

    def kind(self, tensor) -> str:
        if not isinstance(tensor, torch.Tensor):
            return "other"
        ptr = tensor.data_ptr()
        if any(p.data_ptr() == ptr for p in self.params):
            return "param"
        if any(p.grad is not None and p.grad.data_ptr() == ptr for p in self.params):
            return "grad"
        return "other"

    def _observed(self, op, collective):
        signature = inspect.signature(collective)

        def observed(*args, **kwargs):
            try:
                given = signature.bind(*args, **kwargs).arguments
            except TypeError:
                given = {}
            group = given.get("group")
            name = self.lockstep.name
            if name is None or group not in (None, dist.group.WORLD):
                return collective(*args, **kwargs)
            tensor = given.get("tensor")
            nbytes = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else None
            rec = {"op": op, "bytes": nbytes, "kind": self.kind(tensor), "async": bool(given.get("async_op")),
                   "produced": len(self.produced), "in_backward": self.in_backward, "waited": False,
                   "future": False}
            if isinstance(tensor, torch.Tensor):
                rec["tensor"], rec["version"] = tensor, tensor._version
            self.lockstep.compare([op, nbytes])
            self.calls.append(rec)
            report({"event": "launch", "case": name, "op": op, "bytes": nbytes})
            work = collective(*args, **kwargs)
            if work is not None and rec["async"]:
                self.pending[id(work)] = (work, rec)
            return work  # torch's own Work, untouched
        return observed

    def waited(self, work) -> None:
        entry = self.pending.get(id(work))
        if entry is None or entry[0] is not work or entry[1]["waited"]:
            return
        rec = entry[1]
        rec.update(waited=True, wait_produced=len(self.produced), wait_in_backward=self.in_backward)
        if "tensor" in rec:
            rec["changed_before_wait"] = rec["tensor"]._version != rec["version"]

    def take(self):
        calls, self.calls, self.pending = self.calls, [], {}
        return calls


def summary(calls: list, produced_total: int) -> dict:
    """One step's all-reduces, in numbers the judge reads."""
    reduces = [c for c in calls if c["op"] == "all_reduce"]
    during = [c for c in reduces if c["produced"] < produced_total]
    overlapping = [c for c in during if c["async"] and not (c["waited"] and c["wait_produced"] < produced_total)]
    return {"all_reduces": [c["bytes"] for c in reduces if c["kind"] != "param"],
            "ops": [c["op"] for c in calls],
            "kinds": sorted({c["kind"] for c in reduces}),
            "launched_in_backward": len(during),
            "overlapping": len(overlapping),
            "in_last_hook": sum(c["in_backward"] and c["produced"] >= produced_total for c in reduces),
            "after_backward": sum(not c["in_backward"] for c in reduces),
            "blocking_in_backward": sum(not c["async"] for c in during),
            "waited_in_backward": sum(c["async"] and c["waited"] and c["wait_produced"] < produced_total
                                      for c in during),
            "not_waited": sum(c["async"] and not c["waited"] and not c["future"] for c in reduces),
            "changed_after_launch": sum(bool(c.get("changed_before_wait")) for c in reduces)}
