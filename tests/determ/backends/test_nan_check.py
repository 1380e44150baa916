"""DETERM_CHECK=nan: the first node that creates a NaN/Inf from finite inputs, forward and backward, under
determ_aot_eager, determ_eager and determ_inductor (real compiles), named once and never its consumers."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from backend_helpers import compile_run, load
from determ_backend.errors import AccuracyError


class SqrtOfShifted(torch.nn.Module):
    """``sqrt(h - 0.5)`` creates NaN in the forward wherever h < 0.5; everything after only carries it."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.l1(x)
        h = torch.sqrt(h - 0.5)  # the creator
        return self.l2(torch.relu(h) * 2)


class SqrtOfZero(torch.nn.Module):
    """``sqrt(sum((d - d.detach())**2))`` is 0 forward; its backward divides by 2*sqrt(0): Inf created in the
    backward graph, then 0 * Inf = NaN reaches every gradient of ``l1`` -- at this forward line."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        d = self.l1(x)
        r = torch.sqrt(((d - d.detach()) ** 2).sum(-1, keepdim=True))  # the backward creator
        return self.l2(d) + r


class MaskedInf(torch.nn.Module):
    """An intentional -inf attention mask: created, but the softmax turns it into zeros -- no finding."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(8, 8)

    def forward(self, x):
        s = self.q(x) @ x.t()
        mask = torch.full_like(s, float("-inf")).triu(1)
        return torch.softmax(s + mask, dim=-1) @ x


class SavedMask(torch.nn.Module):
    """A causal ``-inf`` mask for attention: a training graph saves it for the backward (an output holding Inf)."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(8, 8)

    def forward(self, x):
        q = self.q(x).unsqueeze(1)  # [B, 1, L, E]
        n = x.shape[1]
        mask = torch.where(torch.ones(n, n, dtype=torch.bool).tril(), 0.0, float("-inf"))
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask).sum(1)


class NanMaskIntoAttention(torch.nn.Module):
    """A NaN mask passed as ``attn_mask=``: inductor's attention fallback reads it as a keyword argument."""

    def forward(self, x):
        q = x.unsqueeze(1)  # [B, 1, L, E]
        n = x.shape[1]
        mask = torch.where(torch.ones(n, n, dtype=torch.bool).tril(), 0.0, float("nan"))  # the creator
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)


def _line(cls, text: str) -> str:
    src, start = inspect.getsourcelines(cls.forward)
    return f"{inspect.getsourcefile(cls)}:{start + next(i for i, l in enumerate(src) if text in l)}"


def _nan_findings(report):
    return [f for f in report["findings"] if f["check"] == "nan"]


def _run(model_cls, backend, tmp_path, run_id, **options):
    torch.manual_seed(0)
    _, run_dir = compile_run(model_cls(), (torch.randn(4, 8),), backend, tmp_path, run_id, backward=True,
                             check="nan", **options)
    return load(run_dir)[1]


@pytest.mark.parametrize("backend, op", [("determ_aot_eager", "aten.sqrt.default"), ("determ_eager", "torch.sqrt")])
def test_forward_creator_is_named_and_its_consumers_are_not(tmp_path, backend, op):
    report = _run(SqrtOfShifted, backend, tmp_path, backend)
    (f,) = _nan_findings(report)  # consumers (relu, mul, the linear, the backward) only carry it
    fd = f["first_divergence"]
    assert fd["op"] == op and fd["source"].startswith(_line(SqrtOfShifted, "# the creator"))
    assert fd["metrics"]["nan"] > 0 and fd["metrics"]["inf"] == 0
    (inp,) = fd["inputs"]
    assert inp["min"] < 0.5 and inp["max"] is not None  # the input's range shows why
    assert report["checker_errors"] == []


class SqrtWithConstant(SqrtOfShifted):
    """:class:`SqrtOfShifted` with a tensor constant in its graph (``get_attr``: every Hugging Face decoder has
    some), which is no argument of the call."""

    def forward(self, x):
        return super().forward(x + torch.tensor(0.0))


def test_a_graph_holding_a_tensor_constant_gets_its_repro(tmp_path):
    report = _run(SqrtWithConstant, "determ_aot_eager", tmp_path, "const")
    f = _nan_findings(report)[0]
    assert f["first_divergence"]["op"] == "aten.sqrt.default"
    assert f.get("repro") and Path(f["repro"]).is_file() and "repro_skipped" not in f, f


def test_backward_creator_names_the_forward_line(tmp_path):
    report = _run(SqrtOfZero, "determ_aot_eager", tmp_path, "bwd")
    (f,) = _nan_findings(report)
    fd = f["first_divergence"]
    assert fd["stage"] == "aot_backward"
    assert fd["source"].startswith(_line(SqrtOfZero, "# the backward creator"))
    assert fd["metrics"]["inf"] > 0


def test_an_inf_mask_the_softmax_absorbs_is_a_note_not_a_finding(tmp_path):
    report = _run(MaskedInf, "determ_aot_eager", tmp_path, "mask")
    assert _nan_findings(report) == [] and not report["divergent"]
    notes = [n for n in report["notes"] if n["check"] == "nan"]
    assert notes and notes[0]["masked"][0]["op"] in ("aten.full_like.default", "aten.full.default",
                                                      "aten.triu.default")


