"""API dump of torch.compile'd models and functions: the determ backends' FX nodes as dump entries,
paired and judged inside the compiled regions; plain backends give marked opaque regions."""

from __future__ import annotations

import csv

import pytest
import torch
import torch.nn.functional as F

from determ_backend import _torch_compat, dump
from determ_backend.dump.capture import hooks as dump_hooks
from dump_helpers import batch, compare_two, dump_run, make_net, names, overflow_index, sequential

REGION = "Compiled_Net_0"  # named by the compiled module's class, not OptimizedModule


@pytest.fixture(autouse=True)
def _clean():
    torch._dynamo.reset()
    yield
    dump.remove_hooks()
    torch._dynamo.reset()


def _options(tmp_path, backend, **extra):
    return {"dir": str(tmp_path / "determ"), **extra} if backend.startswith("determ_") else None


def dump_compiled(tmp_path, tag, net, backend="determ_aot_eager", save_tensors=False, **switch):
    """Dump one training step of ``torch.compile(net, backend=backend)``; returns the index file."""
    opts = _options(tmp_path, backend, **({"save_tensors": True} if save_tensors else {}))
    compiled = torch.compile(net, backend=backend, options=opts)
    x, t = batch()
    return dump_run(tmp_path, tag, compiled, step=lambda n: F.cross_entropy(n(x), t).backward(), **switch)


def _root_causes(cmp):
    return [p.a["name"] for p in cmp.root_causes]


@pytest.mark.parametrize("mode", ["tensor", "statistics"])
def test_perturbed_layer_is_named_inside_the_compiled_graph(tmp_path, capsys, mode):
    stats = mode == "statistics"
    a = dump_compiled(tmp_path, "a", make_net(), save_tensors=not stats, summary_only=stats)
    b = dump_compiled(tmp_path, "b", make_net(perturb="fc1.weight"), save_tensors=not stats, summary_only=stats)
    got = names(a)
    assert got.index(f"{REGION}.aot_forward.addmm_forward") < got.index(f"{REGION}_forward")
    assert f"{REGION}.aot_backward.mm_backward" in got and f"{REGION}_backward" in got
    cmp = compare_two(b, a, tmp_path / "out")
    assert _root_causes(cmp) == [f"{REGION}.aot_forward.addmm_forward"]  # fc1's node; not the region, not relu_1
    out = capsys.readouterr().out
    assert "FX node addmm (aten.addmm.default)" in out and "dump_helpers.py:30 (forward)" in out
    rows = {r["NPU Name"]: r for r in csv.DictReader(open(cmp.csv_path))}
    conv = rows[f"{REGION}.aot_forward.convolution_forward_output"]
    assert conv["Bitwise Equal"] == "Yes"
    region = rows[f"{REGION}_forward_output"]
    assert region["Root Cause"] == "No" and "FX nodes" in region["Err_message"]
    node = dump.read_dump(a).by_name(f"{REGION}.aot_forward.addmm_forward")
    weight = next(t for t in node["inputs"] if t["node"] == "fc1.weight")
    assert weight["param"] is True and node["fx"]["stage"] == "aot_forward"
    if stats:
        assert rows[f"{REGION}.aot_forward.addmm_forward_output"]["Err_message"] == "statistics only"
    else:
        assert torch.equal(dump.read_dump(a).tensor(weight), make_net().fc1.weight.detach())
        assert float(rows[f"{REGION}.aot_forward.addmm_forward_output"]["MaxAbsErr"]) > 1e-3


def test_identical_compiled_runs_do_not_diverge(tmp_path, capsys):
    a = dump_compiled(tmp_path, "a", make_net())
    b = dump_compiled(tmp_path, "b", make_net())
    cmp = compare_two(b, a, tmp_path / "out")
    assert not cmp.divergent and all(p.a is not None and p.b is not None for p in cmp.pairs)
    assert "no divergence" in capsys.readouterr().out


