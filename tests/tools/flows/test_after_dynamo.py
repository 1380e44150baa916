"""After-dynamo repro flows (wrap_backend, REPRO_LEVEL 1-4) on PyTorch's own *_TESTING_ONLY backends."""

from __future__ import annotations

import pytest
import json

import torch

import determ_backend
from repro_tools.report import build as build_report
from determ_backend.errors import AccuracyError
from repro_tools.flows.failure import GraphDump
from repro_tools.repro.script import read_meta

import repro_helpers
from repro_helpers import (assert_reproduces, compile_and_fail, forward_source, last_stderr_line, model, model_inputs,
                           repro_config, run_code, run_script, run_without_determ)

ERRORS = [("compile_error", "relu_compile_error_TESTING_ONLY"), ("runtime_error", "relu_runtime_error_TESTING_ONLY")]


def _graph_dir(tmp_path, n=0):
    return tmp_path / "out" / "r" / "repro" / f"dynamo-{n}"


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("kind, backend", ERRORS)
def test_level1_writes_a_repro_and_reraises(tmp_path, capsys, kind, backend):
    err = compile_and_fail(determ_backend.wrap_backend(backend, repro_config(tmp_path, 1)))
    assert "Relu" in str(err)
    assert last_stderr_line(capsys.readouterr().err) == str(tmp_path / "repro.py")
    assert (_graph_dir(tmp_path) / "repro.py").is_file()
    assert read_meta(tmp_path / "repro.py")["kind"] == kind
    assert_reproduces(tmp_path / "repro.py", kind, "torch.relu(")


@pytest.mark.slow
@pytest.mark.parametrize("kind, backend", ERRORS[1:])
def test_level2_writes_a_launcher_that_minifies(tmp_path, capsys, kind, backend):
    compile_and_fail(determ_backend.wrap_backend(backend, repro_config(tmp_path, 2)))
    launcher = _graph_dir(tmp_path) / "minifier_launcher.py"
    assert last_stderr_line(capsys.readouterr().err) == str(launcher)
    assert not (tmp_path / "repro.py").exists()
    proc = run_script(launcher, cwd=tmp_path)
    assert proc.returncode == 1 and last_stderr_line(proc.stderr) == str(tmp_path / "repro.py"), proc.stderr[-3000:]
    assert (_graph_dir(tmp_path) / "minify-0" / "minimal" / "repro.py").is_file()
    assert_reproduces(tmp_path / "repro.py", kind, "torch.relu(")
    assert " @ " not in forward_source(tmp_path / "repro.py")  # minimal: the relu alone


@pytest.mark.slow
@pytest.mark.parametrize("kind, backend", ERRORS[:1])
def test_level3_launcher_first_then_isolated_minify(tmp_path, capfd, kind, backend):
    compile_and_fail(determ_backend.wrap_backend(backend, repro_config(tmp_path, 3)))
    assert (_graph_dir(tmp_path) / "minifier_launcher.py").is_file()
    assert last_stderr_line(capfd.readouterr().err) == str(tmp_path / "repro.py")
    assert_reproduces(tmp_path / "repro.py", kind, "torch.relu(")


_CRASH = """
import torch
from determ_backend import wrap_backend
from repro_helpers import model, model_inputs, relu_abort_backend, repro_config
from pathlib import Path
torch.compile(model, backend=wrap_backend(relu_abort_backend, repro_config(Path('.'), 3)))(*model_inputs())
"""


@pytest.mark.slow
def test_level3_leaves_a_launcher_when_the_compiler_kills_the_process(tmp_path):
    proc = run_code(_CRASH, tmp_path)
    assert proc.returncode < 0, proc.stderr[-2000:]  # SIGABRT: nothing after the crash ran
    launcher = _graph_dir(tmp_path) / "minifier_launcher.py"
    assert launcher.is_file() and not (tmp_path / "repro.py").exists()
    minify = run_script(launcher, cwd=tmp_path)
    assert minify.returncode == 1, minify.stderr[-3000:]
    proc = assert_reproduces(tmp_path / "repro.py", "crash", "torch.relu(")
    assert "SIGABRT" in proc.stdout


