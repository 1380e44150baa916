"""Every access to private torch APIs (``torch._dynamo``, ``torch._inductor``,
``torch._functorch``, ``torch.utils._python_dispatch``, ``torch.utils._pytree``,
``torch._ops``, private attributes such as ``_schema``, ``_version`` or
``_boxed_call``) in ``determ_backend`` and ``repro_tools`` goes through this module,
so a torch upgrade touches one file.  Each accessor is small, named after what it
gives, and tolerant of the supported torch versions (>= 2.5); the sections below
say which part of the project uses them.  Imports of heavy private modules are
lazy: importing determ does not import inductor or dynamo.

Not here: helpers only the benchmarks use (PyTorch's ``DebugMode``, its FX
minifier, fresh inductor caches) live in ``scripts/_bench_common.py``; the repro
scripts' standalone runtime (``repro_tools/repro/_harness.py``) imports only torch.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import re
import sys
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils import _python_dispatch as _dispatch  # both imported by torch itself: no import cost
from torch.utils import _pytree

__all__ = [
    # configs and compilers
    "inductor_config", "set_fallback_random", "inductor_config_patch", "config_snapshot", "config_applied",
    "lookup_backend", "aot_autograd", "compile_fx", "compile_fx_inner",
    # operators, tensors, calling conventions
    "op_schema", "op_schema_name", "is_op_overload", "is_op_overload_packet", "op_overload_name",
    "op_packet_name", "tensor_version", "is_boxed", "set_boxed", "is_zero_tensor",
    "functorch_active", "functorch_disabled", "unobserved",
    # dispatch modes and pytrees
    "TorchDispatchMode", "current_dispatch_mode", "dispatch_mode_depth", "dispatch_modes_disabled",
    "tree_map", "tree_flatten", "tree_unflatten",
    # inductor instrumentation
    "boxed_nop", "aot_eager", "inductor_cache_dir", "compiled_source", "set_compiled_callable",
    "capture_buffer_origins", "autograd_cache_disabled", "donated_buffers_disabled", "sym_expr", "example_value",
    # eager dispatch modes
    "eval_frame_setter", "dynamo_skip_code", "current_autograd_node_getter",
    # repro scripts and flows
    "config_diffs", "is_dynamo_control_flow", "is_run_and_save_rng_state", "inductor_mode_options", "custom_op_module", "op_registering_module", "is_fake_tensor", "real_tensors", "symint_hint",
    # API dump
    "queue_autograd_callback", "is_compiled_module", "observe_compiled_calls", "suspend_function_mode",
    "resume_function_mode", "compiled_original",
    # stages and bisection
    "share_symbolic_context", "aot_eager_decomp_partition", "bisector_stage_scope", "bisector_subsystems",
    "bisector_write_state", "bisector_read_bounds", "bisector_debug_info", "is_inductor_config",
    "inductor_config_problem",
]


# --- configs and compilers (determ_backend.backends, repro_tools) ------------------------------------------

def inductor_config():
    import torch._inductor.config as cfg

    return cfg


def set_fallback_random(value: bool) -> None:
    inductor_config().fallback_random = value


@contextlib.contextmanager
def inductor_config_patch(changes: Dict[str, Any]) -> Iterator[None]:
    """Temporarily set inductor config entries (dotted names, e.g. ``cpp.inject_relu_bug_TESTING_ONLY``)."""
    with inductor_config().patch(changes):
        yield


def _config_modules() -> list:
    import torch._dynamo.config as dc
    import torch._functorch.config as fc
    import torch._inductor.config as ic

    return [ic, dc, fc]


def config_snapshot() -> List[Dict[str, Any]]:
    """This thread's inductor / dynamo / functorch config (their settings are per thread)."""
    return [m.get_config_copy() for m in _config_modules()]


@contextlib.contextmanager
def config_applied(snapshot: List[Dict[str, Any]]) -> Iterator[None]:
    """Another thread's :func:`config_snapshot` in force on this thread, restored on exit."""
    with contextlib.ExitStack() as stack:
        for mod, want in zip(_config_modules(), snapshot):
            have = mod.get_config_copy()
            changes = {}
            for k, v in want.items():
                try:
                    differs = bool(have.get(k) != v)
                except Exception:  # a value that does not compare (a tensor): leave it
                    differs = False
                if differs:
                    changes[k] = v
            if changes:
                stack.enter_context(mod.patch(changes))
        yield


def lookup_backend(name_or_fn) -> Callable:
    """Resolve a dynamo backend name (``"inductor"``, ``"aot_eager"``, a registered entry point) or callable."""
    from torch._dynamo.backends.registry import lookup_backend as _lookup

    return _lookup(name_or_fn)