def test_extra_op_inside_the_compiled_graph_does_not_break_the_pairing(tmp_path):
    a = dump_compiled(tmp_path, "a", make_net())
    b = dump_compiled(tmp_path, "b", make_net(extra=True, perturb="fc2.weight"))
    cmp = compare_two(b, a, tmp_path / "out")
    unpaired = [p for p in cmp.pairs if p.a is None or p.b is None]
    # b (the NPU side, p.a) has one more relu and its threshold_backward: unpaired, nothing else shifts
    assert sorted((p.b is None, p.a["op"]) for p in unpaired) == [
        (True, "aten.relu.default"), (True, "aten.threshold_backward.default")]
    assert _root_causes(cmp) == [f"{REGION}.aot_forward.addmm_1_forward"]


def _free_function(u, v):
    return torch.sin(u) @ v


@pytest.mark.parametrize("backend", ["determ_aot_eager", "aot_eager"])
def test_compiled_free_function_appears(tmp_path, backend):
    fn = torch.compile(_free_function, backend=backend, options=_options(tmp_path, backend))
    u = torch.randn(3, 3, requires_grad=True)
    expected = fn(u, u)
    idx = dump_run(tmp_path, "f", make_net(), step=lambda n: (fn(u, u) * 2).sum().backward())
    d = dump.read_dump(idx)
    region = d.by_name("Compiled_free_function_0_forward")
    assert torch.equal(d.tensor(region["outputs"][0]), expected)
    got = [n for n in names(idx) if not n.startswith("Compiled_free_function_0")]
    assert got == ["Tensor_mul_0_forward", "Tensor_sum_0_forward", "Tensor_sum_0_backward", "Tensor_mul_0_backward"]
    if backend.startswith("determ_"):
        assert region["nodes"] == 2 and "opaque" not in region
        assert "Compiled_free_function_0.aot_forward.sin_forward" in names(idx)
        assert "Compiled_free_function_0.aot_backward.cos_backward" in names(idx)
    else:
        assert region["opaque"] is True and "determ_aot_eager" in region["note"]
        assert d.by_name("Compiled_free_function_0_backward")["opaque"] is True
    assert not dump_hooks.passthrough() and torch.overrides._get_current_function_mode() is None


def test_plain_backend_region_is_opaque_and_the_advice_says_how_to_see_inside(tmp_path, capsys):
    a = dump_compiled(tmp_path, "a", make_net(), backend="aot_eager")
    b = dump_compiled(tmp_path, "b", make_net(perturb="fc1.weight"), backend="aot_eager")
    assert [n for n in names(a) if n.startswith("Compiled")] == [f"{REGION}_forward", f"{REGION}_backward"]
    cmp = compare_two(b, a, tmp_path / "out")
    assert _root_causes(cmp) == [f"{REGION}_forward"]
    assert "compile with determ_aot_eager / determ_inductor" in capsys.readouterr().out
    row = next(r for r in csv.DictReader(open(cmp.csv_path)) if r["NPU Name"] == f"{REGION}_forward_output")
    assert "opaque torch.compile region" in row["Err_message"]


def test_a_compiled_regions_backward_is_opaque_as_its_forward(tmp_path):
    """Calls inside backward() are recorded, but not those of a compiled graph's generated backward code
    (inductor's ``extern_kernels.mm`` is ``torch.mm``)."""
    got = names(dump_compiled(tmp_path, "a", make_net(), backend="inductor"))
    assert [n for n in got if n.startswith("Compiled")] == [f"{REGION}_forward", f"{REGION}_backward"]
    assert not [n for n in got if n.startswith(("Torch_", "Tensor_")) and not n.startswith("Tensor_flatten")]


def test_the_dump_does_not_make_dynamo_recompile(tmp_path):
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    fn = torch.compile(_free_function, backend=backend)
    u = torch.randn(3, 3)
    fn(u, u)
    dump_run(tmp_path, "f", make_net(), step=lambda n: fn(u, u))
    assert len(compiles) == 1


def test_graph_break_gives_each_graph_its_own_name(tmp_path):
    def two_graphs(u):
        h = torch.relu(u) * 2
        torch._dynamo.graph_break()
        return torch.relu(h) + 1

    fn = torch.compile(two_graphs, backend="determ_aot_eager", options=_options(tmp_path, "determ_aot_eager"))
    got = names(dump_run(tmp_path, "g", make_net(), step=lambda n: fn(torch.randn(4))))
    assert "Compiled_two_graphs_0.aot_forward.relu_forward" in got
    assert "Compiled_two_graphs_0.graph1.aot_forward.relu_forward" in got