@pytest.mark.slow
def test_level4_accuracy_failure_is_dumped_minified_and_raised(tmp_path, capsys):
    err = compile_and_fail(determ_backend.wrap_backend("relu_accuracy_error_TESTING_ONLY", repro_config(tmp_path, 4)),
                           model_inputs(requires_grad=True))
    assert isinstance(err.__cause__ or err, AccuracyError) or "AccuracyError" in str(err)
    stderr = capsys.readouterr().err
    assert last_stderr_line(stderr) == str(tmp_path / "repro.py")
    assert (_graph_dir(tmp_path) / "minifier_launcher.py").is_file()
    # the backend rewrites the graph it is handed: the minifier's oracle must still see eager's relu
    assert "NOT minified" not in stderr and (_graph_dir(tmp_path) / "minify-0" / "minimal" / "repro.py").is_file()
    assert_reproduces(tmp_path / "repro.py", "accuracy", "torch.relu(")
    assert " @ " not in forward_source(tmp_path / "repro.py")  # minimal: the relu alone


def test_level4_without_minify_leaves_the_launcher(tmp_path, capsys):
    cfg = repro_config(tmp_path, 4, minify=False)
    err = compile_and_fail(determ_backend.wrap_backend("relu_accuracy_error_TESTING_ONLY", cfg))
    assert "less accurate than eager" in str(err)
    launcher = _graph_dir(tmp_path) / "minifier_launcher.py"
    assert last_stderr_line(capsys.readouterr().err) == str(launcher) and not (tmp_path / "repro.py").exists()
    meta = read_meta(launcher)
    assert meta["kind"] == "accuracy" and meta["launcher"] is True and "AccuracyError" not in meta.get("error", "")


def test_level4_accuracy_error_reaches_the_caller_unwrapped_once_dumped(tmp_path, capsys):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=determ_backend.wrap_backend("relu_accuracy_error_TESTING_ONLY",
                                                                         repro_config(tmp_path, 4, minify=False)))
    for _ in range(2):  # the graph stays compiled and keeps failing; it is dumped once
        with pytest.raises(AccuracyError, match="less accurate than eager"):
            compiled(*model_inputs())
    assert sorted(p.name for p in (tmp_path / "out" / "r" / "repro").iterdir()) == ["dynamo-0"]
    report = json.loads((tmp_path / "out" / "r" / "report.json").read_text())
    assert report["divergent"] and report["findings"][0]["detail"]
    assert report["findings"][0]["repro"].endswith("dynamo-0")


def test_level4_passes_a_correct_backend_unchanged(tmp_path):
    torch._dynamo.reset()
    x, w = model_inputs(requires_grad=True)
    out = torch.compile(model, backend=determ_backend.wrap_backend("eager", repro_config(tmp_path, 4)))(x, w)
    assert torch.equal(out, model(x, w))
    assert not (tmp_path / "out" / "r" / "repro").exists()


@pytest.mark.parametrize("backend", ["eager", "relu_accuracy_error_TESTING_ONLY"])
def test_level4_does_not_judge_a_graph_that_draws_random_numbers(tmp_path, caplog, backend):
    """Eager and compiled draws differ, so values say nothing about the compiler: neither a divergence (the
    correct backend) nor a pass (the broken one).  It says so instead, and the program goes on."""
    from repro_helpers import dropout_model

    torch._dynamo.reset()
    x, w = model_inputs(requires_grad=True)
    torch.compile(dropout_model, backend=determ_backend.wrap_backend(backend, repro_config(tmp_path, 4)))(x, w)
    assert any("not checked" in r.getMessage() and "REPRO_AFTER=aot" in r.getMessage() for r in caplog.records
               if r.levelname == "WARNING")
    report = json.loads((tmp_path / "out" / "r" / "report.json").read_text())
    assert not report["divergent"] and report["checker_errors"] == []
    assert "draws random numbers" in report["notes"][0]["skipped"]
    assert "starting at " + repro_helpers.__file__ in report["notes"][0]["skipped"]  # which graph
    assert not (tmp_path / "out" / "r" / "repro").exists()
    # nothing was checked, so neither report.json nor its page may say the run is clean
    assert report["checks"] == []
    rep = build_report([str(tmp_path / "out" / "r")])
    assert rep.verdict.startswith("nothing checked"), rep.verdict


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_level4_leaves_a_compiled_optimizer_step_as_the_program_would(tmp_path, backend):
    """Dynamo hands a compiled optimizer step its parameters and state as the graph's attributes, updated in
    place.  The check's run of the compiled graph updated them once more: after two AdamW steps the step count
    was 3 and every parameter had moved further than the program asked."""
    from repro_helpers import same_training, train_with_compiled_optimizer

    want = train_with_compiled_optimizer(backend)
    got = train_with_compiled_optimizer(determ_backend.wrap_backend(backend, repro_config(tmp_path, 4)))
    assert [s["step"].item() for s in got[1]] == [2.0] * 4
    assert same_training(got, want)
    report = tmp_path / "out" / "r" / "report.json"  # written when the run has something to say
    assert not report.exists() or json.loads(report.read_text())["checker_errors"] == []
    assert not (tmp_path / "out" / "r" / "repro").exists()


