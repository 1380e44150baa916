"""Where and how far a graph is compiled: ``DETERM_DEVICE`` and ``DETERM_BISECT_STAGE``.

* :func:`on_device` runs a Dynamo graph on another device spec (``cuda:0``,
  ``cpu:float64``, ...): the graph's inputs (parameters included: Dynamo lifts
  them), constants and submodules are moved and cast before compiling and on
  every call, and outputs return to the device and dtype the graph produced
  originally, with autograd intact.  ``repro-tools xdevice`` runs a user script
  once per device this way.  Input mutations land on the moved copies.  The
  moved example inputs keep the shape symbols Dynamo gave the originals, so
  AOTAutograd traces them as those inputs (not as unknown tensors with
  dynamic sizes no guard can name).
* :func:`stage_scope` and :func:`scoped_wrap`: under ``DETERM_BISECT_STAGE`` a
  determ backend compiles through that stage of the stack (see
  :data:`~determ_backend.config.STAGES`) and torch's ``CompilerBisector`` hooks
  (passes, lowerings, decompositions, config changes) are scoped to it, so
  ``repro-tools bisect`` can bisect inside the stage while determ's tracing and
  checks stay in place.  The bisection itself lives in :mod:`repro_tools.bisect.core`.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from determ_backend import _torch_compat, devices
from determ_backend.backends.instrument import OP_NAME

__all__ = ["on_device", "Converter", "converter", "moved_graph", "widen_casts", "widened", "stage_scope", "scoped_wrap"]


_COMPLEX_OF = {torch.float64: torch.complex128, torch.float32: torch.complex64, torch.float16: torch.complex32}


def widened(d: Any, dtype: torch.dtype) -> Any:
    """``d`` widened to floating ``dtype``: a narrower floating dtype becomes ``dtype``, a narrower complex one the
    complex dtype of ``dtype``'s precision (``complex64`` -> ``complex128`` for float64); anything else as is."""
    if not isinstance(d, torch.dtype):
        return d
    if d.is_floating_point:
        return dtype if torch.finfo(d).bits < torch.finfo(dtype).bits else d
    if d.is_complex and dtype in _COMPLEX_OF and d.itemsize < _COMPLEX_OF[dtype].itemsize:
        return _COMPLEX_OF[dtype]
    return d


class Converter(NamedTuple):
    """Moves values to one device spec: ``conv(value)`` puts a tensor on ``device``, a floating one cast to
    ``dtype`` when the spec names one; any other value is returned as is."""

    device: str
    dtype: Optional[torch.dtype]

    def __call__(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        want = t.dtype
        if self.dtype is not None and t.is_floating_point():
            want = self.dtype
        elif self.dtype is not None and t.is_complex():  # widened to the spec's precision (cpu:float64), never narrowed
            want = widened(t.dtype, self.dtype)
        return t.to(device=self.device, dtype=want)


def converter(spec: str) -> Converter:
    """The :class:`Converter` to device spec ``spec`` (``"cuda"``, ``"cpu:float64"``, ...).
    Raises :class:`~determ_backend.errors.DeviceUnavailableError` when the device is absent."""
    dev, dtype = devices.parse_device_spec(spec)
    devices.require(dev)
    return Converter(dev, dtype)


_TO_METHODS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}


def widen_casts(graph: fx.Graph, dtype: torch.dtype) -> None:
    """Every floating dtype the nodes of ``graph`` name that is narrower than ``dtype`` becomes ``dtype``, in
    place: the model's casts (``.to(float32)``, ``.float()``, ``softmax(dtype=float32)``, ``convert_element_type``,
    ``_to_copy``) and the dtypes of the tensors it creates (``full(..., dtype=float32)``).  On a ``cpu:float64``
    side, or in a float64 reference, a value cast back to float32 met float64 ones in a matmul, which does not
    promote (every Hugging Face eager attention), and a float32 buffer refused float64 values (``index_put``).
    Casts to a wider dtype stay (a bfloat16 run's float32 softmax); so do bit views (``.view(dtype)``), but for
    the views between a complex tensor and its real pairs (``view_as_real``, ``view_as_complex`` as AOT writes them:
    ``view.dtype(complex64, float32)``), whose both sides are widened: complex values read as float32 pairs met
    float64 ones (every rotary embedding's backward)."""
    def widen(v: Any) -> Any:
        return widened(v, dtype) if isinstance(v, torch.dtype) and v.is_floating_point else v

    for n in graph.nodes:
        if _is_complex_pair_view(n):
            n.args = (n.args[0], widened(n.args[1], dtype), *n.args[2:])
            continue
        if n.op == "call_method" and n.target in _TO_METHODS and len(n.args) == 1 and not n.kwargs:
            if widen(_TO_METHODS[n.target]) is dtype:  # recorded under the model's op (op_name), so that the two
                n.meta[OP_NAME] = f"Tensor.{n.target}"  # sides' records of the cast pair by their signature
                n.target, n.args = "to", (n.args[0], dtype)
            continue
        if n.op not in ("call_function", "call_method"):
            continue
        if isinstance(n.kwargs.get("dtype"), torch.dtype):
            n.kwargs = {**n.kwargs, "dtype": widen(n.kwargs["dtype"])}
        if n.op == "call_method" and n.target in ("to", "type"):
            n.args = tuple(widen(a) for a in n.args)
        elif n.op == "call_function" and "convert_element_type" in str(n.target) and len(n.args) > 1:
            n.args = (n.args[0], widen(n.args[1]), *n.args[2:])


