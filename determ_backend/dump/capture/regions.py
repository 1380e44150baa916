"""Regions recorded as a whole: calls of ``torch.compile``d modules and functions, and ``module_dump`` modules.

A region call is one entry ``<label>_<n>_forward`` (and ``_backward``) with the
region's inputs and outputs; the API hooks see nothing inside it
(:func:`.hooks.enter_opaque`).  Region calls start and end

* in forward hooks on the compiled submodules of registered models
  (``Compiled_<name>_<n>``) and on ``module_dump`` modules (``<name>_<n>``);
* at dynamo's entry point for every other compiled callable: free functions
  (``Compiled_<function>_<n>``) and compiled modules that were not registered
  (``Compiled_<class>_<n>``), through
  :func:`determ_backend._torch_compat.observe_compiled_calls`.

Inside a compiled region the determ backends trace every FX node; :mod:`.compiled`
writes those as entries of the region (``Compiled_f_0.aot_forward.addmm_forward``)
and counts them in the :class:`RegionCall`.  A compiled region without such
entries (a plain backend, or tracing off) is marked ``"opaque": true`` with a
note saying how to see inside it.
"""

from __future__ import annotations

import inspect
import re
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from determ_backend import _torch_compat
from determ_backend.dump.capture import backward as bw
from determ_backend.dump.capture.apis import ApiInfo
from determ_backend.dump.capture.entries import call_items, output_items
from determ_backend.dump.capture.hooks import (ApiRecorder, enter_opaque, exit_opaque, passthrough, user_source, user_stack, guard)

__all__ = ["RegionCall", "Regions", "ModuleRegion", "OPAQUE_NOTE", "callable_label"]

OPAQUE_NOTE = ("torch.compile region: the ops inside are not visible to API hooks; compile with a determ backend "
               "(determ_aot_eager / determ_inductor) for per-node traces")
_NO_BACKWARD_NOTE = ("torch.compile region: its forward graphs were traced but no backward graph ran through a "
                     "determ backend (determ_eager traces forward graphs only; use determ_aot_eager or "
                     "determ_inductor to see backward nodes)")

Params = Callable[[], List[Tuple[str, torch.Tensor]]]


class RegionCall:
    """One call of a region: its name and what the determ backends traced inside it."""

    def __init__(self, call: str, info: ApiInfo, compiled: bool, source: Optional[str] = None):
        self.call, self.info, self.compiled = call, info, compiled
        self.source = source
        """The user line that called the region."""
        self.nodes: Dict[str, int] = {"forward": 0, "backward": 0}
        self.graphs: Dict[str, int] = {}
        self._graph_calls: Dict[Tuple[str, str], int] = {}

    def graph_prefix(self, graph: str, stage: str) -> Tuple[str, int, int]:
        """``(name prefix, graph index, call index)`` for one traced call of ``graph``/``stage`` in this region:
        ``Compiled_m_0.aot_forward``; ``.graph1`` for its second graph, ``#1`` for a second call of a graph."""
        index = self.graphs.setdefault(graph, len(self.graphs))
        n = self._graph_calls.get((graph, stage), 0)
        self._graph_calls[(graph, stage)] = n + 1
        prefix = self.call + (f".graph{index}" if index else "") + f".{stage}" + (f"#{n}" if n else "")
        return prefix, index, n

    def extra(self, direction: str) -> Dict[str, Any]:
        """Fields of the region's own entry: node count, or the opaque mark and its note."""
        n = self.nodes[direction]
        if not self.compiled:
            return {"module": True, "nodes": n} if n else {"module": True}
        if n:
            return {"compiled": True, "nodes": n}
        other = self.nodes["forward" if direction == "backward" else "backward"]
        return {"compiled": True, "opaque": True, "note": _NO_BACKWARD_NOTE if other else OPAQUE_NOTE}


class _Open:
    __slots__ = ("region", "items", "edges", "min_seq", "source", "stack", "suspended", "first")

    def __init__(self, region: RegionCall, items, edges, min_seq, source, stack, first: int = 0):
        self.region, self.items, self.edges, self.min_seq = region, items, edges, min_seq
        self.source, self.stack = source, stack
        self.suspended = False
        self.first = first  # ``seq`` of the first entry written inside the call


