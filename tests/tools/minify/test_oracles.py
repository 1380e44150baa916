"""Oracles: each kind judges a failing and a passing graph; error matching; spec validation."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from determ_backend.errors import ConfigError
from repro_tools.minify.oracles import OracleSpec, Signature, check, check_observed, similar


def _graph(fn, *inputs):
    return make_fx(fn)(*inputs), list(inputs)


def _erf_graph():
    return _graph(lambda x: (torch.erf(x * 2).sum(0),), torch.randn(4, 3))


def _cancel_graph():
    return _graph(lambda x: ((x + 1e8) - 1e8,), torch.rand(8))


def _plain_graph():
    return _graph(lambda x: (torch.relu(x) * 3,), torch.randn(8))


CASES = [  # (kind, compiler, graph, fails)
    ("accuracy", "minifier_helpers:wrong_erf", _erf_graph, True),
    ("accuracy", "aot_eager", _erf_graph, False),
    ("compile_error", "minifier_helpers:erf_compile_error", _erf_graph, True),
    ("compile_error", "minifier_helpers:erf_runtime_error", _erf_graph, False),
    ("runtime_error", "minifier_helpers:erf_runtime_error", _erf_graph, True),
    ("error", "minifier_helpers:erf_runtime_error", _erf_graph, True),
    ("error", "eager", _erf_graph, False),
    ("nondeterminism", "minifier_helpers:noisy_erf", _erf_graph, True),
    ("nondeterminism", "aot_eager", _erf_graph, False),
    ("cross_device", "eager", _cancel_graph, True),
    ("cross_device", "eager", _plain_graph, False),
]


@pytest.mark.parametrize("kind,compiler,make,fails", CASES, ids=[f"{c[0]}-{c[1].split(':')[-1]}-{c[3]}" for c in CASES])
def test_oracle_kinds(kind, compiler, make, fails):
    gm, inputs = make()
    v = check(OracleSpec(kind=kind, compiler=compiler), gm, inputs)
    assert v.fails is fails, v


def test_strict_accuracy_with_zero_tolerance_sees_last_bit_differences():
    gm, inputs = _graph(lambda x: (x.sum(0),), torch.randn(64, 3))
    rev = lambda gm, ex: (lambda x: (torch.flip(x, [0]).sum(0),))  # same math, other summation order  # noqa: E731
    assert not check(OracleSpec(kind="accuracy", compiler=rev), gm, inputs).fails
    assert not check(OracleSpec(kind="accuracy", compiler=rev, strict=True), gm, inputs).fails  # floats: tolerance
    strict = check(OracleSpec(kind="accuracy", compiler=rev, strict=True, tol=0.0), gm, inputs)
    assert strict.fails == (not torch.equal(inputs[0].sum(0), torch.flip(inputs[0], [0]).sum(0)))


def test_strict_accuracy_counts_non_float_outputs():
    gm, inputs = _graph(lambda x: (x > 0,), torch.randn(16))
    flip = lambda gm, ex: (lambda x: (x <= 0,))  # noqa: E731
    assert not check(OracleSpec(kind="accuracy", compiler=flip), gm, inputs).fails
    assert check(OracleSpec(kind="accuracy", compiler=flip, strict=True), gm, inputs).fails


def test_expected_error_keeps_search_on_the_same_bug():
    gm, inputs = _graph(lambda x: (torch.erf(x).sum(0),), torch.randn(4, 3))
    first = check(OracleSpec(kind="compile_error", compiler="minifier_helpers:erf_compile_error"), gm, inputs)
    other = OracleSpec(kind="compile_error", compiler="minifier_helpers:sum_compile_error", expected=first.signature)
    v = check(other, gm, inputs)
    assert not v.fails and "different error" in v.detail


@pytest.mark.parametrize("a,b,same", [
    (("compile", "E", "no lowering for aten.erf at line 12"), ("compile", "E", "no lowering for aten.erf at line 97"), True),
    (("compile", "E", "no lowering for aten.erf"), ("runtime", "E", "no lowering for aten.erf"), False),
    (("compile", "E", "no lowering for aten.erf"), ("compile", "F", "no lowering for aten.erf"), False),
    (("compile", "E", "error: /tmp/a/b.cpp:3: 'x' undeclared"), ("compile", "E", "error: /tmp/c.cpp:9: 'x' undeclared"), True),
    (("compile", "E", "shape mismatch in mm: 3 vs 4"), ("compile", "E", "no lowering for aten.erf"), False),
])
def test_similar(a, b, same):
    assert similar(Signature(*a), Signature(*b), 0.5) is same


@pytest.mark.parametrize("kw", [{"kind": "bogus"}, {"kind": "cross_device", "devices": ("cpu",)},
                                {"kind": "cross_device", "devices": ("cpu", "gpu")}, {"runs": 1}, {"similarity": 2.0}])
def test_bad_spec_is_a_config_error(kw):
    with pytest.raises(ConfigError):
        OracleSpec(**kw)


def test_crash_oracle_needs_isolation():
    gm, inputs = _erf_graph()
    with pytest.raises(ConfigError, match="isolated"):
        check(OracleSpec(kind="crash", compiler="minifier_helpers:abort_on_erf"), gm, inputs)


def test_spec_json_round_trip():
    spec = OracleSpec(kind="error", compiler="minifier_helpers:wrong_erf", config={"fallback_random": True},
                      expected=Signature("compile", "E", "m"))
    assert OracleSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ConfigError, match="importable"):
        OracleSpec(compiler=lambda gm, ex: gm).to_json()


class _Shifted(torch.nn.Module):
    """Parameters (a submodule's, and a get_attr parameter) and a buffer holding the cancellation's 1e8."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.scale = torch.nn.Parameter(torch.full((8,), 3.0))
        self.register_buffer("shift", torch.tensor(1e8))

    def forward(self, x):
        h = torch.tanh(self.lin(x)) * self.scale
        return ((h + self.shift) - self.shift,)


@pytest.mark.parametrize("devices, fails", [(("cpu", "cpu:float64"), True), (("cpu", "cpu"), False)])
def test_cross_device_moves_the_graphs_own_parameters_and_buffers(devices, fails):
    gm = torch.fx.symbolic_trace(_Shifted())
    assert {n.op for n in gm.graph.nodes} >= {"get_attr", "call_module"}
    v = check(OracleSpec(kind="cross_device", compiler="eager", devices=devices), gm, [torch.randn(4, 8)])
    assert v.fails is fails, v
    assert gm.lin.weight.dtype == torch.float32 and gm.shift.dtype == torch.float32  # the original is left alone


@pytest.mark.parametrize("kind", ["accuracy", "nondeterminism"])
def test_a_compiler_that_rewrites_its_graph_in_place_does_not_change_the_reference(kind):
    # PyTorch's test backend turns torch.relu into x + 1 in the graph it is handed, and returns that graph
    gm = torch.fx.symbolic_trace(lambda x: (torch.relu(x) * 3,))
    v = check(OracleSpec(kind=kind, compiler="relu_accuracy_error_TESTING_ONLY"), gm, [torch.randn(8)])
    assert v.fails is (kind == "accuracy"), v
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"][0] is torch.relu


@pytest.mark.parametrize("kind,compiler,fails", [("accuracy", "minifier_helpers:wrong_erf", True),
                                                 ("nondeterminism", "minifier_helpers:noisy_erf", True),
                                                 ("accuracy", "aot_eager", False)])
def test_check_observed_is_check_outside_inductor_accuracy(kind, compiler, fails):
    # inductor's buffers are only captured for an inductor accuracy oracle (tests/test_minifier.py has that case)
    gm, inputs = _erf_graph()
    v, seen = check_observed(OracleSpec(kind=kind, compiler=compiler), gm, inputs, {})
    assert v.fails is fails and seen is None


@pytest.mark.parametrize("kind", ["error", "compile_error", "accuracy", "nondeterminism"])
@pytest.mark.parametrize("compiler", ["determ_no_such_backend", "determ_no_such_module:fn"])
def test_a_compiler_that_does_not_resolve_is_a_config_error_not_a_verdict(kind, compiler):
    gm, inputs = _erf_graph()
    with pytest.raises(ConfigError, match="determ_no_such_"):
        check(OracleSpec(kind=kind, compiler=compiler), gm, inputs)


@pytest.mark.parametrize("sig, text", [(Signature("crash", "SIGABRT", ""), "crash: SIGABRT"),
                                       (Signature("accuracy", "", "output 0 differs"), "accuracy: output 0 differs"),
                                       (Signature("compile", "E", "boom\nmore"), "compile: E: boom")])
def test_signature_short_has_no_dangling_separator(sig, text):
    assert sig.short() == text


def test_a_candidate_that_raises_says_what_it_raised():
    """The minifier refused an input graph with 'candidate raised instead of running' and nothing more (a graph whose
    `.item()` needs a shape environment raised DataDependentOutputException)."""
    def raising(gm, example_inputs):
        raise RuntimeError("the compiler cannot take this graph\nsecond line")

    gm, inputs = _erf_graph()
    v = check(OracleSpec(kind="accuracy", compiler=raising), gm, inputs)
    assert not v.fails and v.detail == ("candidate raised instead of running: RuntimeError: the compiler cannot take "
                                        "this graph")


def test_a_long_failure_message_keeps_its_head_its_errors_and_its_tail():
    """A C++ compile error carries the compiler's whole output: 1,900 lines of warnings went into every repro's META
    (a one-op repro.py of 2,666 lines) and onto the terminal."""
    from repro_tools.minify.oracles import condensed

    lines = [f"warning: unused variable 'x{i}'" for i in range(1900)]
    lines[950] = "kernel.cpp:12:5: error: 'tmp3' was not declared in this scope"
    short = condensed("\n".join(lines))
    assert "error: 'tmp3' was not declared" in short and short.count("\n") < 40
    assert "lines left out" in short and short.splitlines()[0] == lines[0] and short.splitlines()[-1] == lines[-1]
    assert condensed("one line") == "one line"
