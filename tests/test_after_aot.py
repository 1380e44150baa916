"""After-AOT repro flows (wrap_compiler / aot_backend / inductor_backend, REPRO_LEVEL 1-4).

aot_eager-style compilers from repro_helpers are cheap; the inductor cases use PyTorch's
``cpp.inject_relu_bug_TESTING_ONLY`` with caches disabled (a cold compile each: few, and slow-marked).
"""

from __future__ import annotations

import pytest
import torch

import repro_helpers as rh
from determ_backend.errors import AccuracyError
from repro_tools.after_aot import aot_backend, inductor_backend
from repro_tools.repro_script import read_meta

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
    assert last_stderr_line(capsys.readouterr().err) == str(tmp_path / "repro.py")
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
from repro_tools.after_aot import aot_backend
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
