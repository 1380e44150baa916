"""The determ compile backends: registration, traces, bit-identity, checks."""

from __future__ import annotations

import json
import logging
import operator
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from backend_helpers import MLP, BreakModel, NondetModel, compile_run, load
from determ_backend.backends import run as run_mod
from determ_backend.config import load_config
from determ_backend.errors import ConfigError
from determ_backend.fingerprint.core import hash_tensor
from determ_backend.trace.stream import format_hash
from repro_tools.cli import main as cli


def _plain(model, x, backend, backward=False):
    torch._dynamo.reset()
    y = torch.compile(model, backend=backend)(x)
    if backward:
        y.sum().backward()
    return y


@pytest.mark.parametrize("check", ["determinism", "accuracy", "nan", "determinism,accuracy,nan,batch_invariance"])
def test_checks_leave_a_compiled_optimizer_step_as_the_program_would(tmp_path, check):
    """A compiled optimizer step's dynamo graph updates the parameters and optimizer state in place, as its
    attributes.  The checks' extra runs updated them too: the determinism twin applied each step twice, the
    accuracy check's replays fifteen times (and blamed the optimizer state for diverging)."""
    from determ_backend.backends import run as run_mod
    from repro_helpers import same_training, train_with_compiled_optimizer

    want = train_with_compiled_optimizer("eager")
    got = train_with_compiled_optimizer("determ_eager", options={"dir": str(tmp_path), "run_id": "r", "check": check})
    run_mod.finish_all()
    assert [s["step"].item() for s in got[1]] == [2.0] * 4
    assert same_training(got, want)
    _, report = load(tmp_path / "r")
    assert not report["divergent"] and report["checker_errors"] == [], report


@pytest.mark.parametrize("determ,plain", [("determ_eager", "eager"), ("determ_aot_eager", "aot_eager")])
def test_tracing_on_and_off_are_bit_identical_to_wrapped_backend(tmp_path, determ, plain):
    torch.manual_seed(0)
    m, x = MLP(), torch.randn(5, 8)
    ref = _plain(m, x, plain, backward=True)
    ref_grads = [p.grad.clone() for p in m.parameters()]
    for trace in (True, False):
        m.zero_grad(set_to_none=True)
        y, _ = compile_run(m, (x,), determ, tmp_path, f"r{trace}", backward=True, trace=trace)
        assert torch.equal(y, ref)
        assert all(torch.equal(p.grad, g) for p, g in zip(m.parameters(), ref_grads))


def test_trace_has_every_node_with_param_names_and_backward(tmp_path):
    torch.manual_seed(0)
    seen = {}

    def spy(gm, inputs):
        seen["n"] = sum(1 for n in gm.graph.nodes if n.op != "output")
        return gm.forward

    m, x = MLP(), torch.randn(5, 8)
    torch._dynamo.reset()
    torch.compile(m, backend=spy)(x)
    _, run_dir = compile_run(m, (x,), "determ_eager", tmp_path, "eager")
    recs, report = load(run_dir)
    assert len(recs) == seen["n"]
    assert {"layers.0.weight", "layers.0.bias", "layers.2.weight", "layers.2.bias"} <= {r.node for r in recs if r.kind == "param"}
    assert all(r.source and "backend_helpers.py" in r.source for r in recs if r.kind == "node")
    assert report["divergent"] is False and report["first_divergence"] is None
    _, run_dir = compile_run(m, (x,), "determ_aot_eager", tmp_path, "aot", backward=True)
    recs, _ = load(run_dir)
    stages = {r.stage for r in recs}
    assert stages == {"aot_forward", "aot_backward"}
    assert "layers.2.weight" in {r.node for r in recs if r.stage == "aot_backward"}


def test_graph_breaks_give_several_graphs(tmp_path):
    torch.manual_seed(0)
    _, run_dir = compile_run(BreakModel(), (torch.randn(2, 8),), "determ_aot_eager", tmp_path, "brk")
    recs, _ = load(run_dir)
    assert {r.graph for r in recs} == {"g0", "g1"}