def test_level4_judges_a_graph_by_what_it_writes_not_only_what_it_returns(tmp_path):
    """A compiled optimizer step returns nothing, and a function may update its input in place: the check
    compared outputs and gradients only, so an update 1% off passed.  What a graph writes -- an input, a
    tensor attribute -- is now compared like an output; the correct compilers still pass."""
    from repro_helpers import input_update_too_large, overshooting_optimizer, train_with_compiled_optimizer

    with pytest.raises(AccuracyError, match="attribute .* as the graph left it"):
        train_with_compiled_optimizer(determ_backend.wrap_backend(
            overshooting_optimizer, repro_config(tmp_path / "opt", 4, minify=False)))
    # the step was compiled without grad (dynamo guards on it): its repro runs it so (with grad, the in-place
    # update of a parameter raised "a leaf Variable that requires grad is being used in an in-place operation")
    launcher = next((tmp_path / "opt").rglob("minifier_launcher.py"))
    assert read_meta(launcher)["only_fwd"] is True
    # and run standalone it reproduces the same verdict, from the state the program's call found
    proc = assert_reproduces(launcher, "accuracy", "lerp_", "run")
    assert "as the graph left it" in proc.stdout and "nan" not in proc.stdout, proc.stdout

    def scale(x, y):
        x.mul_(2)
        return y.sum()

    for backend, fails in ((input_update_too_large, True), ("eager", False), ("aot_eager", False)):
        torch._dynamo.reset()
        x, y = torch.randn(6), torch.randn(6)
        want = x * 2
        f = torch.compile(scale, backend=determ_backend.wrap_backend(backend, repro_config(tmp_path / str(fails), 4,
                                                                                         minify=False)))
        if fails:
            with pytest.raises(AccuracyError, match="input 0 as the graph left it"):
                f(x, y)
        else:
            f(x, y)
            assert torch.equal(x, want)


def test_dumps_are_never_overwritten(tmp_path):
    backend = determ_backend.wrap_backend("relu_compile_error_TESTING_ONLY", repro_config(tmp_path, 1))
    compile_and_fail(backend)
    compile_and_fail(backend)
    assert (_graph_dir(tmp_path, 0) / "repro.py").is_file() and (_graph_dir(tmp_path, 1) / "repro.py").is_file()


def test_config_is_captured_at_compile_time_not_at_dump_time(tmp_path):
    import torch._inductor.config as icfg

    gm = torch.fx.symbolic_trace(lambda x: (torch.relu(x),))
    with icfg.patch({"fallback_random": True}):
        dump = GraphDump(repro_config(tmp_path, 1), "dynamo", "eager", gm)
    path = dump.write("repro.py", [torch.randn(3)], "runtime_error")
    assert read_meta(path)["config"]["fallback_random"] is True


@pytest.mark.slow
def test_level4_catches_a_real_inductor_accuracy_bug_behind_plain_inductor(tmp_path, capsys):
    """PyTorch's own after-dynamo level 4 lets this one pass (its checker error is swallowed)."""
    import torch._inductor.config as icfg

    cfg = repro_config(tmp_path, 4, minify=False)
    with icfg.patch({"cpp.inject_relu_bug_TESTING_ONLY": "accuracy", "force_disable_caches": True}):
        err = compile_and_fail(determ_backend.wrap_backend("inductor", cfg))
    assert "less accurate than eager" in str(err)
    launcher = _graph_dir(tmp_path) / "minifier_launcher.py"
    assert last_stderr_line(capsys.readouterr().err) == str(launcher)
    assert read_meta(launcher)["config"]["cpp.inject_relu_bug_TESTING_ONLY"] == "accuracy"
    assert_reproduces(launcher, "accuracy", "torch.relu(", "run")


