"""The capture plan of determ_inductor (determ_backend.backends.inductor_instrument) on hand-written wrappers,
shaped as inductor's C++ backend writes them: which record each buffer is, and what it read."""

from __future__ import annotations

import torch
import torch.fx as fx

from determ_backend.backends.inductor_instrument import plan_call

aten = torch.ops.aten

_WRAPPER = """
cpp_fused_relu_pool_0 = async_compile.cpp_pybinding(['const float*', 'float*', 'float*'], r'''
extern "C"  void kernel(const float* in_ptr0,
                       float* out_ptr0,
                       float* out_ptr1)
{
}
''')


def call(args):
    arg0_1, = args
    args.clear()
    buf0 = empty_strided_cpu((4, 8), (8, 1), torch.float32)
    buf1 = empty_strided_cpu((4, 4), (4, 1), torch.float32)
    # Topologically Sorted Source Nodes: [relu, pool, neg], Original ATen: [aten.relu]
    cpp_fused_relu_pool_0(arg0_1, buf0, buf1)
    del arg0_1
    return (buf1, buf0, )
"""


def _gm() -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("arg0_1")
    relu = g.call_function(aten.relu.default, (x,))
    relu.name = "relu"
    pool = g.call_function(aten.narrow.default, (relu, 1, 0, 4))  # stands for a pooling of the relu
    pool.name = "pool"
    g.output((pool, relu))
    return fx.GraphModule(torch.nn.Module(), g)


def test_a_buffer_computed_from_a_sibling_in_the_same_kernel_depends_on_it():
    """The kernel writes the relu and the pooling of it; the pooling's launch arguments name only the
    kernel input, yet its value is computed from the relu inside the kernel: a wrong relu must reach it."""
    origins = {"buf0": {"origin": "relu", "origins": ["relu"]}, "buf1": {"origin": "pool", "origins": ["pool", "relu"]}}
    plan = plan_call(_WRAPPER, _gm(), origins, display={})
    by_node = {i.node: i for i in plan.infos}
    assert by_node["relu"].inputs == ("arg0_1",)
    assert by_node["pool"].inputs == ("arg0_1", "relu")
    assert [i.node for i in plan.infos if i.kind == "output"] == ["output.0", "output.1"]
    assert by_node["output.0"].inputs == ("pool",)


def test_siblings_are_recorded_after_the_siblings_they_read():
    """The launch writes the pooling's buffer first and the relu's second (argument order); the records must follow
    the graph, the relu before the pooling that reads it: the nan check, seeing the pooling first, took its input
    for one not seen yet and named the pooling (a compiled RMSNorm of every Llama-like model in training)."""
    origins = {"buf0": {"origin": "pool", "origins": ["pool", "relu"]}, "buf1": {"origin": "relu", "origins": ["relu"]}}
    plan = plan_call(_WRAPPER, _gm(), origins, display={})
    at = {i.node: k for k, i in enumerate(plan.infos)}
    captures = [ln.strip() for ln in plan.source.splitlines() if ln.strip().startswith("_determ_capture(")]
    assert [c for c in captures if "buf" in c][:2] == [f"_determ_capture({at['relu']}, buf1)", f"_determ_capture({at['pool']}, buf0)"]
    assert plan.infos[at["pool"]].inputs == ("arg0_1", "relu")


def test_siblings_that_do_not_depend_on_each_other_stay_apart():
    origins = {"buf0": {"origin": "relu", "origins": ["relu"]}, "buf1": {"origin": "neg", "origins": ["neg"]}}
    g = fx.Graph()
    x = g.placeholder("arg0_1")
    relu = g.call_function(aten.relu.default, (x,))
    relu.name = "relu"
    neg = g.call_function(aten.neg.default, (x,))
    neg.name = "neg"
    g.output((neg, relu))
    plan = plan_call(_WRAPPER, fx.GraphModule(torch.nn.Module(), g), origins, display={})
    by_node = {i.node: i for i in plan.infos}
    assert by_node["relu"].inputs == ("arg0_1",) and by_node["neg"].inputs == ("arg0_1",)


