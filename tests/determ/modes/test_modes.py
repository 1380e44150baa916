"""HashMode, HashDebugTrace (log + JSONL + repro-tools diff) and BitwiseEquivalenceMode."""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys

import pytest
import torch

from determ_backend import devices
from determ_backend.compare import compare_traces
from determ_backend.errors import ConfigError, NondeterminismError, TraceFormatError
from determ_backend.modes.core import BitwiseEquivalenceMode, HashDebugTrace, HashMode, read_hash_log, read_hash_log_file
from determ_backend.fingerprint.core import hash_tensor
from determ_backend.trace.stream import format_hash, read_trace, read_trace_file
from eager_helpers import (diff_logs, eager_nd_backward, eager_nd_rowsum, flip_nan_payload, flip_zero_sign, make,
                           nodes, root_ops, traced_run, train_step)
from repro_tools.cli import main as cli_main
from paths import ROOT

ND_OP = "determ_test.eager_nd_rowsum.default"
REPO = ROOT


# -- HashDebugTrace + diff --------------------------------------------------------------------------

@pytest.fixture
def two_logs(tmp_path):
    traced_run(tmp_path / "trace_first.log")
    traced_run(tmp_path / "trace_second.log")
    return tmp_path / "trace_first.log", tmp_path / "trace_second.log"


