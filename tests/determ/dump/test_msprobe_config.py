"""msprobe's ``config.json`` under ``PrecisionDebugger``: levels L0 / L1 / mix, summary modes, step and rank
selection, the online baseline (``bench_path``), and the one-line warnings and errors for its keys."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from dump_helpers import batch, make_net
from determ_backend import dump
from determ_backend.errors import ConfigError

_LOGGER = "determ_backend.dump.capture"


def _run(tmp_path, out: str, config: dict, perturb=None, steps: int = 1, gelu: str = "none"):
    """Train ``steps`` steps of the dump helpers' net under a PrecisionDebugger reading ``config``."""
    cfg = tmp_path / f"{out}.json"
    cfg.write_text(json.dumps(dict(config, dump_path=str(tmp_path / out))))
    dbg = dump.PrecisionDebugger(config_path=str(cfg))
    net = make_net(perturb=perturb)
    x, t = batch()
    for _ in range(steps):
        dbg.start(net)
        F.cross_entropy(F.gelu(net(x), approximate=gelu), t).backward()
        dbg.stop()
        dbg.step()
    return tmp_path / out


def _names(root, step=0):
    return [e["name"] for e in dump.read_dump(root / f"step{step}" / "rank0").entries]


def test_level_L0_records_module_boundaries_forward_and_backward_only(tmp_path):
    root = _run(tmp_path, "l0", {"task": "statistics", "level": "L0", "statistics": {"summary_mode": "md5"}})
    got = _names(root)
    assert got == ["Module_conv.Conv2d_0_forward", "Module_fc1.Linear_0_forward", "Module_fc2.Linear_0_forward",
                   "Module_Net_0_forward", "Module_fc2.Linear_0_backward", "Module_fc1.Linear_0_backward",
                   "Module_conv.Conv2d_0_backward", "Module_Net_0_backward"]
    d = dump.read_dump(root / "step0" / "rank0" / "dump.pkl")
    fc1_bwd = next(e for e in d.entries if e["name"] == "Module_fc1.Linear_0_backward")
    # gradient of the output in; gradients of the input and of both parameters out, each with a fingerprint
    assert len(fc1_bwd["inputs"]) == 1 and len(fc1_bwd["outputs"]) == 3
    assert all(t.get("hash") and t.get("stats") for t in fc1_bwd["inputs"] + fc1_bwd["outputs"])


def test_level_L0_compare_names_the_module_whose_weight_differs(tmp_path):
    cfg = {"task": "statistics", "level": "L0"}
    a, b = _run(tmp_path, "a", cfg, perturb="fc1.weight"), _run(tmp_path, "b", cfg)
    cmp = dump.compare({"npu_pkl_path": str(a / "step0" / "rank0" / "dump.pkl"),
                        "bench_pkl_path": str(b / "step0" / "rank0" / "dump.pkl")}, tmp_path / "out")
    assert cmp.root_causes[0].name == "Module_fc1.Linear_0_forward"


def test_level_mix_records_modules_around_their_apis(tmp_path):
    got = _names(_run(tmp_path, "mix", {"task": "statistics", "level": "mix"}))
    i = got.index("Module_fc1.Linear_0_forward")
    assert got[i - 1] == "Functional_linear_0_forward"  # the module's record follows the API inside it
    assert "Functional_linear_0_backward" in got and "Module_fc1.Linear_0_backward" in got
    assert got.index("Module_fc1.Linear_0_backward") > got.index("Functional_linear_0_backward")


def test_module_names_in_msprobes_form_select_modules(tmp_path):
    got = _names(_run(tmp_path, "sel", {"task": "statistics", "level": "L0",
                                        "statistics": {"list": ["Module.fc1.Linear.forward.0"]}}))
    assert got == ["Module_fc1.Linear_0_forward"]


def test_step_ranges_and_rank_selection(tmp_path):
    root = _run(tmp_path, "steps", {"task": "statistics", "step": ["1-2"]}, steps=4)
    assert sorted(p.name for p in root.iterdir()) == ["step1", "step2"]
    root = _run(tmp_path, "ranks", {"task": "statistics", "rank": [1]}, steps=1)
    assert not root.exists()  # this process is rank 0