_PASS_THROUGH = """
cpp_fused_add_0 = async_compile.cpp_pybinding(['const float*', 'float*'], r'''
extern "C"  void kernel(const float* in_ptr0,
                       float* out_ptr0)
{
}
''')


def call(args):
    primals_1, primals_2, primals_3 = args
    args.clear()
    assert_size_stride(primals_1, (4, ), (1, ))
    buf0 = empty_strided_cpu((4, ), (1, ), torch.float32)
    cpp_fused_add_0(primals_1, buf0)
    buf1 = buf0; del buf0  # reuse
    buf2 = reinterpret_tensor(primals_2, (2, 2), (2, 1), 0)
    aten.add_(primals_3, 1)
    return (buf1, primals_1, primals_2, primals_3, buf2, )
"""


def test_outputs_reuse_a_capture_only_while_nothing_can_have_written_it():
    """A training graph returns its parameters and activations: an output whose variable still certainly
    holds a captured value reuses its fingerprint; a variable another statement could have written (an
    in-place fallback, a view of its memory) is read again."""
    g = fx.Graph()
    p1, p2, p3 = (g.placeholder(n) for n in ("primals_1", "primals_2", "primals_3"))
    add = g.call_function(aten.add.Tensor, (p1, 1))
    add.name = "add"
    g.output((add, p1, p2, p3))
    plan = plan_call(_PASS_THROUGH, fx.GraphModule(torch.nn.Module(), g), {"buf0": {"origin": "add"}}, display={})
    index = {i.node: k for k, i in enumerate(plan.infos)}
    src = plan.source
    assert f"_determ_same({index['output.0']}, {index['add']}, _determ_out[0])" in src  # renamed, still its value
    assert f"_determ_same({index['output.1']}, {index['primals_1']}, _determ_out[1])" in src  # only asserted on
    assert f"_determ_capture({index['output.2']}, _determ_out[2])" in src  # a view of it was made
    assert f"_determ_capture({index['output.3']}, _determ_out[3])" in src  # written in place by a fallback
    assert f"_determ_capture({index['output.4']}, _determ_out[4])" in src  # a reinterpreted view
    assert plan.reused == {index['add'], index['primals_1']}


_ZERO_FILL_THEN_ACCUMULATE = """
cpp_fused_zero_0 = async_compile.cpp_pybinding(['float*'], r'''
extern "C"  void kernel(float* out_ptr0)
{
}
''')
cpp_fused_accumulate_1 = async_compile.cpp_pybinding(['const float*', 'float*'], r'''
extern "C"  void kernel(const float* in_ptr0,
                       float* in_out_ptr0)
{
}
''')


def call(args):
    arg0_1, = args
    args.clear()
    buf0 = empty_strided_cpu((4, 8), (8, 1), torch.float32)
    # Topologically Sorted Source Nodes: [acc], Original ATen: [aten.index_put]
    cpp_fused_zero_0(buf0)
    # Topologically Sorted Source Nodes: [acc], Original ATen: [aten.index_put]
    cpp_fused_accumulate_1(arg0_1, buf0)
    del arg0_1
    return (buf0, )
"""


