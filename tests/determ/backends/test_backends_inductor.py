"""determ_inductor on real inductor (C++ CPU backend).  Few and small: each cold compile costs seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from backend_helpers import MLP, compile_run, load
from repro_tools.report import build as build_report

pytestmark = pytest.mark.slow


def test_inductor_trace_is_bit_identical_and_names_buffers_by_fx_node(tmp_path, monkeypatch):
    from determ_backend.backends.recorder import ValueMemo
    from determ_backend.fingerprint.core import hash_tensor
    torch.manual_seed(0)
    m, x = MLP(), torch.randn(5, 8)
    torch._dynamo.reset()
    ref = torch.compile(m, backend="inductor")(x)
    ref.sum().backward()
    ref_grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad(set_to_none=True)
    taken = []
    real_get = ValueMemo.get
    monkeypatch.setattr(ValueMemo, "get", lambda self, t, stats: taken.append(real_get(self, t, stats)) or taken[-1])
    y, run_dir = compile_run(m, (x,), "determ_inductor", tmp_path, "ind", backward=True)
    # the backward's saved weights took the fingerprints the forward's outputs computed: the weights' own
    params = dict(m.named_parameters())
    saved = [r for r in load(run_dir)[0] if r.stage == "inductor_backward" and r.kind == "param"]
    assert saved and all(int(r.hash, 16) == hash_tensor(params[r.node]) for r in saved)
    assert sum(t is not None for t in taken) >= len(saved)
    assert torch.equal(y, ref)
    assert all(torch.equal(p.grad, g) for p, g in zip(m.parameters(), ref_grads))
    recs, report = load(run_dir)
    assert {r.stage for r in recs} == {"inductor_forward", "inductor_backward"}
    nodes = [r for r in recs if r.kind == "node"]
    assert nodes and all(r.op.startswith("aten.") for r in nodes), [r.op for r in nodes]
    assert all((r.extra or {}).get("buffer", "").startswith("buf") for r in nodes)
    assert {"layers.0.weight", "layers.2.weight"} <= {r.node for r in recs if r.kind == "param"}
    assert any(r.kind == "output" for r in recs)
    assert report["divergent"] is False


class _NormAttention(torch.nn.Module):
    """LayerNorm (fused kernels with in/out buffers on fresh allocations) and attention (a tuple-output
    fallback whose items are read through ``bufN = bufM[k]``)."""

    def __init__(self):
        super().__init__()
        self.ln, self.qkv = torch.nn.LayerNorm(16), torch.nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(self.ln(x)).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum(-1)


def test_every_inductor_record_input_resolves_to_a_traced_record(tmp_path):
    torch.manual_seed(0)
    _, run_dir = compile_run(_NormAttention(), (torch.randn(2, 8, 16),), "determ_inductor", tmp_path, "res",
                             backward=True)
    recs, _ = load(run_dir)
    for stage in ("inductor_forward", "inductor_backward"):
        names = {r.node for r in recs if r.stage == stage}
        loose = [(r.node, i) for r in recs if r.stage == stage for i in r.inputs if i not in names]
        assert names and not loose, (stage, loose)


_ACCURACY_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    import torch._inductor.config as ic
    ic.cpp.inject_relu_bug_TESTING_ONLY = "accuracy"
    torch.manual_seed(0)
    class M(torch.nn.Module):
        def __init__(s):
            super().__init__(); s.l1 = torch.nn.Linear(8, 16); s.l2 = torch.nn.Linear(16, 4)
        def forward(s, x):
            h = (torch.relu(s.l1(x) * 2.0) + 1.0).tanh()
            return s.l2(h).sin()
    f = torch.compile(M(), backend="determ_inductor", options={"dir": sys.argv[1], "run_id": "acc", "check": "accuracy"})
    with torch.no_grad():
        f(torch.randn(3, 8))
""")


def _run_script(tmp_path, name: str, source: str):
    """Run ``source`` as ``<name>.py`` in a process of its own (inductor's config flag plants the bug there);
    ``(completed process, report of run <name>)``."""
    script = tmp_path / f"{name}.py"
    script.write_text(source)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    return r, load(tmp_path / name)[1]


