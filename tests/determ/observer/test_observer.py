"""ObserverContext: observations, op traces, non-deterministic marking, safe reference files."""

from __future__ import annotations

import json
import logging
import os
import pickle
import struct

import pytest
import torch

import determ_backend as db
from determ_backend.errors import ConfigError, NondeterminismError, TraceFormatError
from determ_backend.trace.stream import read_trace
from eager_helpers import eager_nd_rowsum, make

ND_OP = "determ_test.eager_nd_rowsum.default"


def observed_run(dump_dir, name, reference=None, marking=None, extra=False, trace_ops=True, **kwargs):
    """One training step of a fresh model under an ObserverContext.

    ``marking``: None, "region" (marking_non_deterministic), "value" (observe_non_deterministic on
    the op's output) or "call" (observe_non_deterministic with a callable)."""
    model, x = make(nondet=False)
    x.requires_grad_(True)
    ref = None if reference is None else os.path.join(dump_dir, f"{reference}.jsonl")
    with db.ObserverContext(dump_dir, name, reference_hash_file=ref, **kwargs) as obs:
        db.observe("input", x)
        if trace_ops:
            db.enable_mode()
        h = model.a(x).relu()
        h = h * 1.0 if extra else h  # one more op, same values
        if marking == "region":
            with db.marking_non_deterministic("rowsum"):
                h = eager_nd_rowsum(h)
        elif marking == "value":
            h = db.observe_non_deterministic("rowsum", eager_nd_rowsum(h))
        elif marking == "call":
            h = db.observe_non_deterministic("rowsum", eager_nd_rowsum, h)
        else:
            h = eager_nd_rowsum(h)
        out = model.b(h)
        out.pow(2).mean().backward()
        db.disable_mode()
        db.observe("out", {"y": out, "n": 3})
        db.observe("grad", x.grad)
    return obs


def names(obs, root=None):
    return [m["name"] for m in obs.mismatches if root is None or m["root_cause"] == root]


def test_reference_run_then_mismatch_root_is_the_nondeterministic_op(tmp_path):
    observed_run(tmp_path, "ref")
    obs = observed_run(tmp_path, "run2", reference="ref")
    roots = [m for m in obs.mismatches if m["root_cause"]]
    assert [m["op"] for m in roots] == [ND_OP]
    assert {"out#0.0", "grad#0"} <= set(names(obs, root=False))  # downstream, not root causes
    for m in obs.mismatches:
        assert m["current_stack"] and m["reference_stack"] and m["current"] != m["reference"]
    assert any(m.get("metrics") for m in roots)


@pytest.mark.parametrize("marking", ["region", "value", "call"])
def test_marking_non_deterministic_makes_downstream_clean(tmp_path, marking):
    observed_run(tmp_path, "ref", marking=marking)
    obs = observed_run(tmp_path, "run2", reference="ref", marking=marking)
    assert obs.mismatches == []
    recs = read_trace(obs.trace_path)
    assert any((r.extra or {}).get("non_deterministic") for r in recs)
    assert any((r.extra or {}).get("backward") for r in recs)  # gradients flowed through the substitution


def test_without_ops_traced_observations_still_compare(tmp_path):
    observed_run(tmp_path, "ref", trace_ops=False, marking="value")
    obs = observed_run(tmp_path, "run2", reference="ref", trace_ops=False, marking="value")
    assert obs.mismatches == []
    obs = observed_run(tmp_path, "run3", reference="ref", trace_ops=False)
    assert "out#0.0" in names(obs)


def test_extra_op_does_not_misalign(tmp_path):
    observed_run(tmp_path, "ref", marking="region")
    obs = observed_run(tmp_path, "run2", reference="ref", marking="region", extra=True)
    assert obs.mismatches == [], names(obs)
    assert obs.unmatched["reference_only"] == []
    assert obs.unmatched["current_only"] and all("aten.mul.Tensor" in n for n in obs.unmatched["current_only"])


