"""API dump + compare: root cause, alignment, dtypes, statistics mode, overflow, compiled regions."""

from __future__ import annotations

import contextlib
import csv
import os
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from determ_backend import dump
from determ_backend.dump.capture import hooks as dump_hooks
from determ_backend.errors import ConfigError, DetermError, DeviceUnavailableError, TraceFormatError
import real_models
from dump_helpers import batch, compare_two, dump_run, make_net, names, overflow_index, sequential, train_step


@pytest.fixture(autouse=True)
def _clean():
    yield
    dump.remove_hooks()


def _root_causes(cmp):
    return [p.a["name"] for p in cmp.root_causes]


def test_star_import_gives_the_ptdbg_names():
    ns = {}
    exec("from determ_backend.dump import *", ns)
    for name in ("seed_all", "set_dump_path", "register_hook", "set_dump_switch", "set_overflow_check_switch",
                 "compare", "compare_distributed", "parse", "acc_cmp_dump", "overflow_check"):
        assert name in ns


def test_records_forward_and_backward_with_ptdbg_names(tmp_path):
    idx = dump_run(tmp_path, "a", make_net())
    got = names(idx)
    for n in ("Functional_conv2d_0_forward", "Functional_relu_0_forward", "Tensor_flatten_0_forward",
              "Functional_linear_0_forward", "Torch_relu_0_forward", "Functional_linear_1_forward",
              "Functional_cross_entropy_0_forward", "Functional_linear_0_backward", "Functional_conv2d_0_backward"):
        assert n in got
    d = dump.read_dump(idx)
    conv_b = d.by_name("Functional_conv2d_0_backward")
    # backward inputs: grad of the output; outputs: grads of weight and bias (x does not require grad)
    assert [t["shape"] for t in conv_b["inputs"]] == [[4, 4, 6, 6]]
    assert sorted(t["name"] for t in conv_b["outputs"]) == ["output.1", "output.2"]
    lin = d.by_name("Functional_linear_0_forward")
    assert [t.get("param", False) for t in lin["inputs"]] == [False, True, True]


def test_backward_gradients_are_the_real_gradients(tmp_path):
    net = make_net()
    idx = dump_run(tmp_path, "a", net)
    d = dump.read_dump(idx)
    e = d.by_name("Functional_linear_1_backward")
    grad_w = next(t for t in e["outputs"] if t["name"] == "output.1")
    assert torch.equal(d.tensor(grad_w), net.fc2.weight.grad)


def test_perturbed_layer_is_the_root_cause_not_its_backward_or_consumers(tmp_path):
    a = dump_run(tmp_path, "a", make_net())
    b = dump_run(tmp_path, "b", make_net(perturb="fc1.weight"))
    cmp = compare_two(b, a, tmp_path / "out")
    assert _root_causes(cmp) == ["Functional_linear_0_forward"]
    rows = list(csv.DictReader(open(cmp.csv_path)))
    yes = [r["NPU Name"] for r in rows if r["Root Cause"] == "Yes"]
    assert yes == ["Functional_linear_0_forward_output"]
    before = [r for r in rows if r["NPU Name"].startswith("Functional_conv2d_0_forward")]
    assert all(r["Bitwise Equal"] == "Yes" for r in before)


def _two_training_steps(net):
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(2):
        opt.zero_grad()
        train_step(net)
        opt.step()


def test_weights_an_earlier_divergence_updated_blame_none_of_their_consumers(tmp_path):
    """Two AdamW steps with one weight perturbed: step 1's optimizer updates every weight from differing gradients,
    so in step 2 each layer reads a differing weight.  Only the perturbed weight's first consumer is a root cause,
    not step 2's layers nor the optimizer's weight decay (which read the weights, and nothing else that differs)."""
    a = dump_run(tmp_path, "a", make_net(), step=_two_training_steps, filter_switch="OFF")
    b = dump_run(tmp_path, "b", make_net(perturb="fc1.weight"), step=_two_training_steps, filter_switch="OFF")
    cmp = compare_two(b, a, tmp_path / "out")
    assert _root_causes(cmp) == ["Functional_linear_0_forward"]
    assert sum(1 for p in cmp.pairs if p.output_diverges) > 10  # step 2 and the updates diverge too


@pytest.mark.parametrize("filter_switch", ["ON", "OFF"])
@pytest.mark.parametrize("default", ["given", "left out"])
def test_a_differing_non_tensor_argument_blames_its_call(tmp_path, capsys, filter_switch, default):
    """gelu(approximate='tanh') in one run: the call the code hands another argument is the root cause, whether or
    not the dump keeps non-tensor arguments, and whether the other run names the default (``gelu(x)``, as
    transformers' GELUActivation calls it: the calls pair all the same)."""
    def step(approximate):
        def run(net):
            x, _ = batch()
            h = net.fc1(torch.relu(net.conv(x)).flatten(1))
            (F.gelu(h) if approximate is None else F.gelu(h, approximate=approximate)).sum()
        return run

    a = dump_run(tmp_path, "a", make_net(), step=step("none" if default == "given" else None),
                 filter_switch=filter_switch)
    b = dump_run(tmp_path, "b", make_net(), step=step("tanh"), filter_switch=filter_switch)
    cmp = compare_two(b, a, tmp_path / "out")
    assert _root_causes(cmp) == ["Functional_gelu_0_forward"]
    assert cmp.unpaired == 0
    if filter_switch == "OFF" and default == "given":
        assert "so does what it was given (Functional_gelu_0_forward_input.approximate)" in capsys.readouterr().out


def test_integer_inputs_the_filter_leaves_out_still_show_that_they_differ(tmp_path):
    """With the default filter_switch="ON" integer tensors are not dumped, but fingerprinted: an embedding fed another
    token id has inputs that differ, so it is not blamed ("its inputs match") for what the data changed."""
    def step(changed):
        def run(emb):
            ids = torch.tensor([[1, 2, 3, 4]])
            if changed:
                ids[0, 2] = 5
            F.embedding(ids, emb.weight).sum()
        return run

    emb = torch.nn.Embedding(8, 4)
    a = dump_run(tmp_path, "a", emb, step=step(False), summary_only=False)
    b = dump_run(tmp_path, "b", emb, step=step(True), summary_only=False)
    cmp = compare_two(b, a, tmp_path / "out")
    assert _root_causes(cmp) == []
    first = cmp.first_divergence
    assert first.name == "Functional_embedding_0_forward" and first.inputs_match is False
    ids = next(t for t in dump.read_dump(b).by_name("Functional_embedding_0_forward")["inputs"] if t["name"] == "input.0")
    assert ids["filtered"] and ids["hash"] and "payload" not in ids


def test_dumps_with_nothing_to_judge_are_not_shown_to_agree(tmp_path, capsys):
    """A stack-mode dump holds no values, and a run that failed at once dumped no call: neither agrees with a run."""
    from repro_tools.cli import main as cli_main

    a = dump_run(tmp_path, "a", make_net(), mode="stack")
    b = dump_run(tmp_path, "b", make_net(perturb="fc1.weight", scale=3.0), mode="stack")
    cmp = compare_two(b, a, tmp_path / "out")
    assert not cmp.divergent and not cmp.shown_to_agree
    assert "nothing to judge" in capsys.readouterr().out
    assert cli_main(["compare", str(b), str(a), "-o", str(tmp_path / "out")]) == 1

    def fails_at_once(net):
        raise RuntimeError("the model failed before its first call")

    full = dump_run(tmp_path, "full", make_net())
    with pytest.raises(RuntimeError):
        dump_run(tmp_path, "empty", make_net(), step=fails_at_once)
    cmp = compare_two(tmp_path / "empty" / "rank0" / "dump.pkl", full, tmp_path / "out")
    assert not cmp.divergent and not cmp.shown_to_agree and cmp.paired == 0
    assert "no call of one dump pairs" in capsys.readouterr().out


def test_extra_identity_op_does_not_break_the_pairing(tmp_path):
    a = dump_run(tmp_path, "a", make_net())
    b = dump_run(tmp_path, "b", make_net(extra=True, perturb="fc2.weight"))
    cmp = compare_two(b, a, tmp_path / "out")
    unpaired = [(p.a or p.b)["name"] for p in cmp.pairs if p.a is None or p.b is None]
    assert unpaired == ["Torch_relu_0_forward", "Torch_relu_0_backward"]
    shifted = next(p for p in cmp.pairs if p.a and p.a["name"] == "Torch_relu_1_forward")
    assert shifted.b["name"] == "Torch_relu_0_forward" and not shifted.output_diverges
    assert _root_causes(cmp) == ["Functional_linear_1_forward"]


def test_no_divergence_between_identical_runs(tmp_path, capsys):
    a = dump_run(tmp_path, "a", make_net())
    b = dump_run(tmp_path, "b", make_net())
    cmp = compare_two(b, a, tmp_path / "out")
    assert not cmp.divergent and not cmp.root_causes
    assert "no divergence" in capsys.readouterr().out