def test_determinism_check_names_the_nondeterministic_op_only(tmp_path):
    torch.manual_seed(0)
    _, run_dir = compile_run(NondetModel(), (torch.randn(16, 64),), "determ_aot_eager", tmp_path, "nd",
                             check="determinism")
    _, report = load(run_dir)
    assert report["divergent"] is True
    finding = report["findings"][0]
    assert finding["check"] == "determinism"
    roots = finding["root_causes"]
    assert [r["op"] for r in roots] == ["determ_test.nd_rowsum.default"]
    assert report["first_divergence"]["op"] == "determ_test.nd_rowsum.default"
    assert finding["divergent_pairs"] > 1  # consumers diverge too, but are not root causes


def test_a_divergence_found_again_on_later_calls_is_counted_not_repeated(tmp_path, caplog):
    """A training loop met the same divergence every step: one warning line and one more finding per call, with
    report.json rewritten, ever longer, each time."""
    import logging

    torch.manual_seed(0)
    torch._dynamo.reset()
    f = torch.compile(NondetModel(), backend="determ_aot_eager",
                      options={"dir": str(tmp_path), "run_id": "loop", "check": "determinism"})
    with caplog.at_level(logging.WARNING, logger="determ_backend"):
        for _ in range(4):
            f(torch.randn(16, 64))
        run_mod.finish_all()
    _, report = load(tmp_path / "loop")
    assert len(report["findings"]) == 1, [f["first_divergence"] for f in report["findings"]]
    finding = report["findings"][0]
    assert finding["repeats"] == 3 and finding["last_call"] == 3
    assert [r["op"] for r in finding["root_causes"]] == ["determ_test.nd_rowsum.default"]
    assert sum("determinism divergence" in r.getMessage() for r in caplog.records) == 1
    assert "again on 3 later calls" in (tmp_path / "loop" / "report.html").read_text()


