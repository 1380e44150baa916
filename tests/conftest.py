"""Shared test fixtures: the pieces several test packages use, defined once.

- ``free_port``: a fresh free TCP port on 127.0.0.1 per call, for a ``torch.distributed`` rendezvous;
- :func:`shuffled_rowsum`: the body of the nondeterministic custom ops (row sums accumulated in a
  random column order, so float rounding differs from call to call);
- :func:`relu_as_plus_one`: the body of the faulty test compilers that compute every ``relu`` as ``x + 1``.

The helper modules next to this file (``backend_helpers``, ``eager_helpers``, ``repro_helpers``, ...) build
models, custom ops and compilers from these; compilers stay importable by ``module:name`` there, because
repro scripts and worker processes name them that way.
"""

import copy
import os
import socket
import sys

import pytest
import torch
import torch.fx as fx

sys.path.insert(0, os.path.dirname(__file__))

_RELU = (torch.relu, torch.ops.aten.relu.default)


def shuffled_rowsum(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Row sums of ``x`` (last dim kept, size 1) accumulated sequentially in a column order drawn from ``gen``."""
    perm = torch.randperm(x.shape[-1], generator=gen).tolist()
    acc = x[..., perm[0]].clone()
    for j in perm[1:]:  # float32 accumulation: the rounding depends on the order
        acc = acc + x[..., j]
    return acc.unsqueeze(-1)


def relu_as_plus_one(gm: fx.GraphModule, in_place: bool = False) -> fx.GraphModule:
    """``gm`` with every relu computed as ``x + 1``: rewritten in place, or on a copy (the graph handed in stays intact)."""
    gm = gm if in_place else copy.deepcopy(gm)
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in _RELU:
            n.target, n.args = torch.ops.aten.add.Tensor, (n.args[0], 1)
    gm.recompile()
    return gm


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def free_port():
    """:func:`find_free_port`: call it for a fresh port each time (session-wide, so module fixtures can use it)."""
    return find_free_port