def is_run_and_save_rng_state(target) -> bool:
    """Whether ``target`` is ``higher_order.run_and_save_rng_state``: ``(op, *args) -> (state, op(*args))``, how
    activation checkpointing saves the generator's state around a forward draw so that its backward draws the
    same numbers again."""
    return isinstance(target, torch._ops.HigherOrderOperator) and getattr(target, "_name", None) == \
        "run_and_save_rng_state"


def inductor_mode_options(mode: str) -> Dict[str, Any]:
    """The inductor config entries ``torch.compile(..., mode=mode)`` stands for (``max-autotune`` ->
    ``max_autotune``, ``coordinate_descent_tuning``...)."""
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))


def is_dynamo_control_flow(e: BaseException) -> bool:
    """Whether ``e`` is how dynamo steers its own tracing -- a restart of the frame's analysis
    (``TensorifyScalarRestartAnalysis`` and the other ``RestartAnalysis``), a frame to skip -- rather than a
    failure: a backend lets it through untouched, and dynamo goes on."""
    try:
        from torch._dynamo import exc
    except ImportError:
        return False
    kinds = tuple(k for k in (getattr(exc, "RestartAnalysis", None), getattr(exc, "SkipFrame", None)) if k is not None)
    return bool(kinds) and isinstance(e, kinds)


def aot_autograd(**kwargs) -> Callable:
    from torch._dynamo.backends.common import aot_autograd as _aot

    return _aot(**kwargs)


def compile_fx(gm, example_inputs, **kwargs):
    from torch._inductor.compile_fx import compile_fx as _cfx

    return _cfx(gm, example_inputs, **kwargs)


def compile_fx_inner(gm, example_inputs, **kwargs):
    from torch._inductor.compile_fx import compile_fx_inner as _inner

    return _inner(gm, example_inputs, **kwargs)


# --- operators, tensors, calling conventions (determ_backend.modes, backends, dump; repro_tools) -----------

def op_schema(func) -> Any:
    """The ``FunctionSchema`` of an operator overload (``func._schema``), or None for anything else."""
    return getattr(func, "_schema", None)


def op_schema_name(func) -> Optional[str]:
    """``ns::name`` of an operator overload's schema (``aten::add``), or None."""
    schema = op_schema(func)
    return schema.name if schema is not None else None


def is_op_overload(fn) -> bool:
    """An operator overload such as ``torch.ops.aten.relu.default``."""
    return isinstance(fn, torch._ops.OpOverload)


def is_higher_order_op(fn) -> bool:
    """A higher-order operator such as ``torch.ops.higher_order.autograd_function_apply`` (it takes subgraphs)."""
    return isinstance(fn, torch._ops.HigherOrderOperator)


def is_op_overload_packet(fn) -> bool:
    """An operator overload packet such as ``torch.ops.aten.relu``."""
    return isinstance(fn, torch._ops.OpOverloadPacket)


def op_overload_name(op) -> Tuple[str, str, str]:
    """``(namespace, op name, overload name)`` of an operator overload: ``("aten", "add", "Tensor")``."""
    return op.namespace, op._opname, op._overloadname


def op_packet_name(packet) -> str:
    """``ns::name`` of an operator overload packet."""
    return packet._qualified_op_name


# ``tensor_version(t)``: ``t``'s version counter (bumped by every in-place write).  Inference tensors have none:
# RuntimeError.  A C attribute getter rather than a function: the eager modes read it for every tensor of every op.
tensor_version: Callable[[torch.Tensor], int] = operator.attrgetter("_version")


def storage_weak_ref(t: torch.Tensor) -> int:
    """A weak reference to ``t``'s storage, as a number (``UntypedStorage._weak_ref``; a fraction of the cost of
    a ``StorageWeakRef`` object): test it with :func:`storage_expired`, and give it back exactly once with
    :func:`storage_release`."""
    return t.untyped_storage()._weak_ref()


def storage_expired(ref: int) -> bool:
    """Whether the storage of a :func:`storage_weak_ref` was freed."""
    return torch.UntypedStorage._expired(ref)


def storage_release(ref: int) -> None:
    """Give back a :func:`storage_weak_ref` (once; it must not be used afterwards)."""
    torch.UntypedStorage._free_weak_ref(ref)


def is_boxed(fn) -> bool:
    """Whether a compiled graph takes AOTAutograd's boxed calling convention (one list argument)."""
    return bool(getattr(fn, "_boxed_call", False))