def test_bf16_against_fp32(tmp_path):
    a = dump_run(tmp_path, "fp32", make_net())
    b = dump_run(tmp_path, "bf16", make_net(dtype=torch.bfloat16), step=lambda n: train_step(n, torch.bfloat16))
    cmp = compare_two(b, a, tmp_path / "out")
    unpaired = [(p.a or p.b)["name"] for p in cmp.pairs if p.a is None or p.b is None]
    assert unpaired == ["Tensor_float_0_backward"]  # .float() of a float32 tensor returns it: no backward there
    rows = list(csv.DictReader(open(cmp.csv_path)))
    conv = next(r for r in rows if r["NPU Name"] == "Functional_conv2d_0_forward_output")
    assert (conv["NPU Tensor Dtype"], conv["Bench Tensor Dtype"]) == ("torch.bfloat16", "torch.float32")
    assert float(conv["Cosine"]) > 0.99 and conv["Accuracy Reached or Not"] == "Yes"
    assert not cmp.root_causes
    # runs in two dtypes are judged by tolerance everywhere, also after .float() where both sides are fp32
    assert not cmp.exact and not cmp.divergent
    assert dump.compare_dumps(b, a, exact=True).divergent  # bitwise there would claim a divergence
    c = dump_run(tmp_path, "bf16bad", make_net(dtype=torch.bfloat16, perturb="fc1.weight", scale=0.5),
                 step=lambda n: train_step(n, torch.bfloat16))
    assert _root_causes(compare_two(c, a, tmp_path / "out2"))[:1] == ["Functional_linear_0_forward"]


def test_statistics_only_dumps_compare(tmp_path):
    a = dump_run(tmp_path, "a", make_net(), summary_only=True)
    b = dump_run(tmp_path, "b", make_net(perturb="fc1.weight"), summary_only=True)
    assert not (a.parent / "dump" / "tensors.bin").exists()
    cmp = compare_two(b, a, tmp_path / "out")
    assert _root_causes(cmp) == ["Functional_linear_0_forward"]
    row = next(r for r in cmp.rows if r["NPU Name"] == "Functional_linear_0_forward_output")
    assert row["Cosine"] == "N/A" and row["Err_message"] == "statistics only" and row["Max diff"] != "N/A"


@pytest.mark.parametrize("switch, expect, absent", [
    (dict(mode="all"), ["Functional_conv2d_0_forward", "Functional_conv2d_0_backward"], []),
    (dict(mode="list", scope=["Functional_linear_1_forward", "Torch_relu_0_backward"]),
     ["Functional_linear_1_forward", "Torch_relu_0_backward"], ["Functional_linear_1_backward", "Torch_relu_0_forward"]),
    (dict(mode="range", scope=["Tensor_flatten_0_forward", "Torch_relu_0_forward"]),
     ["Tensor_flatten_0_forward", "Functional_linear_0_forward", "Torch_relu_0_forward"],
     ["Functional_relu_0_forward", "Functional_linear_1_forward"]),
    (dict(mode="api_list", api_list=["relu"]), ["Functional_relu_0_forward", "Torch_relu_0_backward"],
     ["Functional_linear_0_forward"]),
    (dict(mode="all", dump_mode=["backward"]), ["Functional_linear_0_backward"], ["Functional_linear_0_forward"]),
])
def test_dump_switch_selects_calls(tmp_path, switch, expect, absent):
    got = names(dump_run(tmp_path, "a", make_net(), **switch))
    assert all(n in got for n in expect) and not any(n in got for n in absent)


@pytest.mark.parametrize("mode", ["api_stack", "stack"])
def test_stack_modes_record_call_stacks(tmp_path, mode):
    d = dump.read_dump(dump_run(tmp_path, "a", make_net(), mode=mode))
    e = d.by_name("Functional_linear_0_forward")
    assert any("dump_helpers.py" in s and "forward" in s for s in e["stack"])
    has_data = "hash" in e["outputs"][0]
    assert has_data == (mode == "api_stack")
    assert dump.parse(d.path, "Functional_linear_0_forward")[0].startswith("Functional_linear_0_forward")


def test_dump_mode_input_keeps_only_inputs_and_filter_off_keeps_scalars(tmp_path):
    d = dump.read_dump(dump_run(tmp_path, "a", make_net(), dump_mode=["forward", "input"], filter_switch="OFF"))
    e = d.by_name("Tensor_flatten_0_forward")
    assert e["outputs"] == [] and {"name": "input.1", "type": "int", "value": 1} in e["inputs"]


def test_acl_modes_need_an_ascend_npu(tmp_path):
    dump.set_dump_path(tmp_path)
    with pytest.raises(DeviceUnavailableError, match="needs an Ascend NPU"):
        dump.set_dump_switch("ON", mode="acl", scope=["Tensor_permute_1_forward"])
    with pytest.raises(DeviceUnavailableError, match="needs an Ascend NPU"):
        dump.register_hook(make_net(), dump.acc_cmp_dump, dump_mode="acl", dump_config="./dump.json")


def _overflowing_step(net):
    x, _ = batch()
    y = net(x)
    z = torch.exp(y * 1e4)  # first overflow: exp of large finite values
    (z * 2).sum()          # inputs already inf: not counted
    torch.exp(y * 2e4)      # second overflow


def test_overflow_check_error_names_the_first_overflow_and_how_many(tmp_path):
    dump.set_dump_path(tmp_path, dump_tag="ovf")
    dump.register_hook(make_net(), dump.overflow_check, overflow_nums=2)
    with pytest.raises(dump.DumpOverflowError) as err:
        _overflowing_step(make_net())
    msg = str(err.value)
    assert msg.startswith("[overflow 2 times]: first overflowing API Torch_exp_0_forward at ")
    assert "overflow_nums=2 reached at Torch_exp_1_forward" in msg


@pytest.mark.parametrize("nums, stops", [(1, True), (-1, False)])
def test_overflow_check_finds_first_overflowing_api(tmp_path, nums, stops):
    dump.set_dump_path(tmp_path, dump_tag="ovf")
    dump.register_hook(make_net(), dump.overflow_check, overflow_nums=nums)
    if stops:
        with pytest.raises(dump.DumpOverflowError, match=r"overflow 1 times.*Torch_exp_0_forward"):
            _overflowing_step(make_net())
    else:
        _overflowing_step(make_net())
        dump.set_overflow_check_switch("OFF")
    d = dump.read_dump(overflow_index(tmp_path / "ovf" / "rank0"))
    expect = ["Torch_exp_0_forward"] if stops else ["Torch_exp_0_forward", "Torch_exp_1_forward"]
    assert [e["name"] for e in d.entries] == expect
    out = d.tensor(d.entries[0]["outputs"][0])
    assert torch.isinf(out).any() and torch.isfinite(d.tensor(d.entries[0]["inputs"][0])).all()


def test_compiled_model_is_an_opaque_entry_not_missing(tmp_path):
    torch._dynamo.reset()
    net = make_net()
    compiled = torch.compile(net, backend="aot_eager")
    x, t = batch()
    expected = compiled(x)
    idx = dump_run(tmp_path, "c", compiled, step=lambda n: F.cross_entropy(n(x), t).backward())
    d = dump.read_dump(idx)
    got = [e["name"] for e in d.entries]
    assert got[0] == "Compiled_Net_0_forward" and "Compiled_Net_0_backward" in got
    assert not any(n.startswith(("Functional_linear", "Functional_conv2d")) for n in got)
    region = d.entries[0]
    assert region["opaque"] is True and "determ backend" in region["note"]
    assert torch.equal(d.tensor(region["outputs"][0]), expected)
    assert not dump_hooks.passthrough()


def test_bad_inputs_give_one_line_errors(tmp_path):
    a = dump_run(tmp_path, "a", make_net())
    with pytest.raises(TraceFormatError, match="no such dump"):
        compare_two(tmp_path / "missing", a, tmp_path / "out")
    dump.set_dump_path(tmp_path, dump_tag="open")
    dump.set_dump_switch("ON")
    torch.relu(torch.ones(2))
    with pytest.raises(TraceFormatError, match=r"this dump is still switched on; call set_dump_switch\('OFF'\)"):
        compare_two(tmp_path / "open" / "rank0" / "dump.pkl", a, tmp_path / "out")
    dump.set_dump_switch("OFF")
    with pytest.raises(ConfigError, match="bench_pkl_path"):
        dump.compare({"npu_pkl_path": str(a)}, tmp_path / "out")
    data = a.parent / "dump" / "tensors.bin"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(TraceFormatError, match="truncated payload file"):
        compare_two(a, a, tmp_path / "out")
    with pytest.raises(DetermError, match="mode='range' needs scope"):
        dump.set_dump_switch("ON", mode="range", scope=["x"])


def test_backward_after_switching_off_records_nothing_and_does_not_fail(tmp_path):
    net = make_net()
    x, t = batch()
    dump.set_dump_path(tmp_path, dump_tag="t")
    dump.set_dump_switch("ON")
    loss = F.cross_entropy(net(x), t)
    dump.set_dump_switch("OFF")
    loss.backward()
    got = names(tmp_path / "t" / "rank0" / "dump.pkl")
    assert "Functional_linear_1_forward" in got and not any(n.endswith("_backward") for n in got)