def test_raise_on_mismatch_raises_at_the_observation(tmp_path):
    observed_run(tmp_path, "ref")
    with pytest.raises(NondeterminismError, match="out#0.0"):
        observed_run(tmp_path, "run2", reference="ref", raise_on_mismatch=True)
    assert (tmp_path / "run2.jsonl").is_file()  # the run is still written


def test_reference_files_are_json_lines_and_safetensors(tmp_path):
    obs = observed_run(tmp_path, "ref", marking="region")
    lines = obs.trace_path.read_text().splitlines()
    assert json.loads(lines[0])["format"] == "determ-trace" and all(json.loads(ln) for ln in lines)
    raw = (tmp_path / "ref.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    assert header["__metadata__"]["format"] == "determ-observer-tensors" and len(header) > 1
    assert not raw.startswith(b"\x80")  # not a pickle (protocol 2+ starts with 0x80)
    assert sorted(os.listdir(tmp_path)) == ["ref.jsonl", "ref.safetensors"]


def test_pickle_reference_is_refused_without_unpickling(tmp_path):
    marker = tmp_path / "unpickled"

    class Trap:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    bad = tmp_path / "ref.pkl"
    bad.write_bytes(pickle.dumps(Trap()))
    with pytest.raises(TraceFormatError, match="ref.pkl.*pickle files are never read"):
        db.ObserverContext(tmp_path, "run2", reference_hash_file=bad)
    assert not marker.exists()


def test_a_value_the_reference_did_not_save_is_compared_not_replayed(tmp_path, caplog):
    """A run that marks a value the reference run did not save (the reference marked nothing, or fewer values)
    went another way than the reference: no error out of the user's op, the run keeps its own value, and the
    comparison shows the difference."""
    observed_run(tmp_path, "ref")  # nothing marked, so nothing saved
    with caplog.at_level(logging.WARNING, logger="determ_backend.observer.core"):
        obs = observed_run(tmp_path, "run2", reference="ref", marking="value")
    assert [u["name"] for u in obs.unreplayed] == ["rowsum#0.0"] and "saved no such value" in obs.unreplayed[0]["why"]
    assert any("marked value rowsum#0.0 is not replayed" in r.getMessage() for r in caplog.records)
    assert obs.mismatches and obs.report_mismatches() is False
    with pytest.raises(NondeterminismError):
        observed_run(tmp_path, "run3", reference="ref", marking="value", raise_on_mismatch=True)


def test_a_marked_step_more_than_the_reference_keeps_the_run_going(tmp_path, caplog):
    """The checked run marks one more value than the reference (a loop one step longer): the saved values are
    replayed, the extra one is the run's own, the run finishes and is not shown to match."""
    def train(name, steps, ref=None, **kw):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        x = torch.randn(4, 8)
        with db.ObserverContext(tmp_path, name, reference_hash_file=ref, **kw) as obs:
            db.enable_mode()
            h = model(x)
            for _ in range(steps):
                with db.marking_non_deterministic("noise"):
                    h = h + torch.rand(h.shape, generator=torch.Generator().manual_seed(torch.seed() % 2**31))
            h.sum().backward()
            db.disable_mode()
            db.observe("grad", model.weight.grad)
        return obs

    train("ref", 1)
    ref = tmp_path / "ref.jsonl"
    assert train("same", 1, ref=ref).mismatches == []
    with caplog.at_level(logging.WARNING, logger="determ_backend.observer.core"):
        obs = train("longer", 2, ref=ref)
    assert obs.unreplayed[0]["name"] == "noise#1/0.0" and all(u["name"].startswith("noise#1/") for u in obs.unreplayed)
    assert obs.report_mismatches() is False and obs.unmatched["current_only"]
    assert any("noise#1/0.0 is not replayed" in r.getMessage() for r in caplog.records)
    with pytest.raises(NondeterminismError, match="records differ from the reference.*none in the reference"):
        train("raised", 2, ref=ref, raise_on_mismatch=True)


def test_module_functions_without_an_observer_are_pass_through():
    x = torch.ones(3)
    db.observe("x", x)
    assert db.observe_non_deterministic("x", x) is x
    assert torch.equal(db.observe_non_deterministic("f", torch.add, x, 1), x + 1)
    with db.marking_non_deterministic():
        pass


def test_observe_grad_and_bad_arguments(tmp_path):
    w = torch.ones(3, requires_grad=True)
    with db.ObserverContext(tmp_path, "g") as obs:
        db.observe_grad("w", w)
        (w * 2).sum().backward()
        with pytest.raises(ConfigError, match="does not require grad"):
            obs.observe_grad("x", torch.ones(2))
    assert [r.node for r in read_trace(obs.trace_path)] == ["w.grad#0"]
    with pytest.raises(ConfigError, match="name"):
        db.ObserverContext(tmp_path, "a/b")


def test_run_with_the_reference_name_is_refused_before_writing(tmp_path):
    observed_run(tmp_path, "ref", marking="region")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ConfigError, match="reference_hash_file=.*ref.jsonl.*overwrite the reference"):
        observed_run(tmp_path, "ref", reference="ref", marking="region")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_missing_tensors_file_is_named(tmp_path):
    """The reference's trace says it saved values: a tensors file not kept next to it is an error when the checked
    run starts, before any of the user's ops ran."""
    observed_run(tmp_path, "ref", marking="region")
    (tmp_path / "ref.safetensors").unlink()
    with pytest.raises(TraceFormatError, match=r"ref\.safetensors: no such file; the reference run saved 1 marked "
                                               r"value\(s\) there \(keep it next to its trace ref\.jsonl\)"):
        db.ObserverContext(tmp_path, "run2", reference_hash_file=tmp_path / "ref.jsonl")


