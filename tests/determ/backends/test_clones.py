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


def test_attribute_state_puts_back_what_a_graph_writes_without_moving_version_counters():
    """A graph may write into its module's tensors (a compiled optimizer step's state): the first call shows
    which; they are put back through ``.data`` (autograd must not take them for modified by determ), and an
    eager run of the graph then writes into copies."""
    from determ_backend.backends.eager import EagerInterpreter
    from determ_backend.clones import AttributeState, written_attributes

    root = torch.nn.Module()
    root.register_buffer("count", torch.zeros(()))
    root.w = torch.nn.Parameter(torch.ones(3))
    g = torch.fx.Graph()  # as dynamo gives it: the buffer is read as an attribute and updated in place
    x = g.placeholder("x")
    g.call_method("add_", (g.get_attr("count"), 1))
    g.output(g.call_function(torch.mul, (x, g.get_attr("w"))))
    gm = torch.fx.GraphModule(root, g)
    state = AttributeState(gm)
    assert sorted(state.tensors) == ["count", "w"]
    before = state.save()
    gm(torch.ones(3))
    assert state.learn(before) == ["count"] and written_attributes(gm) == {"count"}  # w is only read
    version = gm.count._version
    state.restore(before)
    assert gm.count.item() == 0 and gm.count._version == version
    assert list(state.save()) == ["count"]  # from now on only what the calls write is copied
    EagerInterpreter(gm).run(torch.ones(3))
    assert gm.count.item() == 0