def test_module_dump_records_a_module_as_one_entry(tmp_path):
    net = make_net()
    dump.module_dump(net.fc1, "MyFc1")
    got = names(dump_run(tmp_path, "m", net))
    assert "MyFc1_0_forward" in got and "MyFc1_0_backward" in got
    assert "Functional_linear_0_forward" in got  # fc2: Functional_linear_0 now that fc1 is one entry
    assert "Functional_linear_1_forward" not in got


def test_unpaired_culprit_is_named_when_no_root_cause_can_be(tmp_path, capsys):
    def step(bug):
        def run(net):
            x, t = batch()
            h = torch.relu(net.fc1(F.relu(net.conv(x)).flatten(1)))
            h = h * 1.0
            if bug:
                h[0, 0] += 1e-3  # an extra in-place op present in one run only
            F.cross_entropy(net.fc2(h), t).backward()
        return run

    a = dump_run(tmp_path, "a", make_net(), step=step(False))
    b = dump_run(tmp_path, "b", make_net(), step=step(True))
    cmp = compare_two(b, a, tmp_path / "out")
    assert not cmp.root_causes  # every paired call that diverges already has a diverging input
    out = capsys.readouterr().out
    assert "first divergence: Functional_linear_1_forward" in out and "Tensor_add__0_forward (NPU, at " in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_against_cpu(tmp_path):
    a = dump_run(tmp_path, "cpu", make_net())
    b = dump_run(tmp_path, "cuda", make_net().cuda(), step=lambda n: F.cross_entropy(
        n(batch()[0].cuda()), batch()[1].cuda()).backward())
    cmp = compare_two(b, a, tmp_path / "out")
    assert not cmp.exact and not cmp.root_causes
    assert all(p.a is not None and p.b is not None for p in cmp.pairs if p.a and p.a["dir"] == "forward")