@pytest.mark.parametrize("suffix", [".log", ".jsonl"])
def test_cli_diff_names_the_nondeterministic_op(two_logs, suffix):
    a, b = (p.with_suffix(suffix) for p in two_logs)
    r = subprocess.run([sys.executable, "-m", "repro_tools.cli", "diff", str(a), str(b)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    root_line = [ln for ln in r.stdout.splitlines() if ln.startswith("root cause:")]
    assert len(root_line) == 1 and f"op={ND_OP}" in root_line[0], r.stdout
    marked = [ln for ln in r.stdout.splitlines() if ln.startswith("* ")]
    assert len(marked) == 1 and "eager_nd_rowsum" in marked[0]


def test_only_the_nondeterministic_op_is_root_cause(two_logs):
    cmp = diff_logs(*two_logs)
    assert root_ops(cmp) == [ND_OP]
    downstream = [p for p in cmp.pairs if p.equal is False and not p.root_cause]
    assert downstream, "the divergence must propagate downstream (forward and backward)"
    assert any((p.rec.extra or {}).get("backward") for p in downstream)


def test_log_and_jsonl_hold_the_same_records(two_logs):
    log, jsonl = two_logs[0], two_logs[0].with_suffix(".jsonl")
    from_log, from_jsonl = read_hash_log(log), read_trace(jsonl)
    assert [r.__dict__ for r in from_log] == [r.__dict__ for r in from_jsonl]
    assert {r.kind for r in from_log} >= {"param", "input", "node"}


def test_identical_runs_diff_clean(tmp_path, capsys):
    traced_run(tmp_path / "a.log", nondet=False)
    traced_run(tmp_path / "b.log", nondet=False)
    assert cli_main(["diff", str(tmp_path / "a.log"), str(tmp_path / "b.log")]) == 0
    assert "identical" in capsys.readouterr().out


def test_a_hook_only_one_run_has_is_named_not_the_op_after_it(tmp_path, capsys):
    """Run B's forward hook changes a layer's output: the hook's add is the root cause, not the relu it feeds."""
    for name, hook in (("a", False), ("b", True)):
        model, x = make(nondet=False)
        if hook:
            model.a.register_forward_hook(lambda mod, args, out: out + 1e-3)
        with HashDebugTrace(log_path=tmp_path / f"{name}.log", module=model):
            train_step(model, x)
    cmp = diff_logs(tmp_path / "a.log", tmp_path / "b.log")
    assert [(p.rec.op, p.metrics.get("only_in")) for p in cmp.root_causes] == [("aten.add.Tensor", "b")]
    assert cmp.root_causes[0].rec.source.endswith(f"test_modes.py:{_lineno_of('out + 1e-3')}")
    assert cli_main(["diff", str(tmp_path / "a.log"), str(tmp_path / "b.log")]) == 1
    root = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("root cause")]
    assert len(root) == 1 and "only B ran" in root[0] and "op=aten.add.Tensor" in root[0]


def test_a_hook_feeding_a_layer_norm_leaves_its_outputs_of_one_shape_paired(tmp_path, capsys):
    """The layer norm after a hooked block has two outputs of one shape (mean and rstd): the alignment's mending
    traded them, left rstd unpaired, and blamed it as an op only A ran next to the hook's add."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(32, 32)

        def forward(self, x):
            return x + self.fc(x)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block, self.ln, self.head = Block(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)

        def forward(self, x):
            return self.head(self.ln(self.block(x)))

    for name in ("a", "b"):
        torch.manual_seed(0)
        model = Net()
        if name == "b":
            model.block.register_forward_hook(lambda mod, args, out: out + 1e-3)
        with HashDebugTrace(log_path=tmp_path / f"{name}.log", module=model):
            model(torch.randn(2, 8, 32)).sum().backward()
    cmp = diff_logs(tmp_path / "a.log", tmp_path / "b.log")
    assert [(p.rec.op, p.metrics.get("only_in")) for p in cmp.root_causes] == [("aten.add.Tensor", "b")]
    assert [p.rec.op for p in cmp.pairs if not p.paired] == ["aten.add.Tensor"]  # the hook's add, nothing else


def test_a_partner_reached_through_an_op_both_runs_have_is_not_kept(tmp_path):
    """B computes two independent adds in the other order and runs one extra op: A's ``y + a`` kept B's ``u + a``
    as partner (it reads ``u = exp(y)``, an op both runs have), both ``z`` records went unpaired, and the mul that
    differs was no longer named."""
    def run_a(a, b):
        y = a * b
        u, z = y.exp(), y + a
        v = u + a
        return (z * 2.0).sum() + v.sum()

    def run_b(a, b):
        y = a * b
        u = y.exp()
        v = u + a
        z = y + a
        _ = a.neg()
        return (z * 2.001).sum() + v.sum()

    for name, fn in (("a", run_a), ("b", run_b)):
        torch.manual_seed(0)
        a, b = torch.randn(4, 8), torch.randn(4, 8)
        with HashDebugTrace(log_path=tmp_path / f"{name}.log"):
            fn(a, b)
    cmp = diff_logs(tmp_path / "a.log", tmp_path / "b.log")
    assert [p.rec.op for p in cmp.root_causes] == ["aten.mul.Tensor"], [(p.rec.node, p.rec.op) for p in cmp.root_causes]
    assert [p.rec.op for p in cmp.pairs if not p.paired] == ["aten.neg.default"]


def _lineno_of(text: str) -> int:
    with open(__file__, encoding="utf-8") as f:
        return next(i for i, ln in enumerate(f, 1) if text in ln and "_lineno_of" not in ln)


def test_extra_op_does_not_misalign(tmp_path):
    traced_run(tmp_path / "a.log")
    traced_run(tmp_path / "b.log", extra=True)
    cmp = diff_logs(tmp_path / "a.log", tmp_path / "b.log")
    assert root_ops(cmp) == [ND_OP]
    extra_b = [p.b.op for p in cmp.pairs if p.a is None]
    assert extra_b and set(extra_b) == {"aten.mul.Tensor"}  # the extra op and its backward, nothing else
    assert not [p for p in cmp.pairs if p.b is None]


def _block(x, w):
    return torch.tanh(x @ w)


def test_an_extra_call_renumbering_names_pairs_no_values_of_two_shapes(tmp_path):
    """Run A calls a function once more first (on fewer rows): its names' call counts shift, so a name of B stands
    for a value of another shape in A (the weight for the input).  Values of two shapes never pair: no divergence,
    A's extra call is A's alone."""
    torch.manual_seed(0)
    w, x = torch.randn(8, 8), torch.randn(6, 8)
    for name, extra in (("a", True), ("b", False)):
        with HashMode(trace_path=tmp_path / f"{name}.jsonl"):
            if extra:
                _block(x[:2], w)
            _block(x, w).sum()
    cmp = compare_traces(read_trace(tmp_path / "a.jsonl"), read_trace(tmp_path / "b.jsonl"))
    assert all(p.a.shape == p.b.shape for p in cmp.pairs if p.paired)
    assert not cmp.divergent and not cmp.root_causes
    assert {p.a.op for p in cmp.pairs if p.b is None} >= {"aten.mm.default", "aten.tanh.default"}


def test_a_value_computed_to_another_shape_is_named(tmp_path):
    """Run B slices one row more (a slicing bug): the slice of one name consumes the same value in both runs, so
    its two shapes pair as one value that differs, and the slice is named -- not two ops each run ran alone."""
    torch.manual_seed(0)
    lin, x = torch.nn.Linear(8, 8), torch.randn(2, 6, 8)
    for name, rows in (("a", 4), ("b", 5)):
        with HashMode(trace_path=tmp_path / f"{name}.jsonl"):
            torch.relu(lin(x)[:, :rows]).mean(1).sum()
    cmp = compare_traces(read_trace(tmp_path / "a.jsonl"), read_trace(tmp_path / "b.jsonl"))
    assert [p.rec.op for p in cmp.root_causes] == ["aten.slice.Tensor"]
    assert cmp.root_causes[0].metrics.get("shape_mismatch") == [[2, 4, 8], [2, 5, 8]]


class _Checkpointed(torch.nn.Module):
    def __init__(self, checkpointed: bool):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.checkpointed = checkpointed

    def block(self, x):
        return torch.nn.functional.scaled_dot_product_attention(self.a(x), self.b(x), x).tanh()

    def forward(self, x):
        if self.checkpointed:
            return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False).sum()
        return self.block(x).sum()


def test_a_checkpointed_run_against_a_plain_one_shows_no_false_divergence(tmp_path):
    """Activation checkpointing recomputes the forward inside the backward: its ops take names the plain run gives
    its backward ops, for other values.  Gradients are bitwise equal, so nothing diverges."""
    grads = []
    x = torch.randn(2, 2, 4, 8)
    for name, ckpt in (("a", False), ("b", True)):
        m = _Checkpointed(ckpt)
        with HashMode(trace_path=tmp_path / f"{name}.jsonl", module=m):
            m(x).backward()
        grads.append([p.grad for p in m.parameters()])
    assert all(torch.equal(g, h) for g, h in zip(*grads))
    cmp = compare_traces(read_trace(tmp_path / "a.jsonl"), read_trace(tmp_path / "b.jsonl"))
    assert not cmp.divergent and not cmp.root_causes, [(p.rec.node, p.metrics) for p in cmp.pairs if p.equal is False]


def test_log_shows_list_inputs_tuple_outputs_and_sources(two_logs):
    text = two_logs[0].read_text()
    assert "in  args[0][1] = " in text  # torch.cat's list input
    recs = read_hash_log(two_logs[0])
    split = [r for r in recs if r.op == "aten.split.Tensor"]
    assert [r.node[-2:] for r in split] == [".0", ".1"] and split[0].inputs == split[1].inputs
    cat = next(r for r in recs if r.op == "aten.cat.default" and not (r.extra or {}).get("backward"))
    assert cat.inputs == [split[1].node, nodes(recs, "aten.mul.Tensor")[0]]
    assert cat.in_hashes == [split[1].hash, next(r.hash for r in recs if r.node == cat.inputs[1])]
    assert all(r.source and r.source.startswith(str(REPO / "tests" / "eager_helpers.py")) for r in split + [cat])


@pytest.mark.parametrize("mutate", ["truncate", "garbage", "not_a_log"])
def test_bad_logs_are_clear_errors(two_logs, tmp_path, mutate, capsys):
    bad = tmp_path / "bad.log"
    text = two_logs[0].read_text()
    bad.write_text({"truncate": text[: len(text) // 2], "garbage": text.replace("    out ", "    oops ", 1),
                    "not_a_log": "hello\n"}[mutate])
    with pytest.raises(TraceFormatError, match="bad.log"):
        read_hash_log(bad)
    assert cli_main(["diff", str(bad), str(two_logs[1])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.log" in err[0]


def test_dynamo_benchmark_runner_pattern(tmp_path, caplog):
    """As PyTorch's dynamo benchmark runner uses it: one log per run, eager (force_eager) vs compiled."""
    model, x = make(nondet=False)
    with HashDebugTrace(log_path=tmp_path / "trace_first.log") as first:
        with torch.compiler.set_stance("force_eager"):
            train_step(torch.compile(model, backend="aot_eager"), x)
    model, x = make(nondet=False)
    with caplog.at_level(logging.WARNING, logger="determ_backend.modes.core"):
        with HashDebugTrace(log_path=tmp_path / "trace_second.log", verbose=False, max_ops_logged=20000) as second:
            train_step(torch.compile(model, backend="aot_eager"), x)
    assert not first.is_active() and first.compiled_ops == 0 and second.compiled_ops > 0
    assert "compiled region: ran eagerly" in (tmp_path / "trace_second.log").read_text()
    assert any("ran eagerly" in r.message for r in caplog.records)
    cmp = diff_logs(tmp_path / "trace_first.log", tmp_path / "trace_second.log")
    assert not cmp.divergent and cmp.summary()["unmatched_a"] == cmp.summary()["unmatched_b"] == 0


# -- HashMode -------------------------------------------------------------------------------------

def _records(fn, **kwargs):
    with HashMode(**kwargs) as m:
        fn()
    return m.records


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied, as language models tie their embedding and output head

    def forward(self, ids):
        return self.head(self.embed(ids))


def test_a_tied_weight_is_named_as_torch_names_it():
    m = _Tied()
    with HashMode(module=m) as hm:
        m(torch.tensor([[1, 2, 3]]))
    assert [r.node for r in hm.records if r.kind == "param"] == [next(n for n, _ in m.named_parameters())] == [
        "embed.weight"]


def test_backward_ops_are_traced_and_named_after_forward_lines():
    model, x = make(nondet=False)
    recs = _records(lambda: train_step(model, x), module=model)
    bw = [r for r in recs if (r.extra or {}).get("backward")]
    assert {"AddmmBackward0", "ReluBackward0"} <= {r.extra["backward"] for r in bw}
    mm_bw = [r for r in bw if r.extra["backward"] == "AddmmBackward0" and r.op == "aten.mm.default"]
    fwd = [r for r in recs if r.op == "aten.addmm.default"]
    assert mm_bw and {r.source for r in mm_bw} <= {r.source for r in fwd}
    assert all("/bw#" in r.node for r in bw)
    assert {"a.weight", "a.bias", "b.weight", "b.bias"} <= {r.node for r in recs if r.kind == "param"}


def test_in_place_updates_are_followed():
    x = torch.ones(4)

    def body():
        x.add_(1)
        return x * 3

    recs = _records(body)
    add = next(r for r in recs if r.op == "aten.add_.Tensor")
    mul = next(r for r in recs if r.op == "aten.mul.Tensor")
    assert mul.inputs[0] == add.node and mul.in_hashes[0] == add.hash
    assert add.in_hashes[0] != add.hash  # the input hash is the value before the update


def test_a_write_through_an_alias_is_followed_for_every_alias():
    """An input found as the very object an earlier op returned is still re-linked after a write through
    another view of its memory (views share the version counter), and a tensor made by no op is an input."""
    def body():
        y = torch.ones(2, 3) * 2
        v = y.view(2, 3)  # a second Python object over the same memory
        v.add_(1)
        return y.sum(), torch.ones(3).new_zeros(2).mul(4)

    recs = _records(body)
    add = next(r for r in recs if r.op == "aten.add_.Tensor")
    total = next(r for r in recs if r.op == "aten.sum.default")
    assert total.inputs == [add.node] and total.in_hashes == [add.hash]
    mul4 = next(r for r in recs if r.op == "aten.mul.Tensor" and r.inputs[0].startswith("aten.new_zeros"))
    assert mul4.in_hashes == [next(r.hash for r in recs if r.node == mul4.inputs[0])]


@pytest.mark.parametrize("make_value", [lambda: torch.tensor([0.0, -0.0]), lambda: torch.tensor([float("nan")] * 2)])
def test_fingerprints_see_signed_zeros_and_nan_payloads(make_value):
    def body():
        return flip_zero_sign(make_value()) if make_value().isnan().sum() == 0 else flip_nan_payload(make_value())

    a, b = _records(body), _records(body)
    cmp = compare_traces(a, b)
    assert [p.rec.op.split(".")[1] for p in cmp.root_causes] in (["flip_zero_sign"], ["flip_nan_payload"])


def test_views_get_hashes_derived_from_their_base():
    base = torch.arange(12.0).reshape(3, 4)

    def body(bump: bool):
        c = base.clone()
        if bump:
            c[2, 3] = -1.0  # the bases differ in one element
        return c.t(), c.clone().t()

    same, other = _records(lambda: body(False)), _records(lambda: body(True))
    views = lambda recs: [r for r in recs if r.op == "aten.t.default"]  # noqa: E731
    assert all(r.extra.get("derived_hash") for r in views(same))
    assert len({r.hash for r in views(same)}) == 1  # equal bases, same geometry
    assert {r.hash for r in views(same)}.isdisjoint({r.hash for r in views(other)})
    assert views(same)[0].hash != next(r.hash for r in same if r.op == "aten.clone.default")


def test_enable_disable_regions():
    m = HashMode()
    m.enable()
    torch.ones(2).sin()
    m.disable()
    torch.ones(2).cos()
    m.enable()
    torch.ones(2).tan()
    m.close()
    ops = [r.op for r in m.records]
    assert "aten.sin.default" in ops and "aten.tan.default" in ops and "aten.cos.default" not in ops
    with pytest.raises(ConfigError):
        m.enable()


def test_trace_path_streams_a_trace(tmp_path):
    with HashMode(trace_path=tmp_path / "t.jsonl", run="r1") as m:
        torch.arange(6.0).reshape(2, 3).unbind(0)
    recs = read_trace(tmp_path / "t.jsonl")
    assert [r.node for r in recs] == [r.node for r in m.records]
    assert [r.node.rsplit(".", 1)[1] for r in recs if r.op == "aten.unbind.int"] == ["0", "1"]


def test_compiled_region_runs_eagerly_and_is_reported(caplog):
    def f(x):
        return torch.relu(x @ x).sin() + 1

    cf = torch.compile(f, backend="eager")
    x = torch.randn(4, 4)
    with caplog.at_level(logging.WARNING, logger="determ_backend.modes.core"):
        with HashMode() as m:
            y = cf(x)
            z = f(x)
    assert torch.equal(y, z)
    compiled = [r.op for r in m.records if (r.extra or {}).get("compiled_region") == "eager"]
    assert compiled == ["aten.mm.default", "aten.relu.default", "aten.sin.default", "aten.add.Tensor"]
    assert m.compiled_ops == 4
    assert any("ran eagerly" in rec.message for rec in caplog.records)


def test_bitwise_mode_says_a_compiled_region_ran_eagerly(caplog):
    cf = torch.compile(lambda x: torch.relu(x @ x).sin(), backend="eager")
    with caplog.at_level(logging.WARNING, logger="determ_backend.modes._bitwise"):
        with BitwiseEquivalenceMode() as bm:
            cf(torch.randn(4, 4))
    assert bm.compiled_ops == 3 and not bm.mismatches
    assert [r.message for r in caplog.records if "ran eagerly" in r.message][:1]


DEVICES = [d if d == "cpu" else pytest.param(d, marks=pytest.mark.gpu) for d in ("cpu", "cuda", "npu", "xpu")]


@pytest.mark.parametrize("device", DEVICES)
def test_modes_on_each_device(device):
    if not devices.is_available(device):
        pytest.skip(f"no {device} device here")
    x = torch.randn(64, 128, device=device, requires_grad=True)
    with HashMode() as m:
        y = x.relu() * 2
        y.sum().backward()
    rec = next(r for r in m.records if r.op == "aten.mul.Tensor")
    assert rec.hash == format_hash(hash_tensor(y)) and rec.dtype == "float32" and rec.shape == [64, 128]
    assert any((r.extra or {}).get("backward") for r in m.records)
    with BitwiseEquivalenceMode(warn=False) as bm:
        torch.nn.functional.dropout(x, 0.5).sum().backward()
    assert bm.mismatches == [] and bm.ops_checked > 0


# -- BitwiseEquivalenceMode -----------------------------------------------------------------------

def test_bitwise_mode_flags_the_nondeterministic_op_in_forward_and_backward():
    # 64 columns of values spread over several magnitudes: two column orders practically always round apart (with
    # 8 columns an unlucky pair of orders summed alike and the op was not flagged)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 64, generator=g) * torch.logspace(-3, 3, 64)).requires_grad_()
    w = torch.randn(3, 64, generator=g)
    with BitwiseEquivalenceMode(warn=False) as m:
        y = eager_nd_backward(eager_nd_rowsum(x).relu())
        (y * w).sum().backward()  # random upstream gradients: row sums depend on the order
    ops = [mm["op"] for mm in m.get_mismatches()]
    assert ops == [ND_OP, ND_OP]
    fwd, bwd = m.get_mismatches()
    assert "backward" not in fwd and fwd["stack"][0].startswith(__file__)
    assert bwd["backward"].startswith("GeneratedBackwardFor_determ_test_eager_nd_backward")
    assert bwd["forward_source"].startswith(__file__)
    assert fwd["max_diff"] > 0 and fwd["shapes"] == [[3, 64], [3, 64]]


@pytest.mark.parametrize("op,name", [(flip_zero_sign, "flip_zero_sign"), (flip_nan_payload, "flip_nan_payload")])
def test_bitwise_mode_respects_signed_zeros_and_nan_payloads(op, name):
    with BitwiseEquivalenceMode(warn=False) as m:
        op(torch.ones(4))
        torch.full((4,), float("nan")) * 2  # deterministic NaNs are not a mismatch
    assert [mm["op"] for mm in m.mismatches] == [f"determ_test.{name}.default"]


def test_bitwise_mode_random_ops_inplace_ops_and_no_side_effects():
    devices.manual_seed(7)
    x = torch.ones(5)
    with BitwiseEquivalenceMode(warn=False) as m:
        d = torch.nn.functional.dropout(torch.ones(1000), 0.5)
        x.add_(1)
        x.mul_(torch.rand(5))
        after = torch.rand(3)
    devices.manual_seed(7)
    ref_d = torch.nn.functional.dropout(torch.ones(1000), 0.5)
    ref_x = (torch.ones(5) + 1).mul_(torch.rand(5))
    assert m.mismatches == [] and m.ops_checked >= 4
    assert torch.equal(d, ref_d) and torch.equal(x, ref_x) and torch.equal(after, torch.rand(3))
    assert not torch.is_anomaly_enabled()


def test_bitwise_mode_runs_an_in_place_restride_onto_the_whole_storage():
    base = torch.arange(16.0)
    with BitwiseEquivalenceMode(warn=False) as m:
        view = base[4:6].as_strided_((12,), (1,), 0)  # reaches bytes outside the view it was called on
    assert m.mismatches == [] and torch.equal(view, torch.arange(12.0))

def test_bitwise_mode_raise_on_mismatch():
    # seeded columns of spread magnitudes, as above: 16 plain randn columns summed alike in two orders often
    # enough to fail depending on what earlier tests drew
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 64, generator=g) * torch.logspace(-3, 3, 64)
    with pytest.raises(NondeterminismError, match="eager_nd_rowsum"):
        with BitwiseEquivalenceMode(raise_on_mismatch=True):
            eager_nd_rowsum(x)


