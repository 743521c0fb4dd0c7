"""The lockstep of exercise "my_ddp"'s harness: the ranks' collectives compared segment by segment (a
construction, a step) through the store, so that a collective only some ranks call (``mismatch``) stops the
run in about a second, named, instead of at gloo's timeout."""

from __future__ import annotations

import contextlib
import json
import os
import threading

from ddp_tutorial.runfolder import report

#: Seconds between the watchdog's looks at the peers' collectives while a segment runs.
POLL_S = 0.5


class MismatchedCollectives(RuntimeError):
    """The ranks called different collectives in the same segment (a construction, a step)."""


def first_difference(mine: list, theirs: list, theirs_done: bool):
    """Where two ranks' collectives of one segment part: the index, or None while they may still agree.

    Different calls at one index part them; so does a call beyond the end of a peer's finished
    segment (the peer will never make it). Both are facts whatever the timing: no false alarm."""
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            return i
    if theirs_done and len(mine) > len(theirs):
        return len(theirs)
    return None


class Lockstep:
    """The ranks' collectives compared segment by segment, through the store (never through the group,
    where a mismatched collective is stuck).

    ``segment(name)`` wraps one construction or step: its end posts this rank's calls and waits
    for every peer's, and raises ``MismatchedCollectives`` if they differ. Meanwhile a watchdog
    thread posts the calls so far and reads the peers': a rank stuck in a collective its peers
    never call reports ``mismatch`` and exits at once (``launch`` then stops the others)."""

    def __init__(self, store, rank: int, world_size: int):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.name, self.last, self.index, self.calls = None, None, 0, []
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="lockstep-watchdog", daemon=True)
        self.thread.start()

    def _key(self, index: int, state: str, rank: int) -> str:
        return f"my_ddp_lockstep/{index}/{state}/{rank}"

    def record(self, op: str, nbytes) -> None:
        with self.lock:
            self.calls.append([op, nbytes])

    @property
    def current(self):
        return self.name

    @contextlib.contextmanager
    def segment(self, name: str):
        with self.lock:
            self.index, self.name, self.last, self.calls = self.index + 1, name, name, []
        report({"event": "segment", "name": name})  # where a rank that hangs or crashes was
        try:
            yield
        except BaseException:
            with self.lock:
                self.name = None
            raise
        self.end()

    def end(self) -> None:
        with self.lock:
            index, name, mine, self.name = self.index, self.name, list(self.calls), None
        self.store.set(self._key(index, "done", self.rank), json.dumps(mine))
        keys = [self._key(index, "done", r) for r in range(self.world_size)]
        self.store.wait(keys)  # the store's timeout (the group's) is the backstop
        seqs = {r: json.loads(self.store.get(k)) for r, k in enumerate(keys)}
        for r, seq in seqs.items():
            at = first_difference(mine, seq, True)
            if at is None:
                at = first_difference(seq, mine, True)
            if at is not None:
                self._report(name, at, mine, seqs, stuck=False)
                raise MismatchedCollectives(f"in {name}, collective #{at + 1} differs between ranks")

    def _report(self, name, at, mine, seqs, stuck) -> None:
        report({"event": "mismatch", "segment": name, "index": at, "mine": mine, "stuck": stuck,
                "peers": {str(r): s for r, s in seqs.items()}})

    def _watch(self) -> None:
        posted = None
        while not self.stopped.wait(POLL_S):
            with self.lock:
                index, name, mine = self.index, self.name, list(self.calls)
            if name is None:
                continue
            if mine != posted:
                self.store.set(self._key(index, "now", self.rank), json.dumps(mine))
                posted = mine
            seqs = {self.rank: mine}
            for r in range(self.world_size):
                if r == self.rank:
                    continue
                for state in ("done", "now"):
                    key = self._key(index, state, r)
                    if self.store.check([key]):
                        seqs[r] = json.loads(self.store.get(key))
                        at = first_difference(mine, seqs[r], state == "done")
                        if at is not None:
                            self._report(name, at, mine, seqs, stuck=True)
                            report({"event": "final", "exit_code": 1, "case": name, "error": {
                                "type": "MismatchedCollectives", "message": f"stopped in {name}: collective "
                                f"#{at + 1} is not the one its peers call", "where": None, "traceback": []}})
                            os._exit(1)  # the main thread may be stuck in that collective: nothing else ends it
                        break
