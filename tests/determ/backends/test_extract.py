"""determ_backend.backends.extract: the walk behind a node and the cut of a few nodes as a graph of their own."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from determ_backend.backends.eager import eager_node_values
from determ_backend.backends.extract import MissingValue, Step, extract, lift_random_draws, walk_back

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


# ------------------------------------------------------------------ random draws as inputs

def _random_graph() -> fx.GraphModule:
    """Inductor's seeded draws (seeds -> lookup -> random) and aten's native_dropout, as after AOT."""
    import operator

    import torch._inductor.inductor_prims  # noqa: F401  (registers prims.inductor_*)

    prims = torch.ops.prims
    g = fx.Graph()
    x = g.placeholder("x")
    seeds = _op(g, prims.inductor_seeds.default, (2, torch.device("cpu")), "seeds")
    draws = [_op(g, prims.inductor_random.default,
                 ([4, 8], _op(g, prims.inductor_lookup_seed.default, (seeds, i), f"seed{i}"), "rand"), f"rand{i}")
             for i in range(2)]
    drop = _op(g, aten.native_dropout.default, (x, 0.5, True), "drop")
    out, mask = (_op(g, operator.getitem, (drop, i), n) for i, n in enumerate(("dropped", "mask")))
    kept = _op(g, aten.mul.Tensor, (x, _op(g, aten.gt.Scalar, (draws[0], 0.3), "keep")), "kept")
    g.output((_op(g, aten.add.Tensor, (_op(g, aten.add.Tensor, (kept, draws[1]), "noisy"), out), "y"), mask))
    return fx.GraphModule(torch.nn.Module(), g)


def test_random_draws_become_inputs_fed_one_eager_runs_values_and_their_seeds_go():
    gm = _random_graph()
    before = gm.code
    x = torch.randn(4, 8)
    state = torch.get_rng_state()
    lifted = lift_random_draws(gm, [x])
    assert torch.equal(torch.get_rng_state(), state)  # the caller's draws are not consumed
    assert gm.code == before  # the graph handed in is not changed
    assert [d.split()[0] for d in lifted.draws] == ["rand0", "rand1", "dropped", "mask"]  # graph order
    assert "native_dropout (aten.native_dropout.default)" not in lifted.draws
    targets = {str(n.target) for n in lifted.gm.graph.nodes if n.op == "call_function"}
    assert not any("inductor_" in t or "dropout" in t for t in targets), targets  # seeds and lookups went too
    placeholders = [n.name for n in lifted.gm.graph.nodes if n.op == "placeholder"]
    assert placeholders == ["x", "random_rand0", "random_rand1", "random_dropped", "random_mask"]
    assert lifted.inputs[0] is x and len(lifted.inputs) == 5
    # the lifted graph is deterministic and computes the original's arithmetic on the draws it was fed
    y, mask = lifted.gm(*lifted.inputs)
    rand0, rand1, dropped, mask_in = lifted.inputs[1:]
    assert torch.equal(mask, mask_in)
    assert torch.equal(y, x * (rand0 > 0.3) + rand1 + dropped)
    assert all(torch.equal(a, b) for a, b in zip(lifted.gm(*lifted.inputs), (y, mask)))
    # the dropout's values are ones it could have drawn: each kept element scaled by 1 / (1 - p)
    assert torch.equal(dropped, x * mask * 2.0)


def test_a_graph_without_draws_lifts_nothing():
    assert lift_random_draws(_graph(), [torch.randn(3, 3), torch.randn(3, 3)]) is None
