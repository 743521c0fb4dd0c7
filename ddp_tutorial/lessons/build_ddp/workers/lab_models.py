"""The lab's models and seeded batches (rank code), shared with exercise "my_ddp"'s harness."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddp_tutorial.lessons.pitfalls.workers.pitfall_common import generator


class ToyModel(nn.Module):
    """What a first DDP gets wrong: fc3 shares fc2's weight, fc2's bias is frozen, ``fixed`` has
    requires_grad=False. 6 trainable tensors, 2,132 bytes."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(10, 16), nn.Linear(16, 16)
        self.fc3, self.out = nn.Linear(16, 16), nn.Linear(16, 5)
        self.fc3.weight = self.fc2.weight
        self.fc2.bias.requires_grad_(False)
        self.fixed = nn.Parameter(torch.randn(16), requires_grad=False)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.out(F.relu(self.fc3(x) + self.fixed))


class BranchModel(nn.Module):
    """A branch taken only for inputs whose first column is positive: its parameters may get no gradient."""

    def __init__(self):
        super().__init__()
        self.branch, self.body, self.out = nn.Linear(10, 10), nn.Linear(10, 16), nn.Linear(16, 5)

    def forward(self, x):
        if bool(x[0, 0] > 0):
            x = x + self.branch(x)
        return self.out(F.relu(self.body(x)))


class ScaleModel(nn.Module):
    """A layer and a buffer ``scale`` (state that is not trained, as BatchNorm's running statistics)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x):
        return self.lin(x) * self.scale


def seeded(cls, seed):
    """``cls()`` with its parameters drawn from ``seed``."""
    torch.manual_seed(seed)
    return cls()


def sgd(model, lr=0.1):
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)


def flat(model):
    return [float(v) for p in model.parameters() for v in p.detach().reshape(-1)]


def batch(seed, step, rows, d_in, d_out):
    g = generator(seed, step)
    return torch.randn(rows, d_in, generator=g), torch.randn(rows, d_out, generator=g)


def branch_batch(seed, step, rank, rows):
    """Rank 0's batches take the branch (first column positive), rank 1's never do."""
    x, y = batch(seed, 300 + 10 * step + rank, rows, 10, 5)
    x[0, 0] = abs(float(x[0, 0])) + 0.1 if rank == 0 else -abs(float(x[0, 0])) - 0.1
    return x, y
