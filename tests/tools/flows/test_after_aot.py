"""After-AOT repro flows (wrap_compiler / aot_backend / inductor_backend, REPRO_LEVEL 1-4).

aot_eager-style compilers from repro_helpers are cheap; the inductor cases use PyTorch's
``cpp.inject_relu_bug_TESTING_ONLY`` with caches disabled (a cold compile each: few, and slow-marked).
"""

from __future__ import annotations

import re

import functools

import pytest
import torch

import real_models
import repro_helpers as rh
from determ_backend.errors import AccuracyError
from repro_tools.flows.after_aot import aot_backend, inductor_backend
from repro_tools.repro.script import read_meta

from repro_helpers import (assert_reproduces, compile_and_fail, forward_source, last_stderr_line, repro_config, run_code,
                           run_script)

RELU = "torch.ops.aten.relu.default("
ERRORS = [("compile_error", rh.aot_relu_compile_error), ("runtime_error", rh.aot_relu_runtime_error)]


def _graph_dir(tmp_path, n=0):
    return tmp_path / "out" / "r" / "repro" / f"aot-{n}"


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("kind, compiler", ERRORS)
def test_level1_writes_a_repro(tmp_path, capsys, kind, compiler):
    err = compile_and_fail(aot_backend(compiler, config=repro_config(tmp_path, 1)))
    assert "relu" in str(err)
    stderr = capsys.readouterr().err
    assert last_stderr_line(stderr) == str(tmp_path / "repro.py")
    assert "Command:" not in stderr  # the summary's error line is the error's first line alone
    meta = read_meta(tmp_path / "repro.py")
    assert meta["after"] == "aot" and meta["compiler"] == f"repro_helpers:{compiler.__name__}"
    assert meta["regenerated_inputs"] == (2 if kind == "compile_error" else 0)  # fake at compile time, real at run time
    assert_reproduces(tmp_path / "repro.py", kind, RELU)


@pytest.mark.slow
@pytest.mark.parametrize("level, kind, compiler", [(2, *ERRORS[0]), (3, *ERRORS[1])])
def test_levels_2_and_3_minify(tmp_path, capfd, level, kind, compiler):
    compile_and_fail(aot_backend(compiler, config=repro_config(tmp_path, level)))
    launcher = _graph_dir(tmp_path) / "minifier_launcher.py"
    assert launcher.is_file()
    if level == 2:
        assert last_stderr_line(capfd.readouterr().err) == str(launcher)
        assert run_script(launcher, cwd=tmp_path).returncode == 1
    else:
        assert last_stderr_line(capfd.readouterr().err) == str(tmp_path / "repro.py")
    assert_reproduces(tmp_path / "repro.py", kind, RELU)
    assert "aten.mm" not in forward_source(tmp_path / "repro.py")


_CRASH = """
import torch
from pathlib import Path
from repro_helpers import relu_abort_backend, model, model_inputs, repro_config
from repro_tools.flows.after_aot import aot_backend
torch.compile(model, backend=aot_backend(relu_abort_backend, config=repro_config(Path('.'), 3)))(*model_inputs())
"""


@pytest.mark.slow
def test_level3_leaves_a_launcher_when_the_compile_kills_the_process(tmp_path):
    proc = run_code(_CRASH, tmp_path)
    assert proc.returncode < 0, proc.stderr[-2000:]
    launcher = _graph_dir(tmp_path) / "minifier_launcher.py"
    assert launcher.is_file() and read_meta(launcher)["regenerated_inputs"] == 2  # written before compiling
    assert "SIGABRT" in assert_reproduces(launcher, "crash", RELU, "run").stdout


@pytest.mark.slow
def test_level4_accuracy_with_an_aot_eager_style_compiler_is_localized_to_the_relu(tmp_path, capsys):
    err = compile_and_fail(aot_backend(rh.aot_relu_accuracy_error, config=repro_config(tmp_path, 4)))
    assert isinstance(err, AccuracyError) and "forward graph" in str(err)
    assert last_stderr_line(capsys.readouterr().err) == str(tmp_path / "repro.py")
    assert_reproduces(tmp_path / "repro.py", "accuracy", RELU)
    assert "aten.mm" not in forward_source(tmp_path / "repro.py")


def test_level4_raises_on_every_call_of_a_graph_that_failed_the_check(tmp_path):
    """After dynamo a failed graph keeps raising; after AOT only its first call raised, and a program that caught it
    and went on trained on the wrong values silently from then on."""
    torch._dynamo.reset()
    f = torch.compile(rh.model, backend=aot_backend(rh.aot_relu_accuracy_error,
                                                   config=repro_config(tmp_path, 4, minify=False)))
    for _ in range(3):
        with pytest.raises(AccuracyError):
            f(*rh.model_inputs())