def test_keys_determ_does_not_act_on_are_named_in_one_warning(tmp_path, caplog):
    cfg = {"task": "statistics", "level": "L1", "extra_info": True, "async_dump": False, "my_key": 1,
           "statistics": {"summary_mode": "statistics", "tensor_list": []}, "acc_check": {"white_list": []}}
    with caplog.at_level("WARNING", logger=_LOGGER):
        _run(tmp_path, "warn", cfg)
    warnings = [r.getMessage() for r in caplog.records if "does not act on" in r.getMessage()]
    assert warnings == ["PrecisionDebugger: determ does not act on these config keys: extra_info, async_dump, "
                        "my_key, statistics.tensor_list"]


@pytest.mark.parametrize("config, match", [
    ({"level": "L2"}, r"level='L2' \(L2, kernel level, needs an Ascend NPU\)"),
    ({"level": "L3"}, r"level='L3'; supported: L0, L1, mix"),
    ({"task": "acc_check"}, r"task='acc_check' is an msprobe task determ does not run"),
    ({"statistics": {"summary_mode": "sha"}}, r"statistics.summary_mode='sha'; expected one of statistics, md5, xor"),
    ({"statistics": {"bench_path": "/no/such/dump"}}, r"statistics.bench_path='/no/such/dump': expected the path"),
    ({"statistics": {"diff_nums": "3"}}, r"statistics.diff_nums='3'; expected an int >= 0"),
    ({"rank": "0"}, r"rank must be an int or a list of ints and 'a-b' ranges, got '0'"),
    ({"step": ["3-1"]}, r"step must be an int or a list of ints and 'a-b' ranges"),
    ({"statistics": {"data_mode": ["all", "forward"]}}, r"statistics.data_mode=\['all', 'forward'\]"),
    # caught when the debugger is made, under the config's own key (not at start(), as register_hook's argument)
    ({"task": "overflow_check", "overflow_check": {"overflow_nums": "x"}}, r"overflow_check.overflow_nums='x'"),
    ({"task": "overflow_check", "overflow_check": {"overflow_nums": -5}}, r"overflow_check.overflow_nums=-5"),
])
def test_bad_values_of_known_keys_are_one_line_errors(tmp_path, config, match):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict({"dump_path": str(tmp_path / "out")}, **config)))
    with pytest.raises(ConfigError, match=match):
        dump.PrecisionDebugger(config_path=str(cfg))


def test_a_config_path_that_is_a_directory_is_a_one_line_error(tmp_path):
    with pytest.raises(ConfigError, match="config_path .*: is a directory; expected a config.json file"):
        dump.PrecisionDebugger(config_path=str(tmp_path))


def test_level_L0_without_a_model_is_a_clear_error(tmp_path):
    dbg = dump.PrecisionDebugger(dump_path=str(tmp_path / "o"), level="L0")
    with pytest.raises(ConfigError, match="level='L0' records module boundaries: pass the model"):
        dbg.start()


@pytest.mark.parametrize("task", ["statistics", "tensor"])
def test_online_baseline_names_the_root_cause_while_dumping(tmp_path, task, caplog):
    ref = _run(tmp_path, "ref", {"task": task}, steps=2)
    cfg = {"task": task, task: {"bench_path": str(ref), "diff_nums": 1}}
    with caplog.at_level("WARNING", logger=_LOGGER):
        new = _run(tmp_path, "new", cfg, steps=2, gelu="tanh")  # the same model, one API computed differently
    live = [r.getMessage() for r in caplog.records if r.getMessage().startswith("online baseline: root cause")]
    assert len(live) == 2 and all("Functional_gelu_0_forward" in m for m in live)  # once per step, while running
    for step in (0, 1):
        report = json.loads((new / f"step{step}" / "rank0" / "online_compare.json").read_text())
        assert report["root_cause"]["name"] == "Functional_gelu_0_forward"
        assert report["first_divergences"][0]["name"] == "Functional_gelu_0_forward"
        assert report["divergent"] > 1 and report["checked"] > report["divergent"]
    d = dump.read_dump(new / "step0" / "rank0" / "dump.pkl")
    stored = [e["name"] for e in d.entries if any("payload" in t for t in e["inputs"] + e["outputs"])]
    if task == "statistics":  # only the first divergent record keeps its tensors (diff_nums=1)
        assert stored == ["Functional_gelu_0_forward"]
        gelu = d.by_name("Functional_gelu_0_forward")
        assert torch.equal(d.tensor(gelu["outputs"][0]), F.gelu(d.tensor(gelu["inputs"][0]), approximate="tanh"))
    else:
        assert len(stored) == len(d.entries) - sum(1 for e in d.entries if not e["inputs"] + e["outputs"])


