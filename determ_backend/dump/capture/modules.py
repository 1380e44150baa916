"""Installing and removing all dump hooks; records that are not single torch API calls.

* **Regions recorded as a whole** (:mod:`.regions`): a ``torch.compile``d module
  or function is one entry ``Compiled_<name>_<n>_forward`` (and ``_backward``)
  with the region's inputs and outputs -- never silently missing.  With a
  determ backend its FX nodes follow as entries of their own (:mod:`.compiled`);
  with another backend it is marked ``"opaque": true`` with a note.  A module
  passed to ``module_dump(module, name)`` is recorded as ``<name>_<n>_forward``.
* **Collectives** (``torch.distributed.all_reduce``...): they bypass
  ``__torch_function__``, so they are wrapped while a dump is on; the records are
  named ``Distributed_all_reduce_<n>_forward``; the tensor's value before the call is
  the input, after it the output.
* **Module boundaries** (levels ``L0`` and ``mix``): every submodule of a registered
  model is recorded around its calls, ``Module_<path>.<Class>_<n>_forward`` (the model
  itself is ``Module_<Class>_<n>``) and ``_backward`` (gradients of its outputs in,
  of its inputs and parameters out); at ``L0`` no torch API call is recorded.
* **Optimizer steps**: after every ``optimizer.step()`` (a global optimizer post-hook) no fingerprint taken
  before is reused (a fused optimizer writes the parameters without moving their version counters).
* **Parameters**: before every ``optimizer.step()`` (a global optimizer pre-hook)
  each registered model's parameters (``Parameter_<name>_<step>_forward``) and
  gradients (``..._backward``) are recorded -- after any data-parallel all-reduce,
  so replicas must agree on them bit for bit (``repro-tools ranks``).

:class:`Installation` applies all of this and undoes it in :meth:`Installation.remove`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from determ_backend import _torch_compat
from determ_backend.dump.capture.apis import DISTRIBUTED_APIS, ApiInfo
from determ_backend.dump.capture.compiled import CompiledGraphs
from determ_backend.dump.capture.entries import call_items, flatten, output_items
from determ_backend.dump.capture.hooks import (DumpMode, ApiRecorder, guard, passthrough, purge_retired_modes,
                                               user_source)
from determ_backend.dump.capture.regions import OPAQUE_NOTE, ModuleRegion, Regions

__all__ = ["Installation", "compiled_modules", "OPAQUE_NOTE"]

log = logging.getLogger(__name__)

_NO_OUTPUT = frozenset({"send", "isend", "barrier", "gather"})
# collectives whose first argument is only written (an output buffer: its memory before the call, often torch.empty's,
# is no input of theirs), and ``gather``'s second (its gather_list)
_WRITES_ONLY = {name: 0 for name in ("all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                                     "all_to_all_single", "scatter", "recv", "irecv")}
_WRITES_ONLY["gather"] = 1


def _written_only(orig: Callable, name: str) -> Tuple[str, ...]:
    """The item names (:func:`~.entries.call_items`) of the output buffer collective ``name`` only writes: its
    position and, read from ``orig``'s signature, its keyword."""
    pos = _WRITES_ONLY.get(name)
    if pos is None:
        return ()
    try:
        kw = list(inspect.signature(orig).parameters)[pos]
    except (TypeError, ValueError, IndexError):  # no signature to read: by position alone
        return (f"input.{pos}",)
    return (f"input.{pos}", f"input.{kw}")


def _read_items(items: List[tuple], drop: Tuple[str, ...]) -> List[tuple]:
    """``items`` less those under the names ``drop`` (:func:`_written_only`)."""
    if not drop:
        return items
    return [(n, v) for n, v in items if not any(n == d or n.startswith(d + ".") for d in drop)]


def compiled_modules(model: torch.nn.Module) -> List[tuple]:
    """``[(name, module)]`` of compiled modules in ``model`` (outermost only); ``model`` itself is named by the
    class of the module it compiles (``Net``, not ``OptimizedModule``)."""
    found: List[tuple] = []
    covered: List[str] = []
    for name, m in model.named_modules():
        if any(name == c or name.startswith(c + ".") for c in covered):
            continue
        if _torch_compat.is_compiled_module(m):
            found.append((name or type(_torch_compat.compiled_original(m)).__name__, m))
            covered.append(name)
            if name == "":
                break
    return found


