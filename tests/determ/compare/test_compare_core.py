"""The compare core: one verdict (judge) and the causal root-cause rule, on hand-built values and records."""

import math

import pytest
import torch

from determ_backend.compare import Pair, compare_traces, find_roots, judge
from determ_backend.trace.stream import Record
from repro_tools.repro import _harness as _repro_harness


# ---------------------------------------------------------------- judge

def test_floats_within_tolerance_agree_and_beyond_differ():
    x = torch.randn(64, dtype=torch.float64).float()
    assert judge(x, x + 1e-5) is True
    assert judge(x, x + 1.0) is False


def test_fp64_reference_forgives_error_no_worse_than_eagers():
    ref = torch.randn(256, dtype=torch.float64)
    eager = (ref + 0.01 * torch.randn(256, dtype=torch.float64)).float()
    close = (ref + 0.011 * torch.randn(256, dtype=torch.float64)).float()
    far = (ref + 0.5 * torch.randn(256, dtype=torch.float64)).float()
    assert judge(eager, close) is False and judge(eager, close, ref) is True
    assert judge(eager, far, ref) is False
    better = ref.float()  # compiled more accurate than eager: fine one-sided, not symmetric
    assert judge(eager, better, ref) is True
    assert judge(eager, better, ref, symmetric=True) is False


def test_new_nan_always_differs():
    ref = torch.randn(8, dtype=torch.float64)
    e = ref.float()
    c = e.clone()
    c[3] = math.nan
    assert judge(e, c, ref) is False
    assert judge(c, c.clone()) is True  # NaN in both at the same place


def test_non_float_values_count_only_when_strict():
    a = torch.tensor([True, False])
    b = torch.tensor([True, True])
    assert judge(a, b) is None and judge(a, b, strict=True) is False and judge(a, a.clone(), strict=True) is True
    assert judge(3, 4) is None and judge(3, 4, strict=True) is False


def test_bitwise_and_strict_zero_tolerance():
    x = torch.randn(100)
    y = torch.flip(torch.flip(x, [0]) + 0.0, [0])
    z = x.clone()
    z[0] = torch.nextafter(z[0], torch.tensor(math.inf))
    assert judge(x, y, bitwise=True) is True
    assert judge(x, z) is True and judge(x, z, bitwise=True) is False and judge(x, z, strict=True, tol=0.0) is False
    assert judge(x, x.double(), bitwise=True) is False  # another dtype is another value bitwise


def test_shape_mismatch_and_tensor_vs_value_differ():
    assert judge(torch.zeros(2), torch.zeros(3)) is False
    assert judge(torch.zeros(2), 0.0) is False


def test_two_dtypes_are_judged_in_the_wider_one():
    x = torch.randn(64) * 100
    assert judge(x.bfloat16(), x) is False  # not rounded down to bf16 before comparing
    assert judge(x, x.double()) is True


@pytest.mark.parametrize("case", range(6))
def test_standalone_harness_verdict_matches_the_core(case):
    g = torch.Generator().manual_seed(case)
    ref = torch.randn(128, dtype=torch.float64, generator=g)
    e = (ref + 1e-3 * torch.randn(128, dtype=torch.float64, generator=g)).float()
    c = (ref + [1e-4, 1e-3, 3e-3, 1e-2, 0.1, 1.0][case] * torch.randn(128, dtype=torch.float64, generator=g)).float()
    for tol, strict in ((1e-3, False), (1e-2, False), (0.0, True)):
        assert _repro_harness.same_leaf(e, c, ref, tol, 2.0, strict) == judge(e, c, ref, tol=tol, strict=strict)


# ---------------------------------------------------------------- roots

def _rec(node, inputs=(), kind="node", dtype="float32", outputs=None):
    extra = {"outputs": outputs} if outputs is not None else None
    return Record(graph="g0", stage="s", node=node, op=f"aten.{node}", kind=kind, dtype=dtype, shape=[4],
                  inputs=list(inputs), extra=extra)