def test_nothing_is_recorded_in_a_process_that_only_imports(tmp_path):
    import subprocess
    import sys

    code = ("import atexit, torch; from determ_backend.dump import *; "
            "print(torch.overrides._get_current_function_mode() is None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stderr[-1000:]


def test_random_factory_with_another_seed_is_the_root_cause(tmp_path):
    def step(seed):
        def run(net):
            x, t = batch()
            torch.manual_seed(seed)
            noise = torch.randn(x.shape)
            x = x.clone()
            x[:, 0] = 0.0  # __setitem__: recorded with the modified tensor as its output
            F.cross_entropy(net(x + 0.01 * noise), t).backward()
        return run

    a = dump_run(tmp_path, "a", make_net(), step=step(0))
    b = dump_run(tmp_path, "b", make_net(), step=step(1))
    # Torch_randn_0 is the seeded batch (same in both runs); Torch_randn_1 is the noise
    assert _root_causes(compare_two(b, a, tmp_path / "out"))[:1] == ["Torch_randn_1_forward"]
    setitem = dump.read_dump(a).by_name("Tensor___setitem___0_forward")
    out = dump.read_dump(a).tensor(setitem["outputs"][0])
    assert out.shape == (4, 3, 8, 8) and torch.all(out[:, 0] == 0)


def test_msprobe_style_precision_debugger_dumps_selected_steps(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text('{"task": "tensor", "dump_path": "%s", "step": [1], "level": "L1", '
                   '"tensor": {"scope": [], "list": ["linear"]}}' % (tmp_path / "out"))
    dbg = dump.PrecisionDebugger(config_path=str(cfg))
    net = make_net()
    for _ in range(3):
        dbg.start(net)
        train_step(net)
        dbg.stop()
        dbg.step()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["step1"]
    got = names(tmp_path / "out" / "step1" / "rank0" / "api_list_dump.pkl")
    assert "Functional_linear_0_forward" in got and not any("conv2d" in n for n in got)
    with pytest.raises(ConfigError, match=r"level='L2' \(L2, kernel level, needs an Ascend NPU\)"):
        dump.PrecisionDebugger(dump_path=str(tmp_path), level="L2")


@pytest.mark.parametrize("call, match", [
    (lambda p: dump.set_dump_switch("ON", summary_only="no"), "summary_only must be True or False, got 'no'"),
    (lambda p: dump.set_dump_path(3), "set_dump_path: fpath must be a path"),
    (lambda p: dump.parse(p, 3), "parse: name_prefix must be a string"),
    (lambda p: dump.parse(3, "Functional"), "parse: pkl_file must be a path"),
    (lambda p: dump.compare({"npu_pkl_path": 3, "bench_pkl_path": str(p)}, p.parent / "out"),
     r"compare: input_param\['npu_pkl_path'\] must be a path \(str or os.PathLike\), got int 3"),
    (lambda p: dump.compare({"npu_pkl_path": str(p), "bench_pkl_path": str(p)}, 3), "compare: output_path must be"),
])
def test_arguments_of_the_wrong_type_give_one_line_errors(tmp_path, call, match):
    idx = dump_run(tmp_path, "a", make_net(), summary_only=True)
    dump.set_dump_path(tmp_path, dump_tag="b")
    with pytest.raises(ConfigError, match=match):
        call(idx)


def test_an_earlier_runs_dump_is_never_overwritten(tmp_path):
    import shutil

    idx = dump_run(tmp_path, "a", make_net())
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # as left by an earlier process
    before = {p.name: p.read_bytes() for p in (tmp_path / "b" / "rank0").rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match=r"rank0 already holds an earlier dump \(dump.pkl\); remove dump.pkl"):
        dump_run(tmp_path, "b", make_net())
    assert {p.name: p.read_bytes() for p in (tmp_path / "b" / "rank0").rglob("*") if p.is_file()} == before
    # the same process may dump into its own path again, as before (a new dump replaces its own)
    assert dump_run(tmp_path, "a", make_net(perturb="fc1.weight")) == idx
    assert dump.read_dump(idx).entries


def _precision_debugger_names(tmp_path, config: str):
    cfg = tmp_path / "config.json"
    cfg.write_text(config.replace("OUT", str(tmp_path / "out")))
    dbg = dump.PrecisionDebugger(config_path=str(cfg))
    net = make_net()
    for _ in range(2):
        dbg.start(net)
        train_step(net)
        dbg.stop()
        dbg.step()
    steps = sorted(p.name for p in (tmp_path / "out").iterdir())
    return steps, {s: names(next((tmp_path / "out" / s / "rank0").glob("*dump.pkl"))) for s in steps}


@pytest.mark.parametrize("config, steps, expect, absent", [
    ('{"task": "statistics", "dump_path": "OUT", "step": 1, "statistics": {"list": "linear"}}',
     ["step1"], ["Functional_linear_0_forward"], ["Functional_conv2d_0_forward", "Torch_relu_0_forward"]),
    ('{"task": "tensor", "dump_path": "OUT", "step": [0], "tensor": {"list": ["Functional.linear.1.forward", '
     '"Torch_relu_0_backward"]}}', ["step0"], ["Functional_linear_1_forward", "Torch_relu_0_backward"],
     ["Functional_linear_0_forward", "Functional_linear_1_backward", "Torch_relu_0_forward"]),
    ('{"task": "statistics", "dump_path": "OUT", "step": [0], "statistics": {"scope": ["Tensor.flatten.0.forward", '
     '"Torch.relu.0.forward"], "data_mode": ["forward"]}}', ["step0"],
     ["Tensor_flatten_0_forward", "Functional_linear_0_forward", "Torch_relu_0_forward"],
     ["Functional_relu_0_forward", "Functional_linear_1_forward"]),
])
def test_precision_debugger_reads_msprobe_config_forms(tmp_path, config, steps, expect, absent):
    got_steps, got = _precision_debugger_names(tmp_path, config)
    assert got_steps == steps
    got = got[steps[0]]
    assert all(n in got for n in expect) and not any(n in got for n in absent)


def test_precision_debugger_warns_once_when_its_list_selects_nothing(tmp_path, caplog):
    config = '{"task": "statistics", "dump_path": "OUT", "statistics": {"list": ["Functional.linear.9.forward"]}}'
    with caplog.at_level("WARNING", logger="determ_backend.dump.capture.debugger"):
        _precision_debugger_names(tmp_path, config)
    warnings = [r.getMessage() for r in caplog.records if r.name == "determ_backend.dump.capture.debugger"]
    assert len(warnings) == 1 and "statistics.list=['Functional.linear.9.forward'] selected no API call" in warnings[0]


@pytest.mark.parametrize("switch, needle", [
    ({"mode": "list", "scope": ["Functional_linear_9_forward"]}, "mode='list' with scope=['Functional_linear_9_forward']"),
    ({"mode": "api_list", "api_list": ["conv3d"]}, "mode='api_list' with api_list=['conv3d']"),
])
def test_set_dump_switch_warns_when_its_selection_records_nothing(tmp_path, caplog, switch, needle):
    """The ptdbg interface, as ``PrecisionDebugger``: a named selection that matched no call is one warning at
    ``set_dump_switch("OFF")``; one that matched says nothing."""
    with caplog.at_level("WARNING", logger="determ_backend.dump.capture.control"):
        dump_run(tmp_path, "none", sequential(), step=_two_losses(), **switch)
    warnings = [r.getMessage() for r in caplog.records if r.name == "determ_backend.dump.capture.control"]
    assert len(warnings) == 1 and needle in warnings[0] and "recorded no call" in warnings[0], warnings
    caplog.clear()
    with caplog.at_level("WARNING", logger="determ_backend.dump.capture.control"):
        dump_run(tmp_path, "some", sequential(), step=_two_losses(), mode="list", scope=["Functional_linear_0_forward"])
    assert not [r for r in caplog.records if r.name == "determ_backend.dump.capture.control"]


def test_a_scope_of_fragments_selects_nothing_and_the_warning_says_scope_takes_whole_names(tmp_path, caplog):
    """As in msprobe, scope takes whole call names (list also takes fragments); the warning offered fragments."""
    config = '{"task": "statistics", "dump_path": "OUT", "statistics": {"scope": ["relu"]}}'
    with caplog.at_level("WARNING", logger="determ_backend.dump.capture.debugger"):
        _precision_debugger_names(tmp_path, config)
    warnings = [r.getMessage() for r in caplog.records if r.name == "determ_backend.dump.capture.debugger"]
    assert len(warnings) == 1 and "scope takes whole names, list also fragments" in warnings[0], warnings


@pytest.mark.parametrize("config, match", [
    ('{"dump_path": "OUT", "step": "1"}', "step must be an int or a list of ints and 'a-b' ranges, got '1'"),
    ('{"dump_path": "OUT", "statistics": {"list": [3]}}', r"statistics.list must be a string or a list of strings"),
    ('{"dump_path": "OUT", "statistics": {"data_mode": ["fwd"]}}', r"statistics.data_mode=\['fwd'\]"),
])
def test_precision_debugger_config_errors(tmp_path, config, match):
    cfg = tmp_path / "config.json"
    cfg.write_text(config.replace("OUT", str(tmp_path / "out")))
    with pytest.raises(ConfigError, match=match):
        dump.PrecisionDebugger(config_path=str(cfg))


def test_precision_debugger_refuses_a_list_mixing_names_and_fragments(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text('{"dump_path": "%s", "statistics": {"list": ["relu", "Functional.linear.0.forward"]}}' % tmp_path)
    with pytest.raises(ConfigError, match="mixes call names"):
        dump.PrecisionDebugger(config_path=str(cfg))


def test_missing_payload_file_is_one_warning_and_statistics_still_compare(tmp_path, caplog):
    a = dump_run(tmp_path, "a", make_net())
    b = dump_run(tmp_path, "b", make_net(perturb="fc1.weight"))
    (b.parent / "dump" / "tensors.bin").unlink()
    with caplog.at_level("WARNING"):
        cmp = compare_two(b, a, tmp_path / "out")
    lines = [r.getMessage() for r in caplog.records if "references tensor payloads" in r.getMessage()]
    assert len(lines) == 1 and "tensors.bin is missing" in lines[0] and str(b) in lines[0]
    assert _root_causes(cmp) == ["Functional_linear_0_forward"]  # judged on the statistics


def test_a_dump_path_that_cannot_be_written_is_refused_when_set(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match=r"cannot use .*afile/sub/t: .*afile is a file"):
        dump.set_dump_path(tmp_path / "afile" / "sub", dump_tag="t")


def test_a_read_only_dump_path_is_refused_when_set(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("this user may write into read-only directories (root without a read-only mount)")
        with pytest.raises(ConfigError, match="read-only or no permission|read-only or not ours"):
            dump.set_dump_path(ro / "d")
    finally:
        ro.chmod(0o755)


class _Upcasts(torch.nn.Module):
    """Float32 work on bfloat16 data: a rotary-style product of a float32 buffer, a softmax computed in float32,
    and the output cast up: all exact or float32 ops, innocent in a bfloat16-vs-float32 comparison."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)))
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x):
        freqs = torch.arange(16).float()[:, None] * self.inv_freq.float()
        h = self.proj(x)
        scores = torch.softmax(h @ h.transpose(-1, -2), -1, dtype=torch.float32)
        return freqs.sum() + scores.sum() + h.float().sum()


@pytest.mark.parametrize("summary_only", [False, True], ids=["tensors", "statistics"])
def test_bfloat16_against_float32_blames_no_float32_op_or_exact_cast(tmp_path, summary_only):
    # statistics only: a float32 value on both sides is judged within tolerance too (dumps spell the dtype
    # ``torch.float32``: read as a non-float name, it was held to bitwise equality and the cast was blamed)
    def run(tag, dtype):
        torch.manual_seed(0)
        net, x = _Upcasts(), torch.randn(16, 16)
        net, x = net.to(dtype), x.to(dtype)
        return dump_run(tmp_path, tag, net, step=lambda n: n(x), summary_only=summary_only)

    cmp = compare_two(run("bf16", torch.bfloat16), run("fp32", torch.float32), tmp_path / "out")
    assert not cmp.divergent and cmp.root_causes == [], [p.name for p in cmp.root_causes]


class _Residual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) + x  # the residual add


def test_an_extra_add_is_not_paired_with_the_residual_add_beside_it(tmp_path):
    def run(tag, hook):
        torch.manual_seed(0)
        net, x = _Residual(), torch.randn(4, 8)
        if hook:
            net.lin.register_forward_hook(lambda mod, args, out: out + 1e-3)  # one more add, one tensor argument
        return dump_run(tmp_path, tag, net, step=lambda n: n(x))

    cmp = compare_two(run("hook", True), run("plain", False), tmp_path / "out")
    unpaired = [p for p in cmp.pairs if p.a is None or p.b is None]
    assert [(p.a or p.b)["name"] for p in unpaired] == ["Tensor_add_0_forward"] and unpaired[0].b is None
    assert "unpaired calls just before it" in cmp.analysis and "Tensor_add_0_forward (NPU, at " in cmp.analysis


def test_a_gradient_hook_only_one_run_has_is_named_beside_the_gradient_read_out(tmp_path):
    """``bias.register_hook(lambda g: g * 1.01)`` in one run: the gradient read before ``optimizer.step()`` is the
    root cause (nothing paired diverged before it), and the analysis names the hook's mul, whose very output it holds,
    with its line ("at ?" was all it said)."""
    def run(tag, hook):
        torch.manual_seed(0)
        net = sequential()
        if hook:
            net[0].bias.register_hook(lambda g: g * 1.01)  # the culprit

        def step(m):
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            m(torch.randn(4, 16, generator=torch.Generator().manual_seed(1))).pow(2).sum().backward()
            opt.step()
        return dump_run(tmp_path, tag, net, step=step, summary_only=True)

    cmp = compare_two(run("hook", True), run("plain", False), tmp_path / "out")
    assert _root_causes(cmp)[:1] == ["Parameter_0.bias_0_backward"], _root_causes(cmp)
    line = next(ln for ln in cmp.analysis.splitlines() if "its value is the output of" in ln)
    assert "Tensor_mul_0_forward, a call one dump alone has (at " in line and "test_dump.py" in line, line


def test_a_read_only_hook_only_one_run_has_leaves_a_gradient_read_out_its_root_cause(tmp_path):
    """One run has a forward hook that only reads (``o.abs().max()``, feeding nothing) and a bias gradient written
    where no dumped call sees it: the gradient read-out is the root cause ("its inputs match"), not the hook."""
    def run(tag, extra):
        torch.manual_seed(0)
        net = sequential()
        if extra:
            net[0].register_forward_hook(lambda m, a, o: o.abs().max() and None)

        def step(m):
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            m(torch.randn(4, 16, generator=torch.Generator().manual_seed(1))).pow(2).sum().backward()
            if extra:  # written where no dumped call sees it, as DDP's C++ reducer writes gradients
                m[0].bias.grad.numpy()[0] += 1e-3
            opt.step()
        return dump_run(tmp_path, tag, net, step=step, summary_only=True)

    cmp = compare_two(run("extra", True), run("plain", False), tmp_path / "out")
    assert [n for n in _root_causes(cmp) if n.startswith("Parameter_0.bias_")], _root_causes(cmp)


class _Unusual(torch.nn.Module):
    """An inference-mode tensor (no version counter) and a nested tensor (no sizes) among a call's arguments."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))
        with torch.inference_mode():
            self.it = torch.arange(4.0)

    def forward(self, x):
        nt = torch.nested.nested_tensor([x[:2], x[2:]])
        return (self.it * 2 + self.w * x).sum(), (nt * 2).unbind()[0]


def test_inference_and_nested_tensors_are_dumped_without_breaking_the_call(tmp_path):
    net, x = _Unusual(), torch.randn(5, 4)
    want = net(x)
    got = {}
    idx = dump_run(tmp_path, "u", net, step=lambda n: got.setdefault("out", n(x)))
    assert torch.equal(got["out"][0], want[0]) and torch.equal(got["out"][1], want[1])
    assert any(e["name"].startswith("Tensor_mul") for e in dump.read_dump(idx).entries)


def test_what_a_call_is_given_and_what_it_computes():
    """Weights and non-tensor arguments are given (blamed where nothing diverged before); a tensor whose producer
    the backend's trace does not attribute is computed, its verdict unknown (never taken for agreeing)."""
    from determ_backend.dump.comparison.dumps import is_given

    assert is_given({"name": "input.1", "dtype": "torch.float32", "shape": [4], "param": True})
    assert is_given({"name": "approximate", "type": "str", "value": "tanh"})
    assert is_given({"name": "input.2", "type": "None"})
    assert not is_given({"name": "input.0", "dtype": "torch.float32", "shape": [4]})
    assert not is_given({"name": "input.0", "node": "buf3", "unresolved": True})


def test_a_linear_backward_under_autocast_pairs_with_the_float32_one(tmp_path):
    """Under CPU autocast autograd hands a Linear's gradients over in another order: the backward records aligned by
    their shapes in record order, so every linear backward was 'no counterpart' and never judged, and the runs were
    said to agree."""
    idx = []
    for tag, autocast in (("bf16", True), ("fp32", False)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
        x = torch.randn(2, 8, 32)

        def step(net, x=x, autocast=autocast):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = net(x)
            y.float().sum().backward()

        idx.append(dump_run(tmp_path, tag, model, step=step))
    cmp = compare_two(*idx, tmp_path / "cmp")
    paired = {p.name for p in cmp.pairs if p.a is not None and p.b is not None}
    assert {"Functional_linear_0_backward", "Functional_linear_1_backward"} <= paired


def test_a_weight_used_through_a_view_is_a_weight_the_compare_can_blame(tmp_path):
    """Falcon's linear computes ``input @ self.weight.T``: the view was not seen as a weight, and with that weight
    perturbed the compare found 'no root cause among the paired APIs' though nothing else differed."""
    class TLinear(torch.nn.Linear):
        def forward(self, x):
            return x @ self.weight.T + self.bias

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = TLinear(16, 16), TLinear(16, 4)

        def forward(self, x):
            return self.fc2(torch.tanh(self.fc1(x)))

    paths = {}
    for run in ("a", "b"):
        torch.manual_seed(0)
        net = Net()
        if run == "a":
            with torch.no_grad():
                net.fc2.weight[0, 0] += 1e-3
        dbg = dump.PrecisionDebugger(dump_path=str(tmp_path / run), level="L1", model=net)
        dbg.start(net)
        net(torch.randn(2, 16)).sum().backward()
        dbg.stop()
        paths[run] = str(tmp_path / run / "step0" / "rank0" / "dump.pkl")
    r = dump.compare({"npu_pkl_path": paths["a"], "bench_pkl_path": paths["b"]}, str(tmp_path / "cmp"))
    assert [p.name for p in r.root_causes][:1] == ["Tensor_matmul_1_forward"], [p.name for p in r.root_causes]


def test_a_call_fed_the_error_it_outputs_is_not_blamed_in_a_bf16_against_fp32_compare(tmp_path):
    """Judged within bf16's tolerance, a small gradient 10% off passes an absolute tolerance, and the backward that
    scales it up was named a second root cause beside the perturbed weight's linear."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.fc3 = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 8)

        @staticmethod
        def norm(x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

        def forward(self, x):
            return self.fc3(self.norm(self.fc2(self.norm(self.fc1(x)))))

    paths = {}
    for run, bf16, delta in (("a", True, 0.5), ("b", False, 0.0)):
        torch.manual_seed(0)
        net = Net()
        with torch.no_grad():
            net.fc2.weight[0, 0] += delta
        x = torch.randn(2, 8, 32) * 0.05
        dbg = dump.PrecisionDebugger(dump_path=str(tmp_path / run), task="tensor", level="L1", model=net)
        dbg.start(net)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = net(x).pow(2).mean()
        loss.backward()
        dbg.stop()
        paths[run] = str(tmp_path / run / "step0" / "rank0" / "dump.pkl")
    r = dump.compare({"npu_pkl_path": paths["a"], "bench_pkl_path": paths["b"]}, str(tmp_path / "cmp"))
    assert [p.name for p in r.root_causes] == ["Functional_linear_1_forward"]


_PER_SAMPLE_GRADS = """
import json, sys, torch
from torch.func import functional_call, grad, vmap
from determ_backend.dump import PrecisionDebugger
from determ_backend.fingerprint.core import hash_tensor
torch.manual_seed(0)
model = torch.nn.Linear(8, 3)
params = {k: v.detach() for k, v in model.named_parameters()}
x, y = torch.randn(5, 8), torch.randint(0, 3, (5,))
def loss(p, xi, yi):
    return torch.nn.functional.cross_entropy(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))
per_sample = lambda: vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)["weight"]
plain = per_sample()
dbg = PrecisionDebugger(task=sys.argv[2], dump_path=sys.argv[1], level="L1")
dbg.start()
got = per_sample()  # the first use of the fingerprint kernel in this process is inside the transforms
dbg.stop()
assert torch.equal(got, plain)
assert hash_tensor(torch.ones(3)) == hash_tensor(torch.ones(3).clone())  # nothing cached from inside them
"""


@pytest.mark.parametrize("task", ["statistics", "tensor"])
def test_a_dump_inside_vmap_and_grad_describes_the_batch_and_leaves_the_program_alone(tmp_path, task):
    """Per-sample gradients (``vmap(grad(...))``) under a dump: its tensors are functorch wrappers with no memory,
    and the fingerprint kernel's constants, first made inside ``grad``, were wrappers too; the program died with
    "Cannot access data pointer of Tensor that doesn't have storage"."""
    import json
    import subprocess
    import sys

    from paths import ROOT

    out = tmp_path / "dump"
    r = subprocess.run([sys.executable, "-c", _PER_SAMPLE_GRADS, str(out), task], capture_output=True, text=True,
                       cwd=str(ROOT), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (index,) = out.glob("step0/rank0/dump.pkl")
    entries = [json.loads(ln) for ln in index.read_text().splitlines()[1:]]
    unsqueeze = next(e for e in entries if e.get("op") == "Tensor.unsqueeze")
    assert unsqueeze["inputs"][0]["shape"] == [5, 8] and unsqueeze["inputs"][0]["stats"]["l2"] > 0  # the batch


def test_a_module_around_a_call_only_one_run_made_is_not_a_root_cause(tmp_path):
    """A forward hook adds to fc1's output in one run: at L1 the hook's add is the likely culprit; at ``mix`` the
    module around it was "root cause: its inputs match but its output does not", and the add went unmentioned."""
    def run(out, hook):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
        if hook:
            m[0].register_forward_hook(lambda mod, args, y: y + 1e-3)
        dbg = dump.PrecisionDebugger(task="statistics", dump_path=str(tmp_path / out), level="mix", model=m)
        dbg.start(m)
        m(torch.randn(4, 16)).sum().backward()
        dbg.stop()
        return tmp_path / out / "step0" / "rank0"

    cmp = compare_two(run("a", False), run("b", True), tmp_path / "cmp")
    assert _root_causes(cmp) == [], _root_causes(cmp)
    assert cmp.first_divergence is not None and cmp.first_divergence.name == "Module_0.Linear_0_forward"


@pytest.mark.parametrize("write", ["fused_adamw", "data"])
def test_a_weight_written_without_its_version_moving_is_fingerprinted_anew(tmp_path, write):
    """``AdamW(fused=True)`` (``torch._fused_adamw_``) writes the parameters without moving their version counters,
    and ``p.data.mul_()`` moves another tensor's: the dump handed the next step the weight's fingerprint from before
    the write (stored fingerprint and stored values disagreed, and compare blamed the next step's linear)."""
    from determ_backend import hash_tensor

    torch.manual_seed(0)
    m = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
    x = torch.randn(4, 8)
    seen = []

    def steps(net):
        for _ in range(2):
            seen.append(format(hash_tensor(net.weight), "016x"))
            net(x).pow(2).mean().backward()
            if write == "fused_adamw":
                opt.step()
            else:
                net.weight.data.mul_(0.5)
            opt.zero_grad()

    index = dump_run(tmp_path, "run", m, steps)
    entries = {e["name"]: e for e in dump.read_dump(index).entries}
    dumped = [next(i for i in entries[f"Functional_linear_{k}_forward"]["inputs"] if i["name"] == "input.1")["hash"]
              for k in (0, 1)]
    assert seen[0] != seen[1] and dumped == seen, (dumped, seen)


def test_the_fingerprint_cache_remembers_each_tensor_once_by_its_storage():
    """A buffer written in place every step (a KV cache) is put again after each write: its id was appended to the
    storage's list every time, a list that grew forever in an inference dump (no optimizer step clears it)."""
    from determ_backend.dump.capture.entries import FingerprintCache

    cache = FingerprintCache()
    kv = torch.zeros(16)
    for step in range(1000):
        kv.add_(1)
        assert cache.get(kv) is None
        cache.put(kv, {"hash": step})
    assert sum(len(v) for v in cache._by_storage.values()) == 1
    cache.forget([("kv", kv.view(4, 4))])  # a write through another tensor of the same memory
    assert cache.get(kv) is None


def test_overflow_check_does_not_count_the_backward_of_an_overflowed_call_again(tmp_path):
    dump.set_dump_path(tmp_path, dump_tag="ovf")
    dump.register_hook(make_net(), dump.overflow_check, overflow_nums=-1)
    y = torch.full((4,), 20.0, requires_grad=True)
    z = torch.exp(y * 10)  # overflows; its backward multiplies the gradient by the inf it returned
    z.clamp(max=1.0).sum().backward()  # clamp passes a zero gradient: 0 * inf is nan from finite inputs
    dump.set_overflow_check_switch("OFF")
    assert torch.isnan(y.grad).all()
    d = dump.read_dump(overflow_index(tmp_path / "ovf" / "rank0"))
    assert [e["name"] for e in d.entries] == ["Torch_exp_0_forward"]


class _SquareWithBackward(torch.autograd.Function):
    """x * x whose backward is Python that calls torch APIs (scaled by ``factor``)."""

    factor = 2.0

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return torch.mul(g, x) * _SquareWithBackward.factor


class _BackwardPythonNet(torch.nn.Module):
    """A custom Function, a reentrant checkpoint (recomputed inside backward) and a gradient hook: torch calls that
    run inside ``backward()``."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = _SquareWithBackward.apply(self.a(x))
        h = checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=True)
        h.register_hook(lambda g: torch.clamp(g, -1, 1))
        return h.sum()


def _backward_python_step(net):
    torch.manual_seed(0)
    net(torch.randn(3, 4)).backward()


def test_calls_made_inside_backward_are_recorded_and_a_fault_there_is_named(tmp_path, monkeypatch):
    runs = {}
    for tag, factor in (("a", 2.0), ("b", 2.0), ("c", 2.5)):
        monkeypatch.setattr(_SquareWithBackward, "factor", factor)
        torch.manual_seed(0)
        runs[tag] = dump_run(tmp_path, tag, _BackwardPythonNet(), step=_backward_python_step)
    got = names(runs["a"])
    # the hook's clamp, the checkpoint's recomputed forward (with its backward) and the custom backward's calls
    for name in ("Torch_clamp_0_forward", "Functional_linear_2_forward", "Functional_linear_2_backward",
                 "Torch_mul_0_forward", "Tensor_mul_1_forward"):
        assert name in got, got
    assert torch.is_grad_enabled() and not torch.overrides._get_current_function_mode_stack()
    assert torch.autograd._engine_run_backward is torch.autograd.graph._engine_run_backward  # the patch is gone
    assert _root_causes(compare_two(runs["a"], runs["b"], tmp_path / "ab")) == []
    assert _root_causes(compare_two(runs["a"], runs["c"], tmp_path / "ac")) == ["Tensor_mul_1_forward"]


class _ScaledGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``factor``: a faulty backward kernel of the call it wraps."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


class _SiluBackwardScaled(torch.overrides.TorchFunctionMode):
    """silu's backward returns ``factor`` times the gradient."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return _ScaledGrad.apply(out, self.factor) if func is F.silu else out


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.act, self.down = torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(self.act(self.up(x)))


class _Nested(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.block, self.head = torch.nn.Linear(8, 16), _Block(), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.block(self.inp(x)))


@pytest.mark.parametrize("level, culprit", [("L0", "Module_block.act.SiLU_0_backward"),
                                            ("mix", "Functional_silu_0_backward")])
def test_a_fault_in_a_backward_blames_no_module_around_it(tmp_path, level, culprit):
    def step(net):
        net(torch.randn(4, 8, generator=torch.Generator().manual_seed(1))).pow(2).mean().backward()

    runs = []
    for tag, broken in (("good", False), ("bad", True)):
        torch.manual_seed(0)
        net = _Nested()
        with (_SiluBackwardScaled(1.001) if broken else contextlib.nullcontext()):
            runs.append(dump_run(tmp_path, tag, net, step=step, level=level))
    assert _root_causes(compare_two(runs[1], runs[0], tmp_path / "cmp")) == [culprit]


@pytest.mark.parametrize("summary_only", [False, True])
def test_a_gross_gradient_fault_is_found_against_another_dtype(tmp_path, summary_only):
    """bf16 against fp32: the tolerance widens to bf16's, relative to each value's size -- as an absolute
    tolerance it passed every gradient smaller than it, a 2x one included."""
    def step(net):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1)).to(next(net.parameters()).dtype)
        net(x).float().pow(2).mean().backward()

    runs = {}
    for tag, dtype, broken in (("fp32", torch.float32, False), ("bf16", torch.bfloat16, True),
                               ("bf16-healthy", torch.bfloat16, False)):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.SiLU(), torch.nn.Linear(64, 8)).to(dtype)
        with (_SiluBackwardScaled(2.0) if broken else contextlib.nullcontext()):
            runs[tag] = dump_run(tmp_path, tag, net, step=step, summary_only=summary_only)
    assert _root_causes(compare_two(runs["bf16"], runs["fp32"], tmp_path / "cmp")) == ["Functional_silu_0_backward"]
    assert _root_causes(compare_two(runs["bf16-healthy"], runs["fp32"], tmp_path / "healthy")) == []


class _Router(torch.nn.Module):
    """A healthy MoE router whose two best experts' scores round to one bf16 value for a token of value 1."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(1, 4, bias=False)
        with torch.no_grad():
            self.gate.weight.copy_(torch.tensor([[1.001], [1.0], [0.5], [0.2]]))

    def forward(self, x):
        return torch.topk(F.softmax(self.gate(x).float(), dim=-1), 1, dim=-1)


def test_indices_flipped_by_a_near_tie_in_another_dtype_blame_no_call(tmp_path):
    runs, picks = [], []
    for tag, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        net = _Router().to(dtype)
        rows = torch.tensor([[1.0], [-1.0], [-2.0], [-3.0], [-0.5]], dtype=dtype)  # the first row's two best tie
        step = lambda n: picks.append(int(n(rows)[1][0]))  # noqa: E731
        runs.append(dump_run(tmp_path, tag, net, step=step))
    assert picks[0] != picks[1]  # the near tie does flip
    cmp = compare_two(runs[1], runs[0], tmp_path / "cmp")
    assert _root_causes(cmp) == [] and cmp.first_divergence.name == "Torch_topk_0_forward"
    assert "may flip" in cmp.analysis


def test_a_perturbed_last_layer_blames_its_forward_not_its_backward(tmp_path):
    """The backward entry of the perturbed Linear records the gradient it is given (the same in both runs), not the
    weight it multiplies it by: the gradient it sends back differs, and it had been a second root cause."""
    def step(m):
        m(torch.randn(8, 16, generator=torch.Generator().manual_seed(1))).sum().backward()

    a = dump_run(tmp_path, "a", sequential(), step=step)
    b = dump_run(tmp_path, "b", sequential((0, 0, 1e-2)), step=step)
    cmp = compare_two(b, a, tmp_path / "out")
    assert _root_causes(cmp) == ["Functional_linear_1_forward"]
    assert next(p for p in cmp.pairs if p.name == "Functional_linear_1_backward").output_diverges


def test_a_payload_changed_on_disk_is_an_error_naming_the_file_not_a_verdict(tmp_path):
    a = dump_run(tmp_path, "a", make_net())
    b_dir = tmp_path / "b"
    import shutil

    shutil.copytree(a.parent, b_dir)
    entry = next(t for e in dump.read_dump(a).entries for t in e["outputs"] if t.get("payload"))
    pack = b_dir / "dump" / "tensors.bin"
    data = bytearray(pack.read_bytes())
    off, n = entry["payload"]
    for i in range(off, off + min(n, 64)):
        data[i] ^= 0x55  # same size: only the fingerprint can tell
    pack.write_bytes(bytes(data))
    with pytest.raises(TraceFormatError, match=r"tensors\.bin: the stored payload of \w+ output.* does not match"):
        compare_two(b_dir / "dump.pkl", a, tmp_path / "out")


class _ArgmaxZero(torch.overrides.TorchFunctionMode):
    """A faulty argmax kernel: index 0 for every row."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return torch.zeros_like(out) if func is torch.argmax else out


def test_a_wrong_discrete_result_is_blamed_against_another_dtype(tmp_path):
    """No near tie: most rows' indices move, which a bf16 rounding of the scores cannot do."""
    def step(net):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1)).to(net.weight.dtype)
        torch.argmax(net(x), dim=-1)

    runs = {}
    for tag, dtype, broken in (("fp32", torch.float32, False), ("bf16", torch.bfloat16, True)):
        torch.manual_seed(0)
        with (_ArgmaxZero() if broken else contextlib.nullcontext()):
            runs[tag] = dump_run(tmp_path, tag, torch.nn.Linear(8, 6).to(dtype), step=step)
    assert _root_causes(compare_two(runs["bf16"], runs["fp32"], tmp_path / "cmp")) == ["Torch_argmax_0_forward"]


