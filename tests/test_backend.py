"""--backend auto: nccl only when every rank on the node has a GPU of its own, else gloo.

Checked with faked GPU counts, so the rule is tested for 0, 1 and 8 GPUs on any machine.
"""

import pytest
import torch

from ddp_tutorial import backend, train
from ddp_tutorial.backend import choose_backend


@pytest.mark.parametrize("gpus, expected", [(0, "gloo"), (1, "gloo"), (3, "gloo"), (4, "nccl"), (8, "nccl")])
def test_auto_picks_nccl_only_with_one_gpu_per_rank(gpus, expected):
    chosen, why = choose_backend("auto", gpus, local_world_size=4)
    assert chosen == expected
    assert why.startswith("auto: ")
    assert ("no CUDA GPU" in why) if gpus == 0 else (f"{gpus} GPU(s) for 4 rank(s)" in why)


def test_a_single_rank_on_a_one_gpu_laptop_uses_its_gpu():
    assert choose_backend("auto", 1, local_world_size=1)[0] == "nccl"


def test_an_explicit_backend_is_kept_or_refused_with_the_reason():
    assert choose_backend("gloo", 8, 4)[0] == "gloo"
    assert choose_backend("nccl", 8, 4)[0] == "nccl"
    with pytest.raises(ValueError, match="needs CUDA"):
        choose_backend("nccl", 0, 1)
    with pytest.raises(ValueError, match="this node runs 4 ranks but has 2 GPU"):
        choose_backend("nccl", 2, 4)
    with pytest.raises(ValueError, match="backend must be one of"):
        choose_backend("mpi", 8, 4)


def fake_gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize("gpus, expected", [(0, "gloo"), (1, "gloo"), (8, "nccl")])
def test_this_node_counts_its_gpus_and_local_ranks(monkeypatch, gpus, expected):
    fake_gpus(monkeypatch, gpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert backend.gpu_count() == gpus
    assert backend.backend_for_this_node("auto")[0] == expected


@pytest.mark.parametrize("rank, local_rank", [(0, 0), (5, 1)])
def test_step_1_puts_each_nccl_rank_on_the_gpu_of_its_local_rank(monkeypatch, capsys, rank, local_rank):
    """train.init_process_group with 8 faked GPUs and 4 ranks per node: nccl on cuda:LOCAL_RANK."""
    fake_gpus(monkeypatch, 8)
    calls = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.setdefault("device", device))
    monkeypatch.setattr(train.dist, "init_process_group", lambda backend, **kw: calls.setdefault("backend", backend))
    for name, value in {"RANK": rank, "WORLD_SIZE": 8, "LOCAL_RANK": local_rank, "LOCAL_WORLD_SIZE": 4}.items():
        monkeypatch.setenv(name, str(value))
    env = train.init_process_group("auto")
    assert (env.backend, env.device, env.rank, env.world_size) == ("nccl", torch.device("cuda", local_rank), rank, 8)
    assert calls == {"device": torch.device("cuda", local_rank), "backend": "nccl"}
    # Rank 0 alone says which backend it chose, and why.
    said = "backend nccl: auto: 8 GPU(s) for 4 rank(s) on this node, one GPU per rank\n"
    assert capsys.readouterr().out == (said if rank == 0 else "")
