"""repro-tools xdevice: one graph on two device specs, root cause, minify; DETERM_DEVICE in the backends.

On this CPU-only machine the second "device" is the CPU computing in float64.  The
graph holds a catastrophic cancellation, ``(h + 1e8) - 1e8``: exact in float64,
all information lost in float32, so the subtraction is the root cause and the
nodes after it only inherit the error.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
import torch.fx as fx

import real_models

from determ_backend.backends import run as run_mod
from determ_backend.config import load_config
from determ_backend.devices import is_available
from determ_backend.errors import ConfigError
from repro_tools.minify import oracles
from repro_tools.cli import main
from repro_tools.minify.repro_files import load_repro_any
from repro_tools.report import build as build_report
from repro_tools.repro.script import import_script, write_repro
from paths import TESTS

DEVICES = "cpu,cpu:float64"


class Cancel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x, y):
        h = torch.tanh(self.lin(x)) * 3.0
        big = h + 1e8
        back = big - 1e8
        return (back * y).sum(-1)


SCRIPT = textwrap.dedent("""
    import torch

    def f(x, y):
        h = torch.tanh(x) * 3.0
        back = (h + 1e8) - 1e8
        return (back * y).sum(-1)

    torch.manual_seed(0)
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    out = torch.compile(f, backend="determ_aot_eager")(x, y)
    assert out.dtype == torch.float32
""")


def xdevice(capsys, *argv: str):
    """Run ``repro-tools xdevice ARGV --json``; returns (exit code, parsed summary or stderr text)."""
    code = main(["xdevice", *argv, "--json"])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else err)


@pytest.fixture(scope="module")
def repro(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    inputs = [torch.randn(4, 16), torch.randn(4, 16)]
    path = tmp_path_factory.mktemp("xdev") / "repro.py"
    torch.manual_seed(0)
    return write_repro(fx.symbolic_trace(Cancel()), inputs, path, meta={"kind": "cross_device", "compiler": "eager"})


@pytest.fixture(scope="module")
def script_runs(tmp_path_factory):
    """The user script run once per device (two subprocesses); returns (exit code, summary, out dir)."""
    d = tmp_path_factory.mktemp("xdev_script")
    (d / "train.py").write_text(SCRIPT)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["xdevice", str(d / "train.py"), "--devices", DEVICES, "--out", str(d / "out"), "--json"])
    return code, json.loads(buf.getvalue()), d / "out"


def _root(summary) -> str:
    return summary["first_divergence"]["node"]


def test_repro_localizes_the_cancellation(repro, capsys):
    code, s = xdevice(capsys, str(repro), "--devices", DEVICES)
    assert code == 1 and s["divergent"]
    fd = s["first_divergence"]
    assert fd["node"] == "sub" and fd["root_cause"] and [r["node"] for r in s["root_causes"]] == ["sub"]
    assert fd["metrics"]["max_abs"] > 1.0 and fd["metrics"]["max_rel"] > 0.5
    assert s["divergent_pairs"] == 3  # sub and the two consumers that inherit its error


class SmallCancel(torch.nn.Module):
    """A cancellation on small values, then a LayerNorm: float32's ``(x * 1e-3 + 1e3) - 1e3`` is wrong by about a
    third of its size, yet within the absolute tolerance; the LayerNorm scales it up and only amplifies it."""

    def __init__(self):
        super().__init__()
        self.ln, self.fc = torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(self.ln((x * 1e-3 + 1e3) - 1e3))


def test_a_node_that_only_amplifies_an_error_below_the_tolerance_is_not_the_root(tmp_path, capsys):
    torch.manual_seed(0)
    path = write_repro(fx.symbolic_trace(SmallCancel()), [torch.randn(4, 16)], tmp_path / "repro.py",
                       meta={"kind": "cross_device", "compiler": "eager"})
    code, s = xdevice(capsys, str(path), "--devices", DEVICES)
    assert code == 1 and [r["node"] for r in s["root_causes"]] == ["sub"]
    assert s["root_causes"][0]["metrics"]["within_absolute_tol_only"]
    assert main(["xdevice", str(path), "--devices", DEVICES]) == 1
    ln = next(line for line in capsys.readouterr().out.splitlines() if " ln " in line)
    assert not ln.startswith("*") and "computes_right_from_its_inputs=True" in ln  # innocent: not marked


def test_a_root_with_several_outputs_is_named_in_a_loaded_repro(tmp_path, capsys):
    """A repro script's graph carries no values: ``native_layer_norm`` (three outputs, read by ``getitem``) was
    recorded as one node its readers did not name, the chain to the output broke, and the layer norm that differs
    was marked masked with 'no root cause found'."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, off, w, b):
        return torch.ops.aten.native_layer_norm.default(x + off, [32], w, b, 1e-5)[0]

    torch.manual_seed(0)
    args = [torch.randn(2, 8, 32) * 0.02, torch.full((32,), 1000.0), torch.ones(32), torch.zeros(32)]
    path = write_repro(make_fx(f)(*args), args, tmp_path / "repro.py", meta={"kind": "cross_device"})
    code, s = xdevice(capsys, str(path), "--devices", DEVICES)
    assert code == 1 and [r["op"] for r in s["root_causes"]] == ["aten.native_layer_norm.default[0]"]


