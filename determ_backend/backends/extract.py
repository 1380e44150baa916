"""Cutting part of an FX graph out as a runnable graph of its own.

Two pieces, shared by the accuracy check's narrowing inside a fused kernel
(:mod:`determ_backend.backends.narrow`) and the minifier (its candidates and its
kernel regions, :mod:`repro_tools.minify.subgraph` and
:mod:`repro_tools.minify.passes.kernel_regions`):

* :func:`walk_back` -- the nodes behind one node, walking its producers while a
  rule says so (which nodes join, which are walked through, where to stop);
* :func:`extract` -- some nodes as a ``GraphModule`` whose inputs are the values
  (recorded elsewhere) of the nodes they read from outside, and whose outputs are
  the nodes asked for.

What is judged inside the cut, and how, is the callers' business; running it is
:mod:`determ_backend.backends.eager`'s.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.fx as fx

__all__ = ["Step", "walk_back", "extract", "MissingValue", "KEEP_META"]

KEEP_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "original_aten")
"""Node meta copied into the cut: where each node came from in the user's code."""


class Step(enum.Enum):
    """What :func:`walk_back` does at a producer."""

    JOIN = "join"
    """the producer is part of the region, and its own producers are walked"""
    PASS = "pass"
    """the producer is not part of the region, but its producers are walked"""
    STOP = "stop"
    """the producer is outside the region and the walk ends there"""


def walk_back(root: fx.Node, step: Callable[[fx.Node], Step], limit: Optional[int] = None,
              order: Optional[Mapping[str, int]] = None) -> Optional[List[fx.Node]]:
    """``root`` and the producers ``step`` joins, walking back from ``root``'s inputs, in graph order
    (``order``: node name -> position, computed from the graph when not given).  None when more than
    ``limit`` nodes join."""
    keep: Dict[str, fx.Node] = {root.name: root}
    seen = {root.name}
    stack = list(root.all_input_nodes)
    while stack:
        a = stack.pop()
        if a.name in seen:
            continue
        seen.add(a.name)
        what = step(a)
        if what is Step.STOP:
            continue
        if what is Step.JOIN:
            keep[a.name] = a
            if limit is not None and len(keep) > limit:
                return None
        stack.extend(a.all_input_nodes)
    if order is None:
        order = {n.name: i for i, n in enumerate(root.graph.nodes)}
    return sorted(keep.values(), key=lambda n: order[n.name])


class MissingValue(LookupError):
    """:func:`extract` has no value for a node the cut reads (``.node``: its name)."""

    def __init__(self, node: str):
        super().__init__(node)
        self.node = node


def extract(root: torch.nn.Module, nodes: Sequence[fx.Node], outputs: Sequence[str], values: Mapping[str, Any], *,
            inline_scalars: bool = False,
            merge_key: Optional[Callable[[Any], Optional[Hashable]]] = None) -> Tuple[fx.GraphModule, List[Any]]:
    """``(module, inputs)``: ``nodes`` (of one graph, in graph order) as a graph of their own returning the
    tuple of ``outputs`` (node names).  Each node they read from outside becomes a placeholder of the same
    name, in graph order, fed its value in ``values``; :class:`MissingValue` when there is none.

    ``inline_scalars``: a Python scalar (a symbolic size's value) is written into the graph as a constant
    and only tensors become inputs (another value is missing).  ``merge_key``: inputs whose values get
    the same key (not None) share one placeholder.  ``root`` owns what ``get_attr`` and ``call_module``
    nodes reach."""
    inside = {n.name for n in nodes}
    graph_nodes = list(nodes[0].graph.nodes) if nodes else []
    outside = {a.name: a for n in nodes for a in n.all_input_nodes if a.name not in inside}
    g = fx.Graph()
    env: Dict[str, Any] = {}
    inputs: List[Any] = []
    merged: Dict[Hashable, fx.Node] = {}
    for a in (n for n in graph_nodes if n.name in outside):
        if a.name not in values:
            raise MissingValue(a.name)
        v = values[a.name]
        if inline_scalars and not isinstance(v, torch.Tensor):
            if not isinstance(v, (bool, int, float)):
                raise MissingValue(a.name)
            env[a.name] = v
            continue
        key = merge_key(v) if merge_key is not None else None
        if key is not None and key in merged:
            env[a.name] = merged[key]
            continue
        ph = g.placeholder(a.name)
        ph.meta = {k: a.meta[k] for k in KEEP_META if k in a.meta}
        env[a.name] = ph
        inputs.append(v)
        if key is not None:
            merged[key] = ph
    for n in nodes:
        new = g.node_copy(n, lambda a: env[a.name])
        new.meta = {k: n.meta[k] for k in KEEP_META if k in n.meta}
        env[n.name] = new
    g.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(root, g), inputs
