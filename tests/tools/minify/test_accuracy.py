"""accuracy: same() over pytrees with the fp64 criterion, same_two_models verdicts (never a swallowed error)."""

from __future__ import annotations

import logging

import pytest
import torch

from repro_tools.minify.accuracy import cast_to_fp64, run_fwd_maybe_bwd, same, same_two_models

X = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))


def _rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).to(x.dtype)


@pytest.mark.parametrize("ref, res, fp64_ref, strict, expected", [
    ([X], [X.clone()], None, False, True),
    ([X], [X + 1e-6], None, False, True),
    ([X], [X + 1.0], None, False, False),
    ({"a": X, "n": torch.tensor(1)}, {"a": X, "n": torch.tensor(2)}, None, False, True),  # non-float ignored
    ({"a": X, "n": torch.tensor(1)}, {"a": X, "n": torch.tensor(2)}, None, True, False),  # ... unless strict
    ([X, 3], [X, 3], None, True, True),
    ([X], [X, X], None, False, False),  # structure differs
    ([X], [X[:8]], None, False, False),  # shape differs
])
def test_same(ref, res, fp64_ref, strict, expected):
    assert same(ref, res, fp64_ref, strict=strict) is expected


def test_same_uses_the_fp64_rmse_criterion():
    x64 = X.double() * 100
    eager = _rounded(x64, torch.float32).float()  # fp32 rounding: eager's own error vs fp64
    close = _rounded(x64, torch.bfloat16).float()  # much worse than eager
    assert not same([eager], [close], [x64])
    compiled = eager + torch.where(torch.rand_like(eager) > 0.5, 1.5e-5, -1.5e-5) * eager.abs().clamp(min=1)
    assert not same([eager], [compiled], None, tol=1e-6)  # beyond tolerance without a reference ...
    assert same([eager], [compiled], [x64], tol=1e-6, multiplier=1e6)  # ... within the fp64 criterion


def test_bitwise_with_strict_and_zero_tol():
    y = X.clone()
    y[0, 0] = torch.nextafter(y[0, 0], torch.tensor(float("inf")))
    assert same([X], [y]) and not same([X], [y], strict=True, tol=0)


class _WrongGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 3


def _lin():
    torch.manual_seed(0)
    return torch.nn.Linear(8, 8)


def test_same_two_models_statuses():
    lin, x = _lin(), torch.randn(4, 8)
    assert same_two_models(lin, lin, [x]).status == "same"
    bad = same_two_models(lin, lambda t: (torch.relu(lin(t)) + 0.5,), [x])
    assert bad.status == "diverged" and bad.leaf == 0 and "compiled_rmse_vs_fp64" in bad.detail and not bad

    def raises(t):
        raise RuntimeError("kernel failed")

    r = same_two_models(lin, raises, [x])
    assert r.status == "compiled_error" and isinstance(r.error, RuntimeError)
    r = same_two_models(raises, lin, [x])
    assert r.status == "checker_error" and "kernel failed" in r.detail


