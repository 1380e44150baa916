"""scripts/corpus.py: its families (each builds offline and runs forward and backward eagerly; RELU_FAMILIES
names exactly those that dispatch ``aten.relu``), the case plan, the verdict of a finished case (from its exit
status, report.json and stderr), the per-case timeout, and one real run on a tiny family."""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import real_models
from paths import ROOT

SCRIPT = ROOT / "scripts" / "corpus.py"
sys.path.insert(0, str(SCRIPT.parent))

import corpus  # noqa: E402

needs_transformers = pytest.mark.skipif(not real_models.available(), reason="transformers is not installed")


def _finished(tmp_path, report=None, stderr="", trace=None):
    """A case directory as a finished child leaves it."""
    d = tmp_path / "case"
    (d / "run").mkdir(parents=True)
    (d / "stderr.log").write_text(stderr)
    if report is not None:
        (d / "run" / "report.json").write_text(json.dumps({"findings": [], "checker_errors": [], "graphs": 1, **report}))
    if trace is not None:
        (d / "run" / "trace.jsonl").write_text("\n".join(json.dumps(r) for r in trace) + "\n")
    return d


def _finding(node, op, source="/x/site-packages/transformers/models/llama/modeling_llama.py:64 (forward)", **extra):
    fd = {"graph": "g0", "stage": "inductor_forward", "call": 0, "node": node, "op": op, "source": source}
    return {"first_divergence": fd, "findings": [{"check": "accuracy", "first_divergence": fd, "root_causes": [fd], **extra}]}


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func)
        return func(*args, **(kwargs or {}))


def test_at_least_ten_families():
    assert len(real_models.FAMILIES) >= 10
    assert real_models.RELU_FAMILIES <= set(real_models.FAMILIES)
    assert set(corpus.QUICK_FAMILIES) <= set(real_models.FAMILIES)
    with pytest.raises(KeyError, match="unknown family"):
        real_models.has_relu("nosuch")


@needs_transformers
@pytest.mark.parametrize("family", list(real_models.FAMILIES))
def test_family_runs_forward_and_backward_eagerly(family):
    model, inputs = real_models.build(family)
    assert sum(p.numel() for p in model.parameters()) < 300_000  # small enough for a quick compile
    model.train()
    with _Ops() as seen:
        loss = real_models.loss_of(model(**inputs))
        loss.backward()
    assert torch.isfinite(loss)
    assert any(p.grad is not None for p in model.parameters())
    assert (torch.ops.aten.relu.default in seen.ops) == real_models.has_relu(family)


CASE = corpus.Case("llama", "eval", "accuracy", "determ_inductor")
INJECT = corpus.Case("t5", "train", "inject", "determ_inductor")


def test_plan_runs_checks_and_flows_and_injects_only_relu_families_on_inductor():
    names = [c.name for c in corpus.plan(["llama", "t5"], ["eval"], ["determinism"], ["aot4", "inject"], "determ_inductor")]
    assert names == ["llama-eval-determinism", "llama-eval-aot4", "t5-eval-determinism", "t5-eval-aot4", "t5-eval-inject"]
    on_aot = corpus.plan(["t5"], ["eval", "train"], [], ["inject"], "determ_aot_eager")
    assert on_aot == []  # inductor's injected bug does not exist in aot_eager


def test_case_env_is_isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("DETERM_CHECK", "determinism")
    monkeypatch.setenv("REPRO_LEVEL", "2")
    env = INJECT.env(tmp_path, tmp_path / "cache", minify=False)
    assert env["DETERM_CHECK"] == "accuracy" and "REPRO_LEVEL" not in env
    assert env["DETERM_DIR"] == str(tmp_path) and env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache")
    aot4 = corpus.Case("llama", "eval", "aot4", "determ_inductor").env(tmp_path, tmp_path, minify=False)
    assert (aot4["REPRO_AFTER"], aot4["REPRO_LEVEL"], aot4["DETERM_MINIFY"]) == ("aot", "4", "0")
    assert "DETERM_CHECK" not in aot4


def test_clean_divergent_and_checker_error(tmp_path):
    assert corpus.judge(CASE, _finished(tmp_path, {}), 0, 1.0).verdict == "clean"
    row = corpus.judge(CASE, _finished(tmp_path / "d", _finding("mean", "aten.mean.dim")), 0, 1.0)
    assert (row.verdict, row.ok) == ("divergent", False)
    assert row.cause == "mean aten.mean.dim @ llama/modeling_llama.py:64 [g0/inductor_forward]"
    row = corpus.judge(CASE, _finished(tmp_path / "e", {"checker_errors": ["accuracy: eager reference run failed"]}), 0, 1.0)
    assert (row.verdict, row.cause) == ("checker-error", "accuracy: eager reference run failed")