def test_accuracy_check_names_injected_relu_bug_inside_its_fused_kernel(tmp_path):
    """Inductor fuses mul, relu, add and tanh into one kernel that stores only the tanh: the buffer's
    region is compiled alone with every node an output, and the relu is the node that diverges."""
    r, report = _run_script(tmp_path, "acc", _ACCURACY_SCRIPT)
    fd = report["first_divergence"]
    assert report["divergent"] and fd["check"] == "accuracy"
    assert fd["op"] == "aten.relu.default" and fd["node"] == "relu"
    assert "acc.py:10" in fd["source"]  # the torch.relu line
    assert fd["metrics"]["err_compiled_vs_fp64"] > fd["metrics"]["err_eager_vs_fp64"]
    assert fd["kernel"]["record"] == "tanh" and fd["kernel"]["region"] == ["mul", "relu", "add", "tanh"]
    assert fd["kernel"]["name"].startswith("cpp_fused") and report["checker_errors"] == []
    assert "determ accuracy divergence" in r.stderr and "node=relu" in r.stderr
    # the page: every traced buffer with its error against eager and eager's own against fp64, the root at
    # the kernel's buffer with the relu named inside it, the user's line in the header
    assert f"report: {tmp_path / 'acc' / 'report.html'}" in r.stderr
    rep = build_report([str(tmp_path / "acc")])
    root = rep.rows[rep.root["row"]]
    assert rep.root["node"] == "relu" and root["n"] == "tanh" and root["v"] == "root" and root["inside"]["node"] == "relu"
    assert root["e"] > 0.01 and root["r"] is not None and root["r"] < 1e-5
    assert all(r["e"] is not None for r in rep.rows if r["k"] in ("node", "output"))
    assert rep.snippet["line"] == 10 and "torch.relu" in dict(rep.snippet["lines"])[10]


_SMALL_VALUE_SCRIPT = textwrap.dedent("""
    import sys, torch
    import torch._inductor.config as ic
    ic.cpp.inject_relu_bug_TESTING_ONLY = "accuracy"
    torch.manual_seed(0)
    class M(torch.nn.Module):
        def __init__(s):
            super().__init__(); s.w = torch.nn.Parameter(torch.ones(512, 64))
        def forward(s, x):
            b = torch.relu(x) * 1e-4
            return b @ s.w
    f = torch.compile(M(), backend="determ_inductor", options={"dir": sys.argv[1], "run_id": "small", "check": "accuracy"})
    with torch.no_grad():
        f(torch.randn(64, 512))
""")


def test_a_wrong_value_too_small_for_the_absolute_tolerance_is_blamed_not_the_matmul_it_feeds(tmp_path):
    """``relu(x) * 1e-4`` with the injected relu bug is off by ~1e-4, within tol=1e-3 in absolute terms; the mm
    summing 512 of them fails.  The mm computes exactly what it should from the values it was given: the root
    moves to the small buffer, and narrowing names the relu inside its kernel."""
    _, report = _run_script(tmp_path, "small", _SMALL_VALUE_SCRIPT)
    roots = report["findings"][0]["root_causes"]
    assert [(x["node"], x["op"]) for x in roots] == [("relu", "aten.relu.default")], roots
    assert "small.py:10" in roots[0]["source"] and roots[0]["kernel"]["record"] == "mul"
    mm = [p for p in _pairs(tmp_path / "small") if p["node"] == "mm"]
    assert mm and not mm[0]["root_cause"] and mm[0]["metrics"].get("computes_right_from_its_inputs")


_TWO_CARRIERS_SCRIPT = textwrap.dedent("""
    import sys, torch
    import torch._inductor.config as ic
    ic.cpp.inject_relu_bug_TESTING_ONLY = "accuracy"
    torch.manual_seed(0)
    def f(x, w):
        r = torch.relu(x @ w)
        a = r * 1e-4
        b = r.flip(-1) * 1e-4
        return (a @ b.t()) * 1e8
    c = torch.compile(f, backend="determ_inductor", options={"dir": sys.argv[1], "run_id": "two", "check": "accuracy"})
    c(torch.randn(8, 16), torch.randn(16, 16))
""")