class Regions:
    """Region calls of one dump: begin/end recording, the open regions of each thread, and which region
    each traced graph belongs to (its backward records arrive after the region's forward has ended)."""

    def __init__(self, recorder: ApiRecorder):
        self.rec = recorder
        self._tls = threading.local()
        self.by_graph: Dict[str, RegionCall] = {}
        self.mode: Optional[Any] = None
        """The dump's torch function mode: taken off the stack inside a region, so dynamo neither traces
        through it nor recompiles because of it, and the source lines of compiled nodes stay the user's."""

    def _open(self) -> List[_Open]:
        return self._tls.__dict__.setdefault("open", [])

    def current(self) -> Optional[RegionCall]:
        """The innermost region call open in this thread."""
        stack = self._open()
        return stack[-1].region if stack else None

    def begin(self, info: ApiInfo, args: tuple, kwargs: Dict[str, Any], params: Params, compiled: bool,
              opaque: bool = True) -> Optional[_Open]:
        """Start a region call (None when already inside a region or the dump machinery).  ``opaque=False``:
        a module boundary of level ``L0``/``mix``, recorded around whatever is recorded inside it."""
        if passthrough() or torch.compiler.is_compiling():
            return None
        rec = self.rec
        with guard():
            call = f"{info.key}_{rec.session.next_call(info.key)}"
            items = call_items(args, kwargs)
            bwd = rec.overflow is None and rec.selector.may_backward(call, info) and torch.is_grad_enabled()
            # the region's own parameters count as inputs of its backward record (their gradients are outputs)
            edges = bw.prepare(items + params()) if bwd else None
            min_seq = bw.sequence_probe() if edges and edges[0] else None
            stack = user_stack() if rec.settings.with_stack else None
            source = user_source()
            state = _Open(RegionCall(call, info, compiled, source), items, edges, min_seq, source, stack,
                          rec.session.seq)
        if opaque:
            self._open().append(state)
            enter_opaque()
            state.suspended = self.mode is not None and _torch_compat.suspend_function_mode(self.mode)
        return state

    def _leave(self, state: _Open) -> None:
        stack = self._open()
        if state in stack:
            stack.remove(state)
            exit_opaque()
        if state.suspended:
            state.suspended = False
            _torch_compat.resume_function_mode(self.mode)

    def end(self, state: Optional[_Open], output: Any) -> None:
        """Finish a region call: its forward entry now, its backward entry when the gradients flow."""
        if state is None:
            return
        self._leave(state)
        rec, region = self.rec, state.region
        with guard():
            outs = output_items(output)
            if rec.overflow is None and rec.selector.select(region.call, region.info, "forward"):
                ins, outs_e = rec.describe_io(state.items, outs)
                extra = region.extra("forward")
                if extra.get("module") and rec.session.seq > state.first:  # a module boundary around entries of its own
                    extra["first"] = state.first
                rec.write(region.call, region.info, "forward", ins, outs_e, state.source, state.stack, **extra)
            if state.edges and state.edges[0]:
                began: Dict[str, int] = {}  # ``seq`` when the region's backward began: its gradients arrived

                def backward_extra() -> Dict[str, Any]:
                    extra = region.extra("backward")
                    # a module boundary around the backward entries of its inner calls, as its forward entry is
                    first = began.get("seq")
                    if extra.get("module") and first is not None and rec.session.seq > first:
                        extra["first"] = first
                    return extra

                rec._attach(region.call, region.info, state.edges, outs, state.source, state.stack, state.min_seq,
                            extra=backward_extra, on_start=lambda: began.setdefault("seq", rec.session.seq))

    def close(self) -> None:
        """Leave the regions still open in this thread (a dump switched off inside a region)."""
        stack = self._open()
        while stack:
            self._leave(stack[-1])

    # ---- compiled callables seen at dynamo's entry point ---------------------------------------
    def install_observer(self) -> Optional[Callable[[], None]]:
        """Record calls of compiled callables that no hook covers; returns the undo function."""
        return _torch_compat.observe_compiled_calls(self._enter_compiled, self._exit_compiled)

    def _enter_compiled(self, fn: Any, args: tuple, kwargs: Dict[str, Any]) -> Optional[_Open]:
        if passthrough():
            return None
        label, module = callable_label(fn)
        params: Params = (lambda: [(f"input.{n}", p) for n, p in module.named_parameters()]) if module is not None \
            else list
        return self.begin(ApiInfo("", f"Compiled_{label}"), args, kwargs, params, compiled=True)

    def _exit_compiled(self, state: _Open, result: Any, ok: bool) -> None:
        self.end(state, result if ok else None)


def callable_label(fn: Any) -> Tuple[str, Optional[torch.nn.Module]]:
    """A readable name for a compiled callable (function name, or module class) and its module if any."""
    target = fn
    try:
        target = inspect.unwrap(fn)
    except ValueError:  # a cycle of __wrapped__
        pass
    owner = getattr(target, "__self__", None)
    module = target if isinstance(target, torch.nn.Module) else owner if isinstance(owner, torch.nn.Module) else None
    if module is not None:
        return type(module).__name__, module
    name = getattr(target, "__name__", None) or type(target).__name__
    return re.sub(r"\W+", "_", name).strip("_") or "function", None


class ModuleRegion:
    """Forward pre/post hooks that record each call of one module as a region call; ``opaque=False`` for the
    module boundaries of levels ``L0``/``mix`` (what runs inside stays visible)."""

    def __init__(self, regions: Regions, info: ApiInfo, compiled: bool, opaque: bool = True):
        self.regions, self.info, self.compiled, self.opaque = regions, info, compiled, opaque
        self._stack: List[Optional[_Open]] = []

    def pre(self, module, args, kwargs):
        params = lambda: [(f"input.{n.replace('_orig_mod.', '')}", p) for n, p in module.named_parameters()]
        self._stack.append(self.regions.begin(self.info, args, kwargs, params, self.compiled, self.opaque))
        return None

    def post(self, module, args, kwargs, output):
        self.regions.end(self._stack.pop() if self._stack else None, output)
        return None