def test_hashdebugtrace_options_validated(tmp_path):
    with pytest.raises(ConfigError, match="jsonl_path"):
        HashDebugTrace(log_path=tmp_path / "x.log", jsonl_path=tmp_path / "x.log")
    (tmp_path / "linked").symlink_to(tmp_path)  # the same file through a linked directory, or a linked file
    with pytest.raises(ConfigError, match="jsonl_path"):
        HashDebugTrace(log_path=tmp_path / "x.log", jsonl_path=tmp_path / "linked" / "x.log")
    (tmp_path / "alias.jsonl").symlink_to(tmp_path / "y.log")
    with pytest.raises(ConfigError, match="jsonl_path"):
        HashDebugTrace(log_path=tmp_path / "y.log", jsonl_path=tmp_path / "alias.jsonl")
    t = traced_run(tmp_path / "lim.log", max_ops_logged=3)
    text = (tmp_path / "lim.log").read_text()
    assert "log limit reached" in text and len(read_hash_log(tmp_path / "lim.log")) < len(read_trace(t.jsonl_path))
    json.loads((tmp_path / "lim.jsonl").read_text().splitlines()[0])


@pytest.mark.parametrize("kwargs,needle", [
    ({"max_ops_logged": "x"}, "max_ops_logged='x'"),
    ({"max_ops_logged": -1}, "max_ops_logged=-1"),
    ({"max_ops_logged": True}, "max_ops_logged=True"),
    ({"max_ops_logged": 2.5}, "max_ops_logged=2.5"),
    ({"verbose": "yes"}, "verbose='yes'"),
    ({"auto_flush": 1}, "auto_flush=1"),
    ({"stats": None}, "stats=None"),
    ({"batch": "8"}, "batch='8'"),
    ({"log_path": 5}, "log_path=5"),
])
def test_hashdebugtrace_bad_options_fail_at_construction(tmp_path, kwargs, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        HashDebugTrace(**{"log_path": tmp_path / "t.log", **kwargs})
    with pytest.raises(ConfigError, match="is a directory"):
        HashDebugTrace(log_path=tmp_path)
    assert not list(tmp_path.iterdir())  # nothing written


def test_hashdebugtrace_jsonl_log_path_names_the_trace(tmp_path):
    t = traced_run(tmp_path / "out.jsonl", nondet=False)
    assert (t.jsonl_path, t.log_path) == (tmp_path / "out.jsonl", tmp_path / "out.log")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "out.log"]
    assert [r.__dict__ for r in read_trace(tmp_path / "out.jsonl")] == [r.__dict__ for r in read_hash_log(t.log_path)]


