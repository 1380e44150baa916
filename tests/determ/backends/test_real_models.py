"""The verdict on real Hugging Face architectures (small configs, no downloads): healthy models report
no divergence, no NaN/Inf creation (``DETERM_CHECK=nan`` runs with the other checks) and no checker error, an injected inductor bug is named at its op with the modeling
file's line, and a second sequence length (a recompile with symbolic shapes) is traced and checked."""

import json
from pathlib import Path

import pytest
import torch

import real_models
from determ_backend.backends import run as run_mod

pytestmark = pytest.mark.skipif(not real_models.available(), reason="transformers is not installed")


def _run(family, backend, out: Path, run_id: str, train: bool, seqs=(16,), config=None, model_config=None,
         **options):
    torch._dynamo.reset()
    model, _ = real_models.build(family, **(model_config or {}))
    model.train(train)
    opts = {"dir": str(out), "run_id": run_id, "check": "determinism,accuracy,nan"}
    opts.update(options)
    f = torch.compile(model, backend=backend, options=opts, dynamic=None)
    with torch._inductor.config.patch(config or {}):
        for seq in seqs:
            _, inputs = real_models.build(family, seq=seq)
            if train:
                real_models.loss_of(f(**inputs)).backward()
            else:
                with torch.no_grad():
                    f(**inputs)
    run_mod.finish_all()
    return json.loads((out / run_id / "report.json").read_text())


def _clean(report):
    assert report["checker_errors"] == [], report["checker_errors"]
    assert not report["divergent"], json.dumps(report["first_divergence"], indent=1)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gpt2", "bert", "t5", "resnet"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_healthy_model_on_aot_eager_has_no_divergence(family, train, tmp_path):
    _clean(_run(family, "determ_aot_eager", tmp_path, f"{family}-{train}", train))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "resnet"])
def test_healthy_training_step_on_inductor_has_no_divergence(family, tmp_path):
    # RMSNorm's mean is realized as the undivided sum (1/N fused downstream); BatchNorm backward reuses buffers
    report = _run(family, "determ_inductor", tmp_path, family, train=True)
    _clean(report)
    trace = [json.loads(line) for line in (tmp_path / family / "trace.jsonl").read_text().splitlines()]
    partial = [r for r in trace if (r.get("extra") or {}).get("holds") == "partial"]
    if family == "llama":
        assert partial  # buffers that hold no node's value are labelled, not judged


@pytest.mark.slow
def test_second_sequence_length_is_traced_and_checked(tmp_path):
    report = _run("llama", "determ_aot_eager", tmp_path, "dyn", train=False, seqs=(16, 24))
    _clean(report)
    trace = [json.loads(line) for line in (tmp_path / "dyn" / "trace.jsonl").read_text().splitlines()]
    shapes = {tuple(r["shape"]) for r in trace if r.get("kind") == "input" and r.get("node") == "arg0_1"
              or r.get("kind") == "input" and r.get("shape") and len(r["shape"]) == 2 and r["shape"][0] == 2}
    assert any(s[-1] == 24 for s in shapes) and any(s[-1] == 16 for s in shapes), shapes


@pytest.mark.slow
def test_injected_relu_bug_is_named_at_relu_with_its_line(tmp_path):
    report = _run("t5", "determ_inductor", tmp_path, "bug", train=False,
                  config={"cpp.inject_relu_bug_TESTING_ONLY": "accuracy"}, check="accuracy")
    assert report["divergent"] and report["checker_errors"] == []
    fd = report["first_divergence"]
    assert fd["node"] == "relu" and fd["op"] == "aten.relu.default", fd
    assert "modeling_t5.py" in fd["source"]
    assert [r["node"] for r in report["findings"][0]["root_causes"]] == ["relu"]


@pytest.mark.slow
def test_injected_relu_bug_in_training_is_named_alone_beside_layer_norm_backward_sums_that_cancel(tmp_path):
    """DeBERTa-v2 with relu FFNs, one training step: the forward's relu and the backward's recomputed one are the
    roots.  A LayerNorm backward's ``sum(dy * w * xhat)`` downstream cancels to ~1e-8 on the compiled side; it
    computes that from its compiled inputs up to its own rounding, which is large beside so small a sum, and it
    had been named a third root (the replay was judged relative to the sum's own size, not to what it sums)."""
    report = _run("deberta_v2", "determ_inductor", tmp_path, "deb", train=True, model_config={"hidden_act": "relu"},
                  config={"cpp.inject_relu_bug_TESTING_ONLY": "accuracy"}, check="accuracy")
    assert report["checker_errors"] == []
    found = {f["first_divergence"]["stage"]: f for f in report["findings"]}
    assert set(found) == {"inductor_forward", "inductor_backward"}, report["findings"]
    for stage, f in found.items():
        named = [((r.get("kernel") or {}).get("node") or r["node"], r["op"]) for r in f["root_causes"]]
        assert all(node.startswith("relu") for node, _ in named) and len(named) == 1, (stage, named)
