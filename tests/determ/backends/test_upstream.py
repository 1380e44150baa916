"""The innocence test of a root (:class:`determ_backend.backends.upstream.Upstream`) on a sum that cancels."""

import torch
import torch.fx as fx

from determ_backend.backends.upstream import Upstream
from determ_backend.devices import get_rng_state


def _cancelling(seed: int = 0):
    """A graph ``(x * c).sum(-1)`` and a compiled side whose products are large and cancel to a small sum; the
    compiled side sums them in another order than eager does (pairs first), as a fused kernel may."""
    def f(x, c):
        return (x * c).sum(-1)

    gm = fx.symbolic_trace(f)
    g = torch.Generator().manual_seed(seed)
    half = torch.randn(8, 128, generator=g) * 1e4
    x = torch.cat([half, half + torch.randn(8, 128, generator=g) * 1e-2], dim=1)
    c = torch.cat([torch.ones(8, 128), -torch.ones(8, 128)], dim=1)
    prod = x * c
    compiled_sum = (prod[:, :128] + prod[:, 128:]).sum(-1)  # the pairs cancel first: another rounding than eager's
    eager = {"mul": prod, "sum_1": f(x, c)}
    return gm, [x, c], prod, compiled_sum, eager


def test_a_sum_that_cancels_computes_right_from_its_inputs_when_it_differs_only_by_its_own_rounding():
    """Eager's order and the pairs-first order round apart by far more than the tolerance of the small sum itself,
    but by a few units in the last place of what it sums: the sum computes right from its inputs (a LayerNorm
    backward's ``sum(dy * w * xhat)`` after a wrong relu had been named a root beside the relu)."""
    gm, args, prod, compiled_sum, eager = _cancelling()
    assert (compiled_sum - eager["sum_1"]).abs().max() > 1e-3 * compiled_sum.abs().max()  # the case at hand
    up = Upstream(gm, args, get_rng_state(), {"mul": prod, "sum_1": compiled_sum}, eager, tol=1e-3)
    assert up.innocent("sum_1") is True


def test_a_sum_wrong_by_one_of_its_terms_is_not_innocent():
    """The same cancelling sum missing one of its products (or with one 1% off) is wrong by far more than its
    rounding."""
    gm, args, prod, compiled_sum, eager = _cancelling()
    wrong = compiled_sum - prod[:, 0]
    up = Upstream(gm, args, get_rng_state(), {"mul": prod, "sum_1": wrong}, eager, tol=1e-3)
    assert up.innocent("sum_1") is False
    wrong = compiled_sum + 0.01 * prod[:, 0]
    up = Upstream(gm, args, get_rng_state(), {"mul": prod, "sum_1": wrong}, eager, tol=1e-3)
    assert up.innocent("sum_1") is False


def _values(gm, args):
    """Every call node's value (eager), by name."""
    from determ_backend.backends.eager import eager_node_values
    return {k: v for k, v in eager_node_values(gm, args).items() if isinstance(v, torch.Tensor)}


def test_a_matmul_ten_percent_wrong_is_not_innocent():
    """A vector-matrix product of 4096 terms, 10% off: its rounding is about 1e-6 of its terms' magnitudes, and the
    whole weight's size times its element count had let it pass for rounding."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 4096, generator=g), torch.randn(4096, 256, generator=g)
    gm = fx.symbolic_trace(lambda x, w: (x * 2) @ (w * 1))
    right = _values(gm, [x, w])
    node = [n.name for n in gm.graph.nodes if n.op == "call_function"][-1]
    up = Upstream(gm, [x, w], get_rng_state(), {**right, node: right[node] * 1.1}, right, tol=1e-3)
    assert up.innocent(node) is False
    other_order = ((x * 2).double() @ w.double()).float()
    up = Upstream(gm, [x, w], get_rng_state(), {**right, node: other_order}, right, tol=1e-3)
    assert up.innocent(node) is True  # another summation order is rounding


def test_an_op_beside_a_huge_mask_is_judged_on_its_own_values():
    """An additive attention mask holds -3.4e38: a bound taken from the largest input passed any value of the op."""
    g = torch.Generator().manual_seed(0)
    s = torch.randn(4, 8, generator=g)
    mask = torch.zeros(4, 8)
    mask[:, 6:] = torch.finfo(torch.float32).min
    gm = fx.symbolic_trace(lambda s, mask: torch.softmax((s * 2) + mask, -1))
    right = _values(gm, [s, mask])
    node = [n.name for n in gm.graph.nodes if n.op == "call_function"][-1]
    up = Upstream(gm, [s, mask], get_rng_state(), {**right, node: right[node] * 1.5}, right, tol=1e-3)
    assert up.innocent(node) is False


def test_a_sum_that_overflows_or_sums_an_inf_is_not_cleared_as_rounding():
    """An inf in the value or among its terms made the rounding bound inf, and any value passed under it."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    gm = fx.symbolic_trace(lambda x: (x * 2).sum(-1))
    right = _values(gm, [x])
    node = [n.name for n in gm.graph.nodes if n.op == "call_method"][-1]
    wrong = right[node].clone()
    wrong[0] = torch.inf
    up = Upstream(gm, [x], get_rng_state(), {**right, node: wrong}, right, tol=1e-3)
    assert up.innocent(node) is False
    x_inf = x.clone()
    x_inf[1, 2] = torch.inf
    right = _values(gm, [x_inf])
    wrong = right[node].clone()
    wrong[1] = -torch.inf
    up = Upstream(gm, [x_inf], get_rng_state(), {**right, node: wrong}, right, tol=1e-3)
    assert up.innocent(node) is False


def test_a_float32_sum_that_cancels_is_judged_at_float32_against_a_float64_replay():
    """xdevice, cpu against cpu:float64: the float32 side's cancelling sum replayed in float64 differs by float32's
    rounding of its terms; the bound had taken float64's unit (the finer of the two) and never cleared it."""
    gm, args, prod, _, eager = _cancelling()
    ref = {k: v.double() for k, v in eager.items()}
    assert (eager["sum_1"].double() - prod.double().sum(-1)).abs().max() > 1e-3 * eager["sum_1"].abs().max()
    up = Upstream(gm, [a.double() for a in args], get_rng_state(), {"mul": prod, "sum_1": eager["sum_1"]}, ref,
                  tol=1e-3, convert=lambda v: v.double())
    assert up.innocent("sum_1") is True