def test_a_batch_the_host_finished_is_handed_on_early_and_one_waiting_on_a_device_is_not(monkeypatch):
    """Records whose fingerprints the native kernel already computed are handed on after 64 (kept for ``batch``
    ops they outlived the collector's young generations, and full collections walked the heap); a batch that
    waits on device work -- here the torch path, with the native kernel off -- waits for ``batch`` records.
    Either way the records are the same."""
    from determ_backend.fingerprint import _native

    def run():
        with HashMode(batch=512) as m:
            y = torch.arange(8.0)
            for _ in range(100):
                y = y + 1
            seen = len(m.records)
        return len(m.records) - seen, m.records

    if not _native.available():
        pytest.skip("the native kernel is not built here")
    pending, early = run()
    assert 0 < pending < 64 and len(early) > 100
    monkeypatch.setenv("DETERM_NATIVE", "0")
    pending, waited = run()
    assert pending == len(waited)
    assert [(r.node, r.hash) for r in waited] == [(r.node, r.hash) for r in early]


def test_hashdebugtrace_log_holds_each_flushed_batch_while_the_run_goes_on(tmp_path):
    """With auto_flush (the default) the log on disk holds the header and every op of each finished batch while
    the run goes on (a reader can follow it); without, the text waits in memory and lands whole at the end."""
    from determ_backend.modes.log import MAGIC

    x = torch.randn(4)
    log = tmp_path / "live.log"
    with HashDebugTrace(log_path=log, batch=1):
        y = x * 2
        z = y + 1  # settles y; the batch of one op is flushed when it ends
        text = log.read_text()
        assert text.startswith(MAGIC) and "aten.mul.Tensor" in text and "# end:" not in text
    assert [r.op for r in read_hash_log(log)][-2:] == ["aten.mul.Tensor", "aten.add.Tensor"] and z.shape == (4,)

    quiet = tmp_path / "quiet.log"
    with HashDebugTrace(log_path=quiet, batch=1, auto_flush=False):
        x * 2
        assert quiet.read_text() == ""
    assert "aten.mul.Tensor" in [r.op for r in read_hash_log(quiet)]

    dropped = tmp_path / "dropped.log"  # enabled, disabled and let go of without close: what it logged still lands
    mode = HashDebugTrace(log_path=dropped, auto_flush=False)
    mode.enable()
    x * 3
    mode.disable()
    del mode
    assert "aten.mul.Tensor" in [r.op for r in read_hash_log(dropped, allow_partial=True)]


def test_limited_log_footer_counts_agree(tmp_path):
    t = traced_run(tmp_path / "lim.log", max_ops_logged=3)
    total = len(read_trace(t.jsonl_path))
    tf = read_hash_log_file(tmp_path / "lim.log")
    tail = (tmp_path / "lim.log").read_text().splitlines()[-3:]
    assert tail[0] == f"# records in the run: {total}"
    assert tail[1].startswith(f"# records in this log: {len(tf.records)} (limited by max_ops_logged=3")
    assert tail[2] == f"# end: {len(tf.records)} records" and 0 < len(tf.records) < total
    assert tf.complete and "max_ops_logged=3" in tf.limited and f"of {total}" in tf.limited
    full = read_hash_log_file(traced_run(tmp_path / "full.log").log_path)
    assert full.limited is None and len(full.records) == total


def _fresh_step():
    x = torch.linspace(-1, 1, 64).reshape(8, 8).requires_grad_()
    (x @ x).relu().sum().backward()


def test_an_outer_mode_does_not_record_an_inner_modes_fingerprinting():
    with HashMode() as alone:
        _fresh_step()
    with HashMode() as outer:
        with HashMode() as inner:
            _fresh_step()
    expected = [(r.node, r.hash) for r in alone.records]
    assert [(r.node, r.hash) for r in inner.records] == expected
    assert [(r.node, r.hash) for r in outer.records] == expected
    with HashMode() as outer:
        with BitwiseEquivalenceMode():
            _fresh_step()
    # the outer mode sees the user's ops (each run twice by the inner mode), none of its fingerprinting
    assert {r.op for r in outer.records} <= {r.op for r in alone.records}


def test_a_recorder_gives_back_its_storage_references_when_it_goes():
    """The producer table holds weak references to storages as plain numbers; they are given back (the table
    emptied) when the mode and its recorder are collected, not leaked."""
    import gc

    from determ_backend.modes.core import HashMode

    x = torch.randn(8, 8)
    mode = HashMode()
    with mode:
        y = (x * 2).relu()
    table = mode._recorder._producers
    assert table  # x is alive, so its entry outlives the flush at exit
    del mode
    gc.collect()
    assert table == {} and y.shape == (8, 8)


@pytest.mark.parametrize("kind", ["HashMode", "HashDebugTrace"])
def test_a_mode_let_go_of_is_freed_at_once_without_the_cycle_collector(kind, tmp_path):
    """A mode made per step and dropped goes with its last reference, records and settling tensors with it:
    nothing in it points back at it, so it is not left for a full garbage collection to find (on a small
    training step those collections cost more than a third of a plain step)."""
    import gc
    import weakref

    x = torch.randn(8, 8, requires_grad=True)
    was_on = gc.isenabled()
    gc.disable()
    try:
        mode = HashMode() if kind == "HashMode" else HashDebugTrace(log_path=tmp_path / "t.log")
        with mode:
            (x * 2).relu().sum().backward()
        assert mode.records if kind == "HashMode" else (tmp_path / "t.jsonl").stat().st_size > 0
        gone, recorder = weakref.ref(mode), weakref.ref(mode._recorder)
        del mode
        assert gone() is None and recorder() is None
    finally:
        if was_on:
            gc.enable()


def test_a_mode_left_on_forgets_freed_tensors_at_each_flush():
    """The producer table names tensors by memory; entries of freed storages go at every flush, so a mode
    left on over a long run holds steady memory (they used to pile up to thousands)."""
    from determ_backend.modes.core import HashMode

    mode = HashMode(keep_records=False)
    mode.enable()
    try:
        x = torch.randn(64, 64)
        for _ in range(50):
            y = (x * 2).relu()  # a new tensor per step, freed at the next
            del y
        mode._recorder.flush()
        table = mode._recorder._producers
        from determ_backend import _torch_compat

        assert table and all(not _torch_compat.storage_expired(ent[0]) for ent in table.values())
    finally:
        mode.disable()


def test_bitwise_mode_replays_an_explicit_generator_and_leaves_it_where_a_plain_run_would():
    def step(g):
        torch.rand(4, generator=g)
        return torch.rand(4, generator=g), torch.randn(3, generator=g)

    plain = step(torch.Generator().manual_seed(0))
    with BitwiseEquivalenceMode(warn=False) as bm:
        under = step(torch.Generator().manual_seed(0))
    assert bm.get_mismatches() == []  # the second run drew the same numbers
    assert all(torch.equal(p, u) for p, u in zip(plain, under))


@pytest.mark.parametrize("kwargs", [{"stack_depth": "x"}, {"stack_depth": -1}, {"raise_on_mismatch": "yes"},
                                    {"warn": 1}])
def test_bitwise_mode_options_are_checked_when_made(kwargs):
    with pytest.raises(ConfigError, match=next(iter(kwargs))):
        BitwiseEquivalenceMode(**kwargs)


