"""analyze: per-node root cause of a repro (determ backends), outputs-only for opaque compilers, exit codes."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.fx as fx

import eager_helpers  # noqa: F401  (registers determ_test::eager_nd_rowsum, a genuinely nondeterministic op)
from determ_backend.errors import ConfigError
from repro_tools.minify import analyze
from repro_tools.repro.script import read_meta, write_repro


def _write(tmp_path, fn, inputs, **meta):
    return write_repro(fx.symbolic_trace(fn), inputs, tmp_path / "repro.py", meta=meta)


def _run(path, **kw) -> int:
    ns = argparse.Namespace(repro=str(path), checks=kw.get("checks", "accuracy,determinism"), tol=None, out=None,
                            json=kw.get("json", False), traceback=kw.get("traceback", False))
    return analyze.run(ns)


def nd_graph(x):
    y = torch.ops.determ_test.eager_nd_rowsum.default(torch.ops.aten.mul.Tensor(x, 2.0))
    return (torch.ops.aten.relu.default(y),)


def plain_graph(x):
    return (torch.ops.aten.relu.default(torch.ops.aten.mul.Tensor(x, 2.0)),)


def test_determinism_root_cause_is_the_nondeterministic_node_with_its_repro_line(tmp_path, capsys):
    path = _write(tmp_path, nd_graph, [torch.randn(16, 64)], compiler="eager", after="aot")
    assert "eager_helpers" in read_meta(path)["imports"]
    r = analyze.analyze_repro(path, ("determinism",))
    assert r["mode"] == "per-node" and r["backend"] == "determ_aot_eager"
    (f,) = r["findings"]
    assert f["check"] == "determinism" and "eager_nd_rowsum" in f["op"]
    assert f["repro_line"].startswith("repro.py:") and "eager_nd_rowsum" in f["repro_line"]
    assert _run(path, checks="determinism") == 1
    assert "root cause" in capsys.readouterr().out


def test_clean_graph_exits_0(tmp_path, capsys):
    path = _write(tmp_path, plain_graph, [torch.randn(8, 8)], compiler="eager", after="aot")
    assert _run(path) == 0
    out = capsys.readouterr().out
    assert "accuracy: no divergence" in out and "determinism: no divergence" in out


def test_opaque_compiler_is_analysed_at_its_outputs_and_says_so(tmp_path, capsys):
    path = _write(tmp_path, plain_graph, [torch.randn(8, 8)], compiler="repro_helpers:noisy_backend")
    r = analyze.analyze_repro(path)
    assert r["mode"] == "outputs only" and "opaque" in r["note"]
    assert [f["check"] for f in r["findings"]] == ["determinism"]


@pytest.mark.parametrize("compiler, backend", [("determ_aot_eager", "determ_aot_eager"), ("determ_eager", "determ_eager")])
def test_a_repro_recorded_with_a_determ_backend_is_traced_per_node(tmp_path, compiler, backend):
    """A repro written after dynamo by ``torch.compile(backend="determ_inductor")`` records that backend: analyze
    called it opaque and gave no root-cause node."""
    path = _write(tmp_path, nd_graph, [torch.randn(16, 64)], compiler=compiler, after="dynamo")
    r = analyze.analyze_repro(path, ("determinism",))
    assert r["mode"] == "per-node" and r["backend"] == backend
    assert "eager_nd_rowsum" in r["findings"][0]["op"]


def test_bad_checks_are_a_clear_error(tmp_path):
    path = _write(tmp_path, plain_graph, [torch.randn(2)])
    with pytest.raises(ConfigError, match="expected a comma-separated subset of"):
        analyze.analyze_repro(path, ("speed",))


def test_an_out_that_is_a_file_names_the_flag(tmp_path):
    """It named DETERM_DIR, which the user never set (the trace is written through it)."""
    path = _write(tmp_path, plain_graph, [torch.randn(2)])
    (tmp_path / "afile").write_text("x")
    ns = argparse.Namespace(repro=str(path), checks="accuracy", tol=None, out=str(tmp_path / "afile"), json=False,
                            traceback=False)
    with pytest.raises(ConfigError, match=r"^--out .*afile: .*afile is a file, not a directory; expected a directory "
                                          r"\(new or existing\)$"):
        analyze.run(ns)


@pytest.mark.slow
def test_inductor_injected_accuracy_bug_is_located_at_the_relu(tmp_path):
    import torch._inductor.config as icfg

    with icfg.patch({"cpp.inject_relu_bug_TESTING_ONLY": "accuracy", "force_disable_caches": True}):
        path = _write(tmp_path, plain_graph, [torch.randn(8, 8)], compiler="inductor_inner", after="aot")
    r = analyze.analyze_repro(path, ("accuracy",))
    (f,) = r["findings"]
    assert r["backend"] == "determ_inductor" and f["node"] == "relu" and f["op"] == "aten.relu.default"
    assert f["metrics"]["max_abs"] > 0.5 and "= torch.ops.aten.relu.default(" in f["repro_line"]


def test_a_compiler_rewriting_its_graph_in_place_is_compared_with_the_untouched_graph(tmp_path):
    path = _write(tmp_path, plain_graph, [torch.randn(8, 8)], compiler="repro_helpers:relu_plus_one_in_place")
    r = analyze.analyze_repro(path, ("accuracy",))
    assert r["mode"] == "outputs only" and [f["check"] for f in r["findings"]] == ["accuracy"]
    assert "diverged" in r["findings"][0]["detail"]


@pytest.mark.parametrize("compiler, stage", [("repro_helpers:aot_relu_compile_error", "compile_error"),
                                             ("repro_helpers:aot_relu_runtime_error", "runtime_error")])
def test_a_failing_graph_is_one_summary_exit_1(tmp_path, capsys, compiler, stage):
    path = _write(tmp_path, plain_graph, [torch.randn(8, 8)], compiler=compiler, after="aot")
    assert _run(path) == 1
    cap = capsys.readouterr()
    assert f"reproduced {stage}: RuntimeError: relu" in cap.out and "raised at " in cap.out
    assert "Traceback" not in cap.out + cap.err
    assert _run(path, traceback=True) == 1
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def _dynamo_graph(fn, inputs):
    """The graph dynamo hands a backend for ``fn``: torch-level calls named after the user's variables."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch.compiler.reset()
    torch.compile(fn, backend=keep)(*inputs)
    return graphs[0]


