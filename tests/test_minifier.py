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
from determ_backend.errors import OracleError
from repro_tools.cli import main
from repro_tools.graph_code import write_graph_dir
from repro_tools.minifier import minify
from repro_tools.oracles import OracleSpec

ROOT = Path(__file__).resolve().parents[1]


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
    with pytest.raises(OracleError, match="input graph does not fail the accuracy oracle"):
        minify(gm, inputs, OracleSpec(kind="accuracy", compiler="aot_eager"), progress=False)


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
    caplog.set_level("INFO", logger="repro_tools.passes")
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
    from repro_tools.repro_script import read_meta, write_repro

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