def test_the_directory_of_a_repro_is_the_repro(repro, capsys):
    """A flow's output directory (``repro/aot-0``, ``minify-0``) names its ``repro.py``."""
    code, s = xdevice(capsys, str(repro.parent), "--devices", DEVICES)
    assert code == 1 and s["target"] == "repro" and _root(s) == "sub"


def test_a_flow_directory_holding_its_launcher_alone_is_that_launcher(repro, tmp_path, capsys):
    """A level-4 flow with DETERM_MINIFY=0 leaves ``minifier_launcher.py`` alone in ``repro/aot-0``: the directory
    was refused as holding no repro, while ``repro-tools minify`` took it."""
    shutil.copy(repro, tmp_path / "minifier_launcher.py")
    code, s = xdevice(capsys, str(tmp_path), "--devices", DEVICES)
    assert code == 1 and s["target"] == "repro" and _root(s) == "sub", s


def test_repro_agrees_within_a_loose_tolerance(repro, capsys):
    code, s = xdevice(capsys, str(repro), "--devices", DEVICES, "--tol", "100")
    assert code == 0 and not s["divergent"] and s["first_divergence"] is None


def test_repro_text_names_the_root_cause(repro, capsys):
    assert main(["xdevice", str(repro), "--devices", "cpu:float32,cpu"]) == 0  # same numerics: agree
    assert main(["xdevice", str(repro), "--devices", "cpu:bfloat16,cpu:float64"]) == 1
    out = capsys.readouterr().out
    assert "root cause:" in out


def test_both_devices_cancelling_alike_agree_within_the_narrow_dtypes_precision(repro, capsys):
    # bf16 and fp32 both lose every digit in `h + 1e8 - 1e8`: the outputs are the same, and `add`, 0.4% apart (1e8
    # in bf16; a masked divergence before the bf16 side was judged at its own precision), agrees within it
    assert main(["xdevice", str(repro), "--devices", "cpu:bfloat16,cpu"]) == 0
    out = capsys.readouterr().out
    assert "bfloat16" in out and "agree within" in out
    code, s = xdevice(capsys, str(repro), "--devices", "cpu:bfloat16,cpu")
    assert code == 0 and not s["divergent"] and s["divergent_pairs"] == 0 and not s.get("masked")


def test_minify_writes_a_repro_that_still_diverges(repro, capsys, tmp_path):
    code, s = xdevice(capsys, str(repro), "--devices", DEVICES, "--minify", "--out", str(tmp_path))
    assert code == 1
    m = s["minify"]
    assert m["culprit"]["node"] == "sub" and m["ops_after"] < m["ops_before"]
    gm, inputs, meta = load_repro_any(m["repro_path"])
    assert "sub" in [n.name for n in gm.graph.nodes] and meta["compiler"] == "eager"  # runs with torch alone
    assert meta["devices"] == ["cpu", "cpu:float64"] and "follow_inputs" not in Path(m["repro_path"]).read_text()
    spec = oracles.OracleSpec(kind="cross_device", compiler="eager", devices=("cpu", "cpu:float64"))
    assert oracles.check(spec, gm, inputs).fails
    assert import_script(m["repro_path"]).main(["run"]) == 1 and "reproduced cross_device" in capsys.readouterr().out
    rep = build_report([str(Path(m["repro_path"]).parent.parent)])  # the minify output directory
    assert rep.kind == "minify" and rep.root["node"] == "sub" and rep.minify["culprit"]["node"] == "sub"
    assert (rep.minify["nodes_before"], rep.minify["nodes_after"]) == (m["nodes_before"], m["nodes_after"])
    assert rep.minify["code"].startswith("class Repro(") and "sub" in rep.minify["code"]


