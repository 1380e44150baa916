"""The minifier end to end: localization, fallback, kinds, rejection of a non-failing input, CLI, resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import minifier_helpers as H
from determ_backend.errors import ConfigError, OracleError, ReproError
from repro_tools.cli import main
from repro_tools.repro.graph_code import write_graph_dir
from repro_tools.minify.minifier import minify
from repro_tools.minify.oracles import OracleSpec
from paths import ROOT



def minified(gm, inputs, isolate=False, **spec):
    res = minify(gm, inputs, OracleSpec(**spec), isolate=isolate, progress=False)
    return res, [str(n.target) for n in H.compute_nodes(res.gm)]


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd_bwd"])
@pytest.mark.parametrize("kind,compiler", [("accuracy", "minifier_helpers:wrong_erf"),
                                           ("nondeterminism", "minifier_helpers:noisy_erf")])
def test_localization_finds_the_single_wrong_node_in_a_few_queries(kind, compiler, backward):
    gm, inputs = H.mlp_graph(layers=3, backward=backward)
    res, ops = minified(gm, inputs, kind=kind, compiler=compiler)
    assert ops == ["aten.erf.default"]
    s = res.summary
    assert s["localized"] and s["culprit"]["op"] == "aten.erf.default" and s["queries"] <= 4


def test_cross_device_localizes_the_cancellation():
    gm = make_fx(lambda x, w: (torch.tanh(((x @ w) + 1e8) - 1e8).sum(0),))(torch.rand(4, 4), torch.rand(4, 4))
    res, ops = minified(gm, [torch.rand(4, 4), torch.rand(4, 4)], kind="cross_device", compiler="eager",
                        devices=("cpu", "cpu:float64"))
    assert ops in (["aten.sub.Tensor"], ["aten.add.Tensor", "aten.sub.Tensor"]) and res.summary["localized"]


@pytest.mark.parametrize("kind,compiler", [("compile_error", "minifier_helpers:erf_compile_error"),
                                           ("runtime_error", "minifier_helpers:erf_runtime_error")])
def test_errors_take_the_fallback_path(kind, compiler):
    gm, inputs = H.mlp_graph(layers=3, backward=True)
    res, ops = minified(gm, inputs, kind=kind, compiler=compiler)
    assert ops == ["aten.erf.default"] and not res.summary["localized"]
    assert res.summary["queries"] <= 2 * len(H.compute_nodes(gm)).bit_length()


def test_fusion_dependent_accuracy_bug_falls_back():
    # wrong only when erf and the following add are compiled together: the all-outputs run cannot see it
    gm, inputs = H.mlp_graph(layers=2)
    res, ops = minified(gm, inputs, kind="accuracy", compiler="minifier_helpers:wrong_erf_add_pair")
    assert sorted(ops) == ["aten.add.Tensor", "aten.erf.default"] and not res.summary["localized"]


def test_input_that_does_not_fail_is_rejected_clearly():
    gm, inputs = H.mlp_graph(layers=1)
    with pytest.raises(OracleError, match=r"input graph does not fail the accuracy oracle \(.*tol=0.001\).*"
                                          r"REPRO_AFTER=aot"):
        minify(gm, inputs, OracleSpec(kind="accuracy", compiler="aot_eager"), progress=False)
    # a graph already after AOT is not told to go after AOT
    with pytest.raises(OracleError, match="tol=10") as e:
        minify(gm, inputs, OracleSpec(kind="accuracy", compiler="aot_eager", tol=10.0), progress=False,
               meta={"after": "aot"})
    assert "REPRO_AFTER" not in str(e.value)


def test_a_graph_that_returns_nothing_is_refused_clearly():
    """A graph that only updates tensors in place (a compiled optimizer step) has no output to cut candidates by:
    the minifier stopped with "'NoneType' object has no attribute 'values'"."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.call_function(torch.ops.aten.mul_.Tensor, (x, x))
    g.output(())
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    with pytest.raises(ReproError, match="returns no tensor computed in it"):
        minify(gm, [torch.randn(4)], OracleSpec(kind="accuracy", compiler="aot_eager"), progress=False)