def set_boxed(fn, boxed: bool = True):
    """Mark ``fn`` as taking (or not) the boxed calling convention; returns ``fn``."""
    fn._boxed_call = boxed
    return fn


# --- dispatch modes and pytrees (determ_backend.modes, determ_backend.observer) ----------------------------

TorchDispatchMode = _dispatch.TorchDispatchMode
"""The base class of a ``__torch_dispatch__`` mode (``torch.utils._python_dispatch``)."""

tree_map = _pytree.tree_map
tree_flatten = _pytree.tree_flatten
tree_unflatten = _pytree.tree_unflatten


# Called on every op under the eager modes, so bound directly rather than wrapped:
current_dispatch_mode = _dispatch._get_current_dispatch_mode  # () -> the innermost active dispatch mode, or None
dispatch_mode_depth = _dispatch._len_torch_dispatch_stack  # () -> how many dispatch modes are active on this thread
dispatch_modes_disabled = _dispatch._disable_current_modes  # () -> context manager: no dispatch mode active inside


# --- inductor instrumentation (determ_backend.backends.inductor_instrument) -------------------------------

def boxed_nop(gm, example_inputs):
    """The fw/bw compiler ``aot_eager`` uses (runs the graph as Python, boxed calling convention)."""
    from torch._dynamo.backends.debugging import boxed_nop as _bn

    return _bn(gm, example_inputs)


def aot_eager(gm, example_inputs, fw_compiler=None, bw_compiler=None, **kwargs):
    from torch._dynamo.backends.debugging import aot_eager as _ae

    return _ae(gm, example_inputs, fw_compiler=fw_compiler, bw_compiler=bw_compiler, **kwargs)


def inductor_cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def compiled_source(compiled) -> Any:
    """``(source_code, fx_cache_key, bound call)`` of an inductor ``CompiledFxGraph`` (None parts when absent)."""
    return (getattr(compiled, "source_code", None), getattr(compiled, "_fx_graph_cache_key", None),
            getattr(compiled, "current_callable", None))


def set_compiled_callable(compiled, fn) -> None:
    compiled.current_callable = fn


def _buffer_origins(scheduler) -> Dict[str, Dict[str, Any]]:
    out: Dict[str, Dict[str, Any]] = {}
    for snode in scheduler.nodes:
        subs = snode.get_nodes() if hasattr(snode, "get_nodes") else [snode]
        for sub in subs:
            for buf in sub.get_outputs():
                node = buf.node
                origin = getattr(node, "origin_node", None)
                origins = getattr(node, "origins", None) or getattr(getattr(sub, "node", None), "origins", ()) or ()
                try:  # a buffer that writes into another one (a copy_ into a view of a zero fill, lowered in place)
                    mutates = [str(n) for n in node.get_mutation_names()]
                except (AttributeError, NotImplementedError):
                    mutates = []
                out[buf.get_name()] = {
                    "origin": origin.name if origin is not None else None,
                    "origins": [o.name for o in origins if getattr(o, "op", None) != "output"],
                    "mutates": mutates,
                }
    return out


@contextlib.contextmanager
def capture_buffer_origins(sink: list) -> Iterator[None]:
    """While active, each inductor codegen appends ``{buffer name: {origin, origins, mutates}}`` to ``sink``
    (``mutates``: the buffers it writes into in place).

    Also installs a no-op post-grad pass whose uuid enters inductor's FX cache key, so
    instrumented compiles have cache entries of their own (produced with this hook active).
    """
    from torch._inductor import config as icfg
    from torch._inductor.custom_graph_pass import CustomGraphPass
    from torch._inductor.scheduler import Scheduler

    user_pass = icfg.post_grad_custom_post_pass

    class _DetermTag(CustomGraphPass):
        def __call__(self, graph):
            if user_pass is not None:
                user_pass(graph)

        def uuid(self):
            inner = user_pass.uuid() if hasattr(user_pass, "uuid") else None
            return ("determ-buffer-origins-v2", inner)

    original = Scheduler.codegen

    def codegen(self, *a, **k):
        sink.append(_buffer_origins(self))
        return original(self, *a, **k)

    Scheduler.codegen = codegen
    try:
        with icfg.patch(post_grad_custom_post_pass=_DetermTag()):
            yield
    finally:
        Scheduler.codegen = original


@contextlib.contextmanager
def autograd_cache_disabled() -> Iterator[None]:
    """AOTAutograd's cache would skip inductor's inner compile (and so our instrumentation)."""
    import torch._functorch.config as fcfg

    with fcfg.patch(enable_autograd_cache=False):
        yield