def _pairs(spec):
    """spec: list of (node, inputs, verdict, kind, dtype, outputs)."""
    out = []
    for node, inputs, eq, *rest in spec:
        kind = rest[0] if rest else "node"
        dtype = rest[1] if len(rest) > 1 else "float32"
        outputs = rest[2] if len(rest) > 2 else None
        r = _rec(node, inputs, kind, dtype, outputs)
        out.append(Pair(r, r, equal=eq))
    return out


def _names(ps):
    return [p.rec.node for p in ps]


def test_root_is_first_live_divergence_with_agreeing_inputs():
    pairs = _pairs([("x", (), True, "input"), ("a", ("x",), True), ("b", ("a",), False), ("c", ("b",), False),
                    ("out", ("c",), False, "output")])
    cmp = find_roots(pairs, "t")
    assert cmp.divergent and _names(cmp.root_causes) == ["b"] and not cmp.masked


def test_divergence_that_reaches_no_failing_output_is_masked():
    # log1p -> gt -> where(gt, relu, relu): the mask differs, the output only through relu
    pairs = _pairs([("x", (), True, "input"), ("log1p", ("x",), False), ("gt", ("log1p",), False, "node", "bool"),
                    ("relu", ("x",), True), ("where", ("gt", "relu"), True, "node", "float32", [0])])
    cmp = find_roots(pairs, "t")
    assert not cmp.divergent and not cmp.root_causes and _names(cmp.masked) == ["log1p"]


def test_confirm_masks_a_candidate_whose_substitution_leaves_outputs_alone():
    pairs = _pairs([("x", (), True, "input"), ("log1p", ("x",), False), ("gt", ("log1p",), False, "node", "bool"),
                    ("relu", ("x",), False), ("where", ("gt", "relu"), False, "node", "float32", [0])])
    assert _names(find_roots(pairs, "t").root_causes) == ["log1p", "relu"]
    for p in pairs:
        p.root_cause = False
    cmp = find_roots(pairs, "t", confirm=lambda cands: [c.rec.node == "relu" for c in cands])
    assert _names(cmp.root_causes) == ["relu"] and _names(cmp.masked) == ["log1p"]


def test_when_no_candidate_explains_alone_all_stay_joint():
    pairs = _pairs([("x", (), True, "input"), ("a", ("x",), False), ("b", ("x",), False),
                    ("out", ("a", "b"), False, "output")])
    cmp = find_roots(pairs, "t", confirm=lambda cands: [False] * len(cands))
    assert _names(cmp.root_causes) == ["a", "b"] and all(p.metrics.get("joint") for p in cmp.root_causes)


def test_non_float_output_is_a_symptom_only_when_strict():
    pairs = _pairs([("x", (), True, "input"), ("log1p", ("x",), False),
                    ("gt", ("log1p",), False, "node", "bool", [0])])
    assert not find_roots(pairs, "t").divergent
    cmp = find_roots(pairs, "t", strict=True)
    assert cmp.divergent and _names(cmp.root_causes) == ["log1p"]


def test_unjudged_records_are_transparent():
    # a partial buffer (not judged) between two judged values: the consumer's inputs are looked through it
    pairs = _pairs([("x", (), True, "input"), ("buf0", ("x",), None), ("mul", ("buf0", "x"), False),
                    ("out", ("mul",), False, "output")])
    assert _names(find_roots(pairs, "t").root_causes) == ["mul"]
    pairs = _pairs([("x", (), True, "input"), ("a", ("x",), False), ("buf0", ("a",), None),
                    ("mul", ("buf0",), False), ("out", ("mul",), False, "output")])
    assert _names(find_roots(pairs, "t").root_causes) == ["a"]


def test_an_unjudged_value_reached_along_two_paths_is_looked_through_on_both():
    # rotate_half: neg reads the unjudged mm and an unjudged slice of it (a diamond, not a cycle): both paths lead
    # back to agreeing values, so neg's inputs agree and it is the root
    pairs = _pairs([("x", (), True, "input"), ("mm", ("x",), None), ("slice", ("mm",), None),
                    ("neg", ("mm", "slice"), False), ("out", ("neg",), False, "output")])
    assert _names(find_roots(pairs, "t").root_causes) == ["neg"]


