"""The demo's model: a small transformer-style network shipped with determ.

:class:`DemoTransformer` (pre-norm blocks: self-attention, then an MLP with a
ReLU) is small enough to compile in seconds on a CPU and big enough that a
wrong kernel hides among a few dozen others.  With ``nondeterministic=True``
its attention output goes through :func:`scrambled_sum`, a custom op whose
floating-point accumulation order changes from call to call -- a stand-in for
the nondeterministic kernels (atomics, split reductions) of real accelerators.

The custom op is registered on first use (:func:`nondeterministic_op`), not at
import.  The demo itself lives in :mod:`repro_tools.cli.demo`.
"""

from __future__ import annotations

import functools
from typing import Callable, Tuple

import torch
from torch import nn

__all__ = ["DemoTransformer", "demo_inputs", "nondeterministic_op"]


@functools.lru_cache(maxsize=None)
def nondeterministic_op() -> Callable[[torch.Tensor], torch.Tensor]:
    """``determ_demo::scrambled_sum(x)``: ``x`` plus its last-dim mean, accumulated in a random order each call."""
    gen = torch.Generator().manual_seed(20240611)  # private and never reseeded: the order differs per call

    @torch.library.custom_op("determ_demo::scrambled_sum", mutates_args=())
    def scrambled_sum(x: torch.Tensor) -> torch.Tensor:
        perm = torch.randperm(x.shape[-1], generator=gen).tolist()
        acc = x[..., perm[0]].clone()
        for j in perm[1:]:
            acc = acc + x[..., j]
        return x + acc.unsqueeze(-1) / x.shape[-1]

    @scrambled_sum.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    def backward(ctx, grad):
        return grad  # the sums are a small perturbation; their gradient is not the point of the demo

    scrambled_sum.register_autograd(backward)
    return scrambled_sum


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, nondeterministic: bool):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.nondeterministic = nondeterministic
        if nondeterministic:
            nondeterministic_op()  # registers torch.ops.determ_demo.scrambled_sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        if self.nondeterministic:
            y = torch.ops.determ_demo.scrambled_sum(y)
        x = x + self.proj(y)
        return x + self.fc2(torch.relu(self.fc1(self.norm2(x))))


class DemoTransformer(nn.Module):
    """``layers`` pre-norm transformer blocks of width ``dim`` and a linear head."""

    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2, nondeterministic: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, heads, nondeterministic) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def demo_inputs(batch: int = 2, seq: int = 8, dim: int = 32, seed: int = 0) -> Tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, seq, dim, generator=g),)