_DETERM_LEVEL4 = '''
import sys, torch
torch.set_num_threads(1)
torch._inductor.config.cpp.inject_relu_bug_TESTING_ONLY = "accuracy"
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
try:
    with torch.no_grad():
        torch.compile(m, backend="determ_inductor")(torch.randn(4, 16))
except Exception as e:
    print("USER ERROR:", type(e).__name__)
'''


def test_level4_around_a_determ_backend_minifies_once_not_recursively(tmp_path):
    """The minifier compiles its candidates with determ_inductor; under REPRO_AFTER=dynamo that backend wraps
    itself in the flow, which dumped and minified each candidate again until Python's recursion limit."""
    import os
    import subprocess
    import sys

    script = tmp_path / "user.py"
    script.write_text(_DETERM_LEVEL4)
    env = dict(os.environ, REPRO_AFTER="dynamo", REPRO_LEVEL="4", DETERM_DIR=str(tmp_path / "out"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert "USER ERROR: AccuracyError" in r.stdout, r.stderr[-2000:]
    assert len(list((tmp_path / "out").glob("*/repro/dynamo-*"))) == 1
    report = json.loads(next((tmp_path / "out").glob("*/report.json")).read_text())
    assert report["checker_errors"] == [] and report["first_divergence"]["op"] == "torch.nn.functional.relu"


_DETERM_LEVEL1 = '''
import torch
torch.set_num_threads(1)
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
try:
    torch.compile(m, backend="determ_inductor", options={"cpp.inject_relu_bug_TESTING_ONLY": "compile_error"})(
        torch.randn(3, 8))
except Exception as e:
    print("USER ERROR:", type(e).__name__)
'''

@pytest.mark.slow
def test_a_determ_backends_repro_after_dynamo_runs_with_torch_alone(tmp_path):
    """The repro of a determ backend's graph names the backend it wraps (it had named determ_inductor: without
    determ the repro could not start, and with it every run of the repro made a determ run in the current
    directory), and holds the inductor config given through ``torch.compile(options=)``."""
    import os
    import shutil
    import subprocess
    import sys

    (tmp_path / "user.py").write_text(_DETERM_LEVEL1)
    env = dict(os.environ, REPRO_AFTER="dynamo", REPRO_LEVEL="1", DETERM_DIR=str(tmp_path / "out"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "user.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert "USER ERROR:" in r.stdout, r.stderr[-2000:]
    meta = read_meta(tmp_path / "repro.py")
    assert meta["compiler"] == "inductor" and meta["config"]["cpp.inject_relu_bug_TESTING_ONLY"] == "compile_error"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(tmp_path / "repro.py", elsewhere / "repro.py")
    if (tmp_path / "repro_store").is_dir():
        shutil.copytree(tmp_path / "repro_store", elsewhere / "repro_store")
    alone = run_without_determ(elsewhere / "repro.py", "run")
    assert "reproduced compile_error" in alone.stdout and "exit run 1" in alone.stdout, (alone.stdout,
                                                                                      alone.stderr[-2000:])
    proc = run_script(elsewhere / "repro.py")  # determ importable: it must not run determ's backend
    assert proc.returncode == 1 and "reproduced compile_error" in proc.stdout, (proc.stdout, proc.stderr[-2000:])
    assert sorted(p.name for p in elsewhere.iterdir()) == ["repro.py"] + (
        ["repro_store"] if (tmp_path / "repro_store").is_dir() else [])


def test_flows_are_suspended_while_determ_compiles_a_candidate(monkeypatch):
    from determ_backend.config import flows_suspended, load_config

    monkeypatch.setenv("REPRO_AFTER", "dynamo")
    monkeypatch.setenv("REPRO_LEVEL", "4")
    assert load_config().repro_after == "dynamo"
    with flows_suspended():
        assert load_config().repro_after is None and load_config({"repro_after": "aot"}).repro_after is None
    assert load_config().repro_level == 4


def test_level4_checks_a_training_graph_at_its_first_call_and_the_step_runs(tmp_path, monkeypatch):
    """The check runs the compiled graph's backward, which AOT compiles on first use: inside dynamo's compile
    torch raised "Metric(s) {'is_forward'} have already been set" and a healthy training step failed."""
    from determ_backend.backends import run as run_mod

    for var, value in (("REPRO_AFTER", "dynamo"), ("REPRO_LEVEL", "4"), ("DETERM_DIR", str(tmp_path / "out"))):
        monkeypatch.setenv(var, value)
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    torch.compile(m, backend="determ_inductor")(torch.randn(4, 16)).sum().backward()
    run_mod.finish_all()
    assert all(p.grad is not None for p in m.parameters())
    report = json.loads(next((tmp_path / "out").glob("*/report.json")).read_text())
    assert report["checker_errors"] == [] and not report["divergent"]


def test_the_accuracy_check_leaves_the_random_state_as_it_found_it():
    """Run inside the user's program (level 4), the check must not move the random stream the program draws from
    next (its dropout masks changed under the flow)."""
    from repro_tools.minify.accuracy import same_two_models

    class Drop(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.dropout(x, 0.5, training=True)

    x = torch.randn(8, 8)
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    same_two_models(Drop(), Drop(), [x], only_fwd=True)
    assert torch.equal(torch.rand(4), expected)


def test_a_compile_error_is_a_finding_in_the_report(tmp_path, capsys):
    """A graph that failed to compile made a run whose report.json said divergent: false, and `repro-tools report`
    called it clean."""
    from determ_backend.backends import run as run_mod

    compile_and_fail(determ_backend.wrap_backend(ERRORS[0][1], repro_config(tmp_path, 1)))
    run_mod.finish_all()
    report = json.loads(next((tmp_path / "out").glob("*/report.json")).read_text())
    assert report["divergent"] and report["findings"][0]["check"] == "repro compile_error"
    assert "Relu" in report["findings"][0]["detail"]


@pytest.mark.slow
def test_level4_checks_a_dynamic_graph_with_the_sizes_of_its_call(tmp_path, capsys):
    """A dynamic graph's size arguments reach the backend as dynamo's SymInts; the check runs inductor's code on
    the numbers they stand for (it crashed the program: "Expected result >= 0", a buffer sized by ``s0``)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 4)
    xs = [torch.randn(b, 16) for b in (8, 5)]
    compiled = torch.compile(lin, backend=determ_backend.wrap_backend("inductor", repro_config(tmp_path, 4)),
                             dynamic=True)
    got = [compiled(x).detach() for x in xs]
    ref = [lin(x).detach() for x in xs]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ref, got))
    assert not (tmp_path / "out" / "r" / "repro").exists()  # nothing dumped: no finding
    assert "divergence" not in capsys.readouterr().err


def test_dynamos_restart_of_its_analysis_is_no_compile_error(tmp_path, capsys):
    """A LayerNorm compiled dynamic: AOT raises dynamo's TensorifyScalarRestartAnalysis through the backend, and
    dynamo traces the frame again.  It was recorded as a compile error, dumped and minified into another error."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    compiled = torch.compile(m, backend=determ_backend.wrap_backend("aot_eager", repro_config(tmp_path, 2)),
                             dynamic=True)
    for b in (8, 10):
        compiled(torch.randn(b, 16)).sum().backward()
    assert not (tmp_path / "out" / "r" / "repro").exists() and not (tmp_path / "repro.py").exists()
    assert "compile_error" not in capsys.readouterr().err


def test_level4_minifying_in_the_program_leaves_its_logging_alone(tmp_path):
    """The in-process minifier set up logging as the command line does (logging.basicConfig at INFO on the
    root logger): from then on the program's and its libraries' INFO messages reached stderr."""
    code = f"""
import logging, torch, determ_backend
from repro_helpers import compile_and_fail, repro_config
from pathlib import Path
compile_and_fail(determ_backend.wrap_backend("relu_accuracy_error_TESTING_ONLY", repro_config(Path({str(tmp_path)!r}), 4)))
root = logging.getLogger()
print("ROOT", root.level, len(root.handlers))
"""
    r = run_code(code, tmp_path)
    assert "ROOT 30 0" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    assert (tmp_path / "repro.py").is_file()  # it did minify, in this process


def test_level4_minifies_a_divergence_only_in_gradients(tmp_path, capsys):
    """A compiler whose only fault is in the backward (relu's gradient): the dynamo graph's forward outputs
    match, its gradients do not; the minifier judges gradients too, and shrinks the graph to the relu."""
    err = compile_and_fail(determ_backend.wrap_backend(repro_helpers.relu_grad_wrong, repro_config(tmp_path, 4)),
                           model_inputs(requires_grad=True))
    assert "gradient" in str(err) and "less accurate than eager" in str(err)
    stderr = capsys.readouterr().err
    assert "NOT minified" not in stderr, stderr[-3000:]
    assert last_stderr_line(stderr) == str(tmp_path / "repro.py")
    assert read_meta(tmp_path / "repro.py")["only_fwd"] is False
    assert_reproduces(tmp_path / "repro.py", "accuracy", "torch.relu(")
    assert " @ " not in forward_source(tmp_path / "repro.py")  # minimal: the relu alone


def test_a_read_only_working_directory_leaves_the_repro_under_the_run_and_says_where(tmp_path):
    """Level 1 with a working directory that cannot be written: the repro under the run directory is named (the
    summary's last line, the finding's ``repro``), and the flow is not said to have failed."""
    import os
    import shutil
    import subprocess
    import sys

    prog = tmp_path / "prog.py"
    prog.write_text(
        "import torch, determ_backend\n"
        "from repro_helpers import model, model_inputs\n"
        "try:\n"
        "    torch.compile(model, backend=determ_backend.wrap_backend('relu_compile_error_TESTING_ONLY'))(*model_inputs())\n"
        "except Exception as e:\n"
        "    print('program saw', type(e).__name__)\n")
    env = dict(os.environ, REPRO_AFTER="dynamo", REPRO_LEVEL="1", DETERM_DIR=str(tmp_path / "out"), DETERM_RUN_ID="r",
               PYTHONPATH=os.pathsep.join([str(repro_helpers.TESTS), os.environ.get("PYTHONPATH", "")]))
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
        cmd, cwd = [sys.executable, str(prog)], ro
    elif shutil.which("unshare") and subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0:
        cmd = ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o ro tmpfs {ro} && cd {ro} && exec {sys.executable} {prog}"]
        cwd = tmp_path
    else:
        pytest.skip("no way to make a read-only working directory for this user")
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert "program saw" in p.stdout, p.stderr[-3000:]
    repro = _graph_dir(tmp_path) / "repro.py"
    assert repro.is_file() and last_stderr_line(p.stderr) == str(repro), p.stderr[-3000:]
    assert "not copied to the working directory" in p.stderr and "could not run" not in p.stderr
    report = json.loads((tmp_path / "out" / "r" / "report.json").read_text())
    assert any(f.get("repro") == str(repro.parent) for f in report["findings"]), report["findings"]


def test_a_runtime_error_is_dumped_with_the_inputs_the_program_passed_not_what_the_call_wrote(tmp_path, capsys):
    """``x.mul_(2)`` runs before the relu that raises: the repro holds the ``x`` the program passed."""
    from repro_tools.repro.script import load_repro

    w = torch.randn(8, 8)

    def f(x):
        x.mul_(2)
        return torch.relu(x @ w)

    x = torch.randn(4, 8)
    before = x.clone()
    torch._dynamo.reset()
    with pytest.raises(Exception):
        torch.compile(f, backend=determ_backend.wrap_backend("relu_runtime_error_TESTING_ONLY",
                                                             repro_config(tmp_path, 1)))(x)
    assert torch.equal(x, before * 2)  # the program's x: the call wrote it before failing
    _, inputs, _ = load_repro(_graph_dir(tmp_path) / "repro.py")
    (dumped,) = [t for t in inputs if isinstance(t, torch.Tensor) and t.shape == x.shape]
    assert torch.equal(dumped, before)