def sym_expr(x: Any) -> Optional[Any]:
    """The symbolic expression of a ``SymInt`` (a dynamic size, e.g. the batch ``s0``); None for a plain int."""
    node = getattr(x, "node", None) if isinstance(x, torch.SymInt) else None
    return getattr(node, "expr", None)


def example_value(node: Any) -> Optional[Any]:
    """The fake value an FX node was traced with (AOT/inductor graphs: ``val``; dynamo graphs: ``example_value``)."""
    meta = getattr(node, "meta", {}) or {}
    return meta.get("val", meta.get("example_value"))


@contextlib.contextmanager
def donated_buffers_disabled() -> Iterator[None]:
    """AOTAutograd lets inductor reuse a backward graph's saved-tensor inputs as scratch memory ("donated
    buffers"); a check that replays the graph on its inputs after the call needs them intact."""
    import torch._functorch.config as fcfg

    if not hasattr(fcfg, "donated_buffer"):  # older torch: no donation
        yield
        return
    with fcfg.patch(donated_buffer=False):
        yield


# --- eager dispatch modes (determ_backend.modes.core) -------------------------------------------------

def eval_frame_setter() -> Callable:
    """Dynamo's C ``set_eval_frame(callback) -> previous``.  The previous callback is not
    None/False exactly while a ``torch.compile``'d function is running (compiled or skipped)."""
    return torch._C._dynamo.eval_frame.set_eval_frame  # an attribute, not an import statement: a mode made per step


def dynamo_skip_code(code) -> None:
    """Never let dynamo compile a frame of ``code`` (frames it calls are unaffected).

    A dispatch mode's ``__torch_dispatch__`` runs while the mode is popped; inside a
    ``torch.compile``'d region dynamo would otherwise try to compile it."""
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

    set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))


def current_autograd_node_getter() -> Callable:
    """``torch._C._current_autograd_node``: the autograd Node being executed (None outside backward)."""
    return torch._C._current_autograd_node


# --- repro scripts and flows (repro_tools.repro.script, repro_tools.flows.after_dynamo, repro_tools.flows.after_aot) -------

def config_diffs() -> Dict[str, str]:
    """Non-default inductor / dynamo / functorch config as Python statements (``codegen_config``), by module."""
    import torch._dynamo.config as dc
    import torch._functorch.config as fc
    import torch._inductor.config as ic

    return {"inductor": ic.codegen_config(), "dynamo": dc.codegen_config(), "functorch": fc.codegen_config()}


_OP_REGISTERING_MODULES = ("torch._inductor.inductor_prims",)
"""torch modules that define ops of torch's own namespaces when imported: inductor's prims (``prims::fma``,
``prims::inductor_seeds``, ``prims::prepare_softmax_online``...) appear in dynamo and AOT graphs (the compiled
AdamW step's ``fma``, dropout's seeds) but exist in a fresh process only once the module ran."""


@functools.lru_cache(maxsize=None)
def _ops_defined_by(module: str) -> frozenset:
    mod = sys.modules[module]
    return frozenset(v.name() for v in vars(mod).values() if isinstance(v, torch._ops.OpOverload))


def op_registering_module(qualname: str):
    """The module to import before op ``ns::name`` can be looked up, when torch registers it lazily (None for
    ops that always exist): the one of :data:`_OP_REGISTERING_MODULES` loaded here that defined it."""
    base = qualname.split(".")[0]
    for module in _OP_REGISTERING_MODULES:
        if module in sys.modules and base in _ops_defined_by(module):
            return module
    return None


def custom_op_module(qualname: str):
    """The Python module that defined custom op ``ns::name`` with ``torch.library.custom_op`` (None if unknown)."""
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(qualname)
    fn = getattr(opdef, "_init_fn", None)
    return getattr(fn, "__module__", None)