@pytest.mark.slow
def test_user_script_localizes_the_cancellation(script_runs):
    code, s, out = script_runs
    assert code == 1 and _root(s) == "sub" and s["first_divergence"]["root_cause"]
    assert s["first_divergence"]["metrics"]["max_abs"] > 1.0  # exact metrics from the saved tensors
    assert s["first_divergence"]["source"].endswith("(f)")  # the user's line, through the backend's trace
    report = json.loads((out / "side1_cpu_float64" / "report.json").read_text())
    assert report["divergent"] is False  # no check ran; the comparison is xdevice's


@pytest.mark.slow
def test_report_of_the_xdevice_output(script_runs, tmp_path, capsys):
    _, _, out = script_runs
    assert main(["report", str(out), "-o", str(tmp_path / "x.html")]) == 1
    rep = build_report([str(out)])
    assert rep.kind == "xdevice" and rep.root["node"] == "sub" and rep.rows[rep.root["row"]]["v"] == "root"
    assert rep.rows[rep.root["row"]]["e"] > 1.0  # exact metrics from the saved tensors
    assert rep.root["source"].endswith("(f)") and "sub" in (tmp_path / "x.html").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("form", ["comma", "two"])
def test_trace_pair_localizes_the_cancellation(script_runs, capsys, form):
    _, _, out = script_runs
    a, b = str(out / "side0_cpu"), str(out / "side1_cpu_float64")
    code, s = xdevice(capsys, *([f"{a},{b}"] if form == "comma" else [a, b]))
    assert code == 1 and _root(s) == "sub" and s["first_divergence"]["stage"] == "aot_forward"