def test_a_model_that_draws_random_numbers_is_not_judged_either_way():
    """Eager and compiled draws never agree: neither "diverged" (the healthy model below, whose two dropout
    masks differ) nor "same" (a broken one) would be a verdict on the compiler."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)).train()
    x = torch.randn(4, 8)
    for compiled in (model, lambda t: model(t) * 0):
        r = same_two_models(model, compiled, [x])
        assert r.status == "not_judged" and not r and "draws random numbers" in r.detail
    assert same_two_models(model.eval(), model, [x]).status == "same"  # no draws in eval mode


def test_a_graph_with_higher_order_ops_is_still_judged():
    """Finding the draws must not stop graphs it cannot look inside (``torch.cond`` under a dispatch mode raised)."""
    got = []

    def capture(gm, example_inputs):
        got.append((gm, list(example_inputs)))
        return gm

    torch._dynamo.reset()
    torch.compile(lambda x: torch.cond(x.sum() > 0, lambda y: y + 1, lambda y: y - 1, (x,)), backend=capture)(
        torch.randn(4))
    gm, inputs = got[0]
    assert same_two_models(gm, gm, inputs).status == "same"
    assert same_two_models(gm, lambda *a: (gm(*a)[0] * 2,), inputs).status == "diverged"


def test_backward_divergence_is_found_unless_only_fwd():
    x = torch.randn(4, 8, requires_grad=True)
    r = same_two_models(lambda t: t * 2, _WrongGrad.apply, [x])
    assert r.status == "diverged" and r.detail.startswith("gradient 0")
    assert same_two_models(lambda t: t * 2, _WrongGrad.apply, [x], only_fwd=True).status == "same"


def test_boxed_compiled_functions_are_called_boxed():
    lin, x = _lin(), torch.randn(4, 8)

    def boxed(args):
        assert isinstance(args, list)
        out = lin(args[0])
        args.clear()  # like inductor
        return (out,)

    boxed._boxed_call = True
    assert same_two_models(lin, boxed, [x]).status == "same"


def test_missing_fp64_reference_is_said_not_hidden(caplog):
    def no_fp64(t):
        if t.dtype == torch.float64:
            raise RuntimeError("no double kernel")
        return t * 3

    with caplog.at_level(logging.WARNING):
        r = same_two_models(no_fp64, no_fp64, [torch.randn(4)])
    assert r.status == "same" and r.fp64 is False and "no fp64 reference" in caplog.text
    r = same_two_models(no_fp64, no_fp64, [torch.randn(4)], require_fp64=True)
    assert r.status == "checker_error" and "no double kernel" in r.detail


def test_run_fwd_maybe_bwd_and_cast_to_fp64():
    lin, x = _lin(), torch.randn(4, 8)
    res = run_fwd_maybe_bwd(lin, [x])
    assert len(res) == 3 and res[1].shape == lin.weight.shape  # output, grad weight, grad bias
    assert len(run_fwd_maybe_bwd(lin, [x], only_fwd=True)) == 1
    m64, (x64,) = cast_to_fp64(lin, [x])
    assert m64.weight.dtype == torch.float64 and x64.dtype == torch.float64 and lin.weight.dtype == torch.float32


def test_the_fp64_reference_widens_the_graphs_own_float_dtypes():
    """A training graph accumulates into a buffer it creates as float32 (an embedding gradient): in the fp64
    reference that buffer is float64 too, or ``index_put`` refuses the float64 values."""
    import torch.fx as fx

    from determ_backend.backends.checks import graph_in_dtype

    aten = torch.ops.aten
    g = fx.Graph()
    x, idx = g.placeholder("x"), g.placeholder("idx")
    buf = g.call_function(aten.full.default, ([4, 3], 0.0), {"dtype": torch.float32, "device": torch.device("cpu")})
    put = g.call_function(aten.index_put.default, (buf, [idx], x, True))
    conv = g.call_function(torch.ops.prims.convert_element_type.default, (put, torch.float32))
    g.output((conv,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    args = [torch.randn(5, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 3, 0])]
    with pytest.raises(RuntimeError, match="dtypes match"):
        gm(*args)
    (out,) = graph_in_dtype(gm, torch.float64)(*args)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, torch.zeros(4, 3, dtype=torch.float64).index_put_([args[1]], args[0], True))
    assert [n.kwargs.get("dtype") for n in gm.graph.nodes if n.op == "call_function"][0] == torch.float32  # untouched
    m64, _ = cast_to_fp64(gm, args)
    assert m64(*args)[0].dtype == torch.float64


def test_the_fp64_reference_widens_a_dynamo_graphs_own_casts():
    """A Dynamo-level graph (what the minifier sees after dynamo) casts with methods: ``.float()`` and
    ``.to(torch.float32)`` of a float64 value met a float64 weight in a matmul, which does not promote, so the
    float64 reference could not run; a bit view (``.view(dtype)``) is no cast and stays."""
    import torch.fx as fx

    from determ_backend.backends.checks import graph_in_dtype

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 3))

        def forward(self, x):
            h = torch.softmax(x.float() @ self.w, dim=-1, dtype=torch.float32)
            return h.to(torch.float32) @ self.w, x.view(torch.int64)

    gm = fx.symbolic_trace(M())
    m64, (x64,) = cast_to_fp64(gm, [torch.randn(2, 3)])
    with pytest.raises(RuntimeError, match="dtype"):  # the graph as traced, with float64 weights
        fx.GraphModule(m64, gm.graph)(x64)
    out, bits = m64(x64)  # the minifier's fp64 reference
    assert [n.args for n in graph_in_dtype(gm, torch.float64).graph.nodes if n.target == "to"][0][1] == torch.float64
    assert out.dtype == torch.float64 and bits.dtype == torch.int64
    w = m64.w.detach()
    torch.testing.assert_close(out, torch.softmax(x64 @ w, dim=-1) @ w)
    assert bits.shape == (2, 3)