class _SiluAfterSubmodule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.up, self.head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(F.silu(self.up(self.inp(x))))  # silu: the model's own code, no module of its own


def test_at_L0_a_module_whose_own_code_diverges_is_named_not_excused_by_its_submodule(tmp_path):
    """silu's backward is 2x wrong inside the model's own forward, after its submodule ``up``: ``up``'s backward
    diverges only because the gradient it is given does (no root itself), so it explains no module around it."""
    def step(net):
        net(torch.randn(4, 8, generator=torch.Generator().manual_seed(1))).pow(2).mean().backward()

    runs = []
    for tag, broken in (("good", False), ("bad", True)):
        torch.manual_seed(0)
        with (_SiluBackwardScaled(2.0) if broken else contextlib.nullcontext()):
            runs.append(dump_run(tmp_path, tag, _SiluAfterSubmodule(), step=step, level="L0"))
    assert _root_causes(compare_two(runs[1], runs[0], tmp_path / "cmp")) == ["Module__SiluAfterSubmodule_0_backward"]


@pytest.mark.skipif(not real_models.available(), reason="transformers is not installed")
def test_a_healthy_relu_model_in_bf16_against_fp32_blames_nothing(tmp_path):
    """OPT's relu gradient differs from fp32's at the few elements whose forward value rounds to the other side of 0
    in bf16 (a mask flip): apart there, the gradient is no root cause."""
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model, inputs = real_models.build("opt", seq=8)
        runs[dtype] = dump_run(tmp_path, str(dtype)[6:], model.to(dtype),
                               step=lambda m: real_models.loss_of(m(**inputs)).backward())
    assert _root_causes(compare_two(runs[torch.bfloat16], runs[torch.float32], tmp_path / "cmp")) == []