def test_an_innocent_root_fed_by_two_small_wrong_values_moves_to_both(tmp_path):
    """The mm multiplies two small buffers made from one wrong relu; both pass the absolute tolerance, so the mm
    looked like the root (it computes right from its inputs, but two of them carry the error, and the root stayed
    there).  The root now follows both to the kernel that made them, and narrowing names the relu."""
    _, report = _run_script(tmp_path, "two", _TWO_CARRIERS_SCRIPT)
    roots = report["findings"][0]["root_causes"]
    assert [(x["node"], x["op"]) for x in roots] == [("relu", "aten.relu.default")], roots


_IN_PLACE_SCRIPT = textwrap.dedent("""
    import sys, torch
    import torch._inductor.config as ic
    ic.cpp.inject_relu_bug_TESTING_ONLY = "accuracy"
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1, bias=False), torch.nn.BatchNorm2d(16),
                            torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 10))
    m = m.to(memory_format=torch.channels_last).train()
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    f = torch.compile(m, backend="determ_inductor", options={"dir": sys.argv[1], "run_id": "inplace", "check": "accuracy"})
    f(x).pow(2).mean().backward()
""")


def test_a_buffer_a_kernel_fills_and_then_writes_in_place_is_not_named_after_the_fill(tmp_path):
    """A channels_last batch norm's backward zero-fills a buffer and copies into a strided view of it in the same
    kernel: the buffer, named after the fill, was blamed (its values are no fill's), and narrowing, cutting the
    region without the in-place copy, blamed the view.  The recomputed relu is the root in both graphs."""
    _, report = _run_script(tmp_path, "inplace", _IN_PLACE_SCRIPT)
    found = {f["first_divergence"]["stage"]: f for f in report["findings"]}
    assert set(found) == {"inductor_forward", "inductor_backward"}, report["findings"]
    for stage, f in found.items():
        named = [(r.get("kernel") or {}).get("node") or r["node"] for r in f["root_causes"]]
        assert named == ["relu"], (stage, f["root_causes"])
    assert report["checker_errors"] == []


_SECOND_BUG_SCRIPT = textwrap.dedent("""
    import sys, torch
    import torch._inductor.config as ic
    ic.cpp.inject_relu_bug_TESTING_ONLY = "accuracy"
    torch.manual_seed(0)
    def f(x, y, e):
        a = torch.relu(x)
        g = (a.amax() < 1e9).to(y.dtype)
        b = torch.relu((y * g) @ e)
        return a, b
    y = torch.rand(8, 8) * 0.5 + 0.25
    y[0, 0] = 1e4
    c = torch.compile(f, backend="determ_inductor", options={"dir": sys.argv[1], "run_id": "second", "check": "accuracy"})
    with torch.no_grad():
        c(torch.randn(8, 8), y, torch.eye(8))
""")


def test_a_second_wrong_node_below_a_guilty_one_stays_a_root(tmp_path):
    """The second relu is wrong on its own (inputs agree bitwise); beside its one large element its error of 1 passed
    for computing right when judged against the largest value alone, and, the first relu lying upstream, it was
    dropped as explained by it."""
    _, report = _run_script(tmp_path, "second", _SECOND_BUG_SCRIPT)
    roots = report["findings"][0]["root_causes"]
    assert [(x["node"], x["op"]) for x in roots] == [("relu", "aten.relu.default"), ("relu_1", "aten.relu.default")]


def _pairs(run_dir):
    files = sorted(run_dir.glob("pairs-*.jsonl"))
    return [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]