def test_a_determinism_finding_confirmed_without_determ_is_a_true_one(tmp_path):
    det = corpus.Case("bert", "train", "determinism", "determ_inductor")
    found = _finding("index_put", "aten.index_put.default")
    d = _finished(tmp_path, found)
    (d / corpus.WITNESS).write_text(json.dumps({"nondeterministic": True, "where": "grad emb.weight"}))
    row = corpus.judge(det, d, 0, 1.0)
    assert (row.verdict, row.ok) == ("nondeterministic", True) and "grad emb.weight" in row.notes[0]
    d = _finished(tmp_path / "b", found)
    (d / corpus.WITNESS).write_text(json.dumps({"nondeterministic": False, "where": None}))
    row = corpus.judge(det, d, 0, 1.0)
    assert (row.verdict, row.ok) == ("divergent", False) and row.notes == ["two plain runs agree bitwise"]
    s = corpus.summarize([corpus.Row(det, "nondeterministic", 1.0)], 1.0)
    assert (s["nondeterministic"], s["false_divergences"]) == (1, 0)


def test_crashes_and_timeouts_are_rows(tmp_path):
    row = corpus.judge(CASE, _finished(tmp_path, None, "Traceback ...\n  File x\nRuntimeError: boom\n"), 1, 2.0)
    assert (row.verdict, row.cause) == ("crash", "exit 1: RuntimeError: boom")
    assert corpus.judge(CASE, _finished(tmp_path / "b", None), 0, 1.0).verdict == "crash"  # no report.json
    assert corpus.judge(CASE, _finished(tmp_path / "c", {}), -11, 1.0).cause.startswith("signal 11")
    assert corpus.judge(CASE, _finished(tmp_path / "d", {}), None, 9.0).verdict == "timeout"
    # the level-4 flow's AccuracyError is a divergence only with its finding in report.json
    aot4 = corpus.Case("llama", "eval", "aot4", "determ_inductor")
    assert corpus.judge(aot4, _finished(tmp_path / "e", {}), corpus.ACCURACY_EXIT, 1.0).verdict == "crash"
    found = {"findings": [{"check": "repro accuracy (after aot)", "detail": "RMSE 0.5 > 0.001"}]}
    row = corpus.judge(aot4, _finished(tmp_path / "f", found), corpus.ACCURACY_EXIT, 1.0)
    assert (row.verdict, row.cause) == ("divergent", "repro accuracy (after aot): RMSE 0.5 > 0.001")


def test_injected_bug_must_be_found_at_relu(tmp_path):
    row = corpus.judge(INJECT, _finished(tmp_path, _finding("relu_1", "aten.relu.default")), 0, 1.0)
    assert row.ok and row.found_relu
    assert not corpus.judge(INJECT, _finished(tmp_path / "b", {}), 0, 1.0).ok  # clean: the bug was missed
    masked = _finding("getitem", "operator.getitem", masked=[{"node": "relu", "op": "aten.relu.default"}])
    trace = [{"graph": "g0", "stage": "inductor_forward", "call": 0, "node": "getitem",
              "extra": {"kernel": "cpp_fused_max_pool2d_with_indices_relu_1"}}]
    row = corpus.judge(INJECT, _finished(tmp_path / "c", masked, trace=trace), 0, 1.0)
    assert (row.ok, row.found_relu) == (False, False)
    assert row.notes == ["relu reported as masked", "buffer of cpp_fused_max_pool2d_with_indices_relu_1"]


def test_summary_and_exit_status():
    rows = [corpus.Row(CASE, "clean", 1.0), corpus.Row(CASE, "divergent", 1.0),
            corpus.Row(INJECT, "divergent", 1.0, found_relu=True), corpus.Row(CASE, "crash", 1.0)]
    s = corpus.summarize(rows, 4.0)
    assert (s["false_divergences"], s["crashes"], s["injected"], s["injected_found_at_relu"]) == (1, 1, 1, 1)
    assert "1 false divergences" in corpus.summary_line(s)
    text = corpus.table(rows)
    assert text.splitlines()[0].split()[:4] == ["architecture", "mode", "check", "verdict"]
    assert "inject-relu" in text


def test_bad_usage_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        corpus.parse_args(["--families", "nosuch"])
    assert e.value.code == 2 and "unknown family nosuch" in capsys.readouterr().err


def test_a_case_past_its_timeout_is_killed(tmp_path):
    launcher = corpus.Launcher(tmp_path, tmp_path / "cache", timeout=0.2, minify=False)
    row = launcher.run(corpus.Case("gpt2", "eval", "determinism", "determ_aot_eager"))
    assert row.verdict == "timeout" and (tmp_path / "gpt2-eval-determinism" / corpus.MARKER).exists()


@pytest.mark.slow
@needs_transformers
def test_corpus_on_a_tiny_family_with_aot_eager(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DETERM_", "REPRO_"))}
    out = tmp_path / "corpus"
    p = subprocess.run([sys.executable, str(SCRIPT), "--families", "gpt2", "--modes", "eval", "--backend",
                        "determ_aot_eager", "--jobs", "2", "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=600)
    lines = p.stdout.splitlines()
    rows = [ln.split() for ln in lines if ln.startswith("gpt2 ")]
    assert [r[:3] for r in rows] == [["gpt2", "eval", c] for c in ("determinism", "accuracy", "nan", "aot4")], p.stdout
    assert all(r[3] == "clean" and r[4] == "yes" for r in rows), p.stdout + p.stderr[-3000:]
    assert lines[-1].startswith("summary: 4 cases") and "0 false divergences" in lines[-1]
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["summary"]["clean"] == 4
    assert (out / "gpt2-eval-accuracy" / "run" / "report.json").is_file()
