"""Each minifier pass alone, on tiny graphs, against a plain predicate."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import minifier_helpers as H
from repro_tools.minify import oracles
from repro_tools.minify import passes
from repro_tools.minify.oracles import InProcessRunner, OracleSpec
from repro_tools.minify.reducer import BudgetExhausted, PredicateRunner, Reducer
from repro_tools.minify.subgraph import Candidate, GraphView


def reduce_with(pass_list, gm, inputs, predicate, budget=500):
    view = GraphView(gm, inputs)
    r = Reducer(view, OracleSpec(kind="error", compiler="eager"), PredicateRunner(predicate), view.full(), budget=budget)
    for p in pass_list:
        p(r)
    return r


def ops(gm):
    return sorted(str(n.target) for n in H.compute_nodes(gm))


def has(*names):
    return lambda gm, inputs: all(any(name in str(n.target) for n in H.compute_nodes(gm)) for name in names)


def chain():  # x -> mul -> erf -> add -> relu -> sum
    return make_fx(lambda x: ((torch.relu(torch.erf(x * 2) + 1)).sum(0),))(torch.randn(4, 3)), [torch.randn(4, 3)]


def result_ops(r):
    gm, _ = r.view.materialize(r.current)
    return ops(gm)


@pytest.mark.parametrize("pass_list,pred,want", [
    ([passes.truncate_suffix], has("erf"), ["aten.erf.default"]),
    ([passes.remove_nodes_probdd], has("erf", "relu"), ["aten.add.Tensor", "aten.erf.default", "aten.relu.default"]),
    ([passes.remove_nodes_probdd, passes.remove_single_nodes], has("erf", "relu"),
     ["aten.add.Tensor", "aten.erf.default", "aten.relu.default"]),  # without add, erf is dead code
    ([passes.remove_single_nodes], has("relu", "sum"), ["aten.relu.default", "aten.sum.dim_IntList"]),
    ([passes.remove_single_nodes], has("mul", "sum"),  # every node in between keeps mul alive
     ["aten.add.Tensor", "aten.erf.default", "aten.mul.Tensor", "aten.relu.default", "aten.sum.dim_IntList"]),
])
def test_pass_alone(pass_list, pred, want):
    gm, inputs = chain()
    r = reduce_with(pass_list, gm, inputs, pred)
    assert result_ops(r) == want
    assert pred(*r.view.materialize(r.current))


def test_truncate_suffix_names_the_culprit_in_log_n_queries():
    gm, inputs = H.mlp_graph(layers=4)
    r = reduce_with([passes.truncate_suffix], gm, inputs, has("erf"))
    assert result_ops(r) == ["aten.erf.default"] and r.culprit == "erf"
    assert r.queries <= len(r.view.compute).bit_length() + 2


def test_prune_outputs_keeps_one_failing_output():
    gm = make_fx(lambda x: (x + 1, x * 2, torch.erf(x), x - 3))(torch.randn(5))
    r = reduce_with([passes.prune_outputs], gm, [torch.randn(5)], has("erf"))
    assert r.view.outputs_of(r.current) == ("erf",)


def test_consolidate_inputs_merges_identical_placeholders():
    a = torch.randn(5)
    gm = make_fx(lambda x, y: (torch.erf(x) + torch.erf(y),))(a, a.clone())
    r = reduce_with([passes.consolidate_inputs], gm, [a, a.clone()], lambda gm, ins: len(ins) >= 1)
    out_gm, ins = r.view.materialize(r.current)
    assert len(ins) == 1 and torch.equal(out_gm(*ins)[0], 2 * torch.erf(a))


def test_single_node_removal_result_is_1_minimal():
    gm, inputs = H.mlp_graph(layers=2)
    pred = has("erf", "native_layer_norm")
    r = reduce_with([passes.truncate_suffix, passes.remove_nodes_probdd, passes.remove_single_nodes], gm, inputs, pred)
    for name in r.current.keep:  # no single node can go
        smaller = r.view.normalize(r.view.without(r.current, {name}))
        assert smaller is None or not pred(*r.view.materialize(smaller))


def test_cache_prevents_repeated_queries():
    gm, inputs = chain()
    calls = []
    r = reduce_with([passes.truncate_suffix], gm, inputs, lambda g, i: calls.append(1) or has("erf")(g, i))
    n = len(calls)
    r.current = r.view.normalize(r.view.full())
    passes.truncate_suffix(r)  # the same candidates again: answered from the cache
    assert len(calls) == n and r.cache_hits >= n - 1


def test_budget_is_enforced():
    gm, inputs = H.mlp_graph(layers=3)
    with pytest.raises(BudgetExhausted):
        reduce_with([passes.remove_nodes_probdd], gm, inputs, has("erf"), budget=3)


# ------------------------------------------------------------------ localization from captured buffers

def _mm_and_outputs(view, name):  # what inductor materializes here: matmuls (extern) and layer norm outputs
    return view.op_name(name) == "aten.mm.default" or view.is_getitem(name)


class _CountingRunner(InProcessRunner):
    observes = 0

    def observe(self, *args):
        self.observes += 1
        return super().observe(*args)


def from_buffers(gm, inputs, observed):
    """localize_from_buffers alone, with the compiled values of the nodes ``observed(view, name)`` selects
    as the input check's capture; returns (reducer, localized, oracle calls, of which all-outputs runs)."""
    view = GraphView(gm, inputs)
    spec = OracleSpec(kind="accuracy", compiler="minifier_helpers:wrong_erf")
    every = Candidate(frozenset(view.compute), view.with_outputs(frozenset(view.compute)))
    compiled = dict(zip(view.outputs_of(every), oracles.observe(spec, *view.materialize(every))[0]))
    runner = _CountingRunner()
    r = Reducer(view, spec, runner, view.full())
    r.observed = {k: v for k, v in compiled.items() if observed(view, k)}
    return r, passes.localize_from_buffers(r), runner.calls, runner.observes


