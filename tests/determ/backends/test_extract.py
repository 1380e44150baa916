"""determ_backend.backends.extract: the walk behind a node and the cut of a few nodes as a graph of their own."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from determ_backend.backends.eager import eager_node_values
from determ_backend.backends.extract import MissingValue, Step, extract, walk_back

aten = torch.ops.aten


def _op(g: fx.Graph, target, args, name: str) -> fx.Node:
    n = g.call_function(target, args)
    n.name = name
    return n


def _graph() -> fx.GraphModule:
    """x, w -> mm -> relu -> add(relu, mm) -> mul(add, size) -> out"""
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    mm = _op(g, aten.mm.default, (x, w), "mm")
    relu = _op(g, aten.relu.default, (mm,), "relu")
    add = _op(g, aten.add.Tensor, (relu, mm), "add")
    size = _op(g, aten.sym_size.int, (x, 0), "size")
    mul = _op(g, aten.mul.Tensor, (add, size), "mul")
    g.output((mul,))
    return fx.GraphModule(torch.nn.Module(), g)


def _nodes(gm, *names):
    by = {n.name: n for n in gm.graph.nodes}
    return [by[n] for n in names]


def test_the_walk_joins_passes_and_stops_as_told_in_graph_order():
    gm = _graph()
    (mul,) = _nodes(gm, "mul")

    def step(a):
        if a.op != "call_function" or a.name == "mm":
            return Step.STOP
        return Step.PASS if a.name == "size" else Step.JOIN

    assert [n.name for n in walk_back(mul, step)] == ["relu", "add", "mul"]
    assert walk_back(mul, step, limit=2) is None


def test_the_cut_feeds_what_it_reads_from_outside_and_returns_what_is_asked():
    gm = _graph()
    x, w = torch.randn(3, 4), torch.randn(4, 5)
    vals = eager_node_values(gm, [x, w])
    nodes = _nodes(gm, "relu", "add", "mul")
    mod, inputs = extract(gm, nodes, ["add", "mul"], vals)
    assert [n.name for n in mod.graph.nodes if n.op == "placeholder"] == ["mm", "size"]
    assert inputs[1] == 3
    add, mul = mod(*inputs)
    assert torch.equal(add, vals["add"]) and torch.equal(mul, vals["mul"])
    mod, inputs = extract(gm, nodes, ["mul"], vals, inline_scalars=True)
    assert [n.name for n in mod.graph.nodes if n.op == "placeholder"] == ["mm"]
    assert torch.equal(mod(*inputs)[0], vals["mul"])


def test_identical_inputs_can_share_a_placeholder_and_a_missing_value_is_named():
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    s = _op(g, aten.add.Tensor, (a, b), "add")
    g.output((s,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    t = torch.ones(2)
    mod, inputs = extract(gm, _nodes(gm, "add"), ["add"], {"a": t, "b": t.clone()},
                          merge_key=lambda v: tuple(v.tolist()))
    assert len(inputs) == 1 and torch.equal(mod(*inputs)[0], 2 * t)
    with pytest.raises(MissingValue) as e:
        extract(gm, _nodes(gm, "add"), ["add"], {"a": t})
    assert e.value.node == "b"
    with pytest.raises(MissingValue):
        extract(gm, _nodes(gm, "add"), ["add"], {"a": t, "b": (t,)}, inline_scalars=True)