def test_without_dependency_information_every_divergence_counts():
    pairs = _pairs([("a", (), True), ("b", (), False), ("c", (), False)])
    for p in pairs:
        p.a.in_hashes = p.b.in_hashes = ["1"]
    cmp = find_roots(pairs, "t")
    assert cmp.divergent and _names(cmp.root_causes) == ["b", "c"]


def test_sinks_stand_for_outputs_when_none_are_marked():
    pairs = _pairs([("x", (), True, "input"), ("a", ("x",), False), ("b", ("a",), True), ("c", ("x",), True)])
    cmp = find_roots(pairs, "t")
    assert not cmp.divergent and _names(cmp.masked) == ["a"]


def test_inputs_judged_by_the_caller_decide_over_missing_links():
    # an API dump: no dependency links, but each call's arguments were dumped and judged
    pairs = _pairs([("linear_0", (), False), ("relu_0", (), False), ("linear_1", (), False)])
    for p, ins in zip(pairs, (True, False, False)):
        p.inputs_equal = ins
    assert _names(find_roots(pairs, "t").root_causes) == ["linear_0"]


def test_dtype_tolerance_widens_to_a_few_ulps_of_the_narrowest_float():
    from determ_backend.compare import DEFAULT_TOL, dtype_tol

    assert dtype_tol(DEFAULT_TOL, "float32", torch.float32) == DEFAULT_TOL
    assert dtype_tol(DEFAULT_TOL, "bfloat16", "float32") == 4 * torch.finfo(torch.bfloat16).eps
    assert dtype_tol(DEFAULT_TOL, torch.float16, "int64") == 4 * torch.finfo(torch.float16).eps
    x = torch.randn(1024)
    assert judge(x, x.bfloat16(), tol=dtype_tol(DEFAULT_TOL, "bfloat16", "float32")) is True
    assert judge(x, x.bfloat16()) is False  # fp32's tolerance: bf16 rounding is a difference


# ---------------------------------------------------------------- records one run has and the other lacks

def _t(node, inputs=(), h="h", op=None, dtype="float32", kind="node", output=False):
    """A traced record: ``h`` its fingerprint, ``op`` defaults to the node's name before '#'."""
    op = op or (kind if kind in ("param", "input") else f"aten.{node.split('#')[0]}.default")
    return Record(graph="eager", stage="eager", node=node, op=op, kind=kind,
                  dtype=dtype, shape=[4], inputs=list(inputs), hash=h, extra={"outputs": [0]} if output else None)


def _run(extra=None, relu_hash="r", x_dtype="float32"):
    """x -> linear -> [extra] -> relu -> out; ``extra``: records inserted after linear, the last feeding relu."""
    recs = [_t("x#0", kind="input", h="x", dtype=x_dtype), _t("w", kind="param", h="w"),
            _t("linear#0", ["x#0", "w"], h="l")]
    feed = "linear#0"
    for r in extra or ():
        recs.append(r)
        feed = r.node
    recs += [_t("relu#0", [feed], h=relu_hash), _t("sum#0", ["relu#0"], h=relu_hash + "s", output=True)]
    return recs


def test_an_op_only_one_run_has_is_the_root_not_its_consumer():
    from determ_backend.compare import compare_traces
    a = _run()
    b = _run([_t("add#0", ["linear#0"], h="l+")], relu_hash="r2")
    cmp = compare_traces(a, b)
    assert [(p.rec.node, p.metrics.get("only_in")) for p in cmp.root_causes] == [("add#0", "b")]
    assert cmp.summary()["first_divergence"]["only_in"] == "b"
    relu = next(p for p in cmp.pairs if p.paired and p.a.node == "relu#0")
    assert relu.equal is False and not relu.root_cause  # it computed right from what it was given
    rev = compare_traces(b, a)
    assert [(p.rec.node, p.metrics.get("only_in")) for p in rev.root_causes] == [("add#0", "a")]