@pytest.mark.parametrize("ref,needle", [("missing.jsonl", "no such file"), (".", "not a file")])
def test_missing_reference_is_one_line_with_one_expectation(tmp_path, ref, needle):
    with pytest.raises(TraceFormatError) as e:
        db.ObserverContext(tmp_path, "run2", reference_hash_file=tmp_path / ref)
    msg = str(e.value)
    assert needle in msg and msg.count("(expected") == 1 and len(msg.splitlines()) == 1


@pytest.mark.parametrize("value", ["text", None, object(), {"a": "b"}])
def test_observing_nothing_observable_is_an_error(tmp_path, value):
    with db.ObserverContext(tmp_path, "o") as obs:
        with pytest.raises(ConfigError, match=r"observe\('v'\): nothing to observe"):
            db.observe("v", value)
        db.observe("v", {"t": torch.ones(2), "label": "kept out", "none": None})
    assert [r.node for r in read_trace(obs.trace_path)] == ["v#0"]  # the failed calls did not count


def test_dump_dir_must_be_a_path():
    with pytest.raises(ConfigError, match="dump_dir"):
        db.ObserverContext(None, "r")


@pytest.mark.parametrize("kwargs,needle", [({"raise_on_mismatch": "no"}, "raise_on_mismatch='no': expected True or False"),
                                           ({"reference_hash_file": 5}, "reference_hash_file: expected the path"),
                                           ({"name": ".."}, "name: expected a run name")])
def test_bad_observer_arguments_are_one_line(tmp_path, kwargs, needle):
    args = {"name": "r", **kwargs}
    with pytest.raises(ConfigError, match=needle):
        db.ObserverContext(tmp_path, args.pop("name"), **args)


def _noisy_run(tmp_path, name, ref=None, noise=False, raise_on_mismatch=False):
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
    x = torch.randn(4, 8)
    with db.ObserverContext(tmp_path, name, reference_hash_file=ref, raise_on_mismatch=raise_on_mismatch) as obs:
        db.enable_mode()
        h = lin1(x)
        if noise:
            h = h + torch.rand(h.shape)  # only this run draws: the root cause is an op the reference never ran
        lin2(h.relu()).sum().backward()
        db.disable_mode()
    return obs


