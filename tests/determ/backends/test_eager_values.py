"""determ_backend.backends.eager: the one eager interpreter (every node's value, substitution, replay, a few nodes alone)."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from determ_backend import devices
from determ_backend.backends.eager import EagerInterpreter, eager_node_values, replay, run_eager

aten = torch.ops.aten


def _op(g: fx.Graph, target, args, name: str, kwargs=None) -> fx.Node:
    n = g.call_function(target, args, kwargs or {})
    n.name = name
    return n


def _graph() -> fx.GraphModule:
    """x -> mul -> var_mean (a tuple) -> mean; mul -> dropout -> d0; add(d0, mean) -> sum; and a size."""
    g = fx.Graph()
    x = g.placeholder("x")
    mul = _op(g, aten.mul.Tensor, (x, 2.0), "mul")
    vm = _op(g, aten.var_mean.correction, (mul, [1]), "var_mean", {"keepdim": True})
    mean = _op(g, operator.getitem, (vm, 1), "mean")
    drop = _op(g, aten.native_dropout.default, (mul, 0.5, True), "dropout")
    d0 = _op(g, operator.getitem, (drop, 0), "d0")
    size = _op(g, aten.sym_size.int, (x, 0), "size")
    add = _op(g, aten.add.Tensor, (d0, mean), "add")
    s = _op(g, aten.sum.default, (add,), "sum")
    g.output((add, s, size))
    return fx.GraphModule(torch.nn.Module(), g)


def test_every_node_is_recorded_with_the_output_leaves():
    gm = _graph()
    x = torch.randn(3, 4)
    torch.manual_seed(0)
    vals = eager_node_values(gm, [x])
    assert torch.equal(vals["x"], x) and torch.equal(vals["mul"], x * 2)
    assert isinstance(vals["var_mean"], tuple) and vals["size"] == 3
    assert torch.equal(vals["output.0"], vals["add"]) and torch.equal(vals["output.1"], vals["sum"])
    torch.manual_seed(0)
    assert torch.equal(run_eager(gm, [x])[0], vals["add"])


def test_a_replay_draws_the_same_random_numbers_and_only_the_substitution_differs():
    gm = _graph()
    x = torch.randn(3, 4)
    state = devices.get_rng_state()
    before = torch.get_rng_state()
    a = replay(gm, [x], state)
    b = replay(gm, [x], state)
    assert torch.equal(a["add"], b["add"]) and torch.equal(torch.get_rng_state(), before)
    c = replay(gm, [x], state, inject={"mean": torch.zeros(3, 1)})
    assert torch.equal(c["d0"], a["d0"])  # the dropout mask: the same numbers
    assert torch.equal(c["add"], a["d0"]) and not torch.equal(c["add"], a["add"])


def test_a_view_that_assumes_another_layout_is_run_as_a_reshape():
    g = fx.Graph()
    x = g.placeholder("x")
    g.output((g.call_function(aten.view.default, (x, [12])),))
    gm = fx.GraphModule(torch.nn.Module(), g)
    xt = torch.randn(4, 3).t()  # not viewable as [12]
    assert torch.equal(run_eager(gm, [xt])[0], xt.reshape(12))


def test_a_few_nodes_alone_on_recorded_values_in_fp64_too():
    gm = _graph()
    x = torch.randn(3, 4)
    torch.manual_seed(0)
    vals = eager_node_values(gm, [x])
    by = {n.name: n for n in gm.graph.nodes}
    interp = EagerInterpreter(gm, garbage_collect_values=False)
    got = interp.run_nodes([by["add"], by["sum"]], vals)
    assert torch.equal(got, vals["sum"])
    got64 = interp.run_nodes([by["add"]], vals, to64=True)
    assert got64.dtype == torch.float64 and torch.allclose(got64.float(), vals["add"])


def test_nodes_run_alone_in_fp64_never_write_into_the_values_they_were_given():
    g = fx.Graph()
    x = g.placeholder("x")
    mul = _op(g, aten.mul.Tensor, (x, 2.0), "mul")
    bump = _op(g, aten.add_.Tensor, (mul, 1.0), "bump")  # in place, on its input
    g.output((bump,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    vals = eager_node_values(gm, [torch.randn(5, dtype=torch.float64)])
    before = vals["mul"].clone()
    by = {n.name: n for n in gm.graph.nodes}
    EagerInterpreter(gm).run_nodes([by["bump"]], vals, to64=True)
    assert torch.equal(vals["mul"], before)


def test_an_item_assignment_and_a_foreach_write_hold_what_they_wrote_and_take_substitutes_there():
    """``y[:, :2] = v`` and ``torch._foreach_mul_([y, z], 2)`` return None: their values are the tensors they wrote
    (``setitem``, ``foreach.0``/``foreach.1``), and a substituted value is written there, so later readers see it."""
    g = fx.Graph()
    x = g.placeholder("x")
    y = _op(g, operator.mul, (x, 2.0), "y")
    z = _op(g, operator.add, (x, 1.0), "z")
    _op(g, operator.setitem, (y, (slice(None), slice(None, 2)), 0.5), "setitem")
    _op(g, torch._foreach_mul_, ([y, z], 2.0), "foreach")
    s = _op(g, operator.add, (y, z), "s")
    g.output((s,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    x = torch.randn(3, 4)
    vals = eager_node_values(gm, [x])
    y_set = x * 2
    y_set[:, :2] = 0.5
    assert torch.equal(vals["setitem"], y_set)
    assert torch.equal(vals["foreach.0"], y_set * 2) and torch.equal(vals["foreach.1"], (x + 1) * 2)
    assert torch.equal(vals["s"], y_set * 2 + (x + 1) * 2)
    sub = replay(gm, [x], devices.get_rng_state(), inject={"foreach.1": torch.zeros(3, 4), "setitem": torch.ones(3, 4)})
    assert torch.equal(sub["foreach.0"], torch.full((3, 4), 2.0)) and torch.equal(sub["s"], torch.full((3, 4), 2.0))
