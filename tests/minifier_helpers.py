"""Compilers with injected bugs and small graphs, shared by the minifier tests and the benchmark.

Each compiler is a dynamo-style backend ``f(gm, example_inputs) -> callable``
whose bug is tied to one kind of node (``erf``), so tests know the culprit.
They are importable by name (``minifier_helpers:wrong_erf``) so the isolated
worker can load them.
"""

from __future__ import annotations

import ctypes
import os
import random
import time
from typing import Any, Callable, List, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

ERF_TARGETS = (torch.ops.aten.erf.default, torch.erf, torch.special.erf)


def _has_erf(gm: fx.GraphModule) -> bool:
    return any(n.op == "call_function" and n.target in ERF_TARGETS for n in gm.graph.nodes)


def _slightly_wrong_erf(x):
    return torch.erf(x * 1.05)


def _noisy_erf(x):
    noise = torch.empty_like(x).uniform_(-1e-6, 1e-6, generator=torch.Generator().manual_seed(random.SystemRandom().getrandbits(62)))
    return torch.erf(x) + noise


def _rewrite_erf(gm: fx.GraphModule, fn: Callable) -> fx.GraphModule:
    g = fx.Graph()
    env = {}
    for n in gm.graph.nodes:
        new = g.node_copy(n, lambda a: env[a])
        if n.op == "call_function" and n.target in ERF_TARGETS:
            new.target = fn
        env[n] = new
    return fx.GraphModule(gm, g)


def wrong_erf(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """A 'wrong lowering': every erf computes erf(1.05 x)."""
    return _rewrite_erf(gm, _slightly_wrong_erf).forward


def noisy_erf(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """A nondeterministic erf: tiny noise from an unseeded source."""
    return _rewrite_erf(gm, _noisy_erf).forward


def erf_compile_error(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """Refuses to compile any graph with an erf."""
    if _has_erf(gm):
        raise NotImplementedError("no lowering for aten.erf.default on this target")
    return gm.forward


def sum_compile_error(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """A *different* compile error (for drift tests): refuses graphs with a sum."""
    if any(n.op == "call_function" and "sum" in str(n.target) for n in gm.graph.nodes):
        raise NotImplementedError("no lowering for aten.sum.dim_IntList with keepdim")
    return erf_compile_error(gm, example_inputs)


def erf_runtime_error(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    def boom(x):
        raise RuntimeError(f"kernel launch failed for erf on shape {tuple(x.shape)}")
    return _rewrite_erf(gm, boom).forward


def abort_on_erf(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """Kills the process (SIGABRT) when compiling a graph with an erf."""
    if _has_erf(gm):
        os.abort()
    return gm.forward


def segfault_on_erf(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    if _has_erf(gm):
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    return gm.forward


def hang_on_erf(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    if _has_erf(gm):
        time.sleep(3600)
    return gm.forward


def slow_erf_compile_error(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """Like erf_compile_error but each compile takes a while (so a run can be killed midway)."""
    time.sleep(0.3)
    return erf_compile_error(gm, example_inputs)


# ---------------------------------------------------------------- graphs

def mlp_graph(layers: int = 2, width: int = 8, batch: int = 4, backward: bool = False, seed: int = 0):
    """An aten graph of an MLP with an explicit erf-GELU per layer; ``backward`` adds the gradients."""
    gen = torch.Generator().manual_seed(seed)
    ws = [torch.randn(width, width, generator=gen) / width ** 0.5 for _ in range(layers)]
    x = torch.randn(batch, width, generator=gen)

    def fwd(x, *ws):
        h = x
        for w in ws:
            h = h @ w
            h = h * 0.5 * (1.0 + torch.erf(h * 0.7071067811865476))
            h = torch.nn.functional.layer_norm(h, (width,))
        return h

    if not backward:
        return make_fx(fwd)(x, *ws), [x, *ws]

    def fwd_bwd(x, *ws):
        ws = [w.detach().requires_grad_(True) for w in ws]
        out = fwd(x, *ws)
        grads = torch.autograd.grad(out.pow(2).sum(), ws)
        return (out.detach(), *grads)

    return make_fx(fwd_bwd)(x, *ws), [x, *ws]


def compute_nodes(gm: fx.GraphModule) -> List[fx.Node]:
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def wrong_erf_add_pair(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """Wrong where an erf feeds an add and the erf itself is not a graph output (so it is "fused" away):
    a fusion-dependent bug that disappears when every intermediate is returned."""
    g = fx.Graph()
    env = {}
    for n in gm.graph.nodes:
        new = g.node_copy(n, lambda a: env[a])
        if n.op == "call_function" and n.target is torch.ops.aten.add.Tensor and any(
                a.op == "call_function" and a.target in ERF_TARGETS and all(u.op != "output" for u in a.users)
                for a in n.all_input_nodes):
            new.target = _add_plus_eps
        env[n] = new
    return fx.GraphModule(gm, g).forward


def _add_plus_eps(a, b, **kw):
    return torch.ops.aten.add.Tensor(a, b, **kw) + 0.05