@pytest.mark.parametrize("argv, needle", [
    (["--devices", "cpu,cuda"], "device 'cuda' is not available"),
    (["--devices", "cpu,npu:1"], "device 'npu:1' is not available"),
    (["--devices", "cpu,cpu:notadtype"], "bad dtype 'notadtype'"),
    (["--devices", "cpu"], "expected exactly two device specs"),
    (["--devices", "cpu,cpu:int8"], "'cpu:int8': expected a floating-point dtype"),
    (["--devices", "cpu:bool,cpu"], "'cpu:bool': expected a floating-point dtype"),
    (["--devices", DEVICES, "--limit", "-1"], "--limit must be >= 0"),
    ([], "--devices: expected two device specs"),
])
def test_bad_devices_exit_2_with_one_line(repro, capsys, argv, needle):
    if "cuda" in " ".join(argv) and is_available("cuda"):
        pytest.skip("this machine has CUDA")
    assert main(["xdevice", str(repro), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and err.startswith("repro-tools xdevice: error:")


@pytest.mark.parametrize("tol", ["nan", "-1", "inf", "x"])
def test_a_tolerance_that_is_no_finite_number_is_a_usage_error(repro, capsys, tol):
    assert main(["xdevice", str(repro), "--devices", DEVICES, "--tol", tol]) == 2
    err = capsys.readouterr().err
    assert "argument --tol: expected a finite number >= 0" in err and "Traceback" not in err


def test_a_zero_tolerance_across_dtypes_compares_values_not_bits():
    """float32 against float64 never share bits: at --tol 0 two dtypes agree when their values are equal (the
    graph inputs, equal after the cast, were each named root cause)."""
    from determ_backend.compare.verdict import judge

    x = torch.randn(8)
    assert judge(x, x.double(), tol=0.0, strict=True) is True
    assert judge(x, x.double() + 1e-9, tol=0.0, strict=True) is False
    assert judge(x, x.clone(), tol=0.0, strict=True) is True


@pytest.mark.parametrize("make, needle", [
    (lambda d: d / "missing.py", "no such script"),
    (lambda d: d / "one.jsonl", "a single trace"),
    (lambda d: d, "a directory holding no graph.py or repro.py"),
])
def test_bad_targets_exit_2(tmp_path, capsys, make, needle):
    target = make(tmp_path)
    if target.suffix == ".jsonl":
        target.write_text("{}\n")
    assert main(["xdevice", str(target), "--devices", DEVICES]) == 2
    assert needle in capsys.readouterr().err


def test_minify_needs_a_graph(tmp_path, capsys):
    assert main(["xdevice", "a.jsonl,b.jsonl", "--minify"]) == 2
    assert "--minify needs a repro.py" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not is_available("cuda"), reason="no CUDA device")
def test_cpu_vs_cuda(repro, capsys):
    code, s = xdevice(capsys, str(repro), "--devices", "cuda,cpu:float64")
    assert code == 1 and _root(s) == "sub"


# ------------------------------------------------------------------ DETERM_DEVICE inside the backends

def test_backend_on_another_dtype_returns_original_dtype_and_gradients(tmp_path):
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    opts = {"dir": str(tmp_path), "run_id": "r", "device": "cpu:float64"}
    out = torch.compile(m, backend="determ_aot_eager", options=opts)(x)
    out.sum().backward()
    run_mod.finish_all()
    assert out.dtype == torch.float32 and m.weight.grad is not None and m.weight.grad.dtype == torch.float32
    torch.testing.assert_close(out, m(x), rtol=1e-5, atol=1e-6)
    dtypes = {json.loads(line).get("dtype") for line in (tmp_path / "r" / "trace.jsonl").read_text().splitlines()[1:-1]}
    assert "float64" in dtypes and "float32" not in dtypes


class Heads(torch.nn.Module):
    """Splits a projection into heads with ``view(..., -1, 16)``: a guard on the weight's size."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.lin(x).view(*x.shape[:-1], -1, 16).transpose(1, 2).sum(-1)


def test_backend_on_another_dtype_guards_on_the_inputs_own_shapes(tmp_path):
    """The cast copies of the graph inputs are traced by AOTAutograd as those inputs, so a shape guard
    on a cast parameter names the parameter (it broke Dynamo's guard creation on Llama-style models)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m, x = Heads(), torch.randn(2, 8, 64)
    opts = {"dir": str(tmp_path), "run_id": "r", "device": "cpu:float64"}
    out = torch.compile(m, backend="determ_aot_eager", options=opts)(x)
    out.sum().backward()
    run_mod.finish_all()
    assert out.dtype == torch.float32 and m.lin.weight.grad.dtype == torch.float32
    torch.testing.assert_close(out, m(x), rtol=1e-5, atol=1e-5)


def test_runs_with_a_second_sequence_length_are_compared(tmp_path, capsys):
    """The recompile for a second length has symbolic sizes: its view records are traced without a
    fixed shape (one that a trace could not hold), and the two runs still pair and agree."""
    def f(x):
        return torch.tanh(x).transpose(0, 1).sum(0)

    for spec in ("cpu", "cpu:float64"):
        torch._dynamo.reset()
        compiled = torch.compile(f, backend="determ_aot_eager",
                                 options={"dir": str(tmp_path), "run_id": spec.replace(":", "_"), "device": spec})
        for n in (4, 6):
            compiled(torch.randn(n, 8, generator=torch.Generator().manual_seed(n)))
        run_mod.finish_all()
    code, s = xdevice(capsys, f"{tmp_path / 'cpu'},{tmp_path / 'cpu_float64'}")
    assert code == 0 and not s["divergent"] and s["pairs"] > 0 and s["unmatched_a"] == s["unmatched_b"] == 0, s


REAL_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    sys.path.insert(0, {tests!r})
    import real_models

    model, inputs = real_models.build("llama", 8)
    out = torch.compile(model, backend="determ_aot_eager")(**inputs)
    real_models.loss_of(out).backward()
""")


@pytest.mark.slow
@pytest.mark.skipif(not real_models.available(), reason="transformers is not installed")
def test_user_script_with_a_real_llama_agrees_on_cpu_and_float64(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(REAL_SCRIPT.format(tests=str(TESTS)))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["xdevice", str(script), "--devices", DEVICES, "--out", str(tmp_path / "out"), "--json"])
    s = json.loads(buf.getvalue())
    assert code == 0 and not s["divergent"] and s["pairs"] > 100, s
    stages = {json.loads(line).get("stage") for line in
              (tmp_path / "out" / "side1_cpu_float64" / "trace.jsonl").read_text().splitlines()[1:-1]}
    assert stages == {"aot_forward", "aot_backward"}


CAST_SCRIPT = textwrap.dedent("""
    import torch

    class Attn(torch.nn.Module):  # Hugging Face's eager attention: softmax in float32, cast back, then a matmul
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            w = torch.softmax(q @ k.transpose(-1, -2), dim=-1, dtype=torch.float32).to(q.dtype)
            return w @ v

    torch.manual_seed(0)
    torch.compile(Attn(), backend="determ_eager")(torch.randn(2, 5, 16)).sum()
""")


def test_a_models_own_casts_follow_a_wider_device_dtype(tmp_path, capsys):
    """The model casts to float32 (a constant to Dynamo): on the cpu:float64 side that value met float64 ones in a
    matmul, which does not promote, and the run died.  Casts to a narrower dtype than the side's are widened."""
    (tmp_path / "attn.py").write_text(CAST_SCRIPT)
    code, s = xdevice(capsys, str(tmp_path / "attn.py"), "--devices", DEVICES, "--out", str(tmp_path / "out"))
    assert code == 0 and not s["divergent"] and s["pairs"] > 5 and s["unmatched_a"] == s["unmatched_b"] == 0, s


@pytest.mark.parametrize("env, needle", [
    ({"DETERM_DEVICE": "gpu"}, "DETERM_DEVICE='gpu'"),
    ({"DETERM_BISECT_STAGE": "dynamo"}, "DETERM_BISECT_STAGE='dynamo'"),
])
def test_bad_settings_are_one_clear_line(env, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(env=env)


def test_unbalanced_script_args_exit_2_with_one_line(tmp_path, capsys):
    (tmp_path / "train.py").write_text("print('never run')\n")
    assert main(["xdevice", str(tmp_path / "train.py"), "--devices", DEVICES, "--script-args", '"unclosed']) == 2
    err = capsys.readouterr().err.strip()
    assert "--script-args" in err and "No closing quotation" in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_script_without_a_trace_is_not_judged_on_an_earlier_runs_trace(tmp_path, capsys, script_runs):
    _, _, runs = script_runs
    out = tmp_path / "out"
    shutil.copytree(runs, out)  # an earlier run's traces in the same --out
    (tmp_path / "plain.py").write_text("print('no torch.compile here')\n")
    assert main(["xdevice", str(tmp_path / "plain.py"), "--devices", DEVICES, "--out", str(out)]) == 2
    assert "wrote no determ trace" in capsys.readouterr().err


def test_a_second_run_into_the_same_out_replaces_the_first(tmp_path, capsys, script_runs):
    """README: a second run replaces the first's files.  The first run's claim on its side directories made the
    second's program write to side0_cpu-2 and xdevice, reading side0_cpu, said it wrote no trace."""
    code, first, runs = script_runs
    out = tmp_path / "out"
    shutil.copytree(runs, out)  # the first run's directories, claims included
    (tmp_path / "train.py").write_text(SCRIPT)
    again, s = xdevice(capsys, str(tmp_path / "train.py"), "--devices", DEVICES, "--out", str(out))
    assert (again, _root(s)) == (code, _root(first))
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(p.name for p in runs.iterdir() if p.is_dir())


def test_minify_picks_a_new_directory_per_run(tmp_path, capsys):
    torch.manual_seed(0)
    inputs = [torch.randn(4, 16), torch.randn(4, 16)]
    src = write_repro(fx.symbolic_trace(Cancel()), inputs, tmp_path / "repro.py",
                      meta={"kind": "cross_device", "compiler": "eager"})
    paths = []
    for _ in range(2):
        code, s = xdevice(capsys, str(src), "--devices", DEVICES, "--minify")
        assert code == 1
        paths.append(Path(s["minify"]["repro_path"]))
    assert [p.relative_to(tmp_path).parts[0] for p in paths] == ["xdevice", "xdevice-2"]
    assert all(p.is_file() for p in paths)
    assert main(["xdevice", str(src), "--devices", DEVICES, "--minify", "--out", str(tmp_path / "xdevice")]) == 2
    assert "holds an earlier minification" in capsys.readouterr().err


def test_traces_with_nothing_paired_are_not_said_to_agree(tmp_path, capsys):
    from backend_helpers import compile_run

    torch.manual_seed(0)
    _, run = compile_run(torch.nn.Linear(4, 4), (torch.randn(2, 4),), "determ_eager", tmp_path, "a")
    trace = run / "trace.jsonl"
    empty = tmp_path / "empty.jsonl"
    lines = trace.read_text().splitlines()
    empty.write_text(lines[0] + '\n{"end": true, "count": 0}\n')  # a complete run that traced nothing
    assert main(["xdevice", f"{trace},{empty}"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{empty}: the trace holds no records, nothing to compare" in err and len(err.splitlines()) == 1


def test_a_script_that_never_compiles_is_told_to_trace_with_hashmode_when_a_backend_was_given(tmp_path, capsys):
    (tmp_path / "plain.py").write_text("print('no torch.compile here')\n")
    assert main(["xdevice", str(tmp_path / "plain.py"), "--devices", DEVICES, "--out", str(tmp_path / "out"),
                 "--backend", "determ_aot_eager"]) == 2
    err = capsys.readouterr().err
    assert "never calls torch.compile" in err and "HashMode" in err and "or pass --backend" not in err


class _PosScale(torch.nn.Module):
    """Llama's rotary table in small: integer positions cast to float32, then to the input's dtype (a no-op where
    the graph is traced in float32)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, position_ids):
        pos = position_ids.float() / 8.0
        return self.lin(x * pos.to(x.dtype))


def test_a_graph_that_fails_on_a_narrower_side_is_one_line_with_exit_2(tmp_path, capsys):
    """The float32 cast stays on a bfloat16 side, meets bfloat16 weights in the linear, and the graph raises there:
    that is bad input (exit 2, one line saying why), not a traceback read as a divergence (exit 1)."""
    paths = []

    def capture(gm, example_inputs):
        paths.append(write_repro(gm, example_inputs, tmp_path / "repro.py", meta={"kind": "cross_device",
                                                                                  "compiler": "eager"}))
        return gm.forward

    torch.manual_seed(0)
    torch.compile(_PosScale(), backend=capture)(torch.randn(4, 8), torch.arange(8))
    assert main(["xdevice", str(paths[0]), "--devices", "cpu:bfloat16,cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "the graph fails on cpu:bfloat16 (RuntimeError:" in err, err
    assert "compare against cpu:float64" in err


SDPA_CACHE_SCRIPT = textwrap.dedent("""
    import torch
    import torch.nn.functional as F

    def attend(q):
        cache = torch.zeros(2, 0, 8, dtype=q.dtype)  # an empty key cache made in q's dtype, as transformers' is
        k = torch.cat([cache, q], dim=1)
        return F.scaled_dot_product_attention(q, k, k)

    torch.compile(attend, backend="determ_aot_eager")(torch.randn(2, 4, 8)).sum()
""")


def test_a_side_whose_compile_fails_is_told_by_its_error_not_by_torchs_advice(tmp_path, capsys):
    (tmp_path / "attend.py").write_text(SDPA_CACHE_SCRIPT)
    assert main(["xdevice", str(tmp_path / "attend.py"), "--devices", "cpu:bfloat16,cpu", "--out",
                 str(tmp_path / "out")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "xdevice: error:" in line]
    assert len(lines) == 1 and lines[0].startswith("repro-tools xdevice: error:"), lines  # not after the bar
    err = lines[0]
    assert "(RuntimeError: Expected query, key, and value" in err, err
    assert "TORCHDYNAMO_VERBOSE" not in err and "compare against cpu:float64" in err


def test_the_narrower_side_hint_is_given_for_a_clash_of_its_dtype_only():
    from repro_tools.xdevice.core import _narrower_hint

    clash = "RuntimeError: mat1 and mat2 must have the same dtype, but got Float and BFloat16"
    assert "compare against cpu:float64" in _narrower_hint("cpu:bfloat16", clash)
    assert _narrower_hint("cpu:float64", clash) == "" and _narrower_hint("cpu", clash) == ""
    for other in ("KeyError: 'torch_dtype'",  # names a dtype, clashes with nothing
                  "RuntimeError: Input type (torch.FloatTensor) and weight type (torch.cuda.FloatTensor) should be "
                  "the same"):  # a clash of devices
        assert _narrower_hint("cpu:bfloat16", other) == "", other
    assert _narrower_hint("cpu:float16", "RuntimeError: expected scalar type Half but found Float") != ""


def _float32_only_bug():
    """A custom op whose float32 kernel adds 1e-2 (every other dtype computes right), registered once."""
    if not hasattr(torch.ops.determ_test, "f32_bug"):
        @torch.library.custom_op("determ_test::f32_bug", mutates_args=())
        def f32_bug(x: torch.Tensor) -> torch.Tensor:
            return x + 1e-2 if x.dtype == torch.float32 else x.clone()

        f32_bug.register_fake(lambda x: torch.empty_like(x))
    return torch.ops.determ_test.f32_bug


@pytest.mark.parametrize("devices", ["cpu,cpu:float64", "cpu:float64,cpu"])
def test_either_order_of_the_devices_names_an_op_wrong_in_one_dtype_alone(tmp_path, capsys, devices):
    """``a = (x * 1e-3 + 1e3) - 1e3`` loses digits in float32 (within the absolute tolerance), then an op wrong in
    float32 alone.  With the float64 side first, its values were replayed on the float32 side in float64 (the side's
    spec names no dtype), where the op computes right: it was cleared, and the root moved to the sub."""
    bug = _float32_only_bug()

    def f(x):
        a = (x * 1e-3 + 1e3) - 1e3
        return bug(a) * 2

    torch.manual_seed(0)
    path = write_repro(fx.symbolic_trace(f), [torch.randn(16, 16)], tmp_path / "repro.py",
                       meta={"kind": "cross_device", "compiler": "eager"})
    code, s = xdevice(capsys, str(path), "--devices", devices)
    assert code == 1 and [r["node"] for r in s["root_causes"]] == ["f32_bug"], s["root_causes"]


def test_a_healthy_bfloat16_graph_agrees_with_float64_within_its_dtypes_precision(tmp_path, capsys):
    """A LayerNorm and a Linear in bfloat16 against float64: one unit in the last place of bfloat16 (7.8e-3) is far
    beyond --tol 1e-3, and the LayerNorm was named the root cause of a healthy graph.  A bfloat16 side's values are
    judged to a few units in the last place of its dtype, and the mode says so."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 64)).to(torch.bfloat16)
    path = write_repro(fx.symbolic_trace(m), [torch.randn(4, 16, 64).to(torch.bfloat16)], tmp_path / "repro.py",
                       meta={"kind": "cross_device", "compiler": "eager"})
    code, s = xdevice(capsys, str(path), "--devices", "cpu,cpu:float64")
    assert code == 0 and not s["divergent"] and "bfloat16" in s["mode"], s


def test_a_cast_widened_on_a_float64_side_is_recorded_as_the_models_cast():
    """Under ``cpu:float64`` the model's ``pos.float()`` runs as ``.to(float64)``; it was recorded as ``Tensor.to``
    while the float32 side recorded ``Tensor.float``, so a healthy Llama's cast did not pair and xdevice said the runs
    were not shown identical."""
    from determ_backend.backends.instrument import op_name
    from determ_backend.backends.retarget import widen_casts

    gm = fx.symbolic_trace(lambda x, pos: x * pos.float())
    widen_casts(gm.graph, torch.float64)
    cast = next(n for n in gm.graph.nodes if n.op == "call_method")
    assert cast.target == "to" and cast.args[1] is torch.float64 and op_name(cast) == "Tensor.float"


def _bf16_double_softmax():
    """A custom softmax whose bfloat16 kernel returns twice the probabilities (other dtypes compute right)."""
    if not hasattr(torch.ops.determ_test, "bf16_softmax"):
        @torch.library.custom_op("determ_test::bf16_softmax", mutates_args=())
        def bf16_softmax(x: torch.Tensor) -> torch.Tensor:
            p = torch.softmax(x, -1)
            return p * 2 if x.dtype == torch.bfloat16 else p

        bf16_softmax.register_fake(lambda x: torch.empty_like(x))
    return torch.ops.determ_test.bf16_softmax


def test_a_bfloat16_op_wrong_by_far_more_than_its_rounding_is_named(tmp_path, capsys):
    """Probabilities over 256 keys, each far below 0.03, twice what they should be on the bfloat16 side: an absolute
    tolerance of a few bfloat16 units passed them (exit 0); judged relative to the value's size they differ."""
    sm = _bf16_double_softmax()

    def f(q, k):
        return sm(q @ k.transpose(-1, -2))

    torch.manual_seed(0)
    q, k = (torch.randn(2, 8, 16) * 0.05).to(torch.bfloat16), torch.randn(2, 256, 16).to(torch.bfloat16)  # flat
    path = write_repro(fx.symbolic_trace(f), [q, k], tmp_path / "repro.py", meta={"kind": "cross_device",
                                                                                   "compiler": "eager"})
    code, s = xdevice(capsys, str(path), "--devices", "cpu,cpu:float64")
    assert code == 1 and [r["node"] for r in s["root_causes"]] == ["bf16_softmax"], s["root_causes"]