def test_a_trace_path_under_a_regular_file_is_refused_when_the_mode_is_made(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        HashMode(trace_path=f / "t.jsonl")
    with pytest.raises(ConfigError, match="not a directory"):
        HashDebugTrace(log_path=f / "sub" / "a.log")
    with HashMode(trace_path=tmp_path / "new" / "dir" / "t.jsonl"):  # missing directories are still made
        torch.ones(2).neg()
    assert (tmp_path / "new" / "dir" / "t.jsonl").exists()


def test_a_run_that_raised_is_marked_incomplete_and_never_diffs_identical(tmp_path, capsys):
    for name in ("a", "b"):
        with pytest.raises(RuntimeError, match="blew up"):
            with HashDebugTrace(log_path=tmp_path / f"{name}.log"):
                torch.ones(4).relu()
                raise RuntimeError("the step blew up")
    log, trace = read_hash_log_file(tmp_path / "a.log"), read_trace_file(tmp_path / "a.jsonl")
    assert not log.complete and not trace.complete and len(log.records) == len(trace.records) > 0
    for ext in ("log", "jsonl"):
        assert cli_main(["diff", str(tmp_path / f"a.{ext}"), str(tmp_path / f"b.{ext}")]) == 1
        out = capsys.readouterr().out
        assert "partial trace (the run died or raised)" in out and "\nidentical" not in out
    from repro_tools.cli import main as tools_main
    assert tools_main(["xdevice", f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}"]) == 1  # not "the devices agree"
    with HashDebugTrace(log_path=tmp_path / "c.log"):  # a run that ends normally is complete
        torch.ones(4).relu()
    assert read_hash_log_file(tmp_path / "c.log").complete


def _nested_then_sparse():
    nt = torch.nested.nested_tensor([torch.ones(2, 4), torch.full((3, 4), 2.0)])
    i = torch.tensor([[0, 1, 2], [1, 0, 3]])
    s = torch.sparse_coo_tensor(i, torch.tensor([1.0, 2.0, 3.0]), (3, 4))
    return (nt * 2 + 1).relu(), (s * 2).to_dense().sum()


@pytest.mark.parametrize("tool", ["hash", "trace", "bitwise"])
def test_nested_and_sparse_tensors_run_unchanged_and_two_runs_show_no_false_root(tool, tmp_path):
    """A nested tensor has no sizes (reading them raised inside the tool and killed the program); a sparse one
    has no fingerprint: neither is judged, two identical runs name no root cause."""
    want_nt, want_sum = _nested_then_sparse()
    for run in ("a", "b"):
        mode = {"hash": lambda: HashMode(trace_path=tmp_path / f"{run}.jsonl"),
                "trace": lambda: HashDebugTrace(log_path=tmp_path / f"{run}.log"),
                "bitwise": lambda: BitwiseEquivalenceMode()}[tool]()
        with mode:
            nt, total = _nested_then_sparse()
        assert all(torch.equal(x, y) for x, y in zip(nt.unbind(), want_nt.unbind())) and torch.equal(total, want_sum)
        if tool == "bitwise":
            assert mode.mismatches == []
    if tool != "bitwise":
        cmp = compare_traces(read_trace(tmp_path / "a.jsonl"), read_trace(tmp_path / "b.jsonl"))
        assert cmp.root_causes == [] and not cmp.divergent


def test_bitwise_mode_leaves_batch_norm_running_statistics_as_one_update():
    """native_batch_norm writes its running statistics without its schema saying so: the twin run must write
    copies, or the user's model steps its statistics twice."""
    torch.manual_seed(0)
    bn, x = torch.nn.BatchNorm1d(4), torch.randn(8, 4)
    twin = torch.nn.BatchNorm1d(4)
    twin.load_state_dict(bn.state_dict())
    bn(x)
    with BitwiseEquivalenceMode() as m:
        twin(x)
    assert torch.equal(bn.running_mean, twin.running_mean) and torch.equal(bn.running_var, twin.running_var)
    assert m.mismatches == []


def test_hash_mode_around_bitwise_mode_sees_each_op_once():
    """The bitwise mode's clones and twin run are its own work: the outer trace holds the user's ops only."""
    torch.manual_seed(0)
    m, x = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU()), torch.randn(8, 16)
    with HashMode() as plain:
        m(x).sum()
    with HashMode() as outer, BitwiseEquivalenceMode():
        m(x).sum()
    assert [r.op for r in outer.records] == [r.op for r in plain.records]


def test_a_call_draws_random_numbers_only_when_its_arguments_let_it():
    """Attention ops carry the random tag for their dropout: with ``dropout_p=0`` (every model in eval) they draw
    nothing, and a Llama graph in eval was taken for one that draws (batch invariance skipped it)."""
    from determ_backend.modes.ops import call_draws_random

    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    q = torch.randn(1, 2, 4, 8)
    assert not call_draws_random(sdpa, (q, q, q, 0.0, True), {"scale": 0.25})
    assert call_draws_random(sdpa, (q, q, q, 0.1, True), {})
    assert call_draws_random(sdpa, (q, q, q), {"dropout_p": 0.2})
    assert not call_draws_random(torch.ops.aten.native_dropout.default, (q, 0.5, False), {})
    assert call_draws_random(torch.ops.aten.native_dropout.default, (q, 0.5, True), {})
    assert call_draws_random(torch.ops.aten.rand.default, ([3],), {})
    assert not call_draws_random(torch.ops.aten.relu.default, (q,), {})


def test_an_out_tensor_the_op_also_reads_keeps_its_values_fingerprint(tmp_path):
    """``torch.add(x, y, out=x)`` reads ``x``: only a tensor passed as ``out=`` and nothing else is left unread
    (fingerprinted by dtype and shape); here two runs with another ``x`` blamed the add."""
    for name, value in (("a", 1.0), ("b", 2.0)):
        x, y = torch.full((4,), value), torch.ones(4)
        with HashMode(trace_path=tmp_path / f"{name}.jsonl"):
            torch.add(x, y, out=x)
            x * 2
    cmp = compare_traces(read_trace(tmp_path / "a.jsonl"), read_trace(tmp_path / "b.jsonl"))
    assert [p.rec.op for p in cmp.root_causes] == ["input"]


_FORWARD_AD = """
import sys, torch
import torch.autograd.forward_ad as fwAD
from determ_backend import BitwiseEquivalenceMode, HashDebugTrace, HashMode
from determ_backend.fingerprint.core import hash_tensor
from determ_backend.trace.stream import format_hash
torch.manual_seed(0)
lin, x = torch.nn.Linear(8, 3), torch.randn(8)
def tangent():
    with fwAD.dual_level():
        return fwAD.unpack_dual(lin(fwAD.make_dual(x, torch.ones(8))).tanh()).tangent
plain = tangent()
modes = [HashMode(trace_path=sys.argv[1] + "/hm.jsonl"), BitwiseEquivalenceMode(),
         HashDebugTrace(log_path=sys.argv[1] + "/hdt.log")]
for mode in modes:
    with mode:
        assert torch.equal(tangent(), plain)
zero = format_hash(hash_tensor(torch.zeros(3)))
print(sum(r.hash == zero and r.shape == [3] for r in modes[0].records), modes[1].get_mismatches())
"""


def test_forward_mode_ad_runs_under_every_eager_tool(tmp_path):
    """Forward-mode AD stands a ZeroTensor (null data pointer) in for the bias's missing tangent: the native kernel
    read it and the process died (segmentation fault) under HashMode, BitwiseEquivalenceMode and HashDebugTrace."""
    r = subprocess.run([sys.executable, "-c", _FORWARD_AD, str(tmp_path)], capture_output=True, text=True,
                       cwd=str(ROOT), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    zeros, mismatches = r.stdout.split(" ", 1)
    assert int(zeros) >= 1 and mismatches.strip() == "[]"  # the zero tangent is fingerprinted as the zeros it is


def test_a_trace_is_written_as_the_run_goes_not_held_until_the_mode_closes(tmp_path):
    """On the CPU every fingerprint batch is handed on early: its trace lines were held until the mode closed, so a
    long run's memory grew with its trace and a process that died left a trace of one header line."""
    path = tmp_path / "run.jsonl"
    x = torch.randn(8, 8)
    with HashMode(trace_path=str(path), keep_records=False) as m:
        for _ in range(600):
            x = (x * 0.5).tanh()
        written = len(path.read_text().splitlines())
    assert written >= 512, written  # 1,201 records made (x and 1,200 ops): at most a batch of lines held, and unflushed
    lines = path.read_text().splitlines()
    assert json.loads(lines[-1]) == {"end": True, "count": 1201} and len(lines) == 1 + 1201 + 1


_OUTER_MODE = """
import torch
from determ_backend import HashMode
from determ_backend._torch_compat import TorchDispatchMode
class Log(TorchDispatchMode):
    def __init__(self):
        super().__init__(); self.ops = []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
m, x = torch.nn.Linear(4, 2), torch.randn(3, 4)
with Log() as log:
    with HashMode():  # the first fingerprint of the process: the kernel's constants are made here
        m(x)
print(",".join(log.ops))
"""


def test_the_fingerprint_kernels_constants_are_no_ops_of_the_users(tmp_path):
    """The native kernel's row weights, made at the first fingerprint of a process, were seen by an outer mode
    (PyTorch's DebugMode, an outer HashDebugTrace) as the user's ops: lift_fresh, detach_, to of an int64[4096]."""
    r = subprocess.run([sys.executable, "-c", _OUTER_MODE], capture_output=True, text=True, cwd=str(ROOT), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "aten.t.default,aten.addmm.default", r.stdout


def _rebuilt(storage: torch.UntypedStorage, n: int) -> torch.Tensor:
    """A tensor over memory another process wrote, as a ``DataLoader`` rebuilds its workers' batches."""
    t = torch.empty(0)
    return t.set_(storage, 0, (n,), (1,))


def test_batches_rebuilt_from_workers_in_another_order_diff_identical(tmp_path, capsys):
    """A ``DataLoader`` with workers rebuilds each batch (``empty(0)``, ``set_`` of the shared storage) when it
    arrives, in an order that changes from run to run; the program uses them in order.  Two identical runs
    diffed as 6 masked divergences at ``set_`` and 24 unpaired records."""
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(16, generator=g).untyped_storage() for _ in range(3)]
    w = torch.randn(16, generator=g)
    for name, arrival in (("a", (0, 1, 2)), ("b", (2, 0, 1))):
        with HashMode(trace_path=str(tmp_path / f"{name}.jsonl")):
            got = {i: _rebuilt(batches[i], 16) for i in arrival}
            for i in range(3):
                (got[i] * w).sum()
    assert cli_main(["diff", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]) == 0
    assert "identical" in capsys.readouterr().out
    recs = read_trace_file(tmp_path / "a.jsonl").records
    assert not [r for r in recs if r.op.startswith("aten.set_")]  # its values enter as an input where they are used
    assert sum(r.kind == "input" and r.shape == [16] for r in recs) >= 3


def test_a_storage_argument_leaves_the_text_log_readable(tmp_path, capsys):
    """``set_`` of a storage (a DataLoader worker's batch) wrote the storage's repr, one line per element, into the
    HashDebugTrace log, and ``repro-tools diff`` of the log stopped at "unknown field"."""
    from determ_backend.modes.log import _short

    src = torch.arange(100, dtype=torch.float32)
    with HashDebugTrace(log_path=tmp_path / "run.log"):
        t = torch.empty(0).set_(src.untyped_storage(), 0, (10, 10), (10, 1))
        (t * 2).sum()
    assert cli_main(["diff", str(tmp_path / "run.log"), str(tmp_path / "run.log")]) == 0
    assert "\n" not in _short(src.untyped_storage())


def test_a_model_built_on_the_meta_device_diffs_identical_with_itself(tmp_path, capsys):
    """Meta tensors (``init_empty_weights``, ``low_cpu_mem_usage``) hold no values: their records carried no
    fingerprint, and a trace diffed against itself was "not shown identical"."""
    with HashMode(trace_path=str(tmp_path / "run.jsonl")):
        with torch.device("meta"):
            m = torch.nn.Linear(8, 4)
        m = m.to_empty(device="cpu")
        torch.nn.init.ones_(m.weight)
        torch.nn.init.zeros_(m.bias)
        m(torch.ones(2, 8)).sum().backward()
    assert cli_main(["diff", str(tmp_path / "run.jsonl"), str(tmp_path / "run.jsonl")]) == 0
    recs = read_trace_file(tmp_path / "run.jsonl").records
    assert all(r.hash for r in recs)


@contextlib.contextmanager
def _another_thread_recording(mode):
    """The body runs while another thread sits inside ``mode`` (entered, one relu recorded)."""
    import threading

    inside, done = threading.Event(), threading.Event()

    def first():
        with mode:
            torch.ones(4).relu()
            inside.set()
            done.wait(30)

    t = threading.Thread(target=first)
    t.start()
    assert inside.wait(30)
    try:
        yield
    finally:
        done.set()
        t.join(30)


def test_one_mode_entered_by_a_second_thread_is_refused_in_one_line(tmp_path):
    """Two threads in one HashMode interleaved their records in one trace under one set of names, lost some, and
    two identical runs diffed as divergent: the second thread now gets a ConfigError, the first records alone."""
    import threading

    m = HashMode(trace_path=str(tmp_path / "run.jsonl"))
    errors = []

    def second():
        try:
            with m:
                torch.ones(4).relu()
        except ConfigError as e:
            errors.append(str(e))

    with _another_thread_recording(m):
        u = threading.Thread(target=second)
        u.start()
        u.join(30)
    assert len(errors) == 1 and "make one per thread" in errors[0], errors
    ops = [r.op for r in read_trace_file(tmp_path / "run.jsonl").records]
    assert ops.count("aten.relu.default") == 1, ops  # the first thread's ops alone


_TRACE = lambda p: HashMode(trace_path=p / "run.jsonl")  # noqa: E731
_LOGGED = lambda p: HashDebugTrace(log_path=p / "run.log")  # noqa: E731  (its trace: run.jsonl)


@pytest.mark.parametrize("make, second", [(_TRACE, _TRACE), (_LOGGED, _LOGGED), (_TRACE, _LOGGED)])
def test_two_modes_given_one_file_are_refused_in_one_line_and_the_first_keeps_its_trace(tmp_path, make, second):
    """Two threads, a mode each, one trace path: both recorded and the file kept one thread's ops.  Now the second
    mode is refused while the first writes; once the first is closed, the path is free again (a mode per step)."""
    errors = []
    with _another_thread_recording(make(tmp_path)):
        refused = second(tmp_path)  # kept alive: a refused mode must not hold on to any of its paths
        try:
            with refused:
                torch.ones(4).sin()
        except ConfigError as e:
            errors.append(str(e))
    assert len(errors) == 1 and "another" in errors[0] and "give each mode its own path" in errors[0], errors
    jsonl = tmp_path / "run.jsonl"
    ops = [r.op for r in read_trace_file(jsonl).records]
    assert "aten.relu.default" in ops and "aten.sin.default" not in ops, ops
    with second(tmp_path):  # the first was closed: a later mode writes the paths again
        torch.ones(4).sin()
    assert "aten.sin.default" in [r.op for r in read_trace_file(jsonl).records]


@pytest.mark.parametrize("tool", ["log", "jsonl"])
def test_a_write_through_a_view_is_what_the_base_is_read_as(tmp_path, tool):
    """``buf[:2] = h`` and ``w[0, 0] += e`` write a tensor through a view of it: read next as an object no op
    returned, the base was recorded as a fresh ``input``, and diff blamed that input (beside the real culprit)."""

    def view_write(swap):
        torch.manual_seed(0)
        l1, l2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        h = l1(torch.randn(2, 8))
        h = torch.nn.functional.gelu(h) if swap else torch.relu(h)
        buf = torch.zeros(4, 16)
        buf[:2] = h
        return l2(buf)

    def indexed_weight(perturb):
        torch.manual_seed(0)
        m = torch.nn.Linear(8, 4)
        x = torch.randn(2, 8)
        with torch.no_grad():
            m.weight[0, 0] += 0.5 if perturb else 0.0
        return m(x)

    for fn, expect in ((view_write, {("aten.relu.default", "a"), ("aten.gelu.default", "b")}),
                       (indexed_weight, {("aten.add_.Tensor", None)})):
        paths = []
        for name, flag in (("a", False), ("b", True)):
            path = tmp_path / f"{fn.__name__}_{name}.{tool}"
            with (HashDebugTrace(log_path=path) if tool == "log" else HashMode(path)):
                fn(flag)
            paths.append(path)
        cmp = diff_logs(*paths) if tool == "log" else compare_traces(read_trace(paths[0]), read_trace(paths[1]))
        assert {(p.rec.op, p.metrics.get("only_in")) for p in cmp.root_causes} == expect, cmp.root_causes


def test_torch_export_runs_under_the_eager_tools_and_its_fake_tensors_are_fingerprinted_by_dtype_and_shape(tmp_path):
    """``torch.export.export`` traces with FakeTensors: the bitwise mode read them and killed the program ("Cannot
    access data pointer"), and HashMode left them unfingerprinted, so two identical runs were never shown identical."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(4, 8)
    expected = torch.export.export(m, (x,)).module()(x)
    with BitwiseEquivalenceMode() as bm:
        y = torch.export.export(m, (x,)).module()(x)
    assert torch.equal(y, expected) and bm.get_mismatches() == []
    for name in ("a", "b"):
        with HashMode(tmp_path / f"{name}.jsonl"):
            torch.export.export(m, (x,)).module()(x)
    cmp = compare_traces(read_trace(tmp_path / "a.jsonl"), read_trace(tmp_path / "b.jsonl"))
    assert cmp.identical, cmp.summary()


def test_ops_of_a_deprecated_torch_api_are_placed_at_the_users_call_not_the_wrapper(tmp_path):
    """``quantize_dynamic`` carries ``typing_extensions.deprecated``: its ops were placed at the wrapper's line in
    ``typing_extensions.py``, a file of site-packages taken for user code."""
    import warnings

    m = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with HashMode(tmp_path / "q.jsonl"):
            torch.ao.quantization.quantize_dynamic(m, {torch.nn.Linear}, dtype=torch.qint8)
    sources = {r.source for r in read_trace(tmp_path / "q.jsonl")}
    assert sources == {f"{__file__}:{_lineno_of('quantize_dynamic(m, {')}"}, sources


def test_a_dtensor_is_fingerprinted_by_its_local_shard_and_fsdps_gather_buffer_as_allocated(tmp_path, free_port):
    """FSDP2 keeps parameters as DTensors and gathers them into a buffer ``all_gather_copy_in`` allocates with only
    this rank's shard written: the DTensors went unfingerprinted (an optimizer step's divergence was invisible,
    identical runs never shown identical) and the buffer's garbage read as masked divergences."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import torch.distributed.fsdp  # noqa: F401  (registers the fsdp:: ops)
    from determ_backend.modes.ops import uninitialized

    assert 1 in uninitialized(torch.ops.fsdp.all_gather_copy_in.default)
    assert 0 not in uninitialized(torch.ops.fsdp.all_gather_copy_in.default)
    assert 0 in uninitialized(torch.ops.aten.empty.memory_format)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        local = torch.randn(4, 4)
        with HashMode(tmp_path / "d.jsonl"):
            d = distribute_tensor(local, mesh, [Shard(0)])
            d.add_(1.0)
    finally:
        dist.destroy_process_group()
    (rec,) = [r for r in read_trace(tmp_path / "d.jsonl") if r.op == "aten.add_.Tensor"]
    assert rec.extra.get("local") == "DTensor" and rec.hash == format_hash(hash_tensor(local + 1.0))


def test_ops_a_custom_backward_or_a_hook_runs_are_named_after_that_code(tmp_path):
    """Autograd's own formulas are named after the forward line that made their node; ops the user's Python runs
    during backward (a custom Function's backward, BLOOM's GeLUFunction; a tensor hook) were named so too, and a bug
    in that backward was reported at the forward line."""

    class Scaled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2  # custom forward

        @staticmethod
        def backward(ctx, g):
            return g * 3  # a tripling custom backward

    x = torch.randn(4, requires_grad=True)
    with HashMode(tmp_path / "f.jsonl"):
        y = Scaled.apply(x).tanh()
        y.register_hook(lambda g: g / 2)  # a halving hook
        y.sum().backward()
    recs = read_trace(tmp_path / "f.jsonl")
    line = {r.op: int(r.source.rsplit(":", 1)[1]) for r in recs if r.op in ("aten.div.Tensor", "aten.tanh_backward.default")}
    bw_mul = [int(r.source.rsplit(":", 1)[1]) for r in recs if r.op == "aten.mul.Tensor" and "/bw" in r.node]
    assert bw_mul == [_lineno_of("# a tripling custom backward")]
    assert line["aten.div.Tensor"] == _lineno_of("# a halving hook")
    assert line["aten.tanh_backward.default"] == _lineno_of("y = Scaled.apply(x).tanh()")  # a formula: forward line


def test_a_sparse_tensor_is_its_producers_value_where_it_is_read(tmp_path):
    """A sparse tensor has no memory key: every read made it a fresh ``input``, the chain from its values broke,
    the real culprit (the values' scaling) was a masked note and the innocent matmuls were blamed."""
    def run(path, scale):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(16, 8))
        i = torch.tensor([[0, 1, 3, 5, 7], [2, 4, 6, 8, 15]])
        with HashDebugTrace(log_path=path):
            v = torch.randn(5) * scale  # the scaled sparse values
            s = torch.sparse_coo_tensor(i, v, (8, 16))
            y = torch.sparse.mm(s, w)
            z = torch.mm(s.to_sparse_csr(), w)
            (y.sum() + z.pow(2).sum()).backward()

    run(tmp_path / "a.log", 1.0)
    run(tmp_path / "b.log", 1.5)
    cmp = diff_logs(tmp_path / "a.log", tmp_path / "b.log")
    assert [(p.rec.op, p.rec.source) for p in cmp.root_causes] == \
        [("aten.mul.Tensor", f"{__file__}:{_lineno_of('# the scaled sparse values')}")]