def test_online_baseline_that_agrees_reports_nothing(tmp_path):
    ref = _run(tmp_path, "ref", {"task": "statistics"})
    new = _run(tmp_path, "new", {"task": "statistics", "statistics": {"bench_path": str(ref)}})
    report = json.loads((new / "step0" / "rank0" / "online_compare.json").read_text())
    assert report["divergent"] == 0 and report["root_cause"] is None and report["tensors_kept"] == 0
    assert not (new / "step0" / "rank0" / "dump" / "tensors.bin").exists()


def test_a_failing_online_check_is_one_error_line_and_the_dump_goes_on(tmp_path, monkeypatch, caplog):
    from determ_backend.dump.capture import online

    def broken(*a, **k):
        raise RuntimeError("boom")

    ref = _run(tmp_path, "ref", {"task": "statistics"})
    monkeypatch.setattr(online, "judge_records", broken)
    with caplog.at_level("ERROR", logger=_LOGGER):
        new = _run(tmp_path, "new", {"task": "statistics", "statistics": {"bench_path": str(ref)}}, gelu="tanh")
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == ["determ dump: the online baseline failed (RuntimeError: boom) and is off for this dump"]
    assert _names(new) == _names(ref)  # the dump itself is whole


def test_online_baseline_judges_as_compare_does(tmp_path):
    """One token id changed: the embedding's inputs differ, and so do its backward's and every later call's; online
    and compare agree that no call is a root cause (online blamed the linear's backward, whose own inputs matched)."""
    def run(out, bench=None, changed=False):
        cfg = {"task": "statistics", "dump_path": str(tmp_path / out)}
        if bench:
            cfg["statistics"] = {"bench_path": str(bench)}
        (tmp_path / f"{out}.json").write_text(json.dumps(cfg))
        dbg = dump.PrecisionDebugger(config_path=str(tmp_path / f"{out}.json"))
        torch.manual_seed(0)
        net = torch.nn.ModuleDict({"emb": torch.nn.Embedding(10, 4), "lin": torch.nn.Linear(4, 3)})
        ids = torch.tensor([[1, 2, 3, 4]])
        if changed:
            ids[0, 2] = 5
        dbg.start(net)
        net["lin"](F.embedding(ids, net["emb"].weight)).sum().backward()
        dbg.stop()
        dbg.step()
        return tmp_path / out / "step0" / "rank0"

    ref = run("ref")
    new = run("new", bench=tmp_path / "ref", changed=True)
    report = json.loads((new / "online_compare.json").read_text())
    cmp = dump.compare({"npu_pkl_path": str(new), "bench_pkl_path": str(ref)}, tmp_path / "out")
    assert report["root_cause"] is None and cmp.root_causes == []
    assert report["first_divergences"][0]["name"] == cmp.first_divergence.name == "Functional_embedding_0_forward"


@pytest.mark.parametrize("level, root", [("L0", "Module_fc1.Linear_0_forward"), ("mix", "Functional_linear_0_forward")])
def test_a_module_around_the_root_cause_is_not_one_too(tmp_path, level, root):
    """A module boundary's output differs whenever a call inside it diverged: the enclosing model (and, at mix,
    the layer around the linear) is explained by what ran inside it, so only the innermost call is the root."""
    cfg = {"task": "statistics", "level": level}
    a, b = _run(tmp_path, "a", cfg, perturb="fc1.weight"), _run(tmp_path, "b", cfg)
    cmp = dump.compare({"npu_pkl_path": str(a / "step0" / "rank0" / "dump.pkl"),
                        "bench_pkl_path": str(b / "step0" / "rank0" / "dump.pkl")}, tmp_path / "out")
    assert [p.name for p in cmp.root_causes] == [root]
    model = next(p for p in cmp.pairs if p.name == "Module_Net_0_forward")
    assert model.output_diverges and not model.inputs_match


@pytest.mark.parametrize("task", ["statistics", "tensor"])
def test_online_baseline_takes_a_module_around_the_root_cause_as_compare_does(tmp_path, task):
    """level mix, one weight perturbed: the layer around the linear that reads it diverges because the linear inside
    did. Compare names the linear alone; so does the online baseline (it called the layer a root cause as well)."""
    cfg = {"task": task, "level": "mix"}
    b = _run(tmp_path, "b", cfg)
    a = _run(tmp_path, "a", dict(cfg, **{task: {"bench_path": str(b)}}), perturb="fc1.weight")
    report = json.loads((a / "step0" / "rank0" / "online_compare.json").read_text())
    cmp = dump.compare({"npu_pkl_path": str(a / "step0" / "rank0" / "dump.pkl"),
                        "bench_pkl_path": str(b / "step0" / "rank0" / "dump.pkl")}, tmp_path / "out")
    online_roots = [f["name"] for f in report["first_divergences"] if f["verdict"] == "root_cause"]
    assert online_roots == [p.name for p in cmp.root_causes] == ["Functional_linear_0_forward"]
    verdicts = {f["name"]: f["verdict"] for f in report["first_divergences"]}
    assert verdicts["Module_fc1.Linear_0_forward"] == "diverged"


