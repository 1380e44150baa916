"""Shared helpers for the eager-tool tests (modes, observer): a genuinely nondeterministic
custom op, ops that flip signed zeros / NaN payloads from call to call, a small model, and
one-line runners."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import List, Optional

import torch

from determ_backend.compare import Comparison, compare_traces
from determ_backend.modes.core import HashDebugTrace, read_hash_log
from conftest import shuffled_rowsum

_GEN = torch.Generator().manual_seed(4321)  # never reseeded: the order changes from call to call
_CALLS = [0]  # call counter of the flip ops


@torch.library.custom_op("determ_test::eager_nd_rowsum", mutates_args=())
def eager_nd_rowsum(x: torch.Tensor) -> torch.Tensor:
    """``x`` plus its row sums accumulated in float32 in a random column order (rounding differs per call)."""
    return x + shuffled_rowsum(x, _GEN)


@eager_nd_rowsum.register_fake
def _(x):
    return torch.empty_like(x)


def _nd_backward(ctx, grad):
    return grad + grad.sum(-1, keepdim=True)


eager_nd_rowsum.register_autograd(_nd_backward)


@torch.library.custom_op("determ_test::eager_nd_backward", mutates_args=())
def eager_nd_backward(x: torch.Tensor) -> torch.Tensor:
    """Deterministic forward (a copy); its backward calls the nondeterministic row sum."""
    return x.clone()


@eager_nd_backward.register_fake
def _(x):
    return torch.empty_like(x)


eager_nd_backward.register_autograd(lambda ctx, grad: eager_nd_rowsum(grad))


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


@torch.library.custom_op("determ_test::flip_zero_sign", mutates_args=())
def flip_zero_sign(x: torch.Tensor) -> torch.Tensor:
    """Zeros like ``x`` whose sign alternates from call to call (0.0 == -0.0 numerically, not bitwise)."""
    _CALLS[0] += 1
    return torch.full_like(x, 0.0 if _CALLS[0] % 2 else -0.0)


@flip_zero_sign.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("determ_test::flip_nan_payload", mutates_args=())
def flip_nan_payload(x: torch.Tensor) -> torch.Tensor:
    """A float32 tensor of NaNs whose payload bits alternate from call to call."""
    _CALLS[0] += 1
    bits = 0x7FC00001 if _CALLS[0] % 2 else 0x7FC00002
    return torch.full_like(x, _f32(bits), dtype=torch.float32)


@flip_nan_payload.register_fake
def _(x):
    return torch.empty_like(x, dtype=torch.float32)


class Net(torch.nn.Module):
    """Linear -> relu -> [nondeterministic op] -> split/cat -> Linear."""

    def __init__(self, nondet: bool = True, d: int = 64):
        super().__init__()
        self.a = torch.nn.Linear(8, d)
        self.b = torch.nn.Linear(d, 4)
        self.nondet = nondet
        self.extra = False  # one more op in forward when set

    def forward(self, x):
        h = self.a(x).relu()
        h = h * 1.0 if self.extra else h  # value-preserving: only the alignment changes
        h = eager_nd_rowsum(h) if self.nondet else h
        left, right = torch.split(h, h.shape[-1] // 2, dim=-1)
        h = torch.cat([right, left * 2.0], dim=-1)
        return self.b(h)


def make(nondet: bool = True, seed: int = 0):
    """A fresh (model, input) pair, identical for every call with the same seed."""
    torch.manual_seed(seed)
    return Net(nondet), torch.randn(5, 8)


def train_step(model, x) -> torch.Tensor:
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss


def traced_run(log_path: Path, nondet: bool = True, extra: bool = False, **kwargs) -> HashDebugTrace:
    """One forward+backward of a fresh model under ``HashDebugTrace``."""
    model, x = make(nondet)
    model.extra = extra
    with HashDebugTrace(log_path=log_path, module=model, **kwargs) as t:
        train_step(model, x)
    return t


def diff_logs(a: Path, b: Path) -> Comparison:
    return compare_traces(read_hash_log(a), read_hash_log(b))


def root_ops(cmp: Comparison) -> List[str]:
    return [p.rec.op for p in cmp.root_causes]


def nodes(records, op: Optional[str] = None) -> List[str]:
    return [r.node for r in records if op is None or r.op == op]