def _dist_wrapper(rec: ApiRecorder, name: str, orig: Callable) -> Callable:
    info = ApiInfo("Distributed", name)
    written_only = _written_only(orig, name)  # read once, not at every call

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling() or passthrough():
            return orig(*args, **kwargs)
        call = f"{info.key}_{rec.session.next_call(info.key)}"
        if rec.overflow is not None or not rec.selector.select(call, info, "forward"):
            return orig(*args, **kwargs)
        with guard():
            items = call_items(args, kwargs)
            ins = rec.describe(_read_items(items, written_only), "input")
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

    def __init__(self, recorder: ApiRecorder, models: Sequence[torch.nn.Module] = (),
                 regions: Sequence[tuple] = ()):
        self.rec = recorder
        self.models = [weakref.ref(m) for m in models]
        self._mode: Optional[DumpMode] = None
        self._handles: List[Any] = []
        self._patched: Dict[str, Callable] = {}
        self._step = 0
        self.regions = Regions(recorder)
        self._listener: Optional[CompiledGraphs] = None
        self._unobserve: Optional[Callable[[], None]] = None
        try:
            self._install_regions(models, regions)
            if recorder.overflow is None and recorder.settings.modules:
                self._install_module_boundaries(models)
            self._install_compiled()
            apis = recorder.overflow is not None or recorder.settings.apis
            if apis:
                self._install_dist()
            from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

            if models and recorder.overflow is None:
                self._handles.append(register_optimizer_step_pre_hook(self._before_step))
            # a fused optimizer (``torch._fused_adamw_``) writes the parameters without moving their version
            # counters: no fingerprint taken before a step stands for a tensor after it
            self._handles.append(register_optimizer_step_post_hook(self._after_step))
            if apis:
                purge_retired_modes()
                self._mode = DumpMode(recorder)
                self._mode.__enter__()
                self.regions.mode = self._mode
        except BaseException:
            self.remove()
            raise

    def _install_regions(self, models, regions) -> None:
        targets = [(f"Compiled_{n}", m, True) for model in models for n, m in compiled_modules(model)]
        targets += [(label, m, False) for label, m in regions]
        for label, m, compiled in targets:
            self._hook(m, ModuleRegion(self.regions, ApiInfo("", label), compiled))

    def _hook(self, module: torch.nn.Module, hooks: ModuleRegion) -> None:
        """Record ``module``'s calls through ``hooks`` (removed in :meth:`remove`)."""
        self._handles.append(module.register_forward_pre_hook(hooks.pre, with_kwargs=True))
        self._handles.append(module.register_forward_hook(hooks.post, with_kwargs=True, always_call=True))

    def _install_module_boundaries(self, models) -> None:
        """Levels ``L0``/``mix``: hooks on every module of each registered model, except inside compiled modules
        (those are regions of their own, whose inside the determ backends trace)."""
        for model in models:
            compiled: List[str] = []
            for name, m in model.named_modules():
                if _torch_compat.is_compiled_module(m):
                    compiled.append(name)
                if any(name == c or name.startswith(c + ".") or c == "" for c in compiled):
                    continue
                path = name.replace("_orig_mod.", "")
                label = f"{path}.{type(m).__name__}" if path else type(m).__name__
                self._hook(m, ModuleRegion(self.regions, ApiInfo("Module", label), compiled=False, opaque=False))

    def _install_compiled(self) -> None:
        """Compiled callables no hook covers become regions; determ backends' traces become node entries."""
        self._unobserve = self.regions.install_observer()
        if self._unobserve is None:
            log.info("determ dump: this torch version gives no entry point for compiled calls; compiled free "
                     "functions are recorded only through the determ backends' traces")
        from determ_backend.backends import run  # imported when a dump starts, not with the package (run registers an exit handler)

        self._listener = run.subscribe(CompiledGraphs(self.rec, self.regions))

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

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.rec.session.cache.clear()

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
        self.regions.close()  # first: it puts the dump's mode back on the stack if a region took it off
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.retired = True
            # off the stack if it is on top; inside backward() torch may hold it off and put it back later
            _torch_compat.suspend_function_mode(mode)
            purge_retired_modes()
        if self._unobserve is not None:
            self._unobserve()
            self._unobserve = None
        if self._listener is not None:
            from determ_backend.backends import run

            run.unsubscribe(self._listener)
            self._listener = None
        for h in self._handles:
            h.remove()
        self._handles = []
        dist = torch.distributed
        for name, orig in self._patched.items():
            setattr(dist, name, orig)
        self._patched = {}
