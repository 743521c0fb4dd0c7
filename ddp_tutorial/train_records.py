"""What ``Run`` reads of train.py's step records (``loss``, ``sync``, ``allreduce_calls``...).

Apart from ``runfolder``: these read the fields train.py writes, which ``launch`` never reads.
"""

from __future__ import annotations

from typing import Any, Dict, List


class TrainRecords:
    """``Run``'s readers of train.py's records; needs ``steps``, ``ranks`` and ``run_dir``."""

    def column(self, rank: int, key: str) -> List[Any]:
        """One field over all micro-steps of ``rank``, e.g. ``run.column(0, "loss")``."""
        return [rec[key] for rec in self.steps.get(rank, [])]

    def sync_steps(self, rank: int) -> List[Dict[str, Any]]:
        """Micro-steps of ``rank`` that synchronised gradients."""
        return [rec for rec in self.steps.get(rank, []) if rec["sync"]]

    def allreduce_calls(self, rank: int = 0) -> int:
        """Bucket all-reduces ``rank`` actually executed, counted by the comm hook."""
        return sum(rec["allreduce_calls"] for rec in self.steps.get(rank, []))

    def optimizer_steps(self, rank: int = 0) -> int:
        return sum(1 for rec in self.steps.get(rank, []) if rec["optimizer_step"])

    def mean_loss_curve(self) -> List[float]:
        """Mean over ranks of the local loss, per micro-step (ranks that finished it)."""
        n = min((len(s) for s in self.steps.values()), default=0)
        ranks = self.ranks
        return [sum(self.steps[r][i]["loss"] for r in ranks) / len(ranks) for i in range(n)]

    def model_state(self):
        """The final ``state_dict`` rank 0 saved as ``model.pt`` (loaded on CPU)."""
        import torch  # only here: reading metrics needs no torch

        return torch.load(self.run_dir / "model.pt", map_location="cpu", weights_only=True)

    def describe(self) -> str:
        """One line per rank: steps, last loss, total sync time."""
        lines = [f"run folder: {self.run_dir}"]
        for rank in self.ranks:
            steps = self.steps[rank]
            if not steps:
                lines.append(f"rank {rank}: no steps")
                continue
            sync = sum(s["sync_s"] for s in steps)
            lines.append(
                f"rank {rank}: {len(steps)} micro-steps, "
                f"{self.optimizer_steps(rank)} optimizer steps, "
                f"loss {steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f}, "
                f"sync {sync * 1e3:.1f} ms in {self.allreduce_calls(rank)} all-reduces")
        return "\n".join(lines)