def test_healthy_model_has_no_nan_finding_and_raise_stops_at_the_creator(tmp_path):
    class Healthy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.sqrt(torch.relu(self.l(x)) + 1.0)

    report = _run(Healthy, "determ_aot_eager", tmp_path, "ok")
    assert _nan_findings(report) == [] and report["checker_errors"] == []
    with pytest.raises(AccuracyError, match=r"determ nan: .*sqrt"):
        _run(SqrtOfShifted, "determ_aot_eager", tmp_path, "raise", raise_on_divergence=True)


@pytest.mark.slow
def test_inductor_names_the_creator_inside_the_fused_kernel_forward_and_backward(tmp_path):
    report = _run(SqrtOfShifted, "determ_inductor", tmp_path, "ind")
    by_stage = {f["first_divergence"]["stage"]: f["first_divergence"] for f in _nan_findings(report)}
    fwd = by_stage["inductor_forward"]
    # the buffer fuses sub, sqrt, relu, mul: the replay names sqrt and its line
    assert fwd["inside"]["node"] == "sqrt" and fwd["inside"]["op"] == "aten.sqrt.default"
    assert fwd["inside"]["source"].startswith(_line(SqrtOfShifted, "# the creator"))
    assert fwd["inside"]["kernel"] and "sqrt" in fwd["inside"]["region"]
    # inductor's partitioner recomputes sqrt in the backward: a creation there too, from finite inputs
    bwd = by_stage["inductor_backward"]
    assert bwd["inside"]["node"] == "sqrt" and bwd["source"].startswith(_line(SqrtOfShifted, "# the creator"))
    assert report["checker_errors"] == []


def test_the_findings_repro_runs_and_minifies_to_the_creator(tmp_path):
    import subprocess
    import sys

    from paths import ROOT

    report = _run(SqrtOfShifted, "determ_aot_eager", tmp_path, "repro")
    repro = _nan_findings(report)[0]["repro"]
    run = subprocess.run([sys.executable, repro, "run"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 1 and "created from finite inputs" in run.stdout, run.stderr[-2000:]
    out = tmp_path / "min"
    m = subprocess.run([sys.executable, "-m", "repro_tools.cli", "minify", repro, "--out", str(out), "--in-process"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert m.returncode == 1, m.stderr[-3000:]
    code = (out / "minimal" / "repro.py").read_text()
    assert "torch.ops.aten.sqrt.default(" in code and "aten.addmm" not in code


def test_an_inf_mask_saved_for_the_backward_is_not_a_finding(tmp_path):
    torch.manual_seed(0)
    _, run_dir = compile_run(SavedMask(), (torch.randn(2, 5, 8),), "determ_aot_eager", tmp_path, "saved",
                             backward=True, check="nan")
    recs, report = load(run_dir)
    fwd_outputs = [r for r in recs if r.stage == "aot_forward" and (r.extra or {}).get("outputs") is not None]
    assert any((r.stats or {}).get("inf") for r in fwd_outputs)  # the mask leaves the forward graph
    assert _nan_findings(report) == [] and not report["divergent"]


@pytest.mark.slow
def test_a_keyword_tensor_of_an_extern_kernel_is_its_input_and_the_mask_is_named_not_the_attention(tmp_path):
    torch.manual_seed(0)
    _, run_dir = compile_run(NanMaskIntoAttention(), (torch.randn(2, 4, 8),), "determ_inductor", tmp_path, "kw",
                             backward=False, check="nan")
    report = load(run_dir)[1]
    fd = [f["first_divergence"] for f in _nan_findings(report)]
    assert len(fd) == 1, report["findings"]
    assert "scaled_dot_product" not in fd[0]["op"]  # the attention only consumed the NaN it was given
    assert fd[0]["source"].startswith(_line(NanMaskIntoAttention, "# the creator"))
    assert report["checker_errors"] == []


def test_a_nan_that_comes_in_with_a_parameter_is_said_not_blamed(tmp_path, caplog):
    """One weight entry holds an Inf: every output is NaN, and no node of the graph created it.  The run names no
    node, but says where the NaN came from (it said nothing at all)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    with torch.no_grad():
        m[0].weight[0, 0] = float("inf")
        y, run_dir = compile_run(m, (torch.randn(4, 8),), "determ_aot_eager", tmp_path, "p", check="nan")
    assert y.isnan().any()
    _, rep = load(run_dir)
    assert not rep["divergent"] and not rep["findings"]
    (note,) = [n for n in rep["notes"] if n.get("notice")]
    assert (note["node"], note["kind"], note["metrics"]) == ("0.weight", "param", {"nan": 0, "inf": 1})
    assert "comes from param 0.weight" in caplog.text


@pytest.mark.parametrize("backend", ["determ_aot_eager", "determ_eager"])
def test_the_nan_check_records_its_statistics_when_they_are_turned_off(tmp_path, backend):
    """``stats=False`` (DETERM_STATS=0) left the check without the NaN counts it reads: the run was said clean."""
    report = _run(SqrtOfShifted, backend, tmp_path, backend, stats=False)
    (f,) = _nan_findings(report)
    assert f["first_divergence"]["op"] in ("aten.sqrt.default", "torch.sqrt") and report["checker_errors"] == []