def test_a_value_preserving_extra_op_passes_its_input_on():
    from determ_backend.compare import compare_traces
    a = _run(relu_hash="r")
    b = _run([_t("mul#0", ["linear#0"], h="l")], relu_hash="r2")  # h * 1.0: its input's fingerprint
    cmp = compare_traces(a, b)
    assert [p.rec.node for p in cmp.root_causes] == ["relu#0"]  # relu's inputs agree through the extra op


def test_casts_only_one_run_has_blame_only_a_narrowing_below_the_other_run():
    from determ_backend.compare import compare_traces
    a = _run()
    widen = compare_traces(a, _run([_t("_to_copy#0", ["linear#0"], h="l64", dtype="float64")], relu_hash="r2"))
    assert not widen.root_causes  # widening loses nothing; relu computed right from a wider value
    assert widen.first_divergence.rec.node == "relu#0" and not widen.first_divergence.root_cause
    narrow = _run([_t("_to_copy#0", ["linear#0"], h="l16", dtype="bfloat16")], relu_hash="r2")
    assert [(p.rec.node, p.metrics.get("only_in")) for p in compare_traces(a, narrow).root_causes] == \
        [("_to_copy#0", "b")]


def test_a_record_fed_by_another_value_than_its_partner_is_never_blamed():
    from determ_backend.compare import compare_traces
    a = [_t("x#0", kind="input", h="x"), _t("y#0", kind="input", h="y"), _t("neg#0", ["x#0"], h="n"),
         _t("neg#1", ["y#0"], h="m", output=True), _t("sum#0", ["neg#0"], h="s", output=True)]
    b = [_t("x#0", kind="input", h="x"), _t("y#0", kind="input", h="y"), _t("neg#0", ["x#0"], h="n"),
         _t("neg#1", ["x#0"], h="n", output=True), _t("sum#0", ["neg#0"], h="s", output=True)]  # neg#1 wired to x
    cmp = compare_traces(a, b)
    assert cmp.divergent and not cmp.root_causes  # the runs differ in structure, not in any op's arithmetic
    assert cmp.first_divergence.rec.node == "neg#1" and not cmp.first_divergence.root_cause


def test_parameters_pair_by_name_only_when_the_sequence_shifts():
    from determ_backend.compare import compare_traces
    a = [_t("w1", kind="param", h="1"), _t("w2", kind="param", h="2"), _t("mm#0", ["w1", "w2"], h="m", output=True)]
    b = [_t("w2", kind="param", h="2", dtype="float64"), _t("mm#0", ["w1", "w2"], h="m", output=True),
         _t("w1", kind="param", h="1", dtype="float64")]
    pairs = compare_traces(a, b, tol=1e-3).pairs
    assert all(p.a.node == p.b.node for p in pairs if p.paired)  # by signature alone w1 would pair with w2
    assert {p.a.node for p in pairs if p.paired} >= {"w2", "mm#0"}


def test_a_culprit_found_upstream_of_an_extern_kernel_is_placed_in_the_kernel_that_computed_it():
    from determ_backend.backends.checks import _kernel_of
    from determ_backend.compare.roots import describe
    recs = [Record(graph="g0", stage="s", node="mul", op="aten.mul.Tensor", extra={"kernel": "cpp_fused_relu_0",
                                                                                   "holds": "partial", "of": "relu"}),
            Record(graph="g0", stage="s", node="convolution", op="aten.convolution.default",
                   extra={"kernel": "extern_kernels.convolution"})]
    assert _kernel_of("relu", recs) == "cpp_fused_relu_0" and _kernel_of("tanh", recs) is None
    p = Pair(recs[1], recs[1], equal=False, root_cause=True,
             inside={"kernel": "cpp_fused_relu_0", "node": "relu", "op": "aten.relu.default", "upstream": True})
    k = describe(p)["kernel"]
    assert k["name"] == "cpp_fused_relu_0" and k["record"] == "convolution" and k["upstream"] is True