def is_fake_tensor(t) -> bool:
    """A FakeTensor (no data: compile-time example inputs after AOT)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


_ROOT_LOCAL = re.compile(r"^[LG]\[['\"][^'\"]*['\"]\]")  # dynamo's name of the compiled object (L['self'], L['fn'])
_INDEX = re.compile(r"\[['\"]?([^'\"\]]*)['\"]?\]")


def innermost_module(node: Any) -> Optional[Tuple[str, str]]:
    """``(path, class name)`` of the innermost module an FX node of a dynamo graph ran in (its ``nn_module_stack``),
    the path as ``named_modules()`` spells it ("" for the compiled module itself); None when none is recorded."""
    stack = node.meta.get("nn_module_stack")
    if not isinstance(stack, dict) or not stack:
        return None
    entry = list(stack.values())[-1]
    if not isinstance(entry, tuple) or len(entry) != 2:
        return None
    path, cls = entry
    path = _INDEX.sub(lambda m: "." + m.group(1), _ROOT_LOCAL.sub("", str(path))).replace("._modules.", ".")
    parts = [p for p in path.split(".") if p]
    if parts[:1] == ["__self__"]:  # torch.compile(model.forward): the bound method's module
        parts = parts[1:]
    name = getattr(cls, "__name__", None) or str(cls).rsplit(".", 1)[-1].strip("'>")
    return ".".join(parts), name


def is_zero_tensor(t: torch.Tensor) -> bool:
    """A ZeroTensor: the zeros forward-mode AD stands in for a missing tangent, with no memory behind it (its data
    pointer is null), read as zeros of its dtype and shape."""
    f = getattr(t, "_is_zerotensor", None)
    return f is not None and f()


def functorch_active() -> bool:
    """Whether a ``torch.func`` transform (``vmap``, ``grad``, ``jvp``...) is running: the tensors user code sees are
    then wrappers (batched, gradient-tracking) with no memory of their own, and tensors made are wrapped too."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def process_group_store() -> Optional[Any]:
    """The key-value store of the default ``torch.distributed`` process group (every rank reaches it without a
    collective); None when there is none."""
    try:
        return torch.distributed.distributed_c10d._get_default_store()
    except Exception:
        return None


@functools.lru_cache(maxsize=None)
def autograd_engine_entry() -> Optional[Any]:
    """The code object of the Python function through which ``backward()`` and ``autograd.grad`` enter the C++
    engine: an op dispatched with it as the nearest Python frame is one of autograd's own formulas; None when this
    torch has no such function."""
    try:
        from torch.autograd import graph
        return graph._engine_run_backward.__code__
    except (ImportError, AttributeError):
        return None


_ENGINE_TLS = threading.local()
_ENGINE_LOCK = threading.Lock()
_ENGINE_STATE: Dict[str, Any] = {"users": 0, "original": None}  # the original is kept once found (never cleared)


def _engine_run_backward_around(*args, **kwargs):
    """torch.autograd's engine entry while :func:`engine_runs_within` is in use: this thread's pending context (set
    by that function, taken once) is entered around the engine's run; any other call runs the engine as it is."""
    original = _ENGINE_STATE["original"]
    enter = getattr(_ENGINE_TLS, "enter", None)
    if enter is None:
        return original(*args, **kwargs)
    _ENGINE_TLS.enter = None  # taken: a backward run inside this one sets its own
    try:
        with enter():
            return original(*args, **kwargs)
    finally:
        _ENGINE_TLS.enter = enter


@contextlib.contextmanager
def engine_runs_within(enter: Callable[[], Any]) -> Iterator[None]:
    """The ``backward()``/``autograd.grad`` this thread calls inside the block runs its backward pass inside
    ``enter()`` (a context manager), entered after torch's own argument handling and ``__torch_function__`` checks,
    around the engine's run: a torch function mode, which is off while its handler of ``backward`` runs, sees the
    calls of custom ``Function`` backwards, hooks and recomputations.  The engine entry of ``torch.autograd`` is
    patched while any thread uses this (other threads' calls pass straight through) and restored after the last;
    on a torch without that entry the backward pass runs without the context."""
    import torch.autograd as autograd
    with _ENGINE_LOCK:
        if _ENGINE_STATE["users"] == 0:
            current = getattr(autograd, "_engine_run_backward", None)
            if current is not None and current is not _engine_run_backward_around:
                _ENGINE_STATE["original"] = current
                autograd._engine_run_backward = _engine_run_backward_around
        _ENGINE_STATE["users"] += 1
    prev = getattr(_ENGINE_TLS, "enter", None)
    _ENGINE_TLS.enter = enter
    try:
        yield
    finally:
        _ENGINE_TLS.enter = prev
        with _ENGINE_LOCK:
            _ENGINE_STATE["users"] -= 1
            if _ENGINE_STATE["users"] == 0 and autograd._engine_run_backward is _engine_run_backward_around:
                autograd._engine_run_backward = _ENGINE_STATE["original"]