def test_a_sibling_view_of_a_storage_written_through_views_is_an_input_of_its_own(tmp_path):
    """Batches split from one tensor before the mode, each normalized in place: a batch read first after the others'
    writes was taken for an ``alias`` of them (made of every record written into the storage), and a changed batch
    was blamed on that alias."""
    def trace(path, perturb):
        data = torch.arange(32, dtype=torch.float32).reshape(8, 4)
        if perturb:
            data[5, 1] += 1  # the third batch's data
        batches = data.split(2)
        with HashMode(path) as m:
            for b in batches:
                b.mul_(0.5)
                (b * 3).sum()
        return m.records

    recs = trace(tmp_path / "a.jsonl", False)
    trace(tmp_path / "b.jsonl", True)
    assert [r.op for r in recs if r.op in ("input", "alias")] == ["input"] * 4
    cmp = compare_traces(read_trace(tmp_path / "a.jsonl"), read_trace(tmp_path / "b.jsonl"))
    assert [p.rec.op for p in cmp.root_causes] == ["input"]


def test_the_bitwise_mode_compares_writes_into_a_tensor_subclass_holding_memory():
    """A plain Python subclass (torchvision's ``tv_tensors.Image``) holds memory of its own: a nondeterministic write
    into it is compared as into a plain tensor (only tensors without values, FakeTensors, are left out)."""
    class Image(torch.Tensor):
        pass

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 64, generator=g) * torch.logspace(-3, 3, 64)).as_subclass(Image)
    with BitwiseEquivalenceMode(warn=False) as bm:
        eager_nd_rowsum(x)
    assert len(bm.get_mismatches()) == 1