def test_a_buffer_written_twice_is_its_node_after_the_last_write():
    """Inductor zero-fills an embedding gradient's buffer, then accumulates into it: the zeros are a partial
    value, the accumulated buffer is the node's (judged against eager's gradient)."""
    g = fx.Graph()
    x = g.placeholder("arg0_1")
    acc = g.call_function(aten.relu.default, (x,))  # stands for the accumulation
    acc.name = "acc"
    g.output((acc,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    plan = plan_call(_ZERO_FILL_THEN_ACCUMULATE, gm, {"buf0": {"origin": "acc", "origins": ["acc"]}}, display={})
    nodes = [(i.node, (i.extra or {}).get("holds"), i.inputs) for i in plan.infos if i.kind == "node"]
    assert nodes == [("acc#1", "partial", ()), ("acc", None, ("arg0_1", "acc#1"))]
    out = next(i for i in plan.infos if i.kind == "output")
    assert out.inputs == ("acc",)


_CAT_SIZES = """
cpp_fused_cat_0 = async_compile.cpp_pybinding(['const float*', 'float*', 'float*', 'const int64_t'], r'''
extern "C"  void kernel(const float* in_ptr0,
                       float* out_ptr0,
                       float* out_ptr1,
                       const int64_t ks0)
{
}
''')


def call(args):
    arg0_1, arg1_1, arg2_1 = args
    args.clear()
    s77 = arg0_1
    buf0 = empty_strided_cpu((s77, 8), (8, 1), torch.float32)
    extern_kernels.mm(arg1_1, arg2_1, out=buf0)
    buf3 = empty_strided_cpu((s77, 16), (16, 1), torch.float32)
    buf1 = reinterpret_tensor(buf3, (s77, 8), (16, 1), 0)  # alias
    buf2 = reinterpret_tensor(buf3, (s77, 8), (16, 1), 8)  # alias
    # Topologically Sorted Source Nodes: [relu, tanh, cat], Original ATen: [aten.relu, aten.tanh, aten.cat]
    cpp_fused_cat_0(buf0, buf1, buf2, s77)
    buf4 = empty_strided_cpu((s77, 4), (4, 1), torch.float32)
    extern_kernels.mm(buf3, arg2_1, out=buf4)
    return (buf4, )
"""


def test_what_kernels_write_through_views_of_a_buffer_is_what_it_holds_and_sizes_are_no_inputs():
    """``cat`` lowered to one allocation whose halves a kernel writes through ``reinterpret_tensor`` views: the mm
    that reads the whole allocation read nothing recorded (it was 'fresh'), so its inputs agreed and a wrong relu
    blamed the mm.  Under dynamic shapes the SymInt graph input (``s77 = arg0_1``) passed to the kernel was an input
    no record holds, so no kernel taking a size could be a root cause."""
    g = fx.Graph()
    n, a, w = g.placeholder("arg0_1"), g.placeholder("arg1_1"), g.placeholder("arg2_1")
    n.meta["val"] = 6  # a size (a SymInt under dynamic shapes)
    mm = g.call_function(aten.mm.default, (a, w))
    relu = g.call_function(aten.relu.default, (mm,))
    tanh = g.call_function(aten.tanh.default, (mm,))
    cat = g.call_function(aten.cat.default, ([relu, tanh], 1))
    mm_1 = g.call_function(aten.mm.default, (cat, w))
    for node, name in ((mm, "mm"), (relu, "relu"), (tanh, "tanh"), (cat, "cat"), (mm_1, "mm_1")):
        node.name = name
    g.output((mm_1,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    origins = {"buf0": {"origin": "mm", "origins": ["mm"]}, "buf1": {"origin": "relu", "origins": ["relu"]},
               "buf2": {"origin": "tanh", "origins": ["tanh"]}, "buf4": {"origin": "mm_1", "origins": ["mm_1"]}}
    plan = plan_call(_CAT_SIZES, gm, origins, display={})
    by_node = {i.node: i for i in plan.infos}
    assert "arg0_1" not in by_node  # a number: no capture
    assert by_node["relu"].inputs == ("mm",) and by_node["tanh"].inputs == ("mm",)
    assert by_node["mm_1"].inputs == ("relu", "tanh", "arg2_1")


_UNINITIALIZED = """
cpp_fused_add_0 = async_compile.cpp_pybinding(['const float*', 'const float*', 'float*'], r'''
extern "C"  void kernel(const float* in_ptr0,
                       const float* in_ptr1,
                       float* out_ptr0)
{
}
''')


def call(args):
    arg0_1, = args
    args.clear()
    buf0 = empty_strided_cpu((4, 1000), (1000, 1), torch.float32)
    buf1 = empty_strided_cpu((4, 1), (1, 1), torch.float32)
    # Topologically Sorted Source Nodes: [add], Original ATen: [aten.add]
    cpp_fused_add_0(arg0_1, buf0, buf1)
    return (buf1, )
"""


def test_memory_read_before_anything_wrote_it_is_recorded_as_read():
    """``torch.empty`` read by a kernel (uninitialized memory): nothing wrote the buffer, so it was no input of the
    kernel at all, and the determinism check blamed the kernel's node instead of the empty."""
    g = fx.Graph()
    x = g.placeholder("arg0_1")
    empty = g.call_function(aten.empty.memory_format, ([4, 1000],))
    add = g.call_function(aten.add.Tensor, (x, empty))
    empty.name, add.name = "empty", "add"
    g.output((add,))
    origins = {"buf0": {"origin": "empty", "origins": ["empty"]}, "buf1": {"origin": "add", "origins": ["add"]}}
    plan = plan_call(_UNINITIALIZED, fx.GraphModule(torch.nn.Module(), g), origins, display={})
    by_node = {i.node: i for i in plan.infos}
    assert by_node["empty"].inputs == () and by_node["add"].inputs == ("arg0_1", "empty")
    lines = [ln.strip() for ln in plan.source.splitlines()]
    at = {i.node: k for k, i in enumerate(plan.infos)}
    assert lines.index(f"_determ_capture({at['empty']}, buf0)") < lines.index("cpp_fused_add_0(arg0_1, buf0, buf1)")


_SIG = "async_compile.cpp_pybinding(['const float*', 'float*'], r'''\nextern \"C\" void kernel(const float* in_ptr0, float* out_ptr0)\n{}\n''')"
_REWRITTEN_AND_UNPARSED = f"""
cpp_fused_a = {_SIG}
cpp_fused_b = {_SIG}
cpp_fused_c = {_SIG}
def call(args):
    arg0_1, arg1_1 = args
    args.clear()
    buf0 = empty_strided_cpu((8,), (1,), torch.float32)
    buf1 = reinterpret_tensor(buf0, (4,), (1,), 0)
    cpp_fused_a(arg0_1, buf1)
    cpp_fused_b(arg1_1, buf1)
    buf2 = empty_strided_cpu((8,), (1,), torch.float32)
    cpp_fused_c(buf0, buf2)
    buf3 = empty_strided_cpu((8,), (1,), torch.float32)
    aten.index_put_(buf3, [arg1_1], arg0_1, False)
    buf4 = empty_strided_cpu((8,), (1,), torch.float32)
    cpp_fused_c(buf3, buf4)
    return (buf2, buf4)
"""


def test_a_view_written_twice_holds_its_last_write_and_an_unparsed_write_is_no_empty_read():
    """A reader of an allocation took both writes of one view as inputs, the overwritten one too; an allocation
    written by a statement the plan does not parse (an in-place fallback) was captured as memory nothing wrote."""
    g = fx.Graph()
    g.output(())
    plan = plan_call(_REWRITTEN_AND_UNPARSED, fx.GraphModule(torch.nn.Module(), g), {}, display={})
    by_buffer = {(i.extra or {}).get("buffer"): i for i in plan.infos if i.extra}
    writes = [i.node for i in plan.infos if (i.extra or {}).get("buffer") == "buf1"]
    assert len(writes) == 2 and by_buffer["buf2"].inputs == (writes[-1],)
    assert not [i for i in plan.infos if (i.extra or {}).get("kernel") == "uninitialized"]
    assert by_buffer["buf4"].inputs == ("buf3",)  # written by what the plan cannot read: not shown to agree


_TEMPLATE_SRC = """
cpp_fused_flex_attention_1 = async_compile.cpp_pybinding(['const float*', 'const int32_t*', 'float*'], r'''
#include <torch/csrc/inductor/cpp_prefix.h>
inline void kernel_kernel_micro_gemm_kernel(const float* A, const float* B, float* C, int64_t K)
{
}
extern "C"
void kernel(const float* query, const int32_t* kv_indices, float* output)
{
  output[0] = query[0];
}
''')
"""


def test_a_template_kernels_output_is_found_by_its_entry_point_and_types():
    """A template kernel (flex attention on the CPU) defines helpers named ``kernel_*`` before its entry point and
    names its pointers itself: the helper's parameters were read as the kernel's, and ``float* output`` was no
    output, so the attention's result was never traced and the relu after it had no root cause."""
    from determ_backend.backends.inductor_instrument import _kernel_outputs

    assert _kernel_outputs(_TEMPLATE_SRC) == {"cpp_fused_flex_attention_1": ([2], [2], [])}


def test_an_in_out_buffer_left_holding_a_reductions_accumulator_is_lent():
    """A kernel that stores a raw reduction accumulator last into an in_out buffer (var's undivided sum of squares
    in memory planned for ``acc * 0.9 + var``) leaves no value of the buffer's node there: judged as that node, a
    clean run had a masked divergence.  A final value stored after the accumulator is the node's."""
    from determ_backend.backends.inductor_instrument import _written_through_alias as lent

    assert lent("auto out_ptr0 = in_out_ptr0;\ntmp_acc0_vec.store(in_out_ptr0 + x);", "in_out_ptr0")
    assert lent("in_out_ptr0[x] = static_cast<float>(tmp_acc0);", "in_out_ptr0")
    assert lent("auto out_ptr0 = in_out_ptr0;\nt.store(out_ptr0 + x);", "in_out_ptr0")
    assert not lent("auto out_ptr2 = in_out_ptr1;\nout_ptr2[0] = tmp_acc0;\nin_out_ptr1[0] = tmp2;", "in_out_ptr1")
    assert not lent("tmp3.store(in_out_ptr0 + x);", "in_out_ptr0")


_FUNCTIONAL_ALL_REDUCE = """
cpp_fused_all_reduce_mul_sqrt_0 = async_compile.cpp_pybinding(['const float*', 'float*'], r'''
extern "C"  void kernel(const float* in_ptr0,
                       float* out_ptr0)
{
}
''')


def call(args):
    arg0_1, = args
    args.clear()
    buf0 = empty_strided_cpu((4, 8), (8, 1), torch.float32)
    # Topologically Sorted Source Nodes: [sqrt, y, tensor], Original ATen: [aten.sqrt, aten.mul, _c10d_functional.all_reduce]
    cpp_fused_all_reduce_mul_sqrt_0(arg0_1, buf0)
    # Topologically Sorted Source Nodes: [sqrt, y, tensor], Original ATen: [aten.sqrt, aten.mul, _c10d_functional.all_reduce]
    torch.ops._c10d_functional.all_reduce_.default(buf0, 'sum', '0')
    # Topologically Sorted Source Nodes: [y_1], Original ATen: [_c10d_functional.wait_tensor]
    torch.ops._c10d_functional.wait_tensor.default(buf0)
    return (buf0, )
"""


def test_a_functional_all_reduce_is_captured_once_waited_on():
    """Inductor lowers a functional all_reduce to an in-place ``all_reduce_`` of the buffer its input was computed
    into, then a ``wait_tensor``: the buffer was captured before the reduction and named ``wait_tensor``, so another
    rank's difference arriving through the all_reduce was blamed on the op reading it."""
    import torch.distributed._functional_collectives  # noqa: F401  (registers the ops)

    g = fx.Graph()
    x = g.placeholder("arg0_1")
    mul = g.call_function(aten.mul.Tensor, (x, 2.0))
    mul.name = "mul"
    ar = g.call_function(torch.ops._c10d_functional.all_reduce.default, (mul, "sum", "0"))
    ar.name = "all_reduce"
    wait = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (ar,))
    wait.name = "wait_tensor"
    g.output((wait,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    plan = plan_call(_FUNCTIONAL_ALL_REDUCE, gm, {"buf0": {"origin": "wait_tensor", "origins": ["mul", "wait_tensor"]}},
                     display={})
    nodes = [(i.node, (i.extra or {}).get("holds"), i.inputs) for i in plan.infos if i.kind == "node"]
    assert nodes == [("wait_tensor#1", "partial", ("arg0_1",)), ("wait_tensor", None, ("wait_tensor#1",))]
    assert plan.source.index("_determ_capture(2, buf0)") > plan.source.index("wait_tensor.default(buf0)")


def test_an_accumulation_guessed_part_of_the_buffers_node_is_its_last_write():
    """BERT's token-type embedding gradient: the zero fill is the buffer's origin node, the accumulating kernel is a
    mutation of it (``mutates``), guessed partial of that same node; the zeros kept the node's name and were judged
    against eager's gradient (a false masked note, cosine 0, every step)."""
    g = fx.Graph()
    x = g.placeholder("arg0_1")
    acc = g.call_function(aten.relu.default, (x,))  # stands for the accumulation
    acc.name = "acc"
    g.output((acc,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    origins = {"buf0": {"origin": "acc", "origins": ["acc"]}, "buf1": {"origins": ["acc"], "mutates": ["buf0"]}}
    plan = plan_call(_ZERO_FILL_THEN_ACCUMULATE, gm, origins, display={})
    nodes = [(i.node, (i.extra or {}).get("holds"), i.inputs) for i in plan.infos if i.kind == "node"]
    assert nodes == [("acc#1", "partial", ()), ("acc", None, ("arg0_1", "acc#1"))]


_SEEDS = """
cpp_fused_dropout_0 = async_compile.cpp_pybinding(['const int64_t*', 'const float*', 'float*'], r'''
extern "C"  void kernel(const int64_t* in_ptr0,
                       const float* in_ptr1,
                       float* out_ptr0)
{
}
''')


def call(args):
    arg0_1, = args
    args.clear()
    buf0 = empty_strided_cpu((1, ), (1, ), torch.int64)
    # Topologically Sorted Source Nodes: [], Original ATen: []
    aten.randint.low_out(-9223372036854775808, 9223372036854775807, [1], out=buf0)
    buf1 = empty_strided_cpu((4, 8), (8, 1), torch.float32)
    # Topologically Sorted Source Nodes: [drop], Original ATen: [aten.native_dropout]
    cpp_fused_dropout_0(buf0, arg0_1, buf1)
    return (buf1, )
"""


def test_the_seeds_a_fallback_writes_through_out_are_recorded():
    """Inductor's random kernels read seeds ``aten.randint.low_out(..., out=buf0)`` wrote: that statement was no
    write, the dropout's input ``buf0`` had no record, and two runs of other seeds had no root cause."""
    import torch._inductor.inductor_prims  # noqa: F401  (registers prims.inductor_seeds)

    g = fx.Graph()
    x = g.placeholder("arg0_1")
    seeds = g.call_function(torch.ops.prims.inductor_seeds.default, (1, torch.device("cpu")))
    seeds.name = "inductor_seeds_default"
    drop = g.call_function(aten.mul.Tensor, (x, 2.0))  # stands for the dropout
    drop.name = "drop"
    g.output((drop,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    origins = {"buf0": {"origin": "inductor_seeds_default", "origins": ["inductor_seeds_default"]},
               "buf1": {"origin": "drop", "origins": ["drop"]}}
    plan = plan_call(_SEEDS, gm, origins, display={})
    nodes = [(i.node, i.inputs) for i in plan.infos if i.kind == "node"]
    assert nodes == [("inductor_seeds_default", ()), ("drop", ("inductor_seeds_default", "arg0_1"))]