def test_switching_the_dump_off_in_a_gradient_hook_leaves_no_mode_behind(tmp_path):
    net = torch.nn.Linear(4, 4)
    dump.set_dump_path(tmp_path, dump_tag="o")
    dump.register_hook(net, dump.acc_cmp_dump)
    dump.set_dump_switch("ON")
    y = net(torch.randn(2, 4, requires_grad=True))
    y.register_hook(lambda g: dump.set_dump_switch("OFF"))
    y.sum().backward()  # torch holds the mode off the stack while its handler of backward runs, then puts it back
    torch.relu(torch.ones(1))
    dump.remove_hooks()
    assert not torch.overrides._get_current_function_mode_stack()
    assert "Torch_relu_0_forward" not in names(tmp_path / "o" / "rank0" / "dump.pkl")


class _Experts(torch.nn.Module):
    """A mixture-of-experts layer as transformers writes it: every expert's matmul in one F.grouped_mm."""

    def __init__(self, perturb: float = 0.0):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(2, 8, 4))
        with torch.no_grad():
            self.w[1, 0, 0] += perturb

    def forward(self, x):
        offs = torch.tensor([3, 6], dtype=torch.int32)  # rows 0-2 to expert 0, rows 3-5 to expert 1
        return torch.special.erf(torch.relu(F.grouped_mm(x, self.w, offs=offs)))