def test_statistics_deltas_are_labelled_as_such_in_text():
    from determ_backend.compare import metrics_text
    text = metrics_text({"bitwise": False, "min_diff": 9.31e-10, "max_diff": 0.0, "l2_rel": 0.5}, skip=("bitwise",))
    assert text == "l2_rel=0.5 statistics |a-b| (not element errors): min=9.31e-10 max=0"
    assert metrics_text({"max_abs": 0.25, "cosine": 1.0}) == "max_abs=0.25 cosine=1"


# ---------------------------------------------------------------- alignment

def _fx(node, op, dtype="float32", shape=(4,), inputs=(), kind="node"):
    return Record(graph="g0", stage="aot_backward", node=node, op=op, kind=kind, dtype=dtype, shape=list(shape),
                  inputs=list(inputs))


def _partners(pairs):
    return {(p.a.node if p.a else None, p.b.node if p.b else None) for p in pairs}


def test_runs_in_different_float_dtypes_pair_saved_values_by_shape_not_by_order():
    # a float64 reference whose RMSNorm casts to float32 saves the cast instead of the value A saves: the float
    # signatures of the two runs never agree, and pairing every input in order set A's mm_3 against B's cast
    from determ_backend.compare import align
    inp = lambda n, d, s: _fx(n, "input", d, s, kind="input")  # noqa: E731
    a = [inp("embedding", "float32", (2, 16, 64)), inp("view", "float32", (32, 64)), inp("mm_3", "float32", (32, 64)),
         inp("rsqrt_1", "float32", (2, 16, 1)), inp("view_9", "float32", (32, 64))]
    b = [inp("_to_copy_2", "float32", (2, 16, 64)), inp("view", "float64", (32, 64)),
         inp("_to_copy_3", "float32", (2, 16, 64)), inp("rsqrt_1", "float32", (2, 16, 1)), inp("view_9", "float64", (32, 64))]
    assert _partners(align(a, b)) == {("embedding", "_to_copy_2"), ("view", "view"), ("rsqrt_1", "rsqrt_1"),
                                      ("view_9", "view_9"), ("mm_3", None), (None, "_to_copy_3")}


def test_a_pair_whose_inputs_disagree_is_mended_by_the_dependency_links():
    # B runs one more add of the same shape before the add both runs have: sequence alignment pairs A's add with
    # B's extra one; the links say which B add consumes the partners of A's add's inputs
    from determ_backend.compare import align
    a = [_fx("x", "input", kind="input"), _fx("y", "input", kind="input"),
         _fx("add", "aten.add.Tensor", inputs=["x", "y"]), _fx("mul", "aten.mul.Tensor", inputs=["add", "y"])]
    b = [_fx("x", "input", kind="input"), _fx("y", "input", kind="input"),
         _fx("add", "aten.add.Tensor", inputs=["x", "x"]), _fx("add_1", "aten.add.Tensor", inputs=["x", "y"]),
         _fx("mul", "aten.mul.Tensor", inputs=["add_1", "y"])]
    pairs = align(a, b)
    assert _partners(pairs) == {("x", "x"), ("y", "y"), ("add", "add_1"), ("mul", "mul"), (None, "add")}
    assert len(pairs) == 5  # every record of both runs once


def test_an_op_one_run_has_on_an_input_path_is_left_to_that_run_not_paired_with_the_op_after_it():
    # B adds a hook's op (h = y + c) in front of the add both runs have: sequence alignment takes the hook's add
    # for A's add; B's add consumes A's partners with the hook's op in between, so it is A's add's partner
    from determ_backend.compare import align
    a = [_fx("x", "input", kind="input"), _fx("y", "input", kind="input"),
         _fx("add", "aten.add.Tensor", inputs=["x", "y"]), _fx("mul", "aten.mul.Tensor", inputs=["add", "y"])]
    b = [_fx("x", "input", kind="input"), _fx("y", "input", kind="input"),
         _fx("add", "aten.add.Tensor", inputs=["y"]), _fx("add_1", "aten.add.Tensor", inputs=["x", "add"]),
         _fx("mul", "aten.mul.Tensor", inputs=["add_1", "y"])]
    pairs = align(a, b)
    assert _partners(pairs) == {("x", "x"), ("y", "y"), ("add", "add_1"), ("mul", "mul"), (None, "add")}