def test_an_op_only_the_checked_run_ran_is_the_root_cause(tmp_path):
    _noisy_run(tmp_path, "ref")
    obs = _noisy_run(tmp_path, "chk", ref=tmp_path / "ref.jsonl", noise=True)
    roots = [m for m in obs.mismatches if m["root_cause"]]
    assert [m["op"] for m in roots] == ["aten.rand.default"] and roots[0]["only_in"] == "current"
    assert roots[0]["metrics"].get("only_in", "current") == "current"  # the metrics say the same side, in its words
    with pytest.raises(NondeterminismError, match=r"first root cause aten\.rand\.default@.*\(only this run ran it\)"):
        _noisy_run(tmp_path, "chk2", ref=tmp_path / "ref.jsonl", noise=True, raise_on_mismatch=True)


def _steps(tmp_path, name, steps, ref=None, raise_on_mismatch=False):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    with db.ObserverContext(tmp_path, name, reference_hash_file=ref, raise_on_mismatch=raise_on_mismatch) as obs:
        for _ in range(steps):
            db.enable_mode()
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            db.disable_mode()
            db.observe("weight", model.weight.detach())
    return obs


@pytest.mark.parametrize("steps", [1, 3])
def test_a_run_a_step_short_or_long_is_not_shown_to_match(tmp_path, caplog, steps):
    _steps(tmp_path, "ref", 2)
    ref = tmp_path / "ref.jsonl"
    same = _steps(tmp_path, "same", 2, ref=ref, raise_on_mismatch=True)
    assert same.mismatches == [] and same.unpaired_summary() is None and same.report_mismatches()
    with caplog.at_level(logging.WARNING, logger="determ_backend.observer.core"):
        obs = _steps(tmp_path, "other", steps, ref=ref)
    side = "of the reference have no counterpart in this run" if steps < 2 else "of this run have none in the reference"
    assert obs.mismatches == [] and side in (obs.unpaired_summary() or "")
    assert any(side in r.getMessage() for r in caplog.records)
    assert obs.report_mismatches() is False
    with pytest.raises(NondeterminismError, match="not shown to match"):
        _steps(tmp_path, "raised", steps, ref=ref, raise_on_mismatch=True)


def test_with_no_root_cause_the_error_names_the_ops_only_one_run_ran(tmp_path):
    """An extra ``h * 1.0`` keeps the values but moves the backward's records: no root cause among the mismatches,
    and the raised line says which records only this run has."""
    def train(name, extra, ref=None):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        x = torch.randn(4, 8)
        with db.ObserverContext(tmp_path, name, reference_hash_file=ref, raise_on_mismatch=ref is not None):
            db.observe("input", x)
            db.enable_mode()
            h = model(x)
            if extra:
                h = h * 1.0
            h.sum().backward()
            db.disable_mode()

    train("ref", False)
    try:
        train("chk", True, ref=tmp_path / "ref.jsonl")
    except NondeterminismError as e:
        msg = str(e)
    else:
        pytest.fail("an extra op was not reported")
    assert "no root cause found" in msg and "of this run have none in the reference (first: aten.mul.Tensor" in msg, msg


def test_a_marked_value_of_another_shape_than_the_saved_one_is_not_replayed(tmp_path):
    def run(name, n, ref=None):
        with db.ObserverContext(tmp_path, name, reference_hash_file=ref) as obs:
            v = db.observe_non_deterministic("noise", torch.rand(n))
            db.observe("sum", v.sum())
        return obs, v

    run("ref", 4)
    obs, v = run("chk", 5, ref=tmp_path / "ref.jsonl")
    assert v.shape == (5,)  # the run's own value, not the saved one
    assert obs.unreplayed == [{"name": "noise#0.0", "why": "the reference saved float32[4], this run has float32[5]"}]
    assert "noise#0.0" in names(obs) + obs.unmatched["current_only"] and obs.report_mismatches() is False