def test_list_mode_naming_the_region_selects_its_nodes(tmp_path):
    got = names(dump_compiled(tmp_path, "l", make_net(), mode="list", scope=[f"{REGION}_forward"]))
    assert f"{REGION}_forward" in got and f"{REGION}.aot_forward.addmm_forward" in got
    assert not any(n.endswith("_backward") for n in got)


def test_overflow_inside_a_compiled_graph_names_the_node(tmp_path):
    fn = torch.compile(lambda y: torch.exp(y * 1e4).sum(), backend="determ_aot_eager",
                       options=_options(tmp_path, "determ_aot_eager"))
    dump.set_dump_path(tmp_path, dump_tag="ovf")
    dump.register_hook(make_net(), dump.overflow_check, overflow_nums=1)
    with pytest.raises(dump.DumpOverflowError, match=r"Compiled_lambda_0\.aot_forward\.exp_forward"):
        fn(batch()[0])
    d = dump.read_dump(overflow_index(tmp_path / "ovf" / "rank0"))
    assert [e["name"] for e in d.entries] == ["Compiled_lambda_0.aot_forward.exp_forward"]


def test_without_dynamos_entry_point_nodes_still_appear_and_determ_internals_do_not(tmp_path, monkeypatch):
    # a torch whose dynamo offers no entry point to observe: no free-function region, nodes stand alone
    monkeypatch.setattr(_torch_compat, "observe_compiled_calls", lambda on_enter, on_exit: None)
    fn = torch.compile(_free_function, backend="determ_aot_eager", options=_options(tmp_path, "determ_aot_eager"))
    u = torch.randn(3, 3)
    got = names(dump_run(tmp_path, "f", make_net(), step=lambda n: fn(u, u)))
    assert [n.split(".", 1)[1] for n in got if n.startswith("Compiled_")] == ["aot_forward.sin_forward",
                                                                               "aot_forward.mm_forward"]
    assert not any(n.startswith(("Torch_cat", "Tensor___xor__", "Torch_repeat_interleave")) for n in got)


def _dump_sequential(tmp_path, tag, perturb, backend="determ_aot_eager"):
    torch._dynamo.reset()
    model = torch.compile(sequential((1, 3, 1e-3) if perturb else None), backend=backend,
                          options=_options(tmp_path, backend))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    return dump_run(tmp_path, tag, model, step=lambda m: F.cross_entropy(m(x), y).backward())  # call site


def test_nodes_of_library_modules_get_the_user_line_that_called_the_model(tmp_path, capsys):
    # nn.Sequential / nn.Linear: the nodes' own lines are inside torch; the advice names the call site and layer
    a = _dump_sequential(tmp_path, "a", perturb=False)
    b = _dump_sequential(tmp_path, "b", perturb=True)
    cmp = compare_two(b, a, tmp_path / "out")
    assert _root_causes(cmp) == ["Compiled_Sequential_0.aot_forward.addmm_1_forward"]
    out = capsys.readouterr().out
    assert "parameters 2.bias, 2.weight" in out or "parameters 2.weight, 2.bias" in out
    assert "at ?" not in out and "test_dump_compiled.py:" in out
    node = dump.read_dump(a).by_name("Compiled_Sequential_0.aot_forward.addmm_1_forward")
    assert node["source"] == dump.read_dump(a).by_name("Compiled_Sequential_0_forward")["source"]


def test_graphs_of_different_determ_backends_are_compared_as_regions_with_a_hint(tmp_path, capsys):
    a = _dump_sequential(tmp_path, "a", perturb=False, backend="determ_aot_eager")
    b = _dump_sequential(tmp_path, "b", perturb=True, backend="determ_eager")
    cmp = compare_two(b, a, tmp_path / "out")
    assert _root_causes(cmp) == ["Compiled_Sequential_0_forward"]
    assert "compile both runs with the same determ backend" in capsys.readouterr().out
