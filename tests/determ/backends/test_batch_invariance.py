"""DETERM_CHECK=batch_invariance: a compiled graph with a dynamic batch dimension is run again on sub-batches
(the first half, the first row) and the first node whose input rows agree while its output rows do not is the
root cause; its repro.py minifies with --kind batch_invariance.  Real compiles with dynamic=True."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

import real_models
from backend_helpers import BackwardBatchDependent, BatchDependent, RowWise, batch_dep_sum, load
from determ_backend.backends import run as run_mod
from paths import ROOT, TESTS


def _run(model, backend, tmp_path, run_id, x=None, dynamic=True, train=False, **options):
    torch._dynamo.reset()
    torch.manual_seed(0)
    f = torch.compile(model, backend=backend, dynamic=dynamic,
                      options=dict({"dir": str(tmp_path), "run_id": run_id, "check": "batch_invariance"}, **options))
    x = torch.randn(8, 256) if x is None else x
    if train:
        f(x.requires_grad_()).sum().backward()
    else:
        with torch.no_grad():
            f(x)
    run_mod.finish_all()
    return load(tmp_path / run_id)[1]


def _culprit_line() -> str:
    src, start = inspect.getsourcelines(BatchDependent.forward)
    return f"{inspect.getsourcefile(BatchDependent)}:{start + next(i for i, l in enumerate(src) if '# the culprit' in l)}"


@pytest.mark.parametrize("backend, node", [("determ_aot_eager", "batch_dep_sum"),
                                           ("determ_eager", "batch_dep_sum_default")])
def test_the_batch_dependent_op_is_the_root_cause(tmp_path, backend, node):
    report = _run(BatchDependent(), backend, tmp_path, backend)
    (f,) = [f for f in report["findings"] if f["check"] == "batch_invariance"]
    fd = f["first_divergence"]
    assert fd["node"] == node and fd["source"].startswith(_culprit_line())
    assert (f["batch"], f["sub_batch"]) == (8, 4)  # 1 + 8 % 3 = 3 chunks vs 1 + 4 % 3 = 2
    assert [r["node"] for r in f["root_causes"]] == [node]  # relu and the scale before it agree row for row
    assert report["checker_errors"] == []


class _BatchMean(torch.nn.Module):
    """Every row gets a little of the batch's mean: the mean over the batch, a value with no rows, is where rows
    start to depend on the batch; the add that consumes it only carries that in."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(256, 64), torch.nn.Linear(64, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = h + h.mean(0, keepdim=True) * 1e-3  # the culprit: the mean
        return self.b(h)


@pytest.mark.parametrize("train", [False, True])
def test_a_reduction_over_the_batch_that_feeds_every_row_is_the_root_cause(tmp_path, train):
    report = _run(_BatchMean(), "determ_aot_eager", tmp_path, f"mean{train}", train=train)
    found = [f for f in report["findings"] if f["check"] == "batch_invariance"]
    assert found and [r["op"] for r in found[0]["root_causes"]] == ["aten.mean.dim"], found
    assert report["checker_errors"] == []


def test_a_row_wise_model_passes(tmp_path):
    report = _run(RowWise(), "determ_aot_eager", tmp_path, "rows")
    assert report["findings"] == [] and report["checker_errors"] == []
    assert not [n for n in report["notes"] if n.get("skipped")]  # checked, not skipped


def test_static_graphs_are_skipped_with_a_note_and_training_is_checked_forward_and_backward(tmp_path):
    report = _run(RowWise(), "determ_aot_eager", tmp_path, "static", dynamic=False)
    (note,) = [n for n in report["notes"] if n["check"] == "batch_invariance"]
    assert "static" in note["skipped"] and "dynamic=True" in note["skipped"]
    # every graph skipped: not shown clean, neither in report.json nor on its page
    assert report["unchecked"] == ["batch_invariance"]
    from repro_tools.report import build as build_report
    assert build_report([str(tmp_path / "static")]).verdict.startswith("nothing checked")
    # a batch of one is a constant even under dynamic=True: the note said to compile with dynamic=True
    report = _run(RowWise(), "determ_aot_eager", tmp_path, "one", x=torch.randn(1, 256))
    (note,) = [n for n in report["notes"] if n["check"] == "batch_invariance"]
    assert "use a batch of 2 or more" in note["skipped"], note
    report = _run(RowWise(), "determ_aot_eager", tmp_path, "train", train=True)
    assert report["findings"] == [] and report["notes"] == [] and report["checker_errors"] == []
    assert report["unchecked"] == []