@pytest.mark.parametrize("graph, observed, calls, observes", [
    (lambda: H.mlp_graph(layers=2), lambda view, name: True, 1, 0),  # the culprit's own buffer: its cut, at once
    (lambda: H.mlp_graph(layers=2), _mm_and_outputs, 2, 1),  # fused: one compile of the region alone, then the cut
    (lambda: (make_fx(lambda x: (torch.erf((x * 2).t()).sum(0),))(torch.randn(4, 3)), [torch.randn(4, 3)]),
     lambda view, name: name != "t", 1, 0),  # fused with a view only: the arithmetic op's cut is asked directly
    (lambda: (make_fx(lambda x: (torch.nn.functional.layer_norm(torch.erf(x * 2), (3,)),))(torch.randn(4, 3)),
              [torch.randn(4, 3)]),
     lambda view, name: name != "erf", 1, 0),  # fused with one more op: the first op's cut fails, no region compile
    (lambda: (make_fx(lambda x: (torch.erf(torch.exp(x)).sum(0),))(torch.randn(4, 3)), [torch.randn(4, 3)]),
     lambda view, name: name != "exp", 2, 0),  # the second op is the culprit: two direct cuts, no region compile
], ids=["materialized", "fused", "fused_with_a_view", "fused_pair_first", "fused_pair_second"])
def test_localize_from_buffers_finds_the_culprit(graph, observed, calls, observes):
    r, localized, asked, observed_runs = from_buffers(*graph(), observed)
    assert localized and r.culprit == "erf" and result_ops(r) == ["aten.erf.default"]
    assert (asked, observed_runs) == (calls, observes)


def test_localize_from_buffers_without_a_bad_region_leaves_it_to_the_all_outputs_run():
    gm, inputs = H.mlp_graph(layers=2)
    r, localized, asked, _ = from_buffers(gm, inputs, lambda view, name: False)
    assert not localized and asked == 0 and r.culprit is None
    assert passes.localize_culprit(r) and result_ops(r) == ["aten.erf.default"]


def test_a_torch_function_is_named_as_the_user_wrote_it():
    """After dynamo the culprit ``torch.relu`` was shown as ``torch._VariableFunctionsClass.relu``."""
    import torch.fx as fx

    from repro_tools.minify.subgraph import target_name

    g = fx.Graph()
    node = g.call_function(torch.relu, (g.placeholder("x"),))
    assert target_name(node) == "torch.relu"


def test_a_graph_reading_a_scalar_back_compiles_through_dynamo():
    """``h.sum().item()`` under ``capture_scalar_outputs``: a backend given the graph outside dynamo has no shape
    environment for the read-back value (DataDependentOutputException), so the minifier refused the input graph and
    the repro script reported that error as a reproduced compile_error."""
    import torch._dynamo

    from repro_helpers import capture_graph
    from repro_tools.minify.compilers import compile_graph, reads_scalars

    def f(x):
        return torch.relu(x) * (1.0 + 0.0 * x.sum().item())

    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        gm, inputs = capture_graph(f, torch.randn(4, 8))
        assert reads_scalars(gm)
        torch.testing.assert_close(compile_graph("aot_eager", gm, inputs)(*inputs)[0], f(*inputs))


def test_a_culprit_of_torchs_own_modules_is_placed_by_its_module():
    """An nn.Sequential's relu has no user frame: the minifier's culprit read '<unknown source>' where the checks
    say '<module 1: ReLU>'."""
    from repro_helpers import capture_graph
    from repro_tools.minify.subgraph import source_line

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    gm, _ = capture_graph(model, torch.randn(2, 4))
    relu = next(n for n in gm.graph.nodes if "relu" in str(n.target))
    assert source_line(relu) == "<module 1: ReLU>"