def test_a_difference_that_reaches_no_differing_output_is_not_called_no_divergence():
    """A paired record differs while every output agrees (within tolerance, on a real run; a trace whose extra op
    left the difference's dependency unpaired): the table counted it ('divergent: 1') and the verdict line then
    said 'no divergence among the paired records'."""
    from repro_tools.cli.diff import format_table

    def recs(h: str, extra: bool):
        out = [Record("g0", "aot_forward", "x", "input", "input", 0, 0, None, "float32", [2], "aa", None, [], [])]
        if extra:
            out.append(Record("g0", "aot_forward", "w", "aten.cos", "node", 0, 1, None, "float32", [2], "ww", None,
                              ["x"], ["aa"]))
        return out + [Record("g0", "aot_forward", "y", "aten.sin", "node", 0, 2, None, "float32", [2], h, None,
                             ["w" if extra else "x"], ["aa"]),
                      Record("g0", "aot_forward", "output.0", "output", "output", 0, 3, None, "float32", [2], "cc",
                             None, ["y"], [h])]

    cmp = compare_traces(recs("b1", True), recs("b2", False))
    text = format_table(cmp)
    assert cmp.summary()["divergent_pairs"] == 1 and "divergent: 1" in text
    assert "1 paired record(s) differ, but no output differs" in text and "no divergence among" not in text


def test_the_cosine_of_a_tensor_with_itself_is_one_exactly():
    from determ_backend.compare.verdict import tensor_metrics

    cosines = [tensor_metrics(x, x.clone())["cosine"]
               for x in (torch.randn(37, 13, generator=torch.Generator().manual_seed(s)) for s in range(50))]
    assert all(c == 1.0 for c in cosines)  # the same values: exactly 1 (the CSV showed 0.9999999999999969)
    assert tensor_metrics(torch.ones(4), -torch.ones(4))["cosine"] == -1.0
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 1e3
    assert tensor_metrics(x.bfloat16(), x.bfloat16().float())["cosine"] == 1.0  # two dtypes, the same values
    assert 0.99 < tensor_metrics(x, x + 1e-3 * torch.randn(1000))["cosine"] <= 1.0


def test_the_same_allocation_made_at_another_moment_pairs_by_name():
    """A DataLoader rebuilds its workers' batches as they arrive: the same ``empty(0)`` and its ``detach``, named
    alike in both runs, sit between other ops at other places, and the runs were never shown identical."""
    alloc = [_t("empty@l:f+1#0", h="e", op="aten.empty.memory_format"),
             _t("detach@l:f+1#0", ["empty@l:f+1#0"], h="e", op="aten.detach.default")]
    work = [_t("x@l:f+2#0", kind="input", h="x"), _t("relu@l:f+2#0", ["x@l:f+2#0"], h="r", output=True),
            _t("tanh@l:f+2#0", ["relu@l:f+2#0"], h="t", output=True)]
    cmp = compare_traces(alloc + work, work[:2] + alloc + work[2:])
    assert cmp.identical and all(p.paired for p in cmp.pairs), [(p.a and p.a.node, p.b and p.b.node) for p in cmp.pairs]
    other = [dict(vars(r)) for r in alloc]  # another allocation's fingerprint (another shape or dtype): not the same
    moved = [Record(**dict(other[0], hash="E")), Record(**dict(other[1], hash="E"))]
    assert not compare_traces(alloc + work, work[:2] + moved + work[2:]).identical


def test_a_chain_of_unjudged_diamonds_is_walked_in_linear_time():
    """Each diamond doubled the verdicts a record's inputs were looked through to: 2**n of them for n diamonds."""
    spec = [("x", (), True, "input")]
    prev = "x"
    for i in range(40):
        spec += [(f"l{i}", (prev,), None), (f"r{i}", (prev,), None), (f"j{i}", (f"l{i}", f"r{i}"), None)]
        prev = f"j{i}"
    spec += [("end", (prev,), False), ("out", ("end",), False, "output")]
    assert _names(find_roots(_pairs(spec), "t").root_causes) == ["end"]


