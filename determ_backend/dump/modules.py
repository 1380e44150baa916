"""Records that are not single torch API calls, and installing/removing all dump hooks.

* **Regions recorded as a whole**: a ``torch.compile``d module runs as one
  compiled graph the API hooks cannot see into, so it is recorded as one entry
  ``Compiled_<name>_<n>_forward`` (and ``_backward``) marked ``"opaque": true``,
  with the region's inputs and outputs -- never silently missing.  A module
  passed to ``module_dump(module, name)`` is recorded the same way as
  ``<name>_<n>_forward`` (not marked opaque).
* **Collectives** (``torch.distributed.all_reduce``...): they bypass
  ``__torch_function__``, so they are wrapped while a dump is on; the records are
  named ``Distributed_all_reduce_<n>_forward``; the tensor's value before the call is
  the input, after it the output.
* **Parameters**: before every ``optimizer.step()`` (a global optimizer pre-hook)
  each registered model's parameters (``Parameter_<name>_<step>_forward``) and
  gradients (``..._backward``) are recorded -- after any data-parallel all-reduce,
  so replicas must agree on them bit for bit (``repro-tools ranks``).

:class:`Installation` applies all of this and undoes it in :meth:`Installation.remove`.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from .. import _torch_compat
from . import backward as bw
from .apis import DISTRIBUTED_APIS, ApiInfo
from .entries import call_items, flatten, output_items
from .hooks import DumpMode, Recorder, enter_opaque, exit_opaque, guard, passthrough, user_source, user_stack

__all__ = ["Installation", "compiled_modules", "OPAQUE_NOTE"]

log = logging.getLogger(__name__)

OPAQUE_NOTE = ("torch.compile region: the ops inside are not visible to API hooks; compile with a determ backend "
               "(determ_aot_eager / determ_inductor) for per-node traces")
_NO_OUTPUT = frozenset({"send", "isend", "barrier", "gather"})


def compiled_modules(model: torch.nn.Module) -> List[tuple]:
    """``[(name, module)]`` of compiled modules in ``model`` (outermost only)."""
    found: List[tuple] = []
    covered: List[str] = []
    for name, m in model.named_modules():
        if any(name == c or name.startswith(c + ".") for c in covered):
            continue
        if _torch_compat.is_compiled_module(m):
            found.append((name or type(m).__name__, m))
            covered.append(name)
            if name == "":
                break
    return found


class _RegionHooks:
    """Forward pre/post hooks that record one module call as a single entry."""

    def __init__(self, recorder: Recorder, info: ApiInfo, opaque: bool):
        self.rec, self.info, self.opaque = recorder, info, opaque
        self._stack: List[Any] = []

    def pre(self, module, args, kwargs):
        if passthrough() or torch.compiler.is_compiling():
            self._stack.append(None)
            return None
        with guard():
            call = f"{self.info.key}_{self.rec.session.next_call(self.info.key)}"
            items = call_items(args, kwargs)
            bwd = self.rec.overflow is None and self.rec.selector.may_backward(call, self.info) and torch.is_grad_enabled()
            # the region's own parameters count as inputs of its backward record (their gradients are outputs)
            params = [(f"input.{n.replace('_orig_mod.', '')}", p) for n, p in module.named_parameters()]
            edges = bw.prepare(items + params) if bwd else None
            min_seq = bw.sequence_probe() if edges and edges[0] else None
            stack = user_stack() if self.rec.settings.with_stack else None
            self._stack.append((call, edges, min_seq, user_source(), stack))
        enter_opaque()
        return None

    def post(self, module, args, kwargs, output):
        state = self._stack.pop() if self._stack else None
        if state is None:
            return None
        exit_opaque()
        call, edges, min_seq, source, stack = state
        extra = {"opaque": True, "note": OPAQUE_NOTE} if self.opaque else {"module": True}
        with guard():
            items = call_items(args, kwargs)
            outs = output_items(output)
            if self.rec.overflow is None and self.rec.selector.select(call, self.info, "forward"):
                ins, outs_e = self.rec.describe_io(items, outs)
                self.rec.write(call, self.info, "forward", ins, outs_e, source, stack, **extra)
            if edges and edges[0]:
                self.rec._attach(call, self.info, edges, outs, source, stack, min_seq, **extra)
        return None


def _dist_wrapper(rec: Recorder, name: str, orig: Callable) -> Callable:
    info = ApiInfo("Distributed", name)

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling() or passthrough():
            return orig(*args, **kwargs)
        call = f"{info.key}_{rec.session.next_call(info.key)}"
        if rec.overflow is not None or not rec.selector.select(call, info, "forward"):
            return orig(*args, **kwargs)
        with guard():
            items = call_items(args, kwargs)
            ins = rec.describe(items, "input")
            source = user_source()
        work = orig(*args, **kwargs)
        with guard():
            rec.session.cache.forget(items)
            if kwargs.get("async_op") and work is not None:
                work.wait()  # the output is only defined once the collective completed
            out: List[tuple] = []
            if name == "gather":
                gl = kwargs.get("gather_list", args[1] if len(args) > 1 else None)
                out = flatten(gl, "output") if gl is not None else []
            elif name not in _NO_OUTPUT and args:
                out = output_items(args[0])
            rec.write(call, info, "forward", ins, rec.describe(out, "output"), source)
        return work

    return wrapper


class Installation:
    """Everything one dump switches on: the API mode, region hooks, collective wrappers, parameter hook."""

    def __init__(self, recorder: Recorder, models: Sequence[torch.nn.Module] = (),
                 regions: Sequence[tuple] = ()):
        self.rec = recorder
        self.models = [weakref.ref(m) for m in models]
        self._mode: Optional[DumpMode] = None
        self._handles: List[Any] = []
        self._patched: Dict[str, Callable] = {}
        self._step = 0
        try:
            self._install_regions(models, regions)
            self._install_dist()
            if models and recorder.overflow is None:
                from torch.optim.optimizer import register_optimizer_step_pre_hook

                self._handles.append(register_optimizer_step_pre_hook(self._before_step))
            self._mode = DumpMode(recorder)
            self._mode.__enter__()
        except BaseException:
            self.remove()
            raise

    def _install_regions(self, models, regions) -> None:
        targets = [(f"Compiled_{n}", m, True) for model in models for n, m in compiled_modules(model)]
        targets += [(label, m, False) for label, m in regions]
        for label, m, opaque in targets:
            hooks = _RegionHooks(self.rec, ApiInfo("", label), opaque)
            self._handles.append(m.register_forward_pre_hook(hooks.pre, with_kwargs=True))
            self._handles.append(m.register_forward_hook(hooks.post, with_kwargs=True, always_call=True))

    def _install_dist(self) -> None:
        dist = torch.distributed
        if not dist.is_available():
            return
        for name in DISTRIBUTED_APIS:
            orig = getattr(dist, name, None)
            if orig is not None:
                self._patched[name] = orig
                setattr(dist, name, _dist_wrapper(self.rec, name, orig))

    def _before_step(self, optimizer, args, kwargs) -> None:
        if passthrough():
            return
        self.snapshot_parameters()

    def snapshot_parameters(self) -> None:
        """Record every registered model's parameters and gradients now."""
        step = self._step
        self._step += 1
        with guard():
            for ref in self.models:
                model = ref()
                if model is None:
                    continue
                for pname, p in model.named_parameters():
                    info = ApiInfo("Parameter", pname)
                    call = f"{info.key}_{step}"
                    for direction, value in (("forward", p), ("backward", p.grad)):
                        if value is not None and self.rec.selector.select(call, info, direction):
                            self.rec.write(call, info, direction, [],
                                           self.rec.describe([("output", value.detach())], "output"))

    def remove(self) -> None:
        """Undo everything (safe to call twice)."""
        if self._mode is not None:
            try:
                self._mode.__exit__(None, None, None)
            finally:
                self._mode = None
        for h in self._handles:
            h.remove()
        self._handles = []
        dist = torch.distributed
        for name, orig in self._patched.items():
            setattr(dist, name, orig)
        self._patched = {}