def _dropout_run(backend, model=rh.dropout_model):
    """One training step of ``model`` (:func:`repro_helpers.dropout_model`) compiled with ``backend``, from seed 0:
    (output, gradient, what the random stream draws next)."""
    torch._dynamo.reset()
    x, w = rh.model_inputs(requires_grad=True)
    torch.manual_seed(0)
    out = torch.compile(model, backend=backend)(x, w)
    out.sum().backward()
    return out.detach(), w.grad, torch.rand(3)


def test_level4_checks_a_dropout_graph_with_its_draws_as_inputs(tmp_path, caplog):
    """Eager and compiled code never draw the same numbers: the check read two different dropout masks and
    could call a correct compiler less accurate than eager, or a broken one accurate."""
    import logging

    caplog.set_level(logging.INFO, logger="repro_tools.flows.after_aot")
    expected = _dropout_run(aot_backend(rh.aot_as_is))
    got = _dropout_run(aot_backend(rh.aot_as_is, config=repro_config(tmp_path, 4)))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))  # the program's own draws, unchanged
    lifted = [r.getMessage() for r in caplog.records if "random draw(s) are inputs" in r.getMessage()]
    assert lifted and "native_dropout" in lifted[0]  # the forward graph was judged, with its mask as an input
    report = _report(tmp_path)
    assert not report["divergent"]
    # a clean run says what was checked: its page read "tracing only", as if nothing had been
    assert report["checks"] == ["repro accuracy (after aot)"]
    assert not (tmp_path / "out" / "r" / "repro").exists()


def test_level4_checks_a_checkpointed_dropout_graph_with_its_saved_draws_as_inputs(tmp_path, caplog):
    """Under activation checkpointing the forward draws inside run_and_save_rng_state (the generator's state is
    saved for the backward to draw again): the graph was left unchecked ("draws random numbers"), though
    REPRO_AFTER=dynamo sends such graphs here.  The saved state and the mask are inputs now."""
    import logging

    caplog.set_level(logging.INFO, logger="repro_tools.flows.after_aot")
    run = functools.partial(_dropout_run, model=rh.checkpointed_dropout_model)
    expected = run(aot_backend(rh.aot_as_is))
    got = run(aot_backend(rh.aot_as_is, config=repro_config(tmp_path, 4)))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))  # the program's own draws, unchanged
    lifted = [r.getMessage() for r in caplog.records if "random draw(s) are inputs" in r.getMessage()]
    assert lifted and "native_dropout" in lifted[0], caplog.text[-2000:]
    assert not any("not checked" in r.getMessage() for r in caplog.records)
    assert not _report(tmp_path, written=False).get("divergent")
    torch._dynamo.reset()
    x, w = rh.model_inputs(requires_grad=True)
    with pytest.raises(AccuracyError, match="forward graph"):  # and a broken compiler is caught there
        torch.compile(rh.checkpointed_dropout_model,
                      backend=aot_backend(rh.aot_relu_accuracy_error, config=repro_config(tmp_path, 4, minify=False)))(x, w)


@pytest.mark.slow
def test_level4_minifies_a_dropout_graphs_bug_to_the_relu_with_the_draws_as_inputs(tmp_path, capsys, caplog):
    torch._dynamo.reset()
    x, w = rh.model_inputs(requires_grad=True)
    with pytest.raises(AccuracyError, match="forward graph"):
        torch.compile(rh.dropout_model, backend=aot_backend(rh.aot_relu_accuracy_error,
                                                            config=repro_config(tmp_path, 4)))(x, w)
    assert last_stderr_line(capsys.readouterr().err) == str(tmp_path / "repro.py")
    launcher = read_meta(_graph_dir(tmp_path) / "minifier_launcher.py")
    assert any("native_dropout" in d for d in launcher["random_draws_as_inputs"])
    assert_reproduces(tmp_path / "repro.py", "accuracy", RELU)
    assert "dropout" not in forward_source(tmp_path / "repro.py") and "aten.mm" not in forward_source(tmp_path / "repro.py")
    line = next(r.getMessage() for r in caplog.records if "divergence:" in r.getMessage())
    assert "node=relu op=aten.relu.default" in line and "None" not in line  # a minifier's culprit has no graph/stage


def _zeros_compiler(gm, example_inputs):
    """Ignores the graph: returns zeros shaped like its outputs (boxed)."""
    outs = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    shapes = [o.meta["val"].shape for o in outs]

    def run(args):
        return [torch.zeros(s) for s in shapes]

    run._boxed_call = True
    return run