def wrapped_tensor(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The one plain tensor a traceable wrapper subclass holds (a ``DTensor``'s local shard, as FSDP2 keeps its
    parameters), by the subclass protocol (``__tensor_flatten__``); None for any other tensor, and for a subclass
    holding several tensors."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None or type(t) in (torch.Tensor, torch.nn.Parameter):
        return None
    try:
        inner = [x for x in (getattr(t, n) for n in flatten()[0]) if isinstance(x, torch.Tensor)]
    except Exception:
        return None
    return inner[0] if len(inner) == 1 and type(inner[0]) is torch.Tensor else None


def functorch_unwrapped(value: Any) -> Any:
    """``value`` with each ``torch.func`` wrapper (batched, gradient-tracking) replaced by the plain tensor it wraps
    (under ``vmap`` the whole batch, batch dimension included), read outside the transform; tensors and lists or
    tuples of them.  A wrapper has no memory of its own, and a copy of it made inside the transform is dead once
    the transform returns."""
    if isinstance(value, (list, tuple)):
        return type(value)(functorch_unwrapped(v) for v in value)
    if not isinstance(value, torch.Tensor) or not torch._C._functorch.is_functorch_wrapped_tensor(value):
        return value
    with functorch_disabled():
        return torch.func.debug_unwrap(value, recurse=True)


def uses_functorch(target: Any) -> bool:
    """Whether an FX node's target is one of ``torch.func``'s level or wrapper functions (a Dynamo graph of a
    ``vmap`` or ``grad`` call holds ``_vmap_increment_nesting``, ``_add_batch_dim``...)."""
    return str(getattr(target, "__module__", "")).startswith(("torch._functorch", "torch._C._functorch"))


@contextlib.contextmanager
def functorch_disabled() -> Iterator[None]:
    """Run the block outside every ``torch.func`` transform: tensors made there are plain tensors (a cached
    constant made inside ``grad`` would be a wrapper, dead once the transform returns)."""
    guard = torch._C._DisableFuncTorch()
    try:
        yield
    finally:
        del guard


@contextlib.contextmanager
def unobserved() -> Iterator[None]:
    """Run the block as if no user code were watching: no ``torch.func`` transform, no dispatch mode and no
    ``__torch_function__`` mode sees its ops (determ's own cached constants: an outer ``DebugMode`` logged them as
    the user's ops, and one made inside ``grad`` was a wrapper)."""
    with functorch_disabled(), _dispatch._disable_current_modes(), torch._C.DisableTorchFunction():
        yield


def view_base(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The tensor ``t`` is a view of (``weight.T``'s is ``weight``), or None when ``t`` is no view."""
    return getattr(t, "_base", None)


@contextlib.contextmanager
def real_tensors() -> Iterator[None]:
    """Leave the active fake tensor mode (AOTAutograd's, while its compiler runs) for the block:
    tensors made or copied inside are real again.  A no-op when no fake mode is active."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        yield


def symint_hint(s):
    """A concrete int for a SymInt (its hint when it is symbolic)."""
    node = getattr(s, "node", None)
    hint = getattr(node, "hint", None)
    return int(hint) if hint is not None else int(s)


# --- API dump hooks (determ_backend.dump) ---------------------------------------------------------

def queue_autograd_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the current backward pass finishes (call from inside an autograd hook)."""
    from torch.autograd import Variable

    Variable._execution_engine.queue_callback(fn)


def is_compiled_module(module) -> bool:
    """True for a ``torch.compile``d module (``OptimizedModule``) or one compiled in place with ``Module.compile()``."""
    import sys

    if getattr(module, "_compiled_call_impl", None) is not None:
        return True
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # nothing can be compiled before dynamo is imported
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


# --- determ_backend.backends.retarget / repro_tools.bisect.core (stages and torch's CompilerBisector) ---

def share_symbolic_context(original, copy) -> None:
    """Let ``copy``, a Dynamo graph input moved or cast (same sizes and strides, another tensor), be
    fakified by AOTAutograd as ``original`` was by Dynamo: the same size symbols, with the input's
    source.  Otherwise AOTAutograd gives the copy fresh symbols that no source backs, and a guard on
    them breaks Dynamo's guard creation.  A no-op outside a Dynamo compile or for a tensor Dynamo
    did not fakify."""
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    if ctx is None or original is copy:
        return
    symbolic = ctx.tensor_to_context.get(original)
    if symbolic is not None:
        ctx.tensor_to_context[copy] = symbolic


def aot_eager_decomp_partition(gm, example_inputs, fw_compiler=None, bw_compiler=None):
    """``aot_eager`` with inductor's decompositions and min-cut partitioner (torch's
    ``aot_eager_decomp_partition`` backend), taking our fw/bw compilers."""
    import functools

    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd as _aot
    from torch._dynamo.backends.debugging import boxed_nop as _bn
    from torch._functorch import config as fcfg
    from torch._inductor.compile_fx import select_decomp_table

    patches = {"unlift_effect_tokens": True}
    patches.update(_bisector().get_config_change("aot_eager_decomp_partition") or {})
    with fcfg.patch(patches):
        return _aot(fw_compiler=fw_compiler or _bn, bw_compiler=bw_compiler or _bn,
                    decompositions=select_decomp_table,
                    partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"),
                    )(gm, example_inputs)


def _bisector():
    from torch._inductor.compiler_bisector import CompilerBisector

    return CompilerBisector


@contextlib.contextmanager
def bisector_stage_scope(stage: str) -> Iterator[Dict[str, Any]]:
    """While active, torch's ``CompilerBisector`` sees ``stage`` as the backend under bisection.

    The subsystem, run state and bisect range still come from ``TORCH_BISECT_SUBSYSTEM``,
    ``TORCH_BISECT_MAX`` and the bisect directory; only the backend name is ours, so the
    caller's own backend stays in place.  Yields the config changes the bisector asks
    for in ``stage`` (``{}`` when none).  A no-op when no subsystem is being bisected.
    """
    cb = _bisector()
    if cb.get_subsystem() is None:
        yield {}
        return
    saved_get, saved_enabled = cb.__dict__["get_backend"], cb.bisection_enabled
    cb.get_backend = classmethod(lambda cls: stage)
    cb.bisection_enabled = True
    try:
        yield dict(cb.get_config_change(stage) or {})
    finally:
        cb.get_backend = saved_get
        cb.bisection_enabled = saved_enabled


def bisector_subsystems(stage: str) -> List[Tuple[str, Optional[Tuple[str, Any]]]]:
    """Torch's bisectable subsystems of ``stage``: ``(name, None)`` for a counted subsystem
    (passes, lowerings, decompositions), ``(name, (field, value))`` for a config change."""
    from torch._inductor.compiler_bisector import BACKENDS, ConfigChange

    out: List[Tuple[str, Optional[Tuple[str, Any]]]] = []
    for sub in BACKENDS.get(stage, []):
        out.append((sub.name, (sub.config_field, sub.config_value) if isinstance(sub, ConfigChange) else None))
    return out


@contextlib.contextmanager
def _bisector_root(root: str) -> Iterator[Any]:
    cb = _bisector()
    saved = cb.in_process_cache
    cb.in_process_cache = root
    try:
        yield cb
    finally:
        cb.in_process_cache = saved


def bisector_write_state(root: str, stage: str, subsystem: str, run_state: str,
                         bounds: Optional[Tuple[int, int]] = None, config: Optional[Dict[str, Any]] = None) -> None:
    """Prepare the files a child process's ``CompilerBisector`` reads: run state
    (``test_disable``/``find_max_bounds``/``bisect``), bisect range and config changes."""
    import os

    with _bisector_root(root) as cb:
        d = os.path.join(cb.get_dir(), stage)
        cb.write_lines_to_file(os.path.join(d, f"{subsystem}_run_state.txt"), [run_state])
        if config is not None:
            cb.set_config_values(stage, subsystem, {k: repr(v) for k, v in config.items()})
        if bounds is not None:
            cb.update_bisect_range(stage, subsystem, bounds[0], bounds[1])
        if run_state != "bisect":
            cb.clear_call_counter_debug_info(stage, subsystem)


def bisector_read_bounds(root: str, stage: str, subsystem: str) -> Optional[Tuple[int, int]]:
    """The bisect range a child wrote (``find_max_bounds``: ``(0, last application index)``), or None."""
    with _bisector_root(root) as cb:
        try:
            return cb.get_bisect_range(stage, subsystem)
        except RuntimeError:
            return None


def bisector_debug_info(root: str, stage: str, subsystem: str, index: int) -> Optional[str]:
    """What the ``index``-th application of a subsystem was (e.g. the lowered node), when recorded."""
    with _bisector_root(root) as cb:
        return cb.get_call_counter_debug_info(stage, subsystem, index)


def is_inductor_config(changes: Dict[str, Any]) -> bool:
    """Whether every key names an inductor config entry (dotted names allowed)."""
    cfg = inductor_config()
    for key in changes:
        obj = cfg
        for part in key.split("."):
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
    return True


def inductor_config_problem(key: str, value: Any) -> Optional[str]:
    """Why ``value`` cannot be inductor config entry ``key`` (None when it can): an unknown key, or a value
    of another type than the entry declares (bool, int, float, str, an enum of literals, optional)."""
    if not is_inductor_config({key: None}):
        return "not an inductor config entry"
    try:
        want = inductor_config().get_type(key)
    except Exception:  # an entry with no declared type: anything goes
        return None
    return None if _fits(value, want) else f"expected {_type_text(want)}, got {value!r}"


def _fits(value: Any, want: Any) -> bool:
    import types
    import typing

    origin = typing.get_origin(want)
    if origin in (typing.Union, getattr(types, "UnionType", typing.Union)):
        return any(_fits(value, a) for a in typing.get_args(want))
    if origin is typing.Literal:
        return value in typing.get_args(want)
    if want is type(None) or want is None:
        return value is None
    if want is bool:
        return isinstance(value, bool)
    if want is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if want is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if want is str:
        return isinstance(value, str)
    if isinstance(want, type):
        return isinstance(value, want) or origin is not None
    return True  # a container or callable type: not checked here


def _type_text(want: Any) -> str:
    import typing

    args = typing.get_args(want)
    if typing.get_origin(want) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if args:
        return " or ".join(_type_text(a) for a in args)
    return "None" if want is type(None) else getattr(want, "__name__", str(want))


# --- determ_backend.dump.capture.regions (calls of torch.compile'd functions) ------------------------------

def observe_compiled_calls(on_enter: Callable[[Any, tuple, dict], Any],
                           on_exit: Callable[[Any, Any, bool], None]) -> Optional[Callable[[], None]]:
    """Report every call of a ``torch.compile``d callable (function or module) in any thread:
    ``token = on_enter(fn, args, kwargs)`` when it starts (``fn`` is the callable that was compiled) and
    ``on_exit(token, result, ok)`` when it ends (``ok`` False when it raised; not called for a None token).

    Dynamo's ``compile_wrapper`` sets the eval-frame callback through the module-level
    ``_maybe_set_eval_frame`` once on entry and once on exit; that name is wrapped until the returned
    function is called.  Returns None when this torch has no such entry point (nothing is observed)."""
    import sys
    import threading

    ef = sys.modules.get("torch._dynamo.eval_frame")
    orig = getattr(ef, "_maybe_set_eval_frame", None) if ef is not None else None
    if orig is None:
        return None
    filename = ef.__file__
    tls = threading.local()
    active = [True]

    def observed(callback):
        frame = sys._getframe(1)
        code = frame.f_code
        if code.co_name == "compile_wrapper" and code.co_filename == filename:
            stack = tls.__dict__.setdefault("stack", [])
            if stack and stack[-1][0] is frame:  # the exit: compile_wrapper's outer finally
                _, token = stack.pop()
                if token is not None:
                    loc = frame.f_locals
                    on_exit(token, loc.get("result"), "result" in loc)
            elif active[0] and "cleanups" in frame.f_locals:  # past the early returns: a compiled call starts
                loc = frame.f_locals
                entry = [frame, None]
                stack.append(entry)  # pushed first: if on_enter raises, the exit still pops it
                entry[1] = on_enter(loc.get("fn"), tuple(loc.get("args", ())), dict(loc.get("kwargs", {})))
        return orig(callback)

    ef._maybe_set_eval_frame = observed

    def undo() -> None:
        active[0] = False
        if ef._maybe_set_eval_frame is observed:
            ef._maybe_set_eval_frame = orig

    return undo


def is_set_grad_enabled(target) -> bool:
    """Whether an FX node's target is ``torch._C._set_grad_enabled`` (how a dynamo graph writes ``torch.no_grad()``)."""
    return target is getattr(torch._C, "_set_grad_enabled", None)


def current_function_mode() -> Optional[Any]:
    """The torch function mode on top of this thread's stack (None when there is none)."""
    from torch.overrides import _get_current_function_mode

    return _get_current_function_mode()


def suspend_function_mode(mode) -> bool:
    """Take ``mode`` off this thread's torch function mode stack if it is on top (True if it was)."""
    from torch.overrides import _get_current_function_mode, _pop_mode

    if _get_current_function_mode() is not mode:
        return False
    _pop_mode()
    return True


def resume_function_mode(mode) -> None:
    """Put back a mode taken off by :func:`suspend_function_mode`."""
    from torch.overrides import _push_mode

    _push_mode(mode)


# --- determ_backend.dump.capture.modules (names of compiled modules) ---------------------------------------

def compiled_original(module):
    """The module a ``torch.compile``d ``OptimizedModule`` wraps (``module`` itself otherwise)."""
    return getattr(module, "_orig_mod", module) if is_compiled_module(module) else module