def _experts_step(net):
    torch.manual_seed(1)
    net(torch.randn(6, 8, requires_grad=True)).sum().backward()


def test_a_grouped_matmul_is_dumped_and_blamed_and_namespaced_apis_are_named_once(tmp_path):
    """F.grouped_mm is invisible to __torch_function__; the torch._grouped_mm it calls is dumped under its name."""
    a = dump_run(tmp_path, "a", _Experts(), step=_experts_step)
    b = dump_run(tmp_path, "b", _Experts(perturb=1e-3), step=_experts_step)
    assert "Functional_grouped_mm_0_forward" in names(a) and "Functional_grouped_mm_0_backward" in names(a)
    assert "Torch_special_erf_0_forward" in names(a)  # not Torch_special_special_erf
    assert _root_causes(compare_two(b, a, tmp_path / "out")) == ["Functional_grouped_mm_0_forward"]


class _WrittenAfterLinear(torch.nn.Module):
    """A linear on [batch, seq, hidden] (its output a view of its addmm), then that output written in place."""

    def __init__(self, idiom: str):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.lin, self.head = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)
        self.idiom = idiom

    def forward(self, ids):
        e = self.emb(ids)
        h = self.lin(e)
        if self.idiom == "relu_":
            h = h.relu_()
        elif self.idiom == "ReLU(inplace=True)":
            h = torch.nn.ReLU(inplace=True)(h)
        else:  # the residual idiom
            h += e
        return self.head(h * 2.0)


@pytest.mark.parametrize("idiom", ["relu_", "ReLU(inplace=True)", "residual"])
def test_a_call_whose_output_is_written_in_place_records_its_gradients_in_order(tmp_path, idiom):
    ids = torch.randint(0, 10, (4, 3), generator=torch.Generator().manual_seed(1))
    net = _WrittenAfterLinear(idiom)
    idx = dump_run(tmp_path, "a", net, step=lambda m: m(ids).sum().backward())
    d = dump.read_dump(idx)
    order = names(idx)
    assert order.index("Functional_linear_0_backward") < order.index("Functional_embedding_0_backward")
    lin_b = d.by_name("Functional_linear_0_backward")
    (g_out,) = [t for t in lin_b["inputs"] if t["name"] == "input.0"]
    grad_w = next(t for t in lin_b["outputs"] if t["name"] == "output.1")
    assert torch.equal(d.tensor(grad_w), net.lin.weight.grad)
    # the gradient the linear was given: that of its output before the write, taken from an out-of-place twin
    twin = _WrittenAfterLinear(idiom)
    h0 = twin.lin(twin.emb(ids))
    h0.retain_grad()
    out = twin.head((h0.relu() if idiom != "residual" else h0 + twin.emb(ids)) * 2.0)
    out.sum().backward()
    assert g_out["shape"] == [4, 3, 8] and torch.allclose(d.tensor(g_out), h0.grad)
    written = {"relu_": "Tensor_relu__0_backward", "ReLU(inplace=True)": "Functional_relu_0_backward",
               "residual": "Tensor_add__0_backward"}[idiom]
    assert written in order, order  # the in-place call has a backward entry of its own
    w = d.by_name(written)
    grad_in = next(t for t in w["outputs"] if t["name"] == "output.0")  # the gradient of what it overwrote
    assert grad_in["shape"] == [4, 3, 8] and torch.allclose(d.tensor(grad_in), h0.grad)


def _bert_step(autocast: bool):
    def run(model):
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids).logits
        logits.float().pow(2).mean().backward()
    return run


def _tiny_bert():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=128, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(cfg)


def test_a_gradient_zero_at_either_precision_is_no_divergence_of_a_mixed_precision_run(tmp_path, capsys):
    """BERT's attention key bias has a gradient that is zero in exact arithmetic (softmax ignores a shift shared by
    every key): float32 and bfloat16 autocast leave it at their own rounding, far apart for its size.  That call is
    excused as a gradient zero in exact arithmetic and nothing diverges from it: the runs agree, exit 0, and the text
    says why."""
    a = dump_run(tmp_path, "a", _tiny_bert(), step=_bert_step(False), summary_only=True)
    b = dump_run(tmp_path, "b", _tiny_bert(), step=_bert_step(True), summary_only=True)
    cmp = compare_two(b, a, tmp_path / "out")
    first = cmp.first_divergence
    assert first is not None and first.negligible and "zero in exact arithmetic" in first.explained
    assert not cmp.divergent and cmp.shown_to_agree and _root_causes(cmp) == []
    assert f"no divergence beyond the dtypes' precision: {first.name} differs" in capsys.readouterr().out
    broken = _tiny_bert()  # a real fault in the same comparison is still one
    with torch.no_grad():
        broken.bert.encoder.layer[0].intermediate.dense.weight.mul_(1.05)
    c = dump_run(tmp_path, "c", broken, step=_bert_step(True), summary_only=True)
    assert compare_two(c, a, tmp_path / "out2").divergent


def test_a_parameters_gradient_read_out_of_a_gradient_zero_in_exact_arithmetic_is_no_divergence(tmp_path, capsys):
    """With an optimizer step in the dump, each parameter's gradient is read out (``Parameter_..._backward``) before
    the step: the key bias's read-out holds the very gradient the linear's backward was excused for, and it was judged
    a divergence of its own (exit 1 where the README promises exit 0).  The advisor names no 'likely culprit' for a
    first divergence that precision carried along."""
    def step(autocast):
        def run(model):
            _bert_step(autocast)(model)
            torch.optim.SGD(model.parameters(), lr=0.0).step()
        return run

    a = dump_run(tmp_path, "a", _tiny_bert(), step=step(False), summary_only=True)
    b = dump_run(tmp_path, "b", _tiny_bert(), step=step(True), summary_only=True)
    cmp = compare_two(b, a, tmp_path / "out")
    read_outs = [p for p in cmp.pairs if p.name.startswith("Parameter_") and "key.bias" in p.name
                 and p.name.endswith("_backward")]
    assert read_outs and all(p.negligible for p in read_outs if p.output_diverges), [p.name for p in read_outs]
    assert not cmp.divergent and cmp.shown_to_agree
    assert "likely culprit" not in capsys.readouterr().out


def test_a_first_divergence_precision_carried_along_names_no_likely_culprit(tmp_path, capsys):
    """GPT-2, a bf16 autocast step against a float32 one, AdamW (foreach): the first divergence is the update,
    whose inputs carry bf16's error; the advisor went on to name the backward of the loss's ``.float()`` (a call only
    the bf16 run has, hundreds of calls earlier) 'a likely culprit'."""
    import real_models

    def step(autocast):
        def run(model):
            _, inputs = real_models.build("gpt2", seq=8)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = model(**inputs)
            real_models.loss_of(out).backward()
            opt.step()
        return run

    def model():
        m, _ = real_models.build("gpt2", seq=8)
        return m.eval()

    a = dump_run(tmp_path, "a", model(), step=step(False))
    b = dump_run(tmp_path, "b", model(), step=step(True))
    capsys.readouterr()
    cmp = compare_two(b, a, tmp_path / "out")
    out = capsys.readouterr().out
    assert cmp.first_divergence is not None and cmp.first_divergence.explained, out
    assert "likely culprit" not in out, out