def test_values_passed_on_from_an_earlier_failing_graph_call_are_not_root_causes(tmp_path):
    """Two training steps under ``determ_aot_eager``, one weight element changed in run B: the weight is the one
    root cause.  The backward's inputs (the activations the forward saved, the incoming gradient) and the second
    step's parameters differ because the forward failed first: each says so, none is blamed."""
    from backend_helpers import run_mod
    from determ_backend.trace.stream import read_trace

    def run(name, planted):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4))
        if planted:
            with torch.no_grad():
                m[0].weight[0, 0] += 1e-2
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))

        torch._dynamo.reset()
        model = torch.compile(m, backend="determ_aot_eager", options={"dir": str(tmp_path), "run_id": name})
        for _ in range(2):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        run_mod.finish_all()
        return read_trace(tmp_path / name)

    cmp = compare_traces(run("a", False), run("b", True))
    assert [(p.rec.stage, p.rec.call, p.rec.node) for p in cmp.root_causes] == [("aot_forward", 0, "0.weight")]
    passed_on = [p for p in cmp.pairs if p.metrics.get("after_earlier_divergence")]
    stages = {(p.rec.stage, p.rec.call) for p in passed_on}
    assert ("aot_backward", 0) in stages and ("aot_forward", 1) in stages, stages
    links = {(p.rec.stage, p.rec.call, p.metrics["after_earlier_divergence"]) for p in passed_on}
    # each backward's inputs come from its forward; the second step's weights from the first step's gradients
    assert links == {("aot_backward", 0, "g0 aot_forward call 0"), ("aot_backward", 1, "g0 aot_forward call 1"),
                     ("aot_forward", 1, "g0 aot_backward call 0")}, links


def test_a_value_no_earlier_failing_call_hands_on_stays_a_root_cause(tmp_path):
    """Two models of one class compiled apart (one graph, called twice), one weight changed in each: the second
    call's weight is a root cause of its own (no backward of the graph failed before it, so no optimizer handed it a
    wrong update)."""
    from backend_helpers import run_mod
    from determ_backend.trace.stream import read_trace

    def run(name, planted):
        torch._dynamo.reset()
        torch.manual_seed(0)
        a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        if planted:
            with torch.no_grad():
                a.weight[0, 0] += 1e-2
                b.weight[0, 0] += 1e-2
        opts = {"dir": str(tmp_path), "run_id": name}
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            torch.compile(a, backend="determ_aot_eager", options=opts)(x)
            torch.compile(b, backend="determ_aot_eager", options=opts)(x)
        run_mod.finish_all()
        return read_trace(tmp_path / name)

    cmp = compare_traces(run("a", False), run("b", True))
    assert sorted((p.rec.call, p.rec.node) for p in cmp.root_causes) == [(0, "weight"), (1, "weight")], \
        [(p.rec.graph, p.rec.node, p.metrics) for p in cmp.pairs if p.equal is False]


def _staged(stage, node, op, source, h, inputs=(), kind="node", output=False, holds=None):
    extra = dict({"outputs": [0]} if output else {}, **({"holds": holds} if holds else {}))
    return Record(graph="g0", stage=stage, node=node, op=op, kind=kind, dtype="float32", shape=[4],
                  inputs=list(inputs), hash=h, source=source, extra=extra or None)


