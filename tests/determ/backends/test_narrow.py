"""Narrowing an accuracy root inside a fused kernel (determ_backend.backends.narrow), on hand-built aten graphs.

The compiler of the region is a faulty test compiler (relu computed as ``x + 1``, the bug PyTorch's
``cpp.inject_relu_bug_TESTING_ONLY`` plants in inductor's C++ code), so these run without inductor; the
end-to-end case on inductor is in test_backends_inductor.py.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from determ_backend.backends import narrow
from determ_backend.backends.eager import eager_node_values
from determ_backend.compare import judge, rounds_alike
from conftest import relu_as_plus_one

aten = torch.ops.aten


def _graph(with_dropout: bool = False) -> fx.GraphModule:
    """x -> mm -> mul -> relu [-> native_dropout -> getitem] -> add -> tanh -> sum, as AOT would trace it."""
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")

    def op(target, args, name):
        n = g.call_function(target, args)
        n.name = name
        return n

    mm = op(aten.mm.default, (x, w), "mm")
    mul = op(aten.mul.Tensor, (mm, 2.0), "mul")
    relu = op(aten.relu.default, (mul,), "relu")
    h = relu
    if with_dropout:
        drop = op(aten.native_dropout.default, (relu, 0.5, True), "native_dropout")
        h = op(operator.getitem, (drop, 0), "getitem")
    add = op(aten.add.Tensor, (h, 1.0), "add")
    tanh = op(aten.tanh.default, (add,), "tanh")
    s = op(aten.sum.default, (tanh,), "sum")
    g.output((tanh, s))
    return fx.GraphModule(torch.nn.Module(), g)


def _relu_plus_one(gm: fx.GraphModule, inputs):
    """A faulty compiler: every relu computes ``x + 1``."""
    return relu_as_plus_one(gm, in_place=True).forward


def _honest(gm: fx.GraphModule, inputs):
    return gm.forward


def _values(gm):
    torch.manual_seed(0)
    args = [torch.randn(3, 4), torch.randn(4, 5)]
    torch.manual_seed(1)
    ref = eager_node_values(gm, args)
    torch.manual_seed(1)
    ref64 = eager_node_values(gm, [a.double() for a in args])
    return ref, ref64


def _judge(e, a, e64):
    return judge(e, a, e64, strict=True)


def test_region_walks_back_through_unjudged_nodes_to_judged_values():
    gm = _graph()
    names = [n.name for n in narrow.region_of(gm, "tanh", judged={"mm"})]
    assert names == ["mul", "relu", "add", "tanh"]
    assert [n.name for n in narrow.region_of(gm, "tanh", judged={"relu"})] == ["add", "tanh"]
    assert narrow.region_of(gm, "tanh", judged=set(), limit=3) == []  # mm, mul, relu, add, tanh: too big


def test_random_ops_feed_the_region_their_eager_values_and_the_walk_goes_on_behind_them():
    gm = _graph(with_dropout=True)
    region = narrow.region_of(gm, "tanh", judged={"mm"})
    assert [n.name for n in region] == ["mul", "relu", "add", "tanh"]
    ref, _ = _values(gm)
    mod, inputs, outs = narrow.region_module(region, ref)
    assert [n.name for n in mod.graph.nodes if n.op == "placeholder"] == ["mm", "getitem"]
    assert outs == ["mul", "relu", "add", "tanh"]
    got = mod(*inputs)
    for name, v in zip(outs, got):
        assert torch.equal(v, ref[name])


def test_narrowing_names_the_fused_node_that_diverges_alone():
    gm = _graph(with_dropout=True)
    ref, ref64 = _values(gm)
    found = narrow.narrow_root(gm, "tanh", {"mm"}, ref, ref64, _relu_plus_one, _judge)
    assert found is not None and found.node.name == "relu"
    d = found.describe()
    assert d["op"] == "aten.relu.default" and d["region"] == ["mul", "relu", "add", "tanh"]
    assert d["shape"] == [3, 5] and d["dtype"] == "float32"


def test_a_kernel_whose_nodes_all_agree_alone_keeps_the_buffer_as_the_answer():
    gm = _graph()
    ref, ref64 = _values(gm)
    found = narrow.narrow_root(gm, "tanh", {"mm"}, ref, ref64, _honest, _judge)
    assert found is not None and found.node is None and found.describe() == {"node": None,
                                                                             "region": ["mul", "relu", "add", "tanh"]}
    assert narrow.narrow_root(gm, "mul", {"mm"}, ref, ref64, _honest, _judge) is None  # one op: nothing to narrow


def test_a_value_the_region_reads_but_nobody_captured_is_refused_in_one_line():
    gm = _graph()
    ref, _ = _values(gm)
    del ref["mm"]
    with pytest.raises(narrow.CannotNarrow, match="no captured value for mm"):
        narrow.region_module(narrow.region_of(gm, "tanh", {"mm"}), ref)


def test_the_region_compiles_on_its_own_thread_under_the_callers_config():
    import torch._inductor.config as ic

    seen = []

    def spy(gm, inputs):
        seen.append(ic.cpp.inject_relu_bug_TESTING_ONLY)
        return gm.forward

    gm = _graph()
    ref, ref64 = _values(gm)
    with ic.patch({"cpp.inject_relu_bug_TESTING_ONLY": "accuracy"}):
        narrow.narrow_root(gm, "tanh", {"mm"}, ref, ref64, spy, _judge)
    assert seen == ["accuracy"]


def _graph_with_allocation() -> fx.GraphModule:
    """x -> mm -> mul, an ``empty`` buffer that ``copy`` fills with it, relu, tanh: the buffer as allocated holds
    garbage (MoE code's ``inv_perm = torch.empty_like(perm)`` filled by ``index_put``)."""
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")

    def op(target, args, name, **kwargs):
        n = g.call_function(target, args, kwargs)
        n.name = name
        return n

    mm = op(aten.mm.default, (x, w), "mm")
    mul = op(aten.mul.Tensor, (mm, 2.0), "mul")
    buf = op(aten.empty.memory_format, ([3, 5],), "empty", dtype=torch.float32)
    filled = op(aten.copy.default, (buf, mul), "copy")
    relu = op(aten.relu.default, (filled,), "relu")
    tanh = op(aten.tanh.default, (relu,), "tanh")
    g.output((tanh,))
    return fx.GraphModule(torch.nn.Module(), g)


def _garbage_allocations(gm: fx.GraphModule, inputs):
    """An honest compiler whose allocations hold other garbage than eager's (NaN, as fresh memory may)."""
    for n in gm.graph.nodes:
        if n.target is aten.empty.memory_format:
            n.target = aten.full.default
            n.args = (n.args[0], float("nan"))
    gm.recompile()
    return gm.forward


def test_memory_as_allocated_is_never_the_node_narrowing_names():
    gm = _graph_with_allocation()
    ref, ref64 = _values(gm)
    found = narrow.narrow_root(gm, "tanh", {"mm"}, ref, ref64, _garbage_allocations, _judge)
    assert found is not None and "empty" in found.region and found.node is None


def _rms_graph() -> fx.GraphModule:
    """x -> pow -> mean -> add -> rsqrt -> mul: an RMSNorm, as AOT traces it."""
    g = fx.Graph()
    x = g.placeholder("x")

    def op(target, args, name):
        n = g.call_function(target, args)
        n.name = name
        return n

    sq = op(aten.pow.Tensor_Scalar, (x, 2), "pow")
    mean = op(aten.mean.dim, (sq, [-1], True), "mean")
    eps = op(aten.add.Tensor, (mean, 1e-6), "add")
    r = op(aten.rsqrt.default, (eps,), "rsqrt")
    out = op(aten.mul.Tensor, (x, r), "mul")
    g.output((out,))
    return fx.GraphModule(torch.nn.Module(), g)


def _mean_one_percent_high(gm: fx.GraphModule, inputs):
    """A faulty compiler: every mean comes out 1% too large (a wrong divisor)."""
    for n in list(gm.graph.nodes):
        if n.target is aten.mean.dim:
            with gm.graph.inserting_after(n):
                wrong = gm.graph.call_function(aten.mul.Tensor, (n, 1.01))
            n.replace_all_uses_with(wrong, delete_user_cb=lambda u: u is not wrong)
    gm.recompile()
    return gm.forward


def test_a_small_wrong_value_is_named_not_the_consumer_that_scales_it_past_the_tolerance():
    """The mean of LLM-scale squares (~4e-4) 1% off passes the absolute tolerance; rsqrt scales the error past it
    but computes its value correctly from the wrong mean: the mean is the culprit."""
    gm = _rms_graph()
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(0)) * 0.02
    ref, ref64 = eager_node_values(gm, [x]), eager_node_values(gm, [x.double()])
    found = narrow.narrow_root(gm, "mul", set(), ref, ref64, _mean_one_percent_high, _judge, rounds_alike)
    assert found.node.name == "mean"
    assert narrow.narrow_root(gm, "mul", set(), ref, ref64, _mean_one_percent_high, _judge).node.name == "rsqrt"