def test_a_reference_of_fewer_steps_leaves_the_later_steps_dumped_and_the_training_going(tmp_path, caplog):
    """The reference dump held step 0 alone: ``start()`` of step 1 raised ConfigError and killed the training loop."""
    ref = _run(tmp_path, "ref", {"task": "statistics", "step": [0]})
    with caplog.at_level("WARNING", logger=_LOGGER):
        new = _run(tmp_path, "new", {"task": "statistics", "statistics": {"bench_path": str(ref)}}, steps=3)
    said = [r.getMessage() for r in caplog.records if "without the online comparison" in r.getMessage()]
    assert len(said) == 2 and "no reference dump for step 1" in said[0], said
    assert (new / "step0" / "rank0" / "online_compare.json").exists()
    assert _names(new, 2) == _names(new, 0)  # the later steps are dumped whole


def test_the_online_root_cause_fed_a_changed_weight_says_so_as_compare_does(tmp_path, caplog):
    """A perturbed weight: online named the right call but said "its inputs match", where compare says "and so does
    what it was given (..._input.1)"."""
    ref = _run(tmp_path, "ref", {"task": "statistics"})
    with caplog.at_level("WARNING", logger=_LOGGER):
        _run(tmp_path, "new", {"task": "statistics", "statistics": {"bench_path": str(ref)}}, perturb="fc2.weight")
    (said,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("online baseline: root cause")]
    assert "and so does what it was given (" in said and "_input.1" in said and "inputs match" not in said, said


def test_an_online_baseline_of_a_bfloat16_run_against_float32_judges_as_compare_does(tmp_path, caplog):
    """A bf16-autocast run against its fp32 reference: each tensor was judged by its own dtypes, so the ``.float()``
    of the bf16 logits (float32 on both sides, bitwise) was the root cause, where compare finds no divergence."""
    def run(out, bench=None, bf16=False):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
        cfg = {"task": "statistics", "dump_path": str(tmp_path / out), "level": "L1"}
        if bench:
            cfg["statistics"] = {"bench_path": str(bench)}
        (tmp_path / f"{out}.json").write_text(json.dumps(cfg))
        dbg = dump.PrecisionDebugger(config_path=str(tmp_path / f"{out}.json"), model=m)
        dbg.start(m)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = m(x)
        F.cross_entropy(logits.float(), y).backward()
        dbg.stop()
        return tmp_path / out

    ref = run("ref")
    with caplog.at_level("WARNING", logger=_LOGGER):
        new = run("bf16", bench=ref, bf16=True)
    assert not [r for r in caplog.records if r.getMessage().startswith("online baseline: root cause")]
    report = json.loads((new / "step0" / "rank0" / "online_compare.json").read_text())
    assert report["root_cause"] is None, report


def test_integer_ids_in_two_widths_leave_the_online_verdicts_bitwise():
    """int32 ids against int64 ones switched every later float32 pair to a tolerance, hiding bitwise differences."""
    from determ_backend.dump.capture.online import OnlineBaseline

    ob = OnlineBaseline.__new__(OnlineBaseline)
    ob._dtypes, ob._device, ob.device = set(), "cpu", "cpu"
    ob._tol({"dtype": "torch.int32"}, {"dtype": "torch.int64"})
    assert ob._tol({"dtype": "torch.float32"}, {"dtype": "torch.float32"}) is None
    ob._tol({"dtype": "torch.bfloat16"}, {"dtype": "torch.float32"})
    assert ob._tol({"dtype": "torch.float32"}, {"dtype": "torch.float32"}) is not None  # mixed precision: widened


def test_a_bench_path_holding_no_dump_is_still_an_error_at_the_first_step(tmp_path):
    """Only the steps a reference lacks after one it holds are dumped without the comparison: a bench_path of no dump
    at all (a wrong directory) is the one-line error it was, not a warning every step and nothing compared."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no reference dump for step 0"):
        _run(tmp_path, "new", {"task": "statistics", "statistics": {"bench_path": str(tmp_path / "empty")}})
