"""Shared models and one-call helpers for the API dump tests."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from determ_backend import dump


class Net(nn.Module):
    """Conv -> relu -> flatten -> fc1 -> relu -> fc2; ``extra`` adds an identity op (relu of a relu)."""

    def __init__(self, extra: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc1 = nn.Linear(4 * 6 * 6, 16)
        self.fc2 = nn.Linear(16, 5)
        self.extra = extra

    def forward(self, x):
        x = F.relu(self.conv(x))
        if self.extra:
            x = torch.relu(x)  # identity on a non-negative tensor
        x = x.flatten(1)
        x = torch.relu(self.fc1(x))
        return self.fc2(x)


def make_net(seed: int = 0, extra: bool = False, perturb: Optional[str] = None, scale: float = 1e-2,
             dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    net = Net(extra)
    if perturb:
        w = dict(net.named_parameters())[perturb]
        with torch.no_grad():
            w.add_(scale * torch.randn(w.shape, generator=torch.Generator().manual_seed(7)))
    return net.to(dtype)


def sequential(perturb: Optional[Tuple[int, int, float]] = None) -> nn.Module:
    """Linear(16, 32) -> ReLU -> Linear(32, 4) (seed 0); ``perturb=(row, col, delta)`` adds ``delta`` to that weight of
    the last Linear."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    if perturb:
        row, col, delta = perturb
        with torch.no_grad():
            model[2].weight[row, col] += delta
    return model


def batch(dtype: torch.dtype = torch.float32, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 3, 8, 8, generator=g).to(dtype), torch.tensor([0, 1, 2, 3])


def train_step(net: nn.Module, dtype: torch.dtype = torch.float32, opt: bool = False) -> torch.Tensor:
    x, t = batch(dtype)
    loss = F.cross_entropy(net(x).float(), t)
    loss.backward()
    if opt:
        torch.optim.SGD(net.parameters(), lr=0.1).step()
    return loss


def dump_run(root: Path, tag: str, net: nn.Module, step: Callable = train_step, **switch) -> Path:
    """Dump one step of ``net`` under ``root/tag``; returns the index file."""
    dump.set_dump_path(root, dump_tag=tag)
    dump.register_hook(net, dump.acc_cmp_dump)
    dump.set_dump_switch("ON", **switch)
    try:
        step(net)
    finally:
        dump.set_dump_switch("OFF")
        dump.remove_hooks()
    mode = switch.get("mode", "all")
    prefix = "" if mode == "all" else f"{mode}_"
    return Path(root) / tag / "rank0" / f"{prefix}dump.pkl"


def compare_two(a: Path, b: Path, out: Path, **kw) -> "dump.DumpComparison":
    return dump.compare({"npu_pkl_path": str(a), "bench_pkl_path": str(b)}, out, **kw)


def names(index: Path):
    return [e["name"] for e in dump.read_dump(index).entries]


def overflow_index(rank_dir: Path) -> Path:
    """The one overflow index ``Overflow_info_<time>.pkl`` in ``rank_dir`` (ptdbg's name), its data directory beside it."""
    import re

    found = sorted(rank_dir.glob("Overflow_info_*.pkl"))
    assert len(found) == 1, found
    assert re.fullmatch(r"Overflow_info_\d{14}(_\d+)?\.pkl", found[0].name), found[0].name
    return found[0]