@pytest.mark.parametrize("tool", ["log", "jsonl"])
def test_a_weight_poked_inside_the_trace_is_blamed_on_the_poke(tmp_path, tool):
    """Run B pokes a weight through an index under the mode (``w[0, 0] += e``): diff blamed the ``select`` view (an
    op only B ran, fed by the agreeing weight), and HashMode without ``module=`` found no root cause at all (the
    weight, named after the line first reading it, was read first by the poke in B and by the layer in A)."""
    def run(path, poke):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        x = torch.randn(4, 8)
        with (HashDebugTrace(log_path=path) if tool == "log" else HashMode(path)):
            if poke:
                with torch.no_grad():
                    m[2].weight[0, 0] += 1e-3  # the poke
            m(x).sum().backward()

    paths = [tmp_path / f"{n}.{tool}" for n in "ab"]
    run(paths[0], False)
    run(paths[1], True)
    cmp = diff_logs(*paths) if tool == "log" else compare_traces(read_trace(paths[0]), read_trace(paths[1]))
    assert [(p.rec.op, p.rec.source) for p in cmp.root_causes] == \
        [("aten.add_.Tensor", f"{__file__}:{_lineno_of('# the poke')}")], cmp.root_causes


@pytest.mark.parametrize("weight", ["fresh", "initialized"])
def test_a_weight_written_through_its_data_alias_is_read_as_that_write(tmp_path, weight):
    """``p.data.mul_(2)`` writes ``p`` through a detached alias with a version counter of its own: the next read of
    ``p`` took its first record by identity (the values before the write), and a change in the write was blamed on
    the op reading ``p`` too; a layer's weight (its version moved by its init) was read through the transposed view
    made of it before the write."""
    def run(path, scale):
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 2)
        p = torch.nn.Parameter(torch.ones(2, 4)) if weight == "fresh" else m.weight
        x = torch.randn(3, 4)
        with HashMode(path):
            torch.nn.functional.linear(x, p).sum()
            p.data.mul_(scale)  # the write through .data
            torch.nn.functional.linear(x, p).sum()

    run(tmp_path / "a.jsonl", 2.0)
    run(tmp_path / "b.jsonl", 2.5)
    cmp = compare_traces(read_trace(tmp_path / "a.jsonl"), read_trace(tmp_path / "b.jsonl"))
    assert [(p.rec.op, p.rec.source) for p in cmp.root_causes] == \
        [("aten.mul_.Tensor", f"{__file__}:{_lineno_of('# the write through .data')}")]