def user_program(x):
    hidden_states = torch.ops.determ_test.eager_nd_rowsum(x * 2)
    eager_nd_rowsum = hidden_states + 1  # a variable named like the op's aten node, on another line
    return eager_nd_rowsum.relu()


def test_an_after_dynamo_repro_line_is_the_statement_calling_the_op_at_the_findings_user_line(tmp_path):
    """After dynamo the repro's statements are named after the user's variables, the finding after the aten node:
    the line was missing, or (a variable named like the node) pointed at another statement."""
    inputs = [torch.randn(16, 64)]
    path = write_repro(_dynamo_graph(user_program, inputs), inputs, tmp_path / "repro.py",
                       meta={"compiler": "determ_aot_eager", "after": "dynamo"})
    (f,) = analyze.analyze_repro(path, ("determinism",))["findings"]
    assert f["node"] == "eager_nd_rowsum" and f["source"].startswith(f"{__file__}:")
    assert f["repro_line"] is not None and "hidden_states" in f["repro_line"].split("=")[0], f["repro_line"]
    assert "eager_nd_rowsum(" in f["repro_line"]


def test_the_name_a_call_ends_with_is_an_operators_name_or_a_callables_last_part():
    import json as _json  # a loaded module whose dotted callables have three parts

    assert _json
    got = [analyze._op_base(op) for op in ("aten.relu.default", "torch.relu", "torch._C._nn.linear",
                                             "json.decoder.scanstring", "determ_test.eager_nd_rowsum.default")]
    assert got == ["relu", "relu", "linear", "scanstring", "eager_nd_rowsum"]