def test_inductor_determinism_check_names_the_nondeterministic_fallback_kernel(tmp_path):
    from backend_helpers import NondetModel

    torch.manual_seed(0)
    with torch.no_grad():
        _, run_dir = compile_run(NondetModel(), (torch.randn(16, 64),), "determ_inductor", tmp_path, "nd",
                                 check="determinism")
    recs, report = load(run_dir)
    roots = report["findings"][0]["root_causes"]
    assert [r["op"] for r in roots] == ["determ_test.nd_rowsum.default"]
    by_buffer = {(r.extra or {}).get("kernel", ""): r.node for r in recs if r.kind == "node"}
    assert any(k.startswith("cpp_fused_mul") and node == "mul" for k, node in by_buffer.items()), by_buffer


def test_a_failure_instrumenting_the_wrapper_is_a_checker_error_and_the_model_runs(tmp_path, monkeypatch):
    """determ's own machinery failing never breaks the program: the graph runs as inductor compiled it."""
    from determ_backend.backends import inductor_instrument

    def broken(*args, **kwargs):
        raise RuntimeError("planner bug\nsecond line")

    monkeypatch.setattr(inductor_instrument, "plan_call", broken)
    torch.manual_seed(0)
    m, x = MLP(), torch.randn(5, 8)
    torch._dynamo.reset()
    ref = torch.compile(m, backend="inductor")(x)
    y, run_dir = compile_run(m, (x,), "determ_inductor", tmp_path, "broken")
    assert torch.equal(y, ref)
    report = json.loads((run_dir / "report.json").read_text())  # no trace: nothing was traced
    assert len(report["checker_errors"]) == 1
    assert "not traced" in report["checker_errors"][0] and "RuntimeError: planner bug" in report["checker_errors"][0]
    assert "second line" not in report["checker_errors"][0]


class _GroupedBf16(torch.nn.Module):
    """A bfloat16 graph with an op that has no float64 kernel (``_grouped_mm``), then a rotary-style
    ``h*c + flip(h)*s`` that eager rounds to bfloat16 twice and inductor's fused kernel once."""

    def forward(self, x, w, offs, c, s):
        h = torch._grouped_mm(x, w, offs=offs)
        return torch.relu(h * c + h.flip(-1) * s)


def test_without_a_float64_reference_bfloat16_rounding_is_no_divergence_and_a_bug_still_is(tmp_path, caplog):
    """The float64 reference cannot run, so values are judged against eager alone: within a few bfloat16 units
    in the last place (1e-3 blamed the add for rounding in another place); the injected relu bug still fails."""
    import torch._inductor.config as ic

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is not in this torch")
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(64, 32, generator=g).bfloat16(), torch.randn(2, 32, 32, generator=g).bfloat16(),
            torch.tensor([32, 64], dtype=torch.int32), torch.rand(64, 32, generator=g).bfloat16(),
            torch.rand(64, 32, generator=g).bfloat16())
    with torch.no_grad():
        compile_run(_GroupedBf16(), args, "determ_inductor", tmp_path, "round", check="accuracy")
    _, report = load(tmp_path / "round")
    assert not report["divergent"] and report["checker_errors"] == [], report["first_divergence"]
    assert "float64 reference of graph" in caplog.text
    with ic.patch({"cpp.inject_relu_bug_TESTING_ONLY": "accuracy"}), torch.no_grad():
        compile_run(_GroupedBf16(), args, "determ_inductor", tmp_path, "bug", check="accuracy")
    _, report = load(tmp_path / "bug")
    fd = report["first_divergence"]
    assert report["divergent"] and fd["node"] == "relu", fd
    assert "no fp64 reference" in report["findings"][0]["mode"], report["findings"][0].get("mode")


class _GroupedNormBf16(torch.nn.Module):
    """A bfloat16 residual add after an op without a float64 kernel, then a float32 RMS scale of it: eager
    rounds the sum to bfloat16 before the upcast, inductor's fused kernel keeps it in float32."""

    def forward(self, x, w, offs, r):
        h = torch._grouped_mm(x, w, offs=offs) + r
        return h.float().reshape(64, 16, 2).pow(2).mean(-1).add(1e-6).rsqrt()