def _records_of(fn, **kwargs) -> list:
    """Every field of every record ``fn`` makes under a HashMode (with the mode's own options)."""
    torch.manual_seed(0)
    with HashMode(**kwargs) as m:
        fn()
    return [vars(r) for r in m.records]


def _edge_ops():
    """Views, in-place writes through views, out=, a multi-output op, a Python scalar, a dtype cast, a nested list
    argument, an uninitialized buffer, an inference tensor and a leaf updated under no_grad, forward and backward."""
    w = torch.nn.Parameter(torch.randn(6, 4))
    x = torch.randn(3, 6)
    h = (x @ w).relu()
    a, b = h.split(2, dim=1)
    buf = torch.empty(3, 2)
    torch.mul(a.detach(), 2, out=buf)
    v = buf.view(6)
    v[1:3] += 1
    s = torch.stack([a, b, buf]).sum()
    s.item()
    (s.to(torch.float64) * 1.5).backward()
    with torch.no_grad():
        w.sub_(w.grad * 0.1)
    with torch.inference_mode():
        torch.ones(3) * 2


@pytest.mark.parametrize("options", [{}, {"stats": True, "stack_depth": 2}, {"batch": 1}])
def test_the_native_recorder_makes_the_records_the_python_one_makes(monkeypatch, options):
    """The recorder's common case runs in C when the native module is loaded: every field of every record is the
    one the Python recorder gives, on a real model's training step and on the edge cases of the op stream."""
    from determ_backend.fingerprint import _native
    import real_models

    if _native.recorder_ops() is None:
        pytest.skip("the native module is not built here")
    if not real_models.available():
        pytest.skip("transformers is not installed")
    model, inputs = real_models.build("llama")

    def step():
        real_models.loss_of(model(**inputs)).backward()
        _edge_ops()

    from determ_backend.modes._record import OpRecorder

    whole = []  # ops the native recorder handed to the Python one whole
    python_begin = OpRecorder.begin
    monkeypatch.setattr(OpRecorder, "begin", lambda *a: whole.append(a[1]) or python_begin(*a))
    native = _records_of(step, module=model, **options)
    monkeypatch.setattr(OpRecorder, "begin", python_begin)
    ops = sum(r["kind"] == "node" for r in native)
    assert len(whole) < ops / 10
    monkeypatch.setattr(_native, "recorder_ops", lambda: None)  # the fingerprint kernel stays on
    model.zero_grad(set_to_none=True)
    python = _records_of(step, module=model, **options)
    assert len(native) == len(python) > 500
    for a, b in zip(native, python):
        assert a == b


def test_the_native_recorder_writes_the_log_and_trace_the_python_one_writes(monkeypatch, tmp_path):
    """HashDebugTrace (argument descriptions, two frames a record, statistics): the same text log and trace, byte
    for byte, whichever recorder ran."""
    from determ_backend.fingerprint import _native
    import real_models

    if _native.recorder_ops() is None:
        pytest.skip("the native module is not built here")
    if not real_models.available():
        pytest.skip("transformers is not installed")
    model, inputs = real_models.build("gpt2")

    def run(name):
        torch.manual_seed(0)
        model.zero_grad(set_to_none=True)
        with HashDebugTrace(log_path=tmp_path / f"{name}.log", run="r", module=model):
            real_models.loss_of(model(**inputs)).backward()
            _edge_ops()
        return (tmp_path / f"{name}.log").read_bytes(), (tmp_path / f"{name}.jsonl").read_bytes()

    written = []
    for name in ("native", "python"):  # one call site: the records' stacks hold the caller's line
        if name == "python":
            monkeypatch.setattr(_native, "recorder_ops", lambda: None)
        written.append(run(name))
    native, python = written
    assert native[0].count(b"\n") > 1000 and native == python


def test_the_native_recorder_refuses_what_is_not_a_frame():
    """op_begin walks the caller's frames in C: anything but a frame is refused as the Python recorder refuses it,
    with an exception, never by the interpreter dying."""
    code = """if True:
        import torch
        from determ_backend.fingerprint import _native
        from determ_backend.modes.core import HashMode
        m = HashMode()
        if _native.recorder_ops() is None:
            print("skip")
            raise SystemExit(0)
        try:
            m._begin(m._recorder, torch.ops.aten.add.Tensor, (torch.ones(2), torch.ones(2)), {}, object(), False)
        except TypeError as e:
            print("TypeError", e)
    """
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    if proc.stdout.strip() == "skip":
        pytest.skip("the native module is not built here")
    assert proc.returncode == 0 and proc.stdout.startswith("TypeError"), (proc.returncode, proc.stdout, proc.stderr[-500:])


def test_a_resized_tensor_is_fingerprinted_by_dtype_and_shape():
    """The memory a growing ``resize_`` adds holds whatever the allocator left there: read, two identical runs
    differed at the resize_ (and ``check_nan`` named it a NaN creation when that memory held NaN bits)."""
    from determ_backend.modes.ops import uninitialized_hash

    with HashMode(stats=True) as m:
        q = torch.zeros(4)
        q.resize_(4096)
        q.fill_(3.0)
        torch.zeros(2).resize_as_(q)
    grown = [r for r in m.records if r.op in ("aten.resize_.default", "aten.resize_as_.default")]
    assert len(grown) == 2 and all(r.hash == uninitialized_hash(r) and r.stats is None for r in grown)


def _batch_norm_run(path, momentum: float):
    """A training forward (batch norm updates its running statistics) then an eval forward (reads them)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8, momentum=momentum))
    x = torch.randn(16, 8)
    with HashMode(trace_path=path, stats=True, module=model), torch.no_grad():
        model.train()
        model(x)  # the training line
        model.eval()
        return model(x)  # the eval line


def test_batch_norms_running_statistics_written_in_training_are_recorded_and_blamed_there(tmp_path):
    """native_batch_norm writes running_mean and running_var without saying so in its schema: their later reads were
    recorded with the fingerprints of their first read, and a momentum that differs was blamed on the eval forward's
    batch norm, whose inputs looked alike.  The training call's written statistics are its records now; the eval call
    writes none."""
    _batch_norm_run(tmp_path / "a.jsonl", 0.1)
    _batch_norm_run(tmp_path / "b.jsonl", 0.2)
    recs = [r for r in read_trace_file(tmp_path / "a.jsonl").records if r.op == "aten.native_batch_norm.default"]
    lines = sorted({r.source.rsplit(":", 1)[1] for r in recs})
    train_line, eval_line = lines
    assert len([r for r in recs if r.source.endswith(":" + train_line)]) == 5  # output, saved mean/invstd, the stats
    assert len([r for r in recs if r.source.endswith(":" + eval_line)]) == 3  # eval: no write
    cmp = compare_traces(read_trace_file(tmp_path / "a.jsonl").records, read_trace_file(tmp_path / "b.jsonl").records)
    assert cmp.root_causes and all(p.rec.op == "aten.native_batch_norm.default" and
                                   p.rec.source.endswith(":" + train_line) for p in cmp.root_causes), \
        [(p.rec.node, p.rec.source) for p in cmp.root_causes]