class _TwoBiases(torch.nn.Module):
    """``softmax(x + b1)`` (a shift every row shares: b1's gradient is zero in exact arithmetic) plus ``b2 * x``;
    ``swap`` stacks them, the other way round when true (a port bug the forward does not show, both being zero), and
    ``hook`` scales b2's gradient in this run alone."""

    def __init__(self, swap: Optional[bool] = None, hook: bool = False):
        super().__init__()
        self.b1, self.b2 = torch.nn.Parameter(torch.zeros(8)), torch.nn.Parameter(torch.zeros(8))
        self.swap = swap
        if hook:
            self.b2.register_hook(lambda g: g * 1.01)

    def forward(self, x):
        if self.swap is None:
            p0, p1 = self.b1, self.b2
        else:
            p0, p1 = torch.stack([self.b2, self.b1] if self.swap else [self.b1, self.b2]).unbind(0)
        return torch.softmax(x + p0, dim=0) + p1 * x


def _two_biases_step(dtype):
    def run(m):
        g = torch.Generator().manual_seed(1)
        x, w = torch.randn(6, 8, generator=g).to(dtype), torch.randn(6, 8, generator=g).to(dtype)
        (m(x) * w).sum().backward()
        torch.optim.SGD(m.parameters(), lr=0.0).step()
    return run


def test_a_read_out_of_another_output_of_an_excused_call_is_a_divergence(tmp_path):
    """float64 against float32 with the biases stacked the other way: the stack's backward is excused (b1's part is
    zero in exact arithmetic), but b1 now reads out b2's real gradient.  A read-out is excused only when it is the
    noise that call's excuse describes, not any output of it."""
    a = dump_run(tmp_path, "a", _TwoBiases(swap=False).double(), step=_two_biases_step(torch.float64))
    b = dump_run(tmp_path, "b", _TwoBiases(swap=True).float(), step=_two_biases_step(torch.float32))
    cmp = compare_two(b, a, tmp_path / "out")
    assert cmp.divergent
    assert not any(p.negligible for p in cmp.pairs if p.name.startswith("Parameter_") and p.output_diverges)


def test_a_hook_only_one_run_has_is_named_after_an_excused_first_divergence(tmp_path, capsys):
    """The first divergence is b1's excused gradient; the hook scaling b2's in one run alone comes after it and is
    still named among the calls only one dump has (only casts are left out there)."""
    a = dump_run(tmp_path, "a", _TwoBiases().double(), step=_two_biases_step(torch.float64))
    b = dump_run(tmp_path, "b", _TwoBiases(hook=True).float(), step=_two_biases_step(torch.float32))
    capsys.readouterr()
    cmp = compare_two(b, a, tmp_path / "out")
    out = capsys.readouterr().out
    assert cmp.divergent and "likely culprit): Tensor_mul_" in out, out


def test_a_small_gradient_that_one_run_computes_wrong_is_still_a_divergence(tmp_path):
    """Small input features make a weight's gradient about 1% of the gradient its linear is given; a fault that
    triples it in the bf16 run (the input saved for backward comes back tripled) is a divergence, not rounding noise:
    the float32 run holds that gradient far above float32's rounding."""
    x = torch.rand(8, 16, generator=torch.Generator().manual_seed(0)) * 1e-3
    t = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.Tanh(),
                                   torch.nn.Linear(32, 4, bias=False))

    def step(faulty: bool):
        def run(model):
            first = [True]

            def unpack(v):  # not a call of the program: the dump does not see it
                if faulty and first[0] and v.shape == (8, 16):
                    first[0] = False
                    with torch._C.DisableTorchFunction():
                        return v * 3
                return v

            with torch.autograd.graph.saved_tensors_hooks(lambda v: v, unpack):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=faulty):
                    y = model(x)
            ((y.float() - t) ** 2).mean().backward()
        return run

    a = dump_run(tmp_path, "a", net(), step=step(True))
    b = dump_run(tmp_path, "b", net(), step=step(False))
    cmp = compare_two(a, b, tmp_path / "out")
    assert cmp.divergent and not cmp.shown_to_agree
    assert not any(p.negligible for p in cmp.pairs)


@pytest.mark.parametrize("level", ["L1", "L0"])
@pytest.mark.parametrize("use_weights", [False, True])
def test_a_view_output_whose_base_feeds_another_output_keeps_its_own_gradient(tmp_path, level, use_weights):
    """multi_head_attention's weights are a view of all of its softmax, which its bmm also reads for the attention
    output: the weights' gradient is read where the view's own node receives it, not at the softmax's node, which
    sums both."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2)
    x = torch.randn(3, 2, 8)
    grads = {}

    def step(net):
        out, w = net(x, x, x, need_weights=True, average_attn_weights=False)
        w.retain_grad()
        (out.pow(2).sum() + ((w * 3.0).sum() if use_weights else 0)).backward()
        grads["w"] = w.grad

    idx = dump_run(tmp_path, "a", mha, step=step, level=level)
    d = dump.read_dump(idx)
    e = d.by_name("Functional_multi_head_attention_forward_0_backward" if level == "L1"
                  else "Module_MultiheadAttention_0_backward")
    got = [d.tensor(t) for t in e["inputs"] if t["name"] == "input.1"]
    if use_weights:
        assert len(got) == 1 and torch.allclose(got[0], grads["w"], atol=1e-6)
    else:
        assert not got or got[0].abs().max().item() == 0


def _two_losses(scale: float = 1.0):
    """Two backward passes through one graph (``retain_graph``): the second loss's weight gradients land on the
    first's; in the second pass a hook scales the output's gradient by ``scale``."""
    def run(model):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
        out = model(x)
        out.sum().backward(retain_graph=True)
        out.register_hook(lambda g: g * scale)
        out.pow(2).mean().backward()
    return run


def test_a_second_backward_through_one_graph_records_its_own_gradients(tmp_path):
    """``retain_graph``: each pass through the graph writes the calls' backward entries, in the order backward ran
    them, holding that pass's gradients; a fault in the second pass alone is found there; the export overwrites
    no file of the first pass with the second's."""
    a = dump_run(tmp_path, "a", sequential(), step=_two_losses())
    order = [n for n in names(a) if n.endswith("_backward")]
    assert order.count("Functional_linear_0_backward") == 2 and order.count("Functional_linear_1_backward") == 2
    assert order.index("Tensor_mean_0_backward") < len(order) - 1 - order[::-1].index("Functional_linear_1_backward")
    # the second pass's weight gradient of the first linear is that of the second loss alone
    ref = sequential()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    ref(x).pow(2).mean().backward()
    d = dump.read_dump(a)
    firsts, seconds = [[e for e in d.entries if e["name"] == "Functional_linear_0_backward"][k] for k in (0, 1)]
    grad_w = next(t for t in seconds["outputs"] if t["name"] == "output.1")
    assert torch.allclose(d.tensor(grad_w), ref[0].weight.grad)
    assert not torch.allclose(d.tensor(next(t for t in firsts["outputs"] if t["name"] == "output.1")),
                              ref[0].weight.grad)
    b = dump_run(tmp_path, "b", sequential(), step=_two_losses(scale=1.001))
    cmp = compare_two(b, a, tmp_path / "out")
    assert _root_causes(cmp) == ["Tensor_mul_0_forward"], _root_causes(cmp)  # the hook's product
    lin = [p for p in cmp.pairs if p.name == "Functional_linear_0_backward"]
    assert [p.output_diverges for p in lin] == [False, True]  # the first pass agrees, the second does not
    files = dump.export_npy(a, tmp_path / "npy").files
    assert len({f.name for f in files}) == len(files)
    assert (tmp_path / "npy" / "Functional_linear_0_backward_output.1_1.npy").is_file()


def test_a_foreach_optimizer_update_is_dumped_and_blamed(tmp_path, monkeypatch):
    """The multi-tensor optimizer updates (``torch._foreach_*``, the default on CUDA) are dumped: a fault in the
    update is blamed on it, not on the next step's first layer, whose weight it made differ."""
    def steps(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()

    a = dump_run(tmp_path, "a", sequential(), step=steps)
    assert "Torch__foreach_add__0_forward" in names(a)
    update = dump.read_dump(a).by_name("Torch__foreach_add__0_forward")
    assert len([t for t in update["outputs"] if t.get("shape")]) == 4  # the four parameters it wrote
    real = torch._foreach_add_

    def off(tensors, other, *args, **kwargs):  # the update a little off: its alpha, which the dump leaves out
        if "alpha" in kwargs:
            kwargs["alpha"] *= 1.001
        return real(tensors, other, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_add_", off)
    b = dump_run(tmp_path, "b", sequential(), step=steps)
    cmp = compare_two(b, a, tmp_path / "out")
    assert _root_causes(cmp) == ["Torch__foreach_add__0_forward"], _root_causes(cmp)