def test_a_backward_only_culprit_is_named_in_the_backward_graph(tmp_path):
    report = _run(BackwardBatchDependent(), "determ_aot_eager", tmp_path, "bwd", train=True)
    (f,) = [f for f in report["findings"] if f["check"] == "batch_invariance"]
    fd = f["first_divergence"]
    assert fd["stage"] == "aot_backward" and "batch_dep_sum" in fd["node"]
    src, start = inspect.getsourcelines(BackwardBatchDependent.forward)
    assert fd["source"].startswith(f"{inspect.getsourcefile(BackwardBatchDependent)}:{start + 1}")
    assert report["checker_errors"] == []


def test_the_findings_repro_minifies_to_the_culprit(tmp_path):
    report = _run(BatchDependent(), "determ_aot_eager", tmp_path, "repro")
    repro = report["findings"][0]["repro"]
    env = dict(os.environ, PYTHONPATH=str(TESTS))  # the repro imports the module that defines the custom op
    run = subprocess.run([sys.executable, repro, "run"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env=env)
    assert run.returncode == 1 and "differ bitwise between batch 8 and batch 4" in run.stdout, run.stderr[-2000:]
    out = tmp_path / "min"
    m = subprocess.run([sys.executable, "-m", "repro_tools.cli", "minify", repro, "--out", str(out), "--in-process"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert m.returncode == 1, m.stderr[-3000:]
    code = (out / "minimal" / "repro.py").read_text()
    assert "torch.ops.determ_test.batch_dep_sum.default(" in code and "aten.addmm" not in code  # the head is not needed
    assert "'culprit': 'batch_dep_sum'" in code


@pytest.mark.slow
def test_inductor_names_the_culprit_and_a_real_model_passes(tmp_path):
    report = _run(BatchDependent(), "determ_inductor", tmp_path, "ind")
    (f,) = [f for f in report["findings"] if f["check"] == "batch_invariance"]
    assert f["first_divergence"]["node"] == "batch_dep_sum" and report["checker_errors"] == []
    if not real_models.available():
        pytest.skip("transformers is not installed")
    torch._dynamo.reset()
    model, inputs = real_models.build("llama")
    model.eval()
    f = torch.compile(model, backend="determ_aot_eager", dynamic=True,
                      options={"dir": str(tmp_path), "run_id": "llama", "check": "batch_invariance,nan"})
    with torch.no_grad():
        f(**inputs)
    run_mod.finish_all()
    report = json.loads((tmp_path / "llama" / "report.json").read_text())
    assert report["findings"] == [] and report["checker_errors"] == []
    assert not [n for n in report["notes"] if n.get("skipped")]


def test_a_batch_size_shared_with_another_dimension_is_skipped_with_a_note(tmp_path):
    class Square(torch.nn.Module):
        def forward(self, x):
            return torch.softmax(x, -1) @ x.t()

    report = _run(Square(), "determ_aot_eager", tmp_path, "duck", x=torch.randn(8, 8))  # dynamo gives both dims s0
    (note,) = [n for n in report["notes"] if n["check"] == "batch_invariance"]
    assert "also the size of another dimension" in note["skipped"]
    assert report["findings"] == [] and report["checker_errors"] == []


class _EmbeddedBatchDependent(torch.nn.Module):
    """An embedding of 16 rows (a multiple of the batch of 8) in front of the culprit: a repro that cut every
    tensor whose first size is a multiple of the batch would cut the table to 8 rows, and ids past them fail."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 256)
        self.head = torch.nn.Linear(1, 4)

    def forward(self, ids):
        h = torch.exp(self.emb(ids)) * 100  # (relu * 100 sums to the same bits in 2 or 3 chunks for this table)
        return self.head(batch_dep_sum(h))


def test_a_repro_cuts_the_inputs_the_check_cut_and_a_weight_stays_whole(tmp_path):
    ids = torch.arange(8, 16)  # every id past the first 8 rows of the table
    torch.manual_seed(0)  # the table's values decide the culprit's sums: the same ones whatever ran before
    report = _run(_EmbeddedBatchDependent().eval(), "determ_aot_eager", tmp_path, "emb", x=ids)
    (f,) = [f for f in report["findings"] if f["check"] == "batch_invariance"]
    repro = f["repro"]
    env = dict(os.environ, PYTHONPATH=str(TESTS))
    run = subprocess.run([sys.executable, repro, "run"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env=env)
    # before: "reproduced runtime_error: IndexError: index out of range in self" (the table cut to 8 rows)
    assert run.returncode == 1 and "differ bitwise between batch 8 and batch 4" in run.stdout, run.stdout + run.stderr[-2000:]
    out = tmp_path / "min"
    m = subprocess.run([sys.executable, "-m", "repro_tools.cli", "minify", repro, "--out", str(out), "--in-process"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert m.returncode == 1, m.stderr[-3000:]
    minimal = out / "minimal" / "repro.py"
    assert "torch.ops.determ_test.batch_dep_sum.default(" in minimal.read_text()
    again = subprocess.run([sys.executable, str(minimal), "run"], capture_output=True, text=True, timeout=300,
                           cwd=tmp_path, env=env)
    assert again.returncode == 1 and "differ bitwise" in again.stdout, again.stdout + again.stderr[-2000:]


def test_a_run_with_more_findings_than_pair_files_writes_its_page(tmp_path):
    """Only the first findings keep their verdicts in a pairs file; a later one kept the comparison's count under
    the same key, and the page (report.html, repro-tools report) then failed on ``run_dir / 79``."""
    def f(x):  # five graphs, each returning its culprit's rows (a graph break in a loop makes dynamo skip the frame)
        a = batch_dep_sum(torch.relu(x) * 100)
        torch._dynamo.graph_break()
        b = batch_dep_sum(torch.relu(x) * 50)
        torch._dynamo.graph_break()
        c = batch_dep_sum(torch.relu(x) * 51)
        torch._dynamo.graph_break()
        d = batch_dep_sum(torch.relu(x) * 52)
        torch._dynamo.graph_break()
        return a, b, c, d, batch_dep_sum(torch.relu(x) * 53)

    report = _run(f, "determ_aot_eager", tmp_path, "many")
    found = [f for f in report["findings"] if f["check"] == "batch_invariance"]
    assert len(found) == 5 and report["checker_errors"] == [], ([(f["first_divergence"]["graph"], f["first_divergence"]["node"]) for f in found], report["notes"])
    assert [f.get("pairs") for f in found] == [f"pairs-{k}.jsonl" for k in range(3)] + [None, None]
    assert all(isinstance(f["paired"], int) and f["paired"] > 0 for f in found)
    assert (tmp_path / "many" / "report.html").is_file()
    page = subprocess.run([sys.executable, "-m", "repro_tools.cli", "report", str(tmp_path / "many"), "--out",
                           str(tmp_path / "page.html")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert page.returncode in (0, 1) and (tmp_path / "page.html").is_file(), page.stderr[-2000:]


def test_a_graph_that_draws_random_numbers_is_skipped_not_blamed(tmp_path):
    """Two dropouts in training: a sub-batch draws its first dropout's mask as the batch did, and its second one
    from another point of the generator, so the second dropout was named as the op that makes a row depend on
    the batch."""
    m = torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Dropout(0.5), torch.nn.Tanh(), torch.nn.Dropout(0.5)).train()
    report = _run(m, "determ_aot_eager", tmp_path, "drop", x=torch.randn(8, 16), train=True)
    assert report["findings"] == [] and report["checker_errors"] == []
    notes = [n["skipped"] for n in report["notes"] if n["check"] == "batch_invariance"]
    assert "draws random numbers" in notes[0] and all("forward graph was not checked" in n for n in notes[1:]), notes


def test_a_checkpointed_graph_that_draws_random_numbers_is_skipped_too(tmp_path):
    """Under activation checkpointing the draw sits inside run_and_save_rng_state: the graph was not seen to draw,
    and ``operator.getitem[0]`` of the checkpointed dropout was named."""
    class Ckpt(torch.nn.Module):
        def forward(self, x):
            block = lambda h: torch.nn.functional.dropout(torch.tanh(h), 0.5, training=True)  # noqa: E731
            return torch.utils.checkpoint.checkpoint(block, torch.tanh(x), use_reentrant=False) * 2

    report = _run(Ckpt(), "determ_aot_eager", tmp_path, "ckpt", x=torch.randn(8, 16), train=True)
    assert report["findings"] == [] and report["checker_errors"] == []
    notes = [n["skipped"] for n in report["notes"] if n["check"] == "batch_invariance"]
    assert notes and "draws random numbers" in notes[0], notes
