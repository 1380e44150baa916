"""Shared helpers for the backend tests: small models, a genuinely nondeterministic
custom op, and one-line runners that compile, run and load the trace/report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from determ_backend.backends import run as run_mod
from determ_backend.trace.stream import Record, read_trace
from conftest import shuffled_rowsum

_GEN = torch.Generator().manual_seed(12345)  # never reseeded: the order changes from call to call


@torch.library.custom_op("determ_test::nd_rowsum", mutates_args=())
def nd_rowsum(x: torch.Tensor) -> torch.Tensor:
    """Row sums accumulated sequentially in a random column order (float rounding differs per call)."""
    return shuffled_rowsum(x, _GEN)


@nd_rowsum.register_fake
def _(x):
    return x.new_empty(x.shape[:-1] + (1,))


def _nd_setup(ctx, inputs, output):
    ctx.n = inputs[0].shape[-1]


def _nd_backward(ctx, grad):
    return grad.expand(*grad.shape[:-1], ctx.n).clone()


nd_rowsum.register_autograd(_nd_backward, setup_context=_nd_setup)


@torch.library.custom_op("determ_test::batch_dep_sum", mutates_args=())
def batch_dep_sum(x: torch.Tensor) -> torch.Tensor:
    """Row sums whose reduction is split into ``1 + batch % 3`` column chunks: a row's bits depend on the batch
    size, as with a kernel that picks its blocking by M."""
    return sum(p.sum(dim=1, keepdim=True) for p in x.chunk(1 + x.shape[0] % 3, dim=1))


@batch_dep_sum.register_fake
def _(x):
    return x.new_empty(x.shape[0], 1)


@torch.library.custom_op("determ_test::double_bdgrad", mutates_args=())
def double_bdgrad(x: torch.Tensor) -> torch.Tensor:
    """``2 x`` forward; its backward adds ``1e-3 *`` :func:`batch_dep_sum` of the gradient: batch invariant
    forward, batch dependent backward."""
    return x * 2


@double_bdgrad.register_fake
def _(x):
    return torch.empty_like(x)


def _bd_backward(ctx, grad):
    return grad * 2 + 1e-3 * batch_dep_sum(grad)


double_bdgrad.register_autograd(_bd_backward)


class BackwardBatchDependent(torch.nn.Module):
    def __init__(self, d: int = 256):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, x):
        return torch.tanh(double_bdgrad(self.norm(x)))  # the backward culprit


class BatchDependent(torch.nn.Module):
    """relu -> scale -> batch_dep_sum -> linear: the custom op is the batch-invariance culprit."""

    def __init__(self, d: int = 256):
        super().__init__()
        self.head = torch.nn.Linear(1, 4)

    def forward(self, x):
        h = torch.relu(x) * 100
        return self.head(batch_dep_sum(h))  # the culprit


class RowWise(torch.nn.Module):
    """Only row-wise work (layer norm, gelu, a per-feature scale, softmax and sums over features): every row's
    bits are the same whatever else is in the batch."""

    def __init__(self, d: int = 256):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.scale = torch.nn.Parameter(torch.randn(d))

    def forward(self, x):
        h = torch.nn.functional.gelu(self.norm(x)) * self.scale
        return torch.softmax(h, dim=-1).sum(-1, keepdim=True) + h.sum(-1, keepdim=True)


class MLP(torch.nn.Module):
    def __init__(self, d_in: int = 8, d_hidden: int = 16, d_out: int = 4):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(d_in, d_hidden), torch.nn.ReLU(),
                                          torch.nn.Linear(d_hidden, d_out))

    def forward(self, x):
        return self.layers(x).sin()


class NondetModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x):
        h = self.lin(x)
        s = nd_rowsum(h * 1000.0)
        return (h * s).tanh() + 1.0


class DeepChain(torch.nn.Module):
    """``n`` steps of four traced ops each (``x * 0.999 + sin(x) * 0.01``); after step ``int(n * at)`` a
    nondeterministic row sum is added in (a long graph with one determinism finding)."""

    def __init__(self, n: int, at: float = 0.5):
        super().__init__()
        self.n, self.at = n, int(n * at)

    def forward(self, x):
        for i in range(self.n):
            x = x * 0.999 + torch.sin(x) * 0.01
            if i == self.at:
                x = x + nd_rowsum(x * 1000.0)
        return x


class BreakModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        x = self.a(x).relu()
        torch._dynamo.graph_break()
        return self.b(x).cos()


def compile_run(model: torch.nn.Module, inputs: Tuple[Any, ...], backend: str, out_dir: Path, run_id: str,
                backward: bool = False, **options) -> Tuple[Any, Path]:
    """Compile ``model`` with a determ backend writing to ``out_dir/run_id``, run it once, close the run."""
    torch._dynamo.reset()
    opts: Dict[str, Any] = {"dir": str(out_dir), "run_id": run_id}
    opts.update(options)
    f = torch.compile(model, backend=backend, options=opts)
    y = f(*inputs)
    if backward:
        y.sum().backward()
    run_mod.finish_all()
    return y, out_dir / run_id


def load(run_dir: Path) -> Tuple[List[Record], Dict[str, Any]]:
    return read_trace(run_dir), json.loads((run_dir / "report.json").read_text())
