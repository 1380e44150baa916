"""FX graph instrumentation: a copy of a graph that reports every node's value to
a :class:`~determ_backend.backends.recorder.Recorder`.

Recording calls are inserted as graph nodes (not an Interpreter), so the
instrumented graph runs as generated Python code at close to the original speed
and computes exactly the same values.  The inductor path, which instruments the
generated wrapper code instead of the FX graph, lives in
:mod:`determ_backend.backends.inductor_instrument`; operator overloads are
inspected through :mod:`determ_backend._torch_compat`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import operator
import re
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx

from determ_backend import _torch_compat
from determ_backend._frames import in_torch
from determ_backend.backends.recorder import NodeInfo, Recorder
from determ_backend.trace.stream import dtype_name, module_place

__all__ = ["OP_NAME", "node_source", "module_place_of", "op_name", "is_view", "param_names", "instrument_graph", "graph_node_infos",
           "written_args", "held_written", "written_inputs"]

# the file name is everything up to the last '", line N, in ' of the line: it may hold quotes itself
_FRAME = re.compile(r'^\s*File "(.+)", line (\d+), in (\S+)', re.M)


def node_source(node: fx.Node) -> Optional[str]:
    """``file:line (function)`` of the user code that produced ``node`` (the innermost frame outside torch).  A node of torch's own
    modules alone (an ``nn.Sequential`` of ``nn.Linear`` and ``nn.ReLU``: dynamo keeps no frame of torch's code) is
    placed by its module instead, ``<module 1: ReLU>``; None when neither is known."""
    st = node.meta.get("stack_trace")
    frames = _FRAME.findall(st) if st else None
    if not frames:
        return module_place_of(node)
    # the innermost frame outside torch (a functional collective's frames end in torch's own Python)
    f, line, fn = next((fr for fr in reversed(frames) if not in_torch(fr[0])), frames[-1])
    return f"{f}:{line} ({fn})"


def module_place_of(node: fx.Node) -> Optional[str]:
    """``<module PATH: Class>`` of the innermost module ``node`` ran in; None when dynamo recorded none."""
    found = _torch_compat.innermost_module(node)
    return module_place(found[0] or "(top)", found[1]) if found is not None else None


OP_NAME = "determ_op_name"
"""``node.meta`` key: the op a node is recorded as when a rewrite changed its target (a ``.float()`` widened to
``.to(float64)`` on a ``cpu:float64`` side is still the model's ``Tensor.float``)."""


def op_name(node: fx.Node) -> str:
    named = node.meta.get(OP_NAME)
    if named is not None:
        return named
    t = node.target
    if node.op == "placeholder":
        return "input"
    if node.op == "get_attr":
        return "get_attr"
    if node.op == "call_method":
        return f"Tensor.{t}"
    if node.op == "call_module":
        return f"module:{t}"
    if _torch_compat.is_op_overload(t):
        namespace, name, overload = _torch_compat.op_overload_name(t)
        return f"aten.{name}.{overload}" if namespace == "aten" else str(t)
    if _torch_compat.is_op_overload_packet(t):
        return _torch_compat.op_packet_name(t).replace("::", ".")
    mod = getattr(t, "__module__", None) or ""
    name = getattr(t, "__name__", None) or str(t)
    if mod.startswith("torch") or mod in ("_operator", "operator", "builtins"):
        return f"{mod.replace('_operator', 'operator')}.{name}"
    return f"{mod}.{name}" if mod else name


_SRC_PART = re.compile(r"member='(_modules|_parameters|_buffers)'\), index='([^']*)'")


def _source_path(src) -> Optional[str]:
    """A dynamo Source of a parameter/buffer -> its module path (``layers.2.weight``)."""
    parts = _SRC_PART.findall(repr(src))
    if not parts or parts[-1][0] == "_modules":
        return None
    return ".".join(p for _, p in parts)


def param_names(gm: fx.GraphModule) -> Dict[str, str]:
    """Placeholder name -> module path (``layers.2.weight``) for placeholders that are parameters/buffers."""
    out: Dict[str, str] = {}
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        src = getattr(n.meta.get("grapharg"), "source", None)
        path = _source_path(src) if src is not None else None
        if path:
            out[n.name] = path
    return out


_VIEW_METHODS = {"view", "view_as", "transpose", "permute", "unsqueeze", "squeeze", "expand", "expand_as", "t",
                 "detach", "narrow", "unflatten", "swapaxes", "movedim", "unbind", "split", "chunk", "as_strided"}
_VIEW_FUNCS = {"transpose", "permute", "unsqueeze", "squeeze", "t", "detach", "narrow", "swapaxes", "movedim",
               "split", "chunk", "unbind"}


def is_view(node: fx.Node) -> bool:
    """Whether ``node`` only re-views its input's data (its values follow from the input: not fingerprinted)."""
    t = node.target
    if node.op == "call_function" and _torch_compat.is_op_overload(t):
        return bool(t.is_view)
    if node.op == "call_method":
        return t in _VIEW_METHODS
    if node.op == "call_function" and getattr(t, "__module__", "") in ("torch", "torch.functional"):
        return getattr(t, "__name__", "") in _VIEW_FUNCS
    return False


def _is_async_collective(node: fx.Node) -> bool:
    """A functional collective (``_c10d_functional.all_reduce``...): its value is final only after the
    ``wait_tensor`` node that consumes it, which is captured instead."""
    t = node.target
    return (node.op == "call_function" and _torch_compat.is_op_overload(t)
            and str(getattr(t, "namespace", "")) == "_c10d_functional" and "wait" not in str(t))


def _is_sequence_valued(node: fx.Node) -> bool:
    val = node.meta.get("val", node.meta.get("example_value"))
    if val is not None:
        return isinstance(val, (tuple, list))
    # a graph without values (loaded from a repro script): the operator's schema says (native_layer_norm returns
    # three tensors, which its getitem users read)
    schema = _torch_compat.op_schema(node.target) if node.op == "call_function" else None
    if schema is None:
        return False
    rets = schema.returns
    return len(rets) > 1 or (len(rets) == 1 and str(rets[0].type).endswith("[]"))


def _tensor_args(node: fx.Node) -> List[str]:
    names: List[str] = []
    for a in node.all_input_nodes:
        if a.name not in names:
            names.append(a.name)
    return names


def graph_node_infos(gm: fx.GraphModule, display: Optional[Dict[str, str]] = None) -> Tuple[List[NodeInfo], Dict[str, int]]:
    """A NodeInfo per placeholder/get_attr/compute node, and node name -> index."""
    display = display or {}
    infos: List[NodeInfo] = []
    index: Dict[str, int] = {}
    # node -> the records that hold what its memory holds after in-place writes (a dynamo graph's ``y.add_(x)``,
    # ``y[:, :8] = v``, ``torch._foreach_mul_([y], 2)``: later readers of ``y`` name ``y``'s node, yet read what the
    # writes left).  A write of the whole tensor replaces them; a write through a view of it adds to them.
    written: Dict[str, Tuple[str, ...]] = {}
    placeholders: set = set()
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        if n.op == "placeholder":
            placeholders.add(n.name)
            kind = "param" if n.name in display else "input"
            info = NodeInfo(node=display.get(n.name, n.name), op="input", kind=kind,
                            extra={"placeholder": n.name} if n.name in display else None)
        elif n.op == "get_attr":
            info = NodeInfo(node=n.name, op="get_attr", kind="param", extra={"attr": str(n.target)})
        else:
            ins = tuple(w for a in _tensor_args(n) for w in written.get(a, (display.get(a, a),)))
            # an async collective's value is not read (it may still be in flight): like a view, it is judged
            # through its neighbours, here the wait_tensor that returns it complete
            kind = "view" if is_view(n) or _is_async_collective(n) else (
                "multi" if _is_sequence_valued(n) and held_written(n) is None else "node")  # a foreach_ op's writes
            op = op_name(n)
            src = n.args[0] if n.target is operator.getitem and n.args and isinstance(n.args[0], fx.Node) else None
            if src is not None and src.name in index and infos[index[src.name]].kind in ("multi", "view"):
                # an element of a multi-output op: judged against that op's own inputs
                parent = infos[index[src.name]]
                ins, op, kind = parent.inputs, f"{parent.op}[{n.args[1]}]", parent.kind if parent.kind == "view" else "node"
            info = NodeInfo(node=n.name, op=op, kind=kind, source=node_source(n), inputs=ins,
                            extra=_meta_extra(n) if kind != "node" else None)
        index[n.name] = len(infos)
        infos.append(info)
        if n.op in ("call_function", "call_method"):
            for rec, base, whole in _writes(n):
                written[base.name] = (rec,) if whole else written.get(base.name, (display.get(base.name, base.name),)) + (rec,)
    _mark_outputs(gm, infos, index)
    for ph in placeholders & written.keys():  # what each input holds after the call: what the program sees
        for name in written[ph]:
            i = index.get(name.rsplit(".", 1)[0] if name not in index else name)
            if i is not None and infos[i].op != "input":
                infos[i] = dataclasses.replace(infos[i], extra=dict(infos[i].extra or {}, writes_input=display.get(ph, ph)))
    return infos, index


_INPLACE_OPERATORS = frozenset({operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                                operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior,
                                operator.ixor, operator.ilshift, operator.irshift})


def _is_tensor_node(n: Any) -> bool:
    if not isinstance(n, fx.Node):
        return False
    val = n.meta.get("val", n.meta.get("example_value"))
    return val is None or isinstance(val, torch.Tensor)  # a graph without values: taken at its word


def written_args(n: fx.Node) -> List[fx.Node]:
    """The tensors ``n`` writes in place, as ``n`` names them (a view of another node's memory included): an
    in-place op or method (``acc.add_(x)``, ``torch.relu_``, a functionalized graph's ``copy_`` back into an input),
    ``out=``, ``inplace=True`` (``F.relu(y, inplace=True)``, ``nn.ReLU(inplace=True)``), an augmented assignment
    (``y += x``), an item assignment (``y[:, :8] = v``), an in-place foreach op
    (``torch._foreach_mul_([a, b], 2)``: each tensor of its first list)."""
    t = n.target
    out = n.kwargs.get("out")
    if isinstance(out, fx.Node):  # ``torch.add(a, b, out=acc)``
        return [out]
    if isinstance(out, (list, tuple)):
        return [o for o in out if isinstance(o, fx.Node)]
    if n.op == "call_function" and not _torch_compat.is_op_overload(t):
        inplace = _inplace_call(n)  # ``F.relu(y, inplace=True)``, ``F.elu(y, 1.0, True)`` (``nn.ELU(inplace=True)``)
        if inplace is not None:
            return [inplace]
    if not n.args:
        return []
    first = n.args[0]
    if n.op == "call_function" and _torch_compat.is_op_overload(t):
        schema = _torch_compat.op_schema(t)
        args = schema.arguments if schema is not None else ()
        if not args or args[0].alias_info is None or not args[0].alias_info.is_write:
            return []
    elif n.op == "call_function" and (t is operator.setitem or t in _INPLACE_OPERATORS):
        if not _is_tensor_node(first):  # ``n += 1`` of a size
            return []
    elif n.op == "call_method" or (n.op == "call_function" and getattr(t, "__module__", "") == "torch"):
        name = t if isinstance(t, str) else getattr(t, "__name__", "")
        if not name.endswith("_") or name.endswith("__"):  # the in-place convention (``add_``, ``_foreach_mul_``)
            return []
    else:
        return []
    items = first if isinstance(first, (list, tuple)) else (first,)
    return [a for a in items if _is_tensor_node(a)]


@functools.lru_cache(maxsize=None)
def _signature(fn: Any) -> Optional[inspect.Signature]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    return sig if "inplace" in sig.parameters else None


def _inplace_call(n: fx.Node) -> Optional[fx.Node]:
    """The tensor a call with ``inplace=True`` writes (its first parameter), however the flag and the tensor are
    passed (``nn.ELU(inplace=True)`` reaches the graph as ``F.elu(y, 1.0, True)``); None otherwise."""
    try:
        sig = _signature(n.target)
    except TypeError:  # an unhashable target
        return None
    if sig is None:
        return None
    try:
        bound = sig.bind(*n.args, **n.kwargs)
    except TypeError:
        return None
    if bound.arguments.get("inplace") is not True:
        return None
    target = bound.arguments.get(next(iter(sig.parameters)))
    return target if _is_tensor_node(target) else None


def held_written(n: fx.Node) -> Optional[Any]:
    """For a writing node whose own value is not what it wrote, the argument that holds it: an item assignment's
    tensor (``y[:, :8] = v`` evaluates to None), the list of tensors an in-place foreach or fused op writes
    (``torch._foreach_mul_([a, b], 2)``, ``torch._fused_adamw_(params, ...)``: None).  None for any other node."""
    if n.op != "call_function" or not n.args:
        return None
    first = n.args[0]
    if n.target is operator.setitem:
        return first if _is_tensor_node(first) else None
    if isinstance(first, (list, tuple)) and written_args(n):
        return first
    return None


def _writes(n: fx.Node) -> List[Tuple[str, fx.Node, bool]]:
    """``(record name, base node, whole)`` per tensor ``n`` writes: the record holding the written value (``n``, or
    ``n.j`` for the j-th tensor of a foreach op), the node whose memory it is (:func:`_memory_base`) and whether the
    write covers all of it (not through a view)."""
    many = isinstance(held_written(n), (list, tuple))
    return [(f"{n.name}.{j}" if many else n.name, _memory_base(a), _memory_base(a) is a)
            for j, a in enumerate(written_args(n))]


def _basic_index(idx: Any) -> bool:
    """An index ``x[idx]`` that views ``x`` (ints, slices, None, Ellipsis), not one that copies (a tensor, a list)."""
    parts = idx if isinstance(idx, tuple) else (idx,)
    return all(p is None or p is Ellipsis or isinstance(p, (int, slice)) for p in parts)


def _memory_base(node: fx.Node) -> fx.Node:
    """The node whose memory ``node`` is, or views (through view ops and basic indexing, ``acc[0]``,
    ``acc[:, :8]``)."""
    base = node
    while base.op != "placeholder" and base.args and isinstance(base.args[0], fx.Node) and (
            is_view(base) or (base.target is operator.getitem and len(base.args) > 1 and _basic_index(base.args[1]))):
        base = base.args[0]
    return base


def written_inputs(gm: fx.GraphModule) -> Dict[str, fx.Node]:
    """Graph input name -> the last node writing it in place (:func:`written_args`).  What it holds then is what
    the program sees after the call, as much as a returned value: the causal rule takes it for a symptom
    (``extra.writes_input``), so a wrong value reaching only a mutated input or buffer (a compiled optimizer step,
    running statistics, ``acc.add_``) is a finding, not a masked note."""
    last: Dict[str, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method"):
            for _, base, _ in _writes(n):
                if base.op == "placeholder":
                    last[base.name] = n
    return last


def _mark_outputs(gm: fx.GraphModule, infos: List[NodeInfo], index: Dict[str, int]) -> None:
    """``extra["outputs"]``: the positions at which the graph returns a node (the causal rule's symptoms)."""
    out = next((n for n in reversed(gm.graph.nodes) if n.op == "output"), None)
    if out is None or not out.args:
        return
    leaves: List[Any] = []
    fx.node.map_aggregate(out.args[0], leaves.append)
    for k, leaf in enumerate(leaves):
        if isinstance(leaf, fx.Node) and leaf.name in index:
            info = infos[index[leaf.name]]
            extra = dict(info.extra or {})
            extra["outputs"] = list(extra.get("outputs", ())) + [k]
            infos[index[leaf.name]] = dataclasses.replace(info, extra=extra)


def _meta_extra(n: fx.Node) -> Optional[dict]:
    val = n.meta.get("val", n.meta.get("example_value"))
    if isinstance(val, torch.Tensor):
        static = all(isinstance(s, int) for s in val.shape)  # a dynamic graph's sizes change from call to call
        return {"dtype": dtype_name(val.dtype), "shape": [int(s) for s in val.shape] if static else None}
    return None


def uses_functorch(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` runs ``torch.func`` transforms (a Dynamo graph of ``vmap`` or ``grad``): inside them its values
    are wrappers with no memory of their own."""
    return any(n.op == "call_function" and _torch_compat.uses_functorch(n.target) for n in gm.graph.nodes)


def instrument_graph(gm: fx.GraphModule, recorder: Recorder, index: Dict[str, int]) -> fx.GraphModule:
    """A copy of ``gm`` that calls ``recorder.capture(i, value)`` after every node in ``index``."""
    new = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    g = new.graph
    nodes = list(g.nodes)
    capture = recorder.capture_unwrapped if uses_functorch(gm) else recorder.capture  # a vmap's values are wrappers
    placeholders = [n for n in nodes if n.op == "placeholder"]
    anchor = placeholders[-1] if placeholders else None
    if anchor is None:
        with g.inserting_before(nodes[0]):
            g.call_function(recorder.begin_call, ())
    else:
        with g.inserting_after(anchor):
            last = g.call_function(recorder.begin_call, ())
        for p in placeholders:
            if p.name in index:
                with g.inserting_after(last):
                    last = g.call_function(capture, (index[p.name], p))
    for n in nodes:
        if n.op in ("output", "placeholder") or n.name not in index:
            continue
        if recorder.infos[index[n.name]].kind in ("view", "multi"):
            continue  # views follow from their input; tuple values are captured by their getitem users
        held = held_written(n)  # an item assignment, an in-place foreach op: their value is what they wrote
        with g.inserting_after(n):
            g.call_function(capture, (index[n.name], n if held is None else held))
    new.recompile()
    return new