def _is_complex_pair_view(n: fx.Node) -> bool:
    """``view.dtype`` between a complex dtype and a real floating one (either way)."""
    if n.op != "call_function" or "view.dtype" not in str(n.target) or len(n.args) < 2:
        return False
    src = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
    to = n.args[1]
    if not isinstance(src, torch.Tensor) or not isinstance(to, torch.dtype):
        return False
    return (src.dtype.is_complex and to.is_floating_point) or (src.dtype.is_floating_point and to.is_complex)


def moved_graph(gm: fx.GraphModule, conv: Converter) -> fx.GraphModule:
    """A copy of ``gm`` whose constants and submodules live on ``conv``'s device and dtype; the model's casts to
    a narrower floating dtype are widened to ``conv.dtype``."""
    owned: Dict[str, Any] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            value = _torch_attr(gm, n.target)
            owned[n.target] = conv(value.detach()) if isinstance(value, torch.Tensor) else value
        elif n.op == "call_module":
            owned[n.target] = _move_module(copy.deepcopy(gm.get_submodule(n.target)), conv)
    graph = copy.deepcopy(gm.graph)
    if conv.dtype is not None:
        widen_casts(graph, conv.dtype)
    new = fx.GraphModule(owned, graph, class_name=type(gm).__name__)
    new.meta.update(getattr(gm, "meta", {}))
    return new


def _torch_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _move_module(mod: torch.nn.Module, conv: Callable[[Any], Any]) -> torch.nn.Module:
    with torch.no_grad():
        for p in list(mod.parameters()) + list(mod.buffers()):
            p.data = conv(p.data)
    return mod


def _output_targets(gm: fx.GraphModule) -> List[Optional[Tuple[torch.dtype, torch.device]]]:
    """(dtype, device) of each graph output as Dynamo traced it (None where unknown)."""
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = out_node.args[0]
    outs = outs if isinstance(outs, (list, tuple)) else [outs]
    targets: List[Optional[Tuple[torch.dtype, torch.device]]] = []
    for o in outs:
        val = o.meta.get("example_value", o.meta.get("val")) if isinstance(o, fx.Node) else None
        targets.append((val.dtype, val.device) if isinstance(val, torch.Tensor) else None)
    return targets


def _back(out: Any, targets: Sequence[Optional[Tuple[torch.dtype, torch.device]]]) -> Any:
    """Outputs moved back to where the original graph produced them."""
    if not isinstance(out, (list, tuple)):
        return _back([out], targets)[0]
    padded = list(targets) + [None] * (len(out) - len(targets))
    moved = [o.to(device=t[1], dtype=t[0]) if t is not None and isinstance(o, torch.Tensor) else o
             for o, t in zip(out, padded)]
    return tuple(moved) if isinstance(out, tuple) else moved


def on_device(spec: str, compile_fn: Callable, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """Compile ``gm`` with ``compile_fn(gm, inputs)`` on device spec ``spec``; the result takes and
    returns values on the original devices and dtypes."""
    conv = converter(spec)
    targets = _output_targets(gm)
    moved = [conv(x) for x in example_inputs]
    for x, m in zip(example_inputs, moved):  # AOTAutograd must see the inputs' own shape symbols
        if isinstance(x, torch.Tensor):
            _torch_compat.share_symbolic_context(x, m)
    compiled = compile_fn(moved_graph(gm, conv), moved)

    def run(*args: Any) -> Any:
        return _back(compiled(*[conv(a) for a in args]), targets)

    return run


@contextlib.contextmanager
def stage_scope(stage: str) -> Iterator[None]:
    """Torch's bisector hooks see ``stage`` as the backend under bisection; inductor config
    changes the bisector asks for are applied."""
    with _torch_compat.bisector_stage_scope(stage) as changes:
        if changes and stage == "inductor":
            with _torch_compat.inductor_config_patch(changes):
                yield
        else:
            yield


def scoped_wrap(stage: str, wrap: Optional[Callable] = None) -> Callable:
    """A ``wrap_compiler`` for the backends: inner compilers (also a backward graph compiled
    lazily, outside the outer compile) run inside :func:`stage_scope`."""

    def wrap_compiler(compiler: Callable, name: str) -> Callable:
        inner = wrap(compiler, name) if wrap is not None else compiler

        def scoped(*args: Any, **kwargs: Any) -> Any:
            with stage_scope(stage):
                return inner(*args, **kwargs)

        return scoped

    return wrap_compiler