def test_a_node_of_torchs_own_modules_is_placed_by_its_module(tmp_path):
    """Dynamo keeps no frame of torch's code, so every node of an nn.Sequential of torch modules had no source and
    a finding read 'at <unknown source>'."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    _, run_dir = compile_run(model, (torch.randn(4, 8),), "determ_aot_eager", tmp_path, "seq")
    recs, _ = load(run_dir)
    fwd = {r.node: r.source for r in recs if r.stage == "aot_forward" and r.kind == "node"}
    assert fwd["relu"] == "<module 1: ReLU>" and fwd["addmm_1"] == "<module 2: Linear>", fwd
    _, run_dir = compile_run(model.forward, (torch.randn(4, 8),), "determ_aot_eager", tmp_path, "bound")
    fwd = {r.node: r.source for r in load(run_dir)[0] if r.stage == "aot_forward" and r.kind == "node"}
    assert fwd["relu"] == "<module 1: ReLU>", fwd  # a bound method's module: no __self__ in the path


def test_memory_allocated_and_overwritten_before_any_read_is_no_divergence(tmp_path):
    """transformers' grouped MoE builds an index map with ``empty_like`` then fills it: the garbage the allocation
    held differed from run to run and was a masked divergence of every healthy MoE model."""
    def f(x, perm):
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0))
        return x[inv] * 2

    x, perm = torch.randn(64, 8), torch.randperm(64)
    for check in ("determinism", "accuracy"):
        _, run_dir = compile_run(f, (x, perm), "determ_aot_eager", tmp_path, check, check=check)
        report = load(run_dir)[1]
        assert not report["divergent"] and report["notes"] == [] and report["checker_errors"] == [], report


@pytest.mark.parametrize("backend", ["determ_aot_eager", "determ_eager"])
def test_a_nondeterministic_value_reaching_only_a_written_back_input_is_a_finding(tmp_path, backend):
    """A value written into the graph's input (``acc.add_``: running statistics, an optimizer step) is seen by the
    program as an output is: a nondeterministic op reaching only that write was a masked note."""
    import eager_helpers  # noqa: F401  (determ_test::eager_nd_rowsum, a genuinely nondeterministic op)

    def f(x, acc):
        acc.add_(torch.ops.determ_test.eager_nd_rowsum(x * 2))
        return x * 3

    _, run_dir = compile_run(f, (torch.randn(16, 64), torch.zeros(16, 64)), backend, tmp_path, "acc",
                             check="determinism")
    report = load(run_dir)[1]
    assert report["divergent"], report
    assert "eager_nd_rowsum" in report["first_divergence"]["op"], report["first_divergence"]


@pytest.mark.parametrize("write", ["twice", "slice", "out", "setitem", "foreach", "iadd"])
def test_a_dynamo_graph_writing_its_input_in_place_blames_the_nondeterministic_op(tmp_path, write):
    """A dynamo graph's in-place ops take the input itself as their argument: the second write (``acc.mul_(2)``)
    read the input as the graph was called with it, whose record agrees, and the deterministic ``mul_`` was the
    root cause; a write through a slice (``acc[:, :8].add_``), ``out=``, an item assignment, an in-place foreach op
    or ``acc += v`` was not seen as a write at all (the nondeterministic op was a masked note)."""
    import eager_helpers  # noqa: F401  (determ_test::eager_nd_rowsum, a genuinely nondeterministic op)

    nd = torch.ops.determ_test.eager_nd_rowsum

    def f(x, acc):
        if write == "twice":
            acc.add_(nd(x * 2))
            acc.mul_(2)
        elif write == "slice":
            acc[:, :8].add_(nd(x * 2)[:, :8])
        elif write == "out":
            torch.add(acc, nd(x * 2), out=acc)
        elif write == "setitem":
            acc[:, :8] = nd(x * 2)[:, :8]
        elif write == "foreach":
            torch._foreach_add_([acc], [nd(x * 2)])
        else:
            acc += nd(x * 2)
        return x * 3

    _, run_dir = compile_run(f, (torch.randn(16, 64), torch.zeros(16, 64)), "determ_eager", tmp_path, write,
                             check="determinism")
    report = load(run_dir)[1]
    assert report["divergent"], report
    assert [r["op"] for r in report["findings"][0]["root_causes"]] == ["determ_test.eager_nd_rowsum"], report


@pytest.mark.parametrize("write", ["method", "setitem", "foreach", "view"])
def test_a_value_written_in_place_in_a_dynamo_graph_is_what_its_later_readers_read(tmp_path, write):
    """``y.add_(v)``, ``y[:, :8] = v``, ``torch._foreach_add_([y], [v])``, ``y[:, :8].add_(v)`` leave ``y``'s node
    name on every later reader of ``y``: the reader's input was ``y`` as first made, whose record agrees, and
    ``tanh``, innocent, was the root cause of the nondeterministic ``v``."""
    import eager_helpers  # noqa: F401  (determ_test::eager_nd_rowsum, a genuinely nondeterministic op)

    nd = torch.ops.determ_test.eager_nd_rowsum

    def f(x):
        y = x * 2
        if write == "method":
            y.add_(nd(x))
        elif write == "setitem":
            y[:, :8] = nd(x)[:, :8]
        elif write == "foreach":
            torch._foreach_add_([y], [nd(x)])
        else:
            y[:, :8].add_(nd(x)[:, :8])
        return torch.tanh(y) * 3

    _, run_dir = compile_run(f, (torch.randn(16, 64),), "determ_eager", tmp_path, write, check="determinism")
    report = load(run_dir)[1]
    assert report["divergent"], report
    assert [r["op"] for r in report["findings"][0]["root_causes"]] == ["determ_test.eager_nd_rowsum"], report


@pytest.mark.parametrize("check", ["determinism", "accuracy"])
def test_a_dynamo_graph_running_vmap_and_grad_is_traced_by_the_tensors_the_wrappers_wrap(tmp_path, check):
    """``torch.vmap`` and ``torch.func.grad`` in a Dynamo graph (Mamba's pure-torch scan): inside them the values are
    wrappers with no memory, and determ_eager stopped the program ("Cannot access data pointer of Tensor that doesn't
    have storage"); the eager reference ran under no_grad, where ``grad`` gave zeros, a false divergence."""
    def per_row(r, w):
        r = r * 2
        r[0] = 0.5  # an item assignment inside the vmap: its kept value was a dead wrapper
        return torch.tanh(r) + w.sum()

    def f(x, w):
        g = torch.func.grad(lambda a: (a * w).sum())(x)
        return torch.vmap(per_row, in_dims=(0, None))(x, w) + g

    x, w = torch.randn(4, 3), torch.randn(3)
    out, run_dir = compile_run(f, (x, w), "determ_eager", tmp_path, check, check=check)
    assert torch.equal(out, f(x, w))
    recs, report = load(run_dir)
    assert not report["divergent"] and report["checker_errors"] == [] and report["notes"] == [], report
    (tanh,) = [r for r in recs if r.op == "torch.tanh"]
    expect = x * 2
    expect[:, 0] = 0.5
    assert tanh.shape == [4, 3] and tanh.hash == format_hash(hash_tensor(torch.tanh(expect)))
    if check == "accuracy":
        from determ_backend.backends.eager import eager_node_values  # the reference keeps the written batch
        torch._dynamo.reset()
        graphs = []
        torch.compile(f, backend=lambda gm, ex: graphs.append(gm) or gm)(x, w)
        args = {"l_x_": x, "l_w_": w}
        vals = eager_node_values(graphs[0], [args[n.name] for n in graphs[0].graph.nodes if n.op == "placeholder"])
        (setitem,) = [v for k, v in vals.items() if k.startswith("setitem")]
        assert torch.equal(setitem, expect)


def test_a_nodes_source_is_the_innermost_frame_outside_torch():
    """A functional collective's stack trace ends in torch's ``_functional_collectives.py``: its records and
    findings pointed there instead of at the user's ``funcol.all_reduce(...)``."""
    import torch.fx as fx
    from determ_backend.backends.instrument import node_source

    torch_file = os.path.join(os.path.dirname(torch.__file__), "distributed", "_functional_collectives.py")
    g = fx.Graph()
    n = g.call_function(torch.relu, (g.placeholder("x"),))
    n.meta["stack_trace"] = (f'  File "/home/u/train.py", line 16, in g\n    s = funcol.all_reduce(x, "sum", grp)\n'
                             f'  File "{torch_file}", line 179, in all_reduce\n    tensor = op(self)\n')
    assert node_source(n) == "/home/u/train.py:16 (g)"


def test_determinism_check_is_clean_on_deterministic_model(tmp_path):
    torch.manual_seed(0)
    _, run_dir = compile_run(MLP(), (torch.randn(4, 8),), "determ_eager", tmp_path, "clean", check="determinism")
    assert load(run_dir)[1]["divergent"] is False


def test_cross_run_diff_localizes_one_ulp_weight_change(tmp_path, capsys):
    torch.manual_seed(0)
    m, x = MLP(), torch.randn(4, 8)
    compile_run(m, (x,), "determ_aot_eager", tmp_path, "a")
    with torch.no_grad():
        w = m.layers[2].weight
        w[1, 3] = torch.nextafter(w[1, 3], torch.tensor(float("inf")))
    compile_run(m, (x,), "determ_aot_eager", tmp_path, "b")
    assert cli(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["first_divergence"]["node"] == "layers.2.weight"
    assert [r["node"] for r in out["root_causes"]] == ["layers.2.weight"]
    assert cli(["diff", str(tmp_path / "a"), str(tmp_path / "a")]) == 0


def test_online_reference_reports_divergence(tmp_path):
    torch.manual_seed(0)
    m, x = MLP(), torch.randn(4, 8)
    compile_run(m, (x,), "determ_eager", tmp_path, "ref")
    x2 = x.clone()
    x2[0, 0] += 1e-3
    _, run_dir = compile_run(m, (x2,), "determ_eager", tmp_path, "new", reference=str(tmp_path / "ref"))
    report = load(run_dir)[1]
    assert report["divergent"] and report["first_divergence"]["check"] == "reference"
    assert report["first_divergence"]["node"] == "l_x_"


def test_reference_calls_the_run_never_made_are_said_not_compared(tmp_path, caplog):
    """The reference recorded a training step (forward and backward); a run of the forward alone compared clean and
    said nothing of the backward it never made (a run that stopped early read as matching its reference)."""
    torch.manual_seed(0)
    m, x = MLP(), torch.randn(4, 8)
    compile_run(m, (x,), "determ_aot_eager", tmp_path, "ref", backward=True)
    with caplog.at_level(logging.WARNING, logger="determ_backend.backends.run"):
        _, run_dir = compile_run(m, (x,), "determ_aot_eager", tmp_path, "fwd", reference=str(tmp_path / "ref"))
    report = load(run_dir)[1]
    notes = [n for n in report["notes"] if n.get("check") == "reference" and "not_compared" in n]
    assert not report["divergent"] and len(notes) == 1
    assert {tuple(k[:2]) for k in notes[0]["not_compared"]} == {("g0", "aot_backward")}
    assert "never made by this run" in caplog.text
    _, same = compile_run(m, (x,), "determ_aot_eager", tmp_path, "same", backward=True,
                          reference=str(tmp_path / "ref"))
    assert not [n for n in load(same)[1]["notes"] if "not_compared" in n]


@pytest.mark.parametrize("content,needle", [
    ("", "not a determ trace"),
    ('{"format": "determ-trace", "version": 1}\n{"graph": "g0", "stage"', "corrupt or truncated"),
    ('{"format": "determ-trace", "version": 1}\n', "truncated trace"),
    ("garbage\n", "not a determ trace"),
])
def test_diff_bad_trace_files_exit_2_with_one_line(tmp_path, capsys, content, needle):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    assert cli(["diff", str(bad), str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and str(bad) in err and len(err.splitlines()) == 1


def test_diff_missing_file(tmp_path, capsys):
    assert cli(["diff", str(tmp_path / "nope"), str(tmp_path / "nope2")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_config_errors_are_one_line():
    with pytest.raises(ConfigError, match=r"options\['check'\]='speed': unknown check"):
        load_config({"check": "speed"}, env={})
    with pytest.raises(ConfigError, match="REPRO_LEVEL"):
        load_config(env={"REPRO_LEVEL": "7"})
    with pytest.raises(ConfigError, match="unknown determ option"):
        load_config({"bogus": 1}, env={})


def test_entry_point_works_in_a_fresh_process_without_import(tmp_path):
    code = textwrap.dedent(f"""
        import torch
        m = torch.nn.Linear(3, 2)
        y = torch.compile(m, backend="determ_aot_eager", options={{"dir": {str(tmp_path)!r}, "run_id": "ep"}})(torch.randn(2, 3))
        print("ok", y.shape)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "ep" / "trace.jsonl").is_file()
    recs, _ = load(tmp_path / "ep")
    assert {"weight", "bias"} <= {r.node for r in recs if r.kind == "param"}


class _Extra(torch.nn.Module):
    """MLP with optional extra ops in the middle; optionally a perturbed last layer."""

    def __init__(self, extra: bool):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2, self.l3 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.extra = extra

    def forward(self, x):
        h = self.l1(x).relu()
        if self.extra:
            h = (h * 1.0).abs()
        h = self.l2(h).relu()
        return self.l3(h).relu().sin()


def test_one_extra_op_does_not_misalign_and_root_is_found(tmp_path, capsys):
    x = torch.randn(4, 8)
    compile_run(_Extra(False), (x,), "determ_eager", tmp_path, "base")
    m = _Extra(True)
    with torch.no_grad():
        m.l3.bias[0] += 0.5
    compile_run(m, (x,), "determ_eager", tmp_path, "extra")
    assert cli(["diff", str(tmp_path / "base"), str(tmp_path / "extra"), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert [r["node"] for r in out["root_causes"]] == ["l3.bias"]
    assert out["unmatched_b"] == 2  # the two extra ops, nothing else


def test_saved_tensors_give_exact_metrics_in_tolerance_diff(tmp_path, capsys):
    torch.manual_seed(0)
    m, x = MLP(), torch.randn(4, 8)
    compile_run(m, (x,), "determ_eager", tmp_path, "a", save_tensors=True)
    x2 = x.clone()
    x2[0, 0] += 1e-6
    compile_run(m, (x2,), "determ_eager", tmp_path, "b", save_tensors=True)
    stored = list((tmp_path / "a" / "tensors").glob("*.safetensors"))
    assert stored and len(stored) == len({r.hash for r in load(tmp_path / "a")[0] if r.hash})
    assert cli(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"]) == 1
    bitwise = json.loads(capsys.readouterr().out)
    assert bitwise["first_divergence"]["node"] == "l_x_"
    assert "max_abs" in bitwise["first_divergence"]["metrics"]
    assert cli(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--tol", "1e-4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["divergent"] is False


def test_options_mix_determ_settings_and_inductor_config():
    from determ_backend.backends.core import split_options

    determ, ind = split_options({"check": "accuracy", "DETERM_DIR": "x", "max_autotune": False,
                                 "cpp.simdlen": 0}, "inductor")
    assert determ == {"check": "accuracy", "DETERM_DIR": "x"}
    assert ind == {"max_autotune": False, "cpp.simdlen": 0}
    with pytest.raises(ConfigError, match="neither determ settings nor inductor config"):
        split_options({"bogus_knob": 1}, "inductor")
    with pytest.raises(ConfigError, match="determ_aot_eager"):
        split_options({"max_autotune": True}, "aot_eager")


def test_recompiles_with_dynamic_shapes_are_traced(tmp_path):
    torch.manual_seed(0)
    torch._dynamo.reset()
    m = MLP()
    f = torch.compile(m, backend="determ_aot_eager", options={"dir": str(tmp_path), "run_id": "dyn"})
    for n in (3, 5, 7):
        f(torch.randn(n, 8))
    from determ_backend.backends import run as run_mod

    run_mod.finish_all()
    recs, _ = load(tmp_path / "dyn")
    assert len({r.graph for r in recs}) == 2  # static first compile, then a dynamic-shape recompile
    batch_shapes = {tuple(r.shape) for r in recs if r.kind == "input" and len(r.shape) == 2 and r.shape[1] == 8}
    assert batch_shapes == {(3, 8), (5, 8), (7, 8)}


def test_backward_inputs_saved_by_the_forward_are_not_read_again_and_trace_the_same(tmp_path, monkeypatch):
    from determ_backend.fingerprint import core
    torch.manual_seed(0)
    m, x = MLP(), torch.randn(5, 8)
    read = []  # every tensor the recorder reads goes through its batch's add (add_known: a fingerprint it has)
    real = core.FingerprintBatch.add
    monkeypatch.setattr(core.FingerprintBatch, "add", lambda self, t: read.append(t.shape) or real(self, t))
    _, on = compile_run(m, (x,), "determ_aot_eager", tmp_path, "memo", backward=True)
    reads_on = len(read)
    _, off = compile_run(m, (x,), "determ_aot_eager", tmp_path, "nomemo", backward=True, reuse_saved=False)
    (recs_on, _), (recs_off, _) = load(on), load(off)
    reads_off = len(read) - reads_on
    fw = {r.hash for r in recs_off if r.stage == "aot_forward"}
    saved = [r for r in recs_off if r.stage == "aot_backward" and r.kind in ("input", "param") and r.hash in fw]
    assert len(saved) >= 2 and reads_off - reads_on == len(saved)  # what the forward returned was not read again
    fields = lambda recs: [(r.graph, r.stage, r.node, r.hash, r.stats, r.shape) for r in recs]
    assert fields(recs_on) == fields(recs_off)


def test_a_write_through_data_between_forward_and_backward_is_seen_only_with_reuse_off(tmp_path):
    """``tensor.data`` writes bypass the version counter: autograd does not see them, and neither does the reuse
    of the forward's fingerprints; ``DETERM_REUSE_SAVED=0`` reads the saved tensors again and does."""
    from determ_backend.backends import run as run_mod
    from determ_backend.fingerprint.core import hash_tensor
    seen = {}
    for reuse in (True, False):
        torch.manual_seed(0)
        m, x = MLP(), torch.randn(5, 8)
        torch._dynamo.reset()
        opts = {"dir": str(tmp_path), "run_id": f"reuse{reuse}", "reuse_saved": reuse}
        y = torch.compile(m, backend="determ_aot_eager", options=opts)(x)
        before = hash_tensor(m.layers[2].weight)
        m.layers[2].weight.data.mul_(2.0)  # the saved weight changes; its version counter does not
        y.sum().backward()
        run_mod.finish_all()
        recs, _ = load(tmp_path / f"reuse{reuse}")
        (w,) = [r for r in recs if r.stage == "aot_backward" and r.node == "layers.2.weight"]
        seen[reuse] = (int(w.hash, 16), before, hash_tensor(m.layers[2].weight))
    assert seen[True][0] == seen[True][1]  # the forward's fingerprint: the write is not seen
    assert seen[False][0] == seen[False][2] != seen[False][1]  # read again: the doubled weight


def test_a_functional_collective_is_judged_at_its_wait_not_read_in_flight():
    """``_c10d_functional.all_reduce`` returns a tensor that is final only after ``wait_tensor``: the collective
    is not captured (read in flight, a twin run's fingerprint differed at random), its wait is."""
    import torch.fx as fx
    import torch.distributed._functional_collectives  # noqa: F401  (registers the ops)
    from determ_backend.backends.instrument import graph_node_infos

    g = fx.Graph()
    x = g.placeholder("x")
    ar = g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
    done = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (ar,))
    g.output(done)
    infos, index = graph_node_infos(fx.GraphModule(torch.nn.Module(), g))
    assert infos[index[ar.name]].kind == "view" and infos[index[done.name]].kind == "node"
    assert infos[index[done.name]].inputs == (ar.name,)


def test_every_form_of_in_place_write_in_a_dynamo_graph_is_what_later_readers_read():
    """The forms a Dynamo graph writes in place with, each read back by the next: a method, ``inplace=True``
    (``nn.ELU(inplace=True)``, the flag passed by position), ``out=``, ``+=``, an item assignment, a foreach op, a write through a view (which
    adds to what the tensor holds), a write into an input (a symptom: ``writes_input``); ``n += 1`` of a size is
    no write."""
    from determ_backend.backends.instrument import graph_node_infos

    graphs = []

    def grab(gm, example_inputs):
        graphs.append(gm)
        return gm

    relu = torch.nn.ELU(inplace=True)  # reaches the graph as F.elu(y, 1.0, True): the flag passed by position

    def f(x, acc):
        y = x * 2
        y.add_(1)
        r1 = y * 1
        relu(y)
        r2 = y * 1
        torch.mul(y, 3, out=y)
        r3 = y * 1
        y += x
        r4 = y * 1
        y[:, :1] = 0
        r5 = y * 1
        torch._foreach_mul_([y, x], 2.0)
        r6 = y * 1
        y[:, :2].sub_(1)
        r7 = y * 1
        acc.mul_(0.5)
        n = x.shape[0]
        n += 1
        return r1, r2, r3, r4, r5, r6, r7, y.sum() * n

    torch._dynamo.reset()
    torch.compile(f, backend=grab, fullgraph=True)(torch.randn(4, 4), torch.ones(4, 4))
    gm = graphs[0]
    infos, index = graph_node_infos(gm)
    nodes = list(gm.graph.nodes)
    reads = [infos[index[n.name]].inputs for n in nodes if n.op == "call_function" and n.target is operator.mul
             and len(n.args) == 2 and n.args[1] == 1]
    writers = [n.name for n in nodes if n.op in ("call_function", "call_method")
               and (str(n.target).endswith("_") or n.target in (operator.iadd, operator.setitem)
                    or n.target is torch.nn.functional.elu or "out" in n.kwargs or "_foreach_" in str(n.target))
               and n.target is not torch._C._set_grad_enabled]
    y_writers = writers[:6] + [writers[6]]  # add_, elu, mul(out=), iadd, setitem, _foreach_mul_, sub_
    expect = [(y_writers[0],), (y_writers[1],), (y_writers[2],), (y_writers[3],), (y_writers[4],),
              (f"{y_writers[5]}.0",), (f"{y_writers[5]}.0", y_writers[6])]
    assert reads == expect, (reads, writers)
    acc_writer = writers[7]
    assert infos[index[acc_writer]].extra["writes_input"].endswith("acc_")
    assert [i.node for i in infos if (i.extra or {}).get("writes_input")] == [y_writers[5], acc_writer]  # x: foreach


@pytest.mark.slow
def test_compile_mode_reaches_inductor_as_it_does_plain_inductor(tmp_path, caplog):
    """``torch.compile(..., mode=)`` stands for inductor options; determ_inductor applied none of them."""
    import torch._inductor.config as ic
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    seen = []

    class Probe(CustomGraphPass):
        def __call__(self, graph):
            seen.append((ic.max_autotune, ic.coordinate_descent_tuning))

        def uuid(self):
            return get_hash_for_files((__file__,))

    def run(backend, mode, **kw):
        torch._dynamo.reset()
        f = torch.compile(lambda x: torch.sin(x) + 1, backend=backend, mode=mode, **kw)
        return f(torch.ones(4))

    with ic.patch(post_grad_custom_post_pass=Probe(), fx_graph_cache=False):
        run("inductor", "max-autotune-no-cudagraphs")
        run("determ_inductor", "max-autotune-no-cudagraphs")
        run("determ_inductor", "default")
    assert seen == [(True, True), (True, True), (False, False)]
    with caplog.at_level("WARNING"):
        run("determ_aot_eager", "max-autotune")  # no inductor underneath: said, not silently dropped
    assert "ignores it" in caplog.text


@pytest.mark.slow
def test_a_graph_that_only_hands_on_its_input_is_not_called_untraced(tmp_path, caplog):
    """``loss.backward()`` inside a compiled step breaks the graph; the graph after it returns ``loss.detach()``
    alone (no kernel, no wrapper to instrument), and determ warned that only its inputs and outputs were
    traced: nothing of it is, and nothing needs to be."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 4)

    def step(x):
        loss = m(x).square().mean()
        loss.backward()
        return loss.detach()

    f = torch.compile(step, backend="determ_inductor", options={"dir": str(tmp_path), "run_id": "r"})
    with caplog.at_level("WARNING"):
        f(torch.randn(4, 8))
    assert "not traced" not in caplog.text and "instrumentable" not in caplog.text


@pytest.mark.slow
def test_the_accuracy_check_says_it_gives_an_inductor_graph_eagers_draws(tmp_path, caplog):
    """Under DETERM_CHECK=accuracy an inductor graph is compiled with fallback_random: a dropout model's masks
    are then eager's, not plain inductor's, and the program's losses differ from a plain run; that is said."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 4)).train()
    f = torch.compile(m, backend="determ_inductor", options={"dir": str(tmp_path), "run_id": "r", "check": "accuracy"})
    with caplog.at_level("WARNING"):
        f(torch.randn(8, 16)).sum().backward()
    assert "graph g0 draws random numbers" in caplog.text and "fallback_random" in caplog.text



def test_the_float64_reference_widens_the_float_pairs_of_complex_values(tmp_path):
    """Inductor's backward of a complex rotary embedding views complex values as float32 pairs (``view.dtype``):
    in the float64 reference they met float64 values ("expected m1 and m2 to have the same dtype"), the reference
    could not run, and the graph was judged against eager alone."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from determ_backend.backends.checks import _to64, graph_in_dtype

    def f(z, w):
        pairs = z.view(torch.float32).reshape(4, 8)  # complex64 (4, 4) -> its real and imaginary parts
        return (pairs @ w,)

    z, w = torch.randn(4, 4, dtype=torch.complex64), torch.randn(8, 3)
    gm = make_fx(f)(z, w)
    assert any("view.dtype" in str(n.target) for n in gm.graph.nodes)
    (out,) = graph_in_dtype(gm, torch.float64)(*_to64([z, w]))
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, z.to(torch.complex128).view(torch.float64).reshape(4, 8) @ w.double())


def test_a_graph_holding_collectives_is_known_in_dynamo_and_aot_form(free_port):
    """A Dynamo graph names a functional collective by its packet (``_c10d_functional.all_reduce``, no namespace
    attribute): it was not seen as a collective, and the batch-invariance check's sub-batch runs, which stop at a
    rank's first divergent one, issued it on one rank alone (the program's next all_reduce got another's values)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.fx as fx
    from determ_backend.backends.eager import holds_collectives

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        graphs = []
        torch._dynamo.reset()
        torch.compile(lambda x: x * 2 + funcol.all_reduce(x * 3, "sum", dist.group.WORLD),
                      backend=lambda gm, ex: graphs.append(gm) or gm)(torch.rand(4, 4))
    finally:
        dist.destroy_process_group()
    assert holds_collectives(graphs[0])
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0")))
    assert holds_collectives(fx.GraphModule(torch.nn.Module(), g))
    g = fx.Graph()
    g.output(g.call_function(torch.relu, (g.placeholder("x"),)))
    assert not holds_collectives(fx.GraphModule(torch.nn.Module(), g))


def test_an_unrecorded_region_leaves_out_this_threads_calls_alone(tmp_path):
    """A repro flow's own run of a graph (``unrecorded()``) is no call of the program's; a call another thread of the
    program makes meanwhile is one, and is recorded."""
    import threading

    from determ_backend.backends.checks import unrecorded
    from determ_backend.trace.stream import read_trace

    torch._dynamo.reset()
    torch.manual_seed(0)
    f = torch.compile(torch.nn.Linear(4, 4), backend="determ_aot_eager",
                      options={"dir": str(tmp_path), "run_id": "r"})
    x = torch.randn(2, 4)
    with torch.no_grad():
        f(x)  # call 0
        with unrecorded():
            f(x)  # this thread's: not a call
            errors = []

            def other():
                try:
                    with torch.no_grad():
                        f(x)
                except Exception as e:  # shown by the assertion below
                    errors.append(repr(e))

            worker = threading.Thread(target=other)  # another thread's: call 1
            worker.start()
            worker.join(60)
        f(x)  # call 2
    run_mod.finish_all()
    calls = sorted({r.call for r in read_trace(tmp_path / "r")})
    assert not errors and calls == [0, 1, 2], (calls, errors)