def test_without_a_float64_reference_a_float32_value_of_bfloat16_data_is_judged_at_bfloat16(tmp_path):
    """The float32 scale carries the bfloat16 rounding of the data it is computed from: held to 1e-3, a healthy
    bfloat16 RMSNorm was a divergence (a bf16 Mixtral's router path)."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is not in this torch")
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(64, 32, generator=g).bfloat16(), torch.randn(2, 32, 32, generator=g).bfloat16(),
            torch.tensor([32, 64], dtype=torch.int32), torch.randn(64, 32, generator=g).bfloat16())
    with torch.no_grad():
        compile_run(_GroupedNormBf16(), args, "determ_inductor", tmp_path, "norm", check="accuracy")
    _, report = load(tmp_path / "norm")
    assert not report["divergent"] and report["checker_errors"] == [], report["first_divergence"]


_WRITES_BACK_SCRIPT = textwrap.dedent("""
    import sys, torch
    import torch._inductor.config as ic
    ic.cpp.inject_relu_bug_TESTING_ONLY = "accuracy"
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 8)
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    def step():  # a hand-written optimizer step: parameters written in place, nothing returned
        for p in m.parameters():
            p.sub_(0.1 * torch.relu(p.grad))
    def accumulate(x, acc):  # clean: the mean's undivided sum lives in memory inductor planned for acc + mean
        h = torch.sigmoid(x)
        acc.add_(h.mean())
        return h[:, :2] * 2
    def ema(x, acc):  # clean: var's undivided sum of squares is stored straight into memory planned for the add
        acc.mul_(0.9).add_(x.var(0) * 0.1)
        return x * 2
    def rows(x, acc, y):  # a wrong relu written into part of the input, and another reaching the output
        acc[2:5].add_(torch.relu(x[2:5]))
        return torch.relu(y) + 1
    opts = {"dir": sys.argv[1], "check": "accuracy"}
    with torch.no_grad():
        torch.compile(step, backend="determ_inductor", options=dict(opts, run_id="step"))()
        torch.compile(accumulate, backend="determ_inductor", options=dict(opts, run_id="acc"))(
            torch.randn(2, 8, 6, 6), torch.zeros(()))
        torch.compile(ema, backend="determ_inductor", options=dict(opts, run_id="ema"))(torch.randn(32, 16),
                                                                                        torch.zeros(16))
        torch.compile(rows, backend="determ_inductor", options=dict(opts, run_id="rows"))(
            torch.randn(8, 8), torch.zeros(8, 8), torch.randn(8, 8))
""")


def test_a_wrong_value_reaching_only_what_the_graph_writes_back_into_its_inputs_is_found(tmp_path):
    """A compiled update step returns nothing: the wrong relu reached only the parameters it writes in place (as a
    compiled optimizer step, running statistics, ``acc.add_``), and was at most a masked note.  And a clean graph
    whose kernel lends acc + mean's buffer to the mean's undivided sum had that sum judged as ``add``: a masked
    divergence of 575x on a correct run."""
    _, step = _run_script(tmp_path, "step", _WRITES_BACK_SCRIPT)
    assert step["divergent"], step
    named = [(r.get("kernel") or {}).get("node") or r["node"] for r in step["findings"][0]["root_causes"]]
    assert set(named) == {"relu", "relu_1"}, step["findings"][0]["root_causes"]  # the weight's and the bias's
    for clean in ("acc", "ema"):
        report = load(tmp_path / clean)[1]
        assert not report["divergent"] and report.get("notes", []) == [] and report["checker_errors"] == [], report
    # a slice of the input written: the write-back was labelled partial and never judged; with an output also
    # wrong, replaying the graph judged the outputs alone and called the write-back's relu masked; narrowing the
    # kernel named the slice (a view of the memory it writes)
    rows = load(tmp_path / "rows")[1]
    named = sorted((r.get("kernel") or {}).get("node") or r["node"] for r in rows["findings"][0]["root_causes"])
    assert named == ["relu", "relu_1"], rows["findings"][0]["root_causes"]
