"""determ_backend.clones.clone_inputs: the one input-cloning helper (checks, replays, oracles, the bitwise mode)."""

from __future__ import annotations

import torch

from determ_backend.clones import clone_inputs


def test_clones_keep_layout_and_are_new_memory():
    x = torch.randn(4, 6).t()[1:]  # strided, with a storage offset
    (c,) = clone_inputs([x])
    assert torch.equal(c, x) and c.stride() == x.stride()
    assert c.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    c.zero_()
    assert x.abs().sum() > 0


def test_an_expanded_tensor_stays_expanded():
    e = torch.randn(1, 3).expand(4, 3)
    (c,) = clone_inputs([e])
    assert c.stride() == (0, 1) and torch.equal(c, e)


def test_views_of_one_buffer_stay_views_of_one_copy():
    base = torch.arange(20.0)
    a, b = base[2:10], base[5:15].view(2, 5)
    ca, cb = clone_inputs([a, b])
    assert torch.equal(ca, a) and torch.equal(cb, b)
    ca[3] = -1.0  # element 5 of the buffer: cb's first
    assert cb[0, 0].item() == -1.0 and b[0, 0].item() == 5.0


def test_nested_arguments_scalars_and_requires_grad():
    p = torch.randn(3, requires_grad=True)
    i = torch.arange(4)
    args, kwargs = clone_inputs([(p, [i, 2.5], None), {"k": p, "n": "x"}])
    cp, (ci, s), none = args
    assert cp.requires_grad and cp.is_leaf and torch.equal(cp, p) and kwargs["k"] is cp and kwargs["n"] == "x"
    assert torch.equal(ci, i) and s == 2.5 and none is None


def test_tensors_without_a_plain_layout_are_cloned_alone():
    sp = torch.randn(3, 3).to_sparse()
    cj = torch.randn(3, dtype=torch.complex64).conj()
    csp, ccj = clone_inputs([sp, cj])
    assert torch.equal(csp.to_dense(), sp.to_dense()) and torch.equal(ccj, cj)