def _write(tmp_path, kind, compiler, layers=2):
    gm, inputs = H.mlp_graph(layers=layers, backward=True)
    write_graph_dir(gm, inputs, tmp_path / "repro", {"kind": kind, "compiler": compiler})
    return tmp_path / "repro"


def test_cli_json_summary(tmp_path, capsys):
    repro = _write(tmp_path, "accuracy", "minifier_helpers:wrong_erf")
    assert main(["minify", str(repro), "--json", "--in-process", "--no-progress"]) == 1
    s = json.loads(capsys.readouterr().out)
    assert {"nodes_before", "nodes_after", "queries", "seconds", "culprit", "repro_path"} <= set(s)
    assert s["culprit"]["op"] == "aten.erf.default" and Path(s["repro_path"]).is_file()
    assert sorted(p.name for p in (repro / "minify" / "checkpoints").iterdir()) == ["001"]


def test_cli_rejects_a_non_failing_input(tmp_path, capsys):
    repro = _write(tmp_path, "accuracy", "aot_eager", layers=1)
    assert main(["minify", str(repro), "--in-process", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "input graph does not fail" in err and len(err.strip().splitlines()) == 1


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    return [sys.executable, "-m", "repro_tools.cli", "minify", *args], env


@pytest.mark.slow
def test_resume_after_the_minifier_was_killed(tmp_path):
    repro = _write(tmp_path, "compile_error", "minifier_helpers:slow_erf_compile_error", layers=3)
    out = tmp_path / "out"
    cmd, env = _cli(str(repro), "--out", str(out), "--in-process", "--no-progress", "--no-localize")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state_file, deadline = out / "minify_state.json", time.monotonic() + 120
    while time.monotonic() < deadline:
        if state_file.is_file() and json.loads(state_file.read_text())["checkpoints"] >= 1:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = json.loads(state_file.read_text())
    assert before["checkpoints"] >= 1 and not (out / "minimal").exists()
    done = subprocess.run(cmd + ["--resume", "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    s = json.loads(done.stdout)
    assert s["culprit"]["op"] == "aten.erf.default" and s["ops_after"] == 1
    assert s["queries"] > before["queries"] and "resuming" in done.stderr


@pytest.mark.slow
def test_crash_is_minified_in_the_isolated_worker(tmp_path):
    gm, inputs = H.mlp_graph(layers=1)
    res = minify(gm, inputs, OracleSpec(kind="crash", compiler="minifier_helpers:abort_on_erf", timeout=60),
                 progress=False)
    assert [str(n.target) for n in H.compute_nodes(res.gm)] == ["aten.erf.default"]
    assert "SIGABRT" in res.summary["failure"]


@pytest.mark.slow
@pytest.mark.parametrize("isolate", [False, True], ids=["in_process", "worker"])
def test_real_inductor_relu_accuracy_bug(tmp_path, monkeypatch, caplog, isolate):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor_cache"))  # the worker inherits it
    caplog.set_level("INFO", logger="repro_tools.minify.passes")
    gm = make_fx(lambda x, w: (torch.relu(x @ w).sum(1) * 2,))(torch.randn(4, 4), torch.randn(4, 4))
    res, ops = minified(gm, [torch.randn(4, 4), torch.randn(4, 4)], isolate=isolate, kind="accuracy",
                        compiler="inductor", config={"cpp.inject_relu_bug_TESTING_ONLY": "accuracy"})
    assert ops == ["aten.relu.default"] and res.summary["localized"] and res.summary["queries"] <= 3
    # localized from the input check's own buffers (relu is fused into the kernel writing the output):
    # the region alone is compiled, never the whole graph with every intermediate as an output
    assert "first region with local error ends at mul: 3 op(s)" in caplog.text


def test_cli_never_overwrites_an_earlier_run(tmp_path, capsys):
    repro = _write(tmp_path, "accuracy", "minifier_helpers:wrong_erf", layers=1)
    paths = []
    for _ in range(2):
        assert main(["minify", str(repro), "--in-process", "--no-progress", "--json"]) == 1
        paths.append(json.loads(capsys.readouterr().out)["repro_path"])
    assert [Path(p).parts[-3] for p in paths] == ["minify", "minify-2"]
    assert main(["minify", str(repro), "--in-process", "--out", str(repro / "minify")]) == 2


def test_checkpoint_and_minimal_repros_keep_the_source_flows_settings(tmp_path, capsys):
    from repro_tools.repro.script import read_meta, write_repro

    gm, inputs = H.mlp_graph(layers=2)
    flow = {"after": "aot", "only_fwd": True, "stage": "forward", "error": "AccuracyError: output 0 is off",
            "repro_level": 4, "env": {"TORCHINDUCTOR_FREEZING": "1"}, "config_other": {"dynamo": {"verbose": True}}}
    src = write_repro(gm, inputs, tmp_path / "minifier_launcher.py",
                      meta={"kind": "accuracy", "compiler": "minifier_helpers:wrong_erf", "launcher": True, **flow})
    assert main(["minify", str(src), "--in-process", "--no-progress", "--json", "--tol", "0.002"]) == 1
    minimal = Path(json.loads(capsys.readouterr().out)["repro_path"])
    want = {k: read_meta(src)[k] for k in flow}  # config_other: also what the source captured at write time
    assert want["config_other"]["dynamo"] == {"verbose": True} and want["env"] == flow["env"]
    for path in [minimal, *sorted((minimal.parents[1] / "checkpoints").glob("*/repro.py"))]:
        meta = read_meta(path)
        assert {k: meta.get(k) for k in flow} == want, path
        assert meta["kind"] == "accuracy" and meta["compiler"] == "minifier_helpers:wrong_erf" and not meta.get("launcher")
        assert meta["tol"] == 0.002 and meta["source"] == str(src)  # the oracle's settings and the source win


# ------------------------------------------------------------------ bad input, recorded settings, interruption

def _one_line_error(capsys, needle):
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    return err


def test_cli_imports_the_compiler_from_the_repros_recorded_sys_path(tmp_path, capsys, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    (home / "determ_test_recorded_comp.py").write_text(
        "from minifier_helpers import erf_compile_error as refuse_erf\n")
    gm, inputs = H.mlp_graph(layers=2)
    write_graph_dir(gm, inputs, tmp_path / "repro", {"kind": "compile_error", "sys_path": [str(home)],
                                                     "compiler": "determ_test_recorded_comp:refuse_erf"})
    monkeypatch.setattr(sys, "path", list(sys.path))  # restored afterwards
    monkeypatch.chdir(tmp_path)
    assert main(["minify", str(tmp_path / "repro"), "--in-process", "--no-progress", "--json"]) == 1
    s = json.loads(capsys.readouterr().out)
    assert "no lowering for aten.erf.default" in s["failure"] and s["culprit"]["op"] == "aten.erf.default"


@pytest.mark.parametrize("compiler, needle", [("determ_no_such_backend", "not a known backend"),
                                              ("determ_no_such_module:fn", "cannot import it")])
def test_cli_compiler_that_does_not_resolve_is_bad_input(tmp_path, capsys, compiler, needle):
    repro = _write(tmp_path, "compile_error", "minifier_helpers:erf_compile_error", layers=1)
    assert main(["minify", str(repro), "--compiler", compiler, "--kind", "error", "--no-progress"]) == 2
    assert "--compiler" in _one_line_error(capsys, needle)
    assert not (repro / "minify").exists()


def test_cli_cross_device_on_a_device_this_machine_lacks_is_bad_input(tmp_path, capsys):
    """A cross-device minification on a device that is absent: one line naming it, before any query (it was
    'input graph does not fail the cross_device oracle (candidate raised instead of running)')."""
    from determ_backend.devices import is_available

    if is_available("cuda"):
        pytest.skip("this machine has CUDA")
    repro = _write(tmp_path, "compile_error", "minifier_helpers:erf_compile_error", layers=1)
    assert main(["minify", str(repro), "--kind", "cross_device", "--devices", "cpu,cuda", "--compiler", "eager",
                 "--no-progress"]) == 2
    _one_line_error(capsys, "device 'cuda' is not available on this machine")
    assert not (repro / "minify").exists()


@pytest.mark.parametrize("argv, needle", [
    (["--timeout", "-5"], "argument --timeout: expected a positive number of seconds, got '-5'"),
    (["--timeout", "0"], "argument --timeout: expected a positive number of seconds, got '0'"),
    (["--kind", "cross_device", "--devices", "cpu,cpu:int32", "--compiler", "eager"],
     "'cpu:int32': expected a floating-point dtype"),
])
def test_cli_bad_flag_values_are_refused_before_any_query(tmp_path, capsys, argv, needle):
    """A timeout of -5 s was reported as "input graph does not fail ... (no answer within -5 s)"; an integer
    dtype minified to a view op."""
    repro = _write(tmp_path, "compile_error", "minifier_helpers:erf_compile_error", layers=1)
    assert main(["minify", str(repro), *argv, "--no-progress"]) == 2
    assert needle in capsys.readouterr().err
    assert not (repro / "minify").exists()


def test_api_compiler_that_does_not_resolve_is_never_the_failure():
    gm, inputs = H.mlp_graph(layers=1)
    with pytest.raises(ConfigError, match="determ_no_such_backend"):
        minify(gm, inputs, OracleSpec(kind="error", compiler="determ_no_such_backend"), progress=False)


def test_cli_graph_that_cannot_run_eagerly_is_bad_input(tmp_path, capsys):
    gm, inputs = H.mlp_graph(layers=1)
    write_graph_dir(gm, inputs, tmp_path / "g")
    (tmp_path / "g" / "graph.py").write_text(
        "import torch\nclass Repro(torch.nn.Module):\n    def forward(self, x, w):\n        return (undefined_fn(x),)\n")
    assert main(["minify", str(tmp_path / "g"), "--kind", "accuracy", "--compiler", "eager", "--no-progress"]) == 2
    _one_line_error(capsys, "the input graph cannot run eagerly (NameError")


def test_api_accuracy_needs_a_graph_that_runs_eagerly():
    gm, inputs = H.mlp_graph(layers=1)
    bad = [torch.randn(3, 5), *inputs[1:]]  # the matmul's shapes do not match
    with pytest.raises(ReproError, match="cannot run eagerly"):
        minify(gm, bad, OracleSpec(kind="accuracy", compiler="minifier_helpers:wrong_erf"), progress=False)


def test_cli_out_that_is_a_file_fails_before_loading(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    assert main(["minify", str(tmp_path / "no_repro_here"), "--out", str(tmp_path / "afile")]) == 2
    _one_line_error(capsys, "is a file, not a directory")


@pytest.mark.parametrize("state", ["[1]", "{}", '{"format": "determ-minify-state", "start_key": 3}'])
def test_cli_resume_from_a_malformed_state_is_one_line(tmp_path, capsys, state):
    repro = _write(tmp_path, "accuracy", "minifier_helpers:wrong_erf", layers=1)
    (tmp_path / "stc").mkdir()
    (tmp_path / "stc" / "minify_state.json").write_text(state)
    assert main(["minify", str(repro), "--out", str(tmp_path / "stc"), "--resume", "--in-process", "--no-progress"]) == 2
    _one_line_error(capsys, "minify_state.json")


def test_api_refuses_an_out_dir_holding_an_earlier_minification(tmp_path):
    gm, inputs = H.mlp_graph(layers=1)
    (tmp_path / "minify_state.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds an earlier minification"):
        minify(gm, inputs, OracleSpec(kind="accuracy", compiler="minifier_helpers:wrong_erf"), out_dir=tmp_path,
               progress=False)


@pytest.mark.parametrize("layout", ["repro.py", "minifier_launcher.py", None])
def test_cli_accepts_a_directory_holding_a_repro_script(tmp_path, capsys, layout):
    from repro_tools.repro.script import write_repro

    d = tmp_path / "d"
    d.mkdir()
    if layout is None:
        assert main(["minify", str(d), "--in-process", "--no-progress"]) == 2
        _one_line_error(capsys, "expected a repro script or a graph directory")
        return
    gm, inputs = H.mlp_graph(layers=1)
    write_repro(gm, inputs, d / layout, meta={"kind": "accuracy", "compiler": "minifier_helpers:wrong_erf"})
    assert main(["minify", str(d), "--in-process", "--no-progress", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["culprit"]["op"] == "aten.erf.default"


def test_cli_config_adds_to_the_recorded_config(tmp_path, capsys):
    from repro_tools.repro.script import read_meta

    gm, inputs = H.mlp_graph(layers=1)
    write_graph_dir(gm, inputs, tmp_path / "repro", {"kind": "accuracy", "compiler": "minifier_helpers:wrong_erf",
                                                     "config": {"fallback_random": True, "max_autotune": True}})
    assert main(["minify", str(tmp_path / "repro"), "--config", "max_autotune=false", "--in-process",
                 "--no-progress", "--json"]) == 1
    meta = read_meta(Path(json.loads(capsys.readouterr().out)["repro_path"]))
    assert meta["config"] == {"fallback_random": True, "max_autotune": False}


@pytest.mark.parametrize("item, message", [("max_autotune=notabool", "expected bool, got 'notabool'"),
                                           ("cpp.threads=many", "expected int"),
                                           ("no_such_entry=1", "not an inductor config entry")])
def test_cli_config_values_are_type_checked_in_one_line(tmp_path, capsys, item, message):
    gm, inputs = H.mlp_graph(layers=1)
    write_graph_dir(gm, inputs, tmp_path / "repro", {"kind": "accuracy", "compiler": "minifier_helpers:wrong_erf"})
    assert main(["minify", str(tmp_path / "repro"), "--config", item, "--in-process", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and f"--config {item!r}" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "repro" / "minify-0").exists()


def _worker_pids(parent: int):
    try:
        return [int(p) for p in Path(f"/proc/{parent}/task/{parent}/children").read_text().split()]
    except OSError:
        return []


def _gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except OSError:
            return True
        if state == "Z":  # exited, waiting to be reaped
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_interrupted_cli_stops_its_worker_and_says_how_to_resume(tmp_path, sig, code):
    import tempfile

    repro = _write(tmp_path, "hang", "minifier_helpers:hang_on_erf", layers=1)
    cmd, env = _cli(str(repro), "--timeout", "120", "--no-progress", "--out", str(tmp_path / "out"))
    # a shell without job control starts background jobs with SIGINT ignored, and the child would inherit
    # that: the CLI is given the default disposition, as a terminal's Ctrl-C finds it
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline, workers = time.monotonic() + 120, []
    while not workers and time.monotonic() < deadline:
        time.sleep(0.2)
        workers = _worker_pids(proc.pid)
    assert workers, "the minifier never started its worker"
    time.sleep(1.0)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert err.strip().splitlines()[-1].startswith("repro-tools minify: interrupted; resume with: ")
    assert "Traceback" not in err and "--resume" in err
    assert "--timeout 120.0 --no-progress" in err.strip().splitlines()[-1]  # the options the progress was judged with
    assert all(_gone(w) for w in workers)
    assert not list(Path(tempfile.gettempdir()).glob(f"determ_worker_{proc.pid}_*"))


def _mask_graph(x):
    y = torch.log1p(x)
    b = torch.logical_not(torch.logical_not(y > 0))
    r = torch.relu(x)
    return (torch.where(b, r, r),)


def _bool_graph(x):
    return (torch.log1p(x) > 0,)


_BOTH_BUGS = (("cpp.inject_relu_bug_TESTING_ONLY", "accuracy"), ("cpp.inject_log1p_bug_TESTING_ONLY", "accuracy"))


@pytest.mark.slow
def test_masked_divergence_is_not_the_culprit_in_either_mode():
    # PyTorch's accuracy-vs-strict scenario: the wrong log1p only feeds a mask that cannot change where(b, x, x)
    x = torch.randn(20, generator=torch.Generator().manual_seed(0))
    for strict in (False, True):
        spec = OracleSpec(kind="accuracy", compiler="inductor", config=_BOTH_BUGS, strict=strict)
        res = minify(make_fx(_mask_graph)(x), [x], spec, progress=False)
        assert res.summary["culprit"]["node"] == "relu", (strict, res.summary)


@pytest.mark.slow
def test_boolean_output_counts_only_when_strict():
    x = torch.randn(20, generator=torch.Generator().manual_seed(0))
    with pytest.raises(OracleError):
        minify(make_fx(_bool_graph)(x), [x], OracleSpec(kind="accuracy", compiler="inductor", config=_BOTH_BUGS),
               progress=False)
    res = minify(make_fx(_bool_graph)(x), [x],
                 OracleSpec(kind="accuracy", compiler="inductor", config=_BOTH_BUGS, strict=True), progress=False)
    assert res.summary["culprit"]["node"] == "log1p"


def test_resume_with_another_oracle_is_refused_in_one_line(tmp_path, capsys):
    """The saved progress was judged by one oracle; resuming with another --tol mixed two answers and then called
    the oracle flaky."""
    repro = _write(tmp_path, "accuracy", "minifier_helpers:wrong_erf", layers=1)
    out = tmp_path / "out"
    assert main(["minify", str(repro), "--out", str(out), "--in-process", "--no-progress"]) == 1
    assert (out / "minify_state.json").is_file()
    capsys.readouterr()
    assert main(["minify", str(repro), "--out", str(out), "--resume", "--in-process", "--no-progress",
                 "--tol", "10"]) == 2
    _one_line_error(capsys, "--resume: the run was started with tol=")


@pytest.mark.parametrize("bad", ["broken_link", "under_proc"])
def test_cli_out_that_cannot_become_a_directory_fails_before_any_query(tmp_path, capsys, bad):
    """A link to a scratch disk that is not mounted, or a folder where nothing can be made (``/proc``): the check
    passed (``exists()`` is False for a broken link, and root may write anywhere by the permission bits), the
    queries ran, and the first checkpoint failed with "File exists: minout"."""
    repro = _write(tmp_path, "accuracy", "minifier_helpers:wrong_erf", layers=1)
    if bad == "broken_link":
        out = tmp_path / "minout"
        out.symlink_to(tmp_path / "not_mounted" / "scratch")
        expect = "is a broken symbolic link"
    else:
        out, expect = Path("/proc/determ_minify_out"), "cannot create it in /proc"
    assert main(["minify", str(repro), "--out", str(out), "--no-progress"]) == 2
    _one_line_error(capsys, expect)
    assert not (tmp_path / "not_mounted").exists()


def test_grads_candidates_need_no_gradient_where_the_graph_cut_it_off():
    """A value the graph detaches, or computes under no_grad (dynamo's pair of _set_grad_enabled calls), gets no
    gradient in the program: a candidate cut there is fed an input that does not require grad either."""
    from repro_tools.minify.subgraph import GraphView

    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    sin = g.call_function(torch.sin, (g.call_method("detach", (x,)),))
    g.call_function(torch._C._set_grad_enabled, (False,))
    cos = g.call_function(torch.cos, (x,))
    g.call_function(torch._C._set_grad_enabled, (True,))
    out = g.call_function(torch.add, (g.call_function(torch.mul, (sin, w)), cos))
    g.output((out,))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    x_, w_ = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
    need = GraphView(gm, [x_, w_], grads=True).grad_names
    assert {"x", "w", "mul", "add"} <= need and not need & {"detach", "sin", "cos"}


def test_a_budget_that_runs_out_before_the_graph_is_minimal_names_no_culprit(capsys):
    """Not localized, two queries: several ops are left, and the last of them (an innocent LayerNorm's op) was
    printed as the culprit beside '(budget exhausted)'.  None is named; the line says why."""
    gm, inputs = H.mlp_graph(layers=3)
    res = minify(gm, inputs, OracleSpec(kind="accuracy", compiler="minifier_helpers:wrong_erf"), budget=2,
                 localize=False, progress=False)
    s = res.summary
    assert s["budget_exhausted"] and s["ops_after"] > 1 and s["culprit"] is None, s
    from repro_tools.cli.minify import _print_text
    _print_text(dict(s, repro_path=None))
    assert "culprit: none named: " in capsys.readouterr().out


def test_a_config_value_in_pythons_spelling_is_its_literal():
    """``--config cpp.inject_relu_bug_TESTING_ONLY=None`` was the text 'None', which inductor refused at the first
    query, and the repro was said not to fail."""
    from repro_tools.cli.minify import _config_items
    assert _config_items(["cpp.inject_relu_bug_TESTING_ONLY=None", "max_autotune=False", "cpp.simdlen=null"]) == {
        "cpp.inject_relu_bug_TESTING_ONLY": None, "max_autotune": False, "cpp.simdlen": None}
    assert _config_items(["cpp.inject_relu_bug_TESTING_ONLY=accuracy"]) == {"cpp.inject_relu_bug_TESTING_ONLY": "accuracy"}