def test_level4_checker_error_is_reported_not_swallowed(tmp_path, caplog):
    import json

    def gather(x, idx):
        return (x[idx] * 2,)

    torch._dynamo.reset()
    backend = aot_backend(_zeros_compiler, config=repro_config(tmp_path, 4), compiler_name="zeros")
    out = torch.compile(gather, backend=backend)(torch.randn(4), torch.tensor([10]))  # eager would index out of range
    assert torch.equal(out[0], torch.zeros(1))
    report = json.loads((tmp_path / "out" / "r" / "report.json").read_text())
    assert len(report["checker_errors"]) == 1 and "eager/fp64 reference raised" in report["checker_errors"][0]
    assert "check could not run" in caplog.text
    assert not (tmp_path / "out" / "r" / "repro").exists()


@pytest.fixture
def inject(request):
    import torch._inductor.config as icfg

    with icfg.patch({"cpp.inject_relu_bug_TESTING_ONLY": request.param, "force_disable_caches": True}):
        yield request.param


@pytest.mark.slow
@pytest.mark.parametrize("inject", ["compile_error", "runtime_error"], indirect=True)
def test_inductor_level1_injected_errors(tmp_path, capsys, inject):
    err = compile_and_fail(inductor_backend(repro_config(tmp_path, 1)))
    assert err is not None
    assert last_stderr_line(capsys.readouterr().err) == str(tmp_path / "repro.py")
    meta = read_meta(tmp_path / "repro.py")
    assert meta["compiler"] == "inductor_inner" and meta["config"]["cpp.inject_relu_bug_TESTING_ONLY"] == inject
    assert_reproduces(tmp_path / "repro.py", inject, RELU)


@pytest.mark.slow
@pytest.mark.parametrize("inject", ["accuracy"], indirect=True)
def test_inductor_level4_injected_accuracy_bug(tmp_path, capsys, inject):
    err = compile_and_fail(inductor_backend(repro_config(tmp_path, 4, minify=False)))
    assert isinstance(err, AccuracyError)
    launcher = _graph_dir(tmp_path) / "minifier_launcher.py"
    assert last_stderr_line(capsys.readouterr().err) == str(launcher)
    assert_reproduces(launcher, "accuracy", RELU, "run")


@pytest.mark.slow
@pytest.mark.parametrize("inject", ["accuracy"], indirect=True)
def test_inductor_level4_finds_the_relu_bug_in_a_dropout_graph(tmp_path, capsys, inject):
    """Inductor draws dropout masks with its own seeded kernels (``prims.inductor_random``), never eager's: the
    check compares the graph with those draws taken as inputs, and the minifier shrinks that graph."""
    torch._dynamo.reset()
    x, w = rh.model_inputs(requires_grad=True)
    with pytest.raises(AccuracyError, match="forward graph"):
        torch.compile(rh.dropout_model, backend=inductor_backend(repro_config(tmp_path, 4)))(x, w)
    assert last_stderr_line(capsys.readouterr().err) == str(tmp_path / "repro.py")
    launcher = read_meta(_graph_dir(tmp_path) / "minifier_launcher.py")
    assert any("inductor_random" in d for d in launcher["random_draws_as_inputs"])
    assert_reproduces(tmp_path / "repro.py", "accuracy", RELU)
    assert "inductor_" not in forward_source(tmp_path / "repro.py")


@pytest.mark.slow
def test_level4_compile_error_is_minified_with_real_inputs(tmp_path, capfd):
    """At compile time AOTAutograd's fake tensor mode is active: the minifier must not run under it."""
    err = compile_and_fail(aot_backend(rh.aot_relu_compile_error, config=repro_config(tmp_path, 4)))
    assert "relu is not supported" in str(err)
    stderr = capfd.readouterr().err
    assert "Cannot access data pointer" not in stderr and "NOT minified" not in stderr
    assert last_stderr_line(stderr) == str(tmp_path / "repro.py")
    assert (_graph_dir(tmp_path) / "minify-0" / "minimal" / "repro.py").is_file()
    assert_reproduces(tmp_path / "repro.py", "compile_error", RELU)
    assert "aten.mm" not in forward_source(tmp_path / "repro.py")
    finding = _report(tmp_path)["findings"][0]  # the report says what the minifier found, not the error alone
    assert finding["check"] == "repro compile_error" and finding["repro"] == str(_graph_dir(tmp_path))
    assert finding["minified"]["nodes_after"] < finding["minified"]["nodes_before"]
    assert finding["minified"]["repro_path"].endswith("repro.py")
    assert finding["first_divergence"]["op"] == "aten.relu.default"  # the one op the minimal graph kept
    assert finding["first_divergence"]["source"].endswith(f"repro_helpers.py:{rh.model.__code__.co_firstlineno + 2}")