def test_traces_of_two_stages_pair_only_values_of_one_line_and_blame_no_op_the_other_fused():
    """An aot_eager trace against an inductor one of the same RMSNorm + GELU model: inductor's ``mean`` buffer
    holds the undivided sum (``holds: partial``) and its gelu's ``mul`` lies on the next line; neither is paired
    with aot_eager's value of that name, and the ops inductor fused into its buffers are not blamed as "only A
    ran" them."""
    a = [_staged("aot_forward", "x", "input", None, "x", kind="input"),
         _staged("aot_forward", "mm", "aten.mm.default", "m.py:9", "mm", ["x"]),
         _staged("aot_forward", "pow_1", "aten.pow.Tensor_Scalar", "m.py:10", "p", ["mm"]),
         _staged("aot_forward", "mean", "aten.mean.dim", "m.py:10", "mean", ["pow_1"]),
         _staged("aot_forward", "mul", "aten.mul.Tensor", "m.py:10", "n", ["mm", "mean"]),
         _staged("aot_forward", "gelu", "aten.gelu.default", "m.py:11", "g", ["mul"]),
         _staged("aot_forward", "out", "aten.mm.default", "m.py:12", "o", ["gelu"], output=True)]
    b = [_staged("inductor_forward", "x", "input", None, "x", kind="input"),
         _staged("inductor_forward", "mm", "aten.mm.default", "m.py:9", "mm", ["x"]),
         _staged("inductor_forward", "mean", "aten.mean.dim", "m.py:10", "sum", ["mm"], holds="partial"),
         _staged("inductor_forward", "mul_3", "aten.mul.Tensor", "m.py:11", "g3", ["mm", "mean"]),
         _staged("inductor_forward", "out", "aten.mm.default", "m.py:12", "o2", ["mul_3"], output=True)]
    cmp = compare_traces(a, b)
    partners = _partners(p for p in cmp.pairs if p.paired)
    assert ("mean", "mean") not in partners and ("mul", "mul_3") not in partners, partners
    assert ("mm", "mm") in partners and ("out", "out") in partners
    assert cmp.divergent and cmp.root_causes == [], [p.rec.node for p in cmp.root_causes]


def test_an_eager_trace_pairs_with_a_compiled_one_by_line_whatever_the_compiled_one_adds_to_it():
    """Compiled traces write ``m.py:9 (forward)``, eager ones ``m.py:9``: one line all the same, so the values pair
    and a changed weight is seen."""
    eager = [_staged("eager", "x", "input", "m.py:8", "x", kind="input"),
             _staged("eager", "w", "param", "m.py:9", "w2", kind="param"),
             _staged("eager", "mm", "aten.mm.default", "m.py:9", "mm2", ["x", "w"], output=True)]
    aot = [_staged("aot_forward", "x", "input", "m.py:8 (forward)", "x", kind="input"),
           _staged("aot_forward", "w", "param", "m.py:9 (forward)", "w", kind="param"),
           _staged("aot_forward", "mm", "aten.mm.default", "m.py:9 (forward)", "mm", ["x", "w"], output=True)]
    cmp = compare_traces(eager, aot)
    assert ("mm", "mm") in _partners(p for p in cmp.pairs if p.paired) and cmp.divergent


def test_ops_only_one_run_has_are_found_behind_a_view_both_runs_take():
    """Attention as sdpa in A and as bmm in B: each path is an op one run alone has, read through a view both runs
    take (paired, not judged: a view's value is its input's) into the projection that differs.  Both paths are
    named; nothing was."""
    def run(attn):
        return [_staged("aot_forward", "x", "input", "m.py:1 (forward)", "x", kind="input"),
                _staged("aot_forward", "q", "aten.mm.default", "m.py:2 (forward)", "q", ["x"]),
                _staged("aot_forward", attn, f"aten.{attn}.default", "m.py:3 (forward)", attn, ["q"]),
                Record(graph="g0", stage="aot_forward", node="view", op="aten.view.default", kind="view",
                       dtype="float32", shape=[4], inputs=[attn], source="m.py:4 (forward)"),
                _staged("aot_forward", "out", "aten.mm.default", "m.py:5 (forward)", "o" + attn, ["view"],
                        output=True)]

    cmp = compare_traces(run("sdpa"), run("bmm"))
    assert sorted((p.rec.node, p.metrics.get("only_in")) for p in cmp.root_causes) == [("bmm", "b"), ("sdpa", "a")]