# ------------------------------------------------------------------ the flows never break the user's program

def _scaled(x):
    """A real tensor constant in the AOT graph (``_tensor_constant0``): AOT's fake mode cannot copy it."""
    return (x * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum(0)


def _report(tmp_path, written=True):
    """The run's report.json (``written=False``: a run that had nothing to report may have none)."""
    import json

    path = tmp_path / "out" / "r" / "report.json"
    if not written and not path.exists():
        return {"checker_errors": [], "divergent": False}
    return json.loads(path.read_text())


@pytest.mark.parametrize("level", [3, 4])
def test_a_graph_with_a_tensor_constant_compiles_under_aot_fake_mode(tmp_path, level):
    from repro_tools.repro.script import load_repro

    torch._dynamo.reset()
    x = torch.randn(3, 4)
    out = torch.compile(_scaled, backend=aot_backend(rh.aot_relu_compile_error, config=repro_config(tmp_path, level)))(x)
    assert torch.equal(out, _scaled(x))
    report = _report(tmp_path, written=False)
    assert report["checker_errors"] == [] and not report["divergent"]
    launchers = sorted((tmp_path / "out" / "r").glob("repro/*/minifier_launcher.py"))
    if level == 4:
        assert launchers == []  # healthy: nothing written
        return
    assert len(launchers) == 1  # written before compiling, the constant's values saved
    gm, inputs, _ = load_repro(launchers[0])
    assert torch.equal(gm(*inputs)[0], _scaled(inputs[0]))


@pytest.mark.parametrize("level", [1, 3])
def test_a_failure_of_the_flows_own_machinery_is_a_checker_error(tmp_path, caplog, level):
    (tmp_path / "out" / "r").mkdir(parents=True)
    (tmp_path / "out" / "r" / "repro").write_text("a file where the flows want their directory\n")
    backend = aot_backend(rh.aot_relu_compile_error, config=repro_config(tmp_path, level))
    if level == 1:  # the compile error reaches the caller as it is; the failed dump is reported
        err = compile_and_fail(backend)
        assert "relu is not supported by this compiler" in str(err)
    else:  # the launcher cannot be written before compiling: the graph compiles and runs as without the flows
        torch._dynamo.reset()
        x = torch.randn(3, 4)
        assert torch.equal(torch.compile(_scaled, backend=backend)(x), _scaled(x))
    errors = _report(tmp_path)["checker_errors"]
    assert len(errors) == 1 and errors[0].startswith("repro (after aot): ")
    assert ("dumping or minifying the failing graph" if level == 1 else "writing the minifier launcher") in errors[0]
    lines = [r.getMessage() for r in caplog.records if "check could not run" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and lines[0].startswith("determ repro")


def test_an_aot_graphs_factory_ops_keep_their_names_in_a_repro(tmp_path):
    """``iota`` takes no traced value: read back from the script, it is still a node, and every later
    node keeps its own name (they used to shift onto other ops)."""
    from repro_tools.repro.script import load_repro, write_repro

    g = torch.fx.Graph()
    x = g.placeholder("x")
    iota = g.call_function(torch.ops.prims.iota.default, (4,), {"start": 0, "step": 1, "dtype": torch.int64,
                                                                "device": torch.device("cpu"), "requires_grad": False})
    add = g.call_function(torch.ops.aten.add.Tensor, (x, iota))
    g.output((g.call_function(torch.ops.aten.relu.default, (add,)),))
    gm = torch.fx.GraphModule({}, g)
    inputs = [torch.randn(3, 4)]
    gm2, inputs2, _ = load_repro(write_repro(gm, inputs, tmp_path / "repro.py", meta={"kind": "accuracy"}))
    assert [(n.name, n.target) for n in gm2.graph.nodes] == [(n.name, n.target) for n in gm.graph.nodes]
    assert torch.equal(gm2(*inputs2)[0], gm(*inputs)[0])


def _tiny_t5():
    """T5 with a relu feed-forward, one layer each side (smaller than real_models' T5: two compiles stay quick)."""
    import transformers as T

    torch.manual_seed(0)
    cfg = T.T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=2, d_kv=16,
                     feed_forward_proj="relu", dropout_rate=0.0)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    return T.T5ForConditionalGeneration(cfg).eval(), {"input_ids": ids, "decoder_input_ids": ids[:, :4]}


def _level4(tmp_path, **options):
    return {"repro_after": "aot", "repro_level": 4, "dir": str(tmp_path / "out"), "run_id": "r", **options}


needs_transformers = pytest.mark.skipif(not real_models.available(), reason="transformers is not installed")


@pytest.mark.slow
@needs_transformers
def test_level4_on_a_healthy_real_model_eval_and_training_step(tmp_path):
    """GPT-2's AOT graphs hold real tensor constants; determ_inductor at level 4 checks them and stays quiet."""
    torch._dynamo.reset()
    model, inputs = real_models.build("gpt2", 8)
    for m in model.modules():  # the eager reference would draw other dropout masks than the compiled graph
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    compiled = torch.compile(model.eval(), backend="determ_inductor", options=_level4(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(compiled(**inputs).logits, model(**inputs).logits, rtol=1e-4, atol=1e-4)
    model.train()
    real_models.loss_of(compiled(**inputs)).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    report = _report(tmp_path)
    assert report["checker_errors"] == [] and not report["divergent"]
    assert not (tmp_path / "out" / "r" / "repro").exists() and not (tmp_path / "repro.py").exists()
    # the trace holds the program's calls alone (each graph ran once), not the check's run of each graph
    from determ_backend.trace.stream import read_trace
    calls = {(r.graph, r.stage, r.call) for r in read_trace(tmp_path / "out" / "r", allow_partial=True)}
    assert calls and {c for _, _, c in calls} == {0}, sorted(calls)


@pytest.mark.slow
@needs_transformers
def test_level4_on_a_real_model_with_inductors_relu_bug_minifies_to_the_relu(tmp_path):
    import torch._inductor.config as icfg

    torch._dynamo.reset()
    model, inputs = _tiny_t5()
    with icfg.patch({"cpp.inject_relu_bug_TESTING_ONLY": "accuracy"}), torch.no_grad():  # in the FX cache key
        with pytest.raises(AccuracyError, match="less accurate than eager"):
            torch.compile(model, backend="determ_inductor", options=_level4(tmp_path))(**inputs)
    report = _report(tmp_path)
    assert report["divergent"] and report["checker_errors"] == []
    assert (_graph_dir(tmp_path) / "minifier_launcher.py").is_file()
    assert (_graph_dir(tmp_path) / "minify-0" / "minimal" / "repro.py").is_file()
    proc = assert_reproduces(tmp_path / "repro.py", "accuracy", RELU)  # a fresh process, torch alone
    assert "reproduced accuracy" in proc.stdout
    forward = forward_source(tmp_path / "repro.py")
    assert forward.count("torch.ops.aten.") == 1 and re.search(r"\brelu(_\d+)? = torch\.ops\.aten\.relu", forward)
    assert read_meta(tmp_path / "repro.py")["culprit"].startswith("relu")  # named as in the model's graph
    # the report names what the minifier localized, and where its minimal repro is
    fd = report["first_divergence"]
    assert fd["node"].startswith("relu") and fd["op"] == "aten.relu.default" and "modeling_t5.py:" in fd["source"]
    assert report["findings"][0]["minified"]["nodes_after"] < report["findings"][0]["minified"]["nodes_before"]


@pytest.mark.slow
@needs_transformers
def test_level4_minifies_a_symbolic_shape_graph_of_a_real_model(tmp_path):
    """A dynamic-shape compile (the recompile a second sequence length brings): the AOT graph takes
    SymInt sizes; the flow catches the relu bug in it, minifies, and the repro runs in a fresh process."""
    import torch._inductor.config as icfg

    torch._dynamo.reset()
    model, inputs = _tiny_t5()
    with icfg.patch({"cpp.inject_relu_bug_TESTING_ONLY": "accuracy"}), torch.no_grad():
        with pytest.raises(AccuracyError, match="less accurate than eager"):
            torch.compile(model, backend="determ_inductor", dynamic=True, options=_level4(tmp_path))(**inputs)
    report = _report(tmp_path)
    assert report["divergent"] and report["checker_errors"] == []
    assert '"Sym(' in (_graph_dir(tmp_path) / "minifier_launcher.py").read_text()  # SymInt placeholders
    proc = assert_reproduces(tmp_path / "repro.py", "accuracy", RELU)
    assert "reproduced accuracy" in proc.stdout
    forward = forward_source(tmp_path / "repro.py")
    assert forward.count("torch.ops.aten.") <= 3, forward  # minified: the relu and what feeds it at most
    assert re.search(r"\brelu(_\d+)?(: \"[^\"]*\")? = torch\.ops\.aten\.relu", forward)
