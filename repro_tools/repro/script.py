"""A GraphModule and its inputs as a standalone ``repro.py``, and back.

:func:`write_repro` writes a script that runs with torch alone: the graph as
``class Repro(torch.nn.Module)`` with readable torch/aten calls (and the user's
source lines as comments), ``META`` (torch version, device, compiler, where it
was intercepted, the failure kind and original exception, the compile-time
config that differs from the defaults, relevant env vars), and the inputs,
parameters and constants as descriptions whose data lives in a content store
next to the script (``repro_store/<sha256>.safetensors``, each distinct storage
once, never pickled) or is regenerated with a fixed seed when no data was
saved (e.g. fake tensors at compile time).  The script's runtime (subcommands
``run``, ``minify``, ``analyze``, ``get-args``) is :mod:`repro_tools.repro._harness`.

:func:`load_repro` reads a script back as ``(gm, inputs, meta)``.  The
minifier, the flows and ``analyze`` live elsewhere.
"""

from __future__ import annotations

import ast
import datetime
import hashlib
import importlib
import importlib.util
import logging
import os
import pprint
import sys
import types
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.fx as fx

from determ_backend import _torch_compat as tc
from determ_backend.errors import ReproError
from determ_backend.trace.stream import atomic_write_text

from repro_tools.repro._inputs import ReproTracer
from repro_tools.repro.codegen import CodeWriter, call_key, module_roots, script_text
from repro_tools.repro.store import STORE_NAME, StoreWriter, copy_store_files, describe_value, json_safe

__all__ = ["write_repro", "load_repro", "read_meta", "repro_class_span", "add_sys_path", "import_script", "copy_repro", "capture_compile_config", "capture_env",
           "compiler_ref", "FAILURE_KINDS", "STORE_NAME"]

log = logging.getLogger(__name__)

FAILURE_KINDS = ("compile_error", "runtime_error", "accuracy", "nondeterminism", "crash", "hang", "cross_device",
                 "batch_invariance", "nan", "any")
"""What ``run`` checks for; ``any`` = an error at compile or run time, or a crash (isolated).  Twin: ``_harness._KINDS``."""
_ORACLE_KINDS = {"error": "any"}  # the minifier's oracle names that differ from ours
_CONFIG_MODULES = ("inductor", "dynamo", "functorch")
_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_COMPILE", "TORCH_LOGS", "PYTORCH_", "CUBLAS_",
                 "CUDA_LAUNCH_BLOCKING", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "DETERM_", "REPRO_")


# ------------------------------------------------------------------ compile-time context

def capture_compile_config() -> Dict[str, Dict[str, Any]]:
    """Inductor/dynamo/functorch config entries that differ from the defaults, now: ``{module: {name: value}}``.

    Call it when the graph is compiled (the flows do), not when the repro is written.
    Values that are not Python literals are kept as their source text under ``"<name>"`` keys.
    """
    out: Dict[str, Dict[str, Any]] = {}
    for module, text in tc.config_diffs().items():
        entries: Dict[str, Any] = {}
        prefix = f"torch._{module}.config."
        for line in text.splitlines():
            name, sep, value = line.partition(" = ")
            if not sep or not name.startswith(prefix):
                continue
            try:
                entries[name[len(prefix):]] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                entries[f"<{name[len(prefix):]}>"] = value
        if entries:
            out[module] = entries
    return out


def capture_env() -> Dict[str, str]:
    """Environment variables that change how torch compiles or runs (plus determ's own)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)}


def compiler_ref(compiler: Any) -> Tuple[str, List[str]]:
    """``(name, sys_path)`` naming ``compiler`` in another process: a backend name, or ``module:qualname``
    (``sys_path``: the directory to import that module from)."""
    if isinstance(compiler, str):
        mod = compiler.partition(":")[0] if ":" in compiler else None
        return compiler, _import_root(mod) if mod else []
    mod, qual = getattr(compiler, "__module__", None), getattr(compiler, "__qualname__", None)
    name = getattr(compiler, "__name__", None) or repr(compiler)
    if mod == "__main__":
        raise ReproError(f"compiler {name!r} is defined in the script being run (__main__): another process cannot "
                         f"import it without running the script again; move it into a module and import it from there")
    if not (mod and qual) or "<" in qual:
        raise ReproError(f"compiler {name!r} has no importable name (a closure or a lambda); pass a backend name or "
                         f"a module-level function")
    return f"{mod}:{qual}", _import_root(mod)


_UNIMPORTABLE_SAID: set = set()


def unimportable_label(compiler: Any, err: Exception) -> str:
    """The label a repro records for a compiler :func:`compiler_ref` cannot name (a script repeats it for every
    graph it compiles); why is logged once per compiler."""
    label = getattr(compiler, "__name__", None) or repr(compiler)
    key = (getattr(compiler, "__module__", None), getattr(compiler, "__qualname__", label))
    if key not in _UNIMPORTABLE_SAID:
        _UNIMPORTABLE_SAID.add(key)
        log.warning("%s; repro scripts will need it edited in", err)
    return label


def _import_root(mod: str) -> List[str]:
    try:
        module = importlib.import_module(mod)
    except ImportError as e:
        raise ReproError(f"compiler module {mod!r} cannot be imported ({e})") from None
    f = getattr(module, "__file__", None)
    if not f:
        return []
    root = Path(f).resolve().parent
    for _ in range(mod.count(".") + (1 if Path(f).name == "__init__.py" else 0)):
        root = root.parent
    return [str(root)]


def _split_config(cfg: Any) -> Tuple[Dict[str, Any], Dict[str, Dict[str, Any]]]:
    """``(inductor entries, {other module: entries})`` from a nested or a flat (inductor-only) config."""
    if isinstance(cfg, (list, tuple)):
        cfg = dict(cfg)
    if not isinstance(cfg, dict):
        raise ReproError(f"meta['config']: expected a dict of config entries, got {type(cfg).__name__}")
    if cfg and all(k in _CONFIG_MODULES and isinstance(v, dict) for k, v in cfg.items()):
        return dict(cfg.get("inductor", {})), {k: dict(v) for k, v in cfg.items() if k != "inductor" and v}
    return dict(cfg), {}


def _fill_meta(meta: Optional[Dict[str, Any]], inputs: Sequence[Any], path: Path) -> Dict[str, Any]:
    m = dict(meta or {})
    if "kind" not in m:
        m["kind"] = _ORACLE_KINDS.get(m.get("oracle"), m.get("oracle")) or "any"
    if m["kind"] not in FAILURE_KINDS:
        raise ReproError(f"meta['kind']={m['kind']!r}: expected one of {', '.join(FAILURE_KINDS)}")
    if "compiler" in m and (not isinstance(m["compiler"], str) or (":" in m["compiler"] and "sys_path" not in m)):
        m["compiler"], m["sys_path"] = compiler_ref(m["compiler"])
    m.setdefault("compiler", "eager")
    m.setdefault("after", "aot" if m["compiler"] == "inductor_inner" else "dynamo")
    m.setdefault("torch_version", torch.__version__)
    devices = sorted({str(x.device) for x in inputs if isinstance(x, torch.Tensor)}) or ["cpu"]
    m.setdefault("device", devices[0] if len(devices) == 1 else ",".join(devices))
    inductor, other = _split_config(m["config"] if "config" in m else capture_compile_config())
    m["config"] = inductor
    m["config_other"] = {**other, **m.get("config_other", {})}
    m.setdefault("env", capture_env())
    m.setdefault("seed", 1234)
    m.setdefault("threads", torch.get_num_threads())  # a kernel's error inside a parallel region differs with more
    m.setdefault("created", datetime.datetime.now().isoformat(timespec="seconds"))
    m["script_name"] = path.name
    return json_safe(m)


def write_repro(gm: fx.GraphModule, inputs: Sequence[Any], path: Union[str, Path], *,
                meta: Optional[Dict[str, Any]] = None, save_data: bool = True,
                store_dir: Union[str, Path, None] = None) -> Path:
    """Write ``gm`` and ``inputs`` as a standalone script at ``path`` (atomically); returns the path.

    ``meta`` keys read by the script: ``kind`` (one of :data:`FAILURE_KINDS`), ``compiler`` (a backend
    name, ``"inductor_inner"``, ``"eager"``, ``"module:function"`` or an importable callable), ``after``
    (``dynamo``/``aot``), ``error``, ``config`` (from :func:`capture_compile_config`, captured now if
    absent; stored as inductor entries in ``config`` and the rest in ``config_other``), ``launcher`` (default subcommand ``minify``), ``tol``, ``multiplier``, ``strict``,
    ``only_fwd``, ``imports``; every other JSON-like key round-trips through :func:`load_repro`.
    Inputs keep their data in ``<store_dir or path's dir>/repro_store`` unless ``save_data`` is False
    or they are fake tensors, in which case they are regenerated from a fixed seed.
    """
    path = Path(path).resolve()
    store_path = Path(store_dir).resolve() if store_dir else path.parent / STORE_NAME
    m = _fill_meta(meta, inputs, path)
    store = StoreWriter(store_path, save_data)
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise ReproError(f"graph has {len(placeholders)} inputs but {len(inputs)} values were given")
    specs = [describe_value(x, name, store) for x, name in zip(inputs, placeholders)]
    writer = CodeWriter(store)
    writer.module_class(gm, "Repro")
    m["store"] = os.path.relpath(store_path, path.parent)
    m["store_abs"] = str(store_path)
    m["regenerated_inputs"] = store.regenerated
    # the modules of this graph's custom ops join the imports given (the ops a graph it was cut from called, which
    # the meta it inherits lists, do not), and their directories the script's sys_path
    inherited = m.pop("op_imports", [])
    given = [x for x in m.pop("imports", []) if x not in inherited]
    if given or writer.op_modules:
        m["imports"] = list(dict.fromkeys(given + writer.op_modules))
    if writer.op_modules:
        m["op_imports"] = list(writer.op_modules)
    m.pop("main_ops", None)
    if writer.main_ops:
        m["main_ops"] = dict(writer.main_ops)
    roots = module_roots(m.get("imports", []))
    if roots:
        m["sys_path"] = list(dict.fromkeys(list(m.get("sys_path") or []) + roots))
    text = script_text(m, specs, writer)
    atomic_write_text(path, text)
    os.chmod(path, 0o755)
    return path


# ------------------------------------------------------------------ reading

def repro_class_span(lines: List[str]) -> Optional[Tuple[int, int]]:
    """``(first, end)`` line indices of the ``class Repro`` block of a repro script's ``lines`` (the graph), or
    None when the script has none."""
    start = next((i for i, ln in enumerate(lines) if ln.startswith("class Repro(")), None)
    if start is None:
        return None
    end = next((i for i in range(start + 1, len(lines)) if lines[i] and not lines[i][0].isspace()), len(lines))
    return start, end


def read_meta(path: Union[str, Path]) -> Dict[str, Any]:
    """``META`` of a repro script, read without executing it."""
    literals = _literals(Path(path), ("META",))
    return literals["META"]


def add_sys_path(meta: Dict[str, Any], source: Union[str, Path]) -> None:
    """Make the directories a repro recorded (META ``sys_path``: where a ``module:function`` compiler
    lives) importable here and in the workers, which inherit ``sys.path``."""
    paths = meta.get("sys_path") or []
    if not isinstance(paths, list) or not all(isinstance(x, str) for x in paths):
        raise ReproError(f"{source}: META sys_path must be a list of directory names, got {paths!r}")
    sys.path.extend(x for x in paths if x not in sys.path)


def _literals(path: Path, names: Sequence[str]) -> Dict[str, Any]:
    if not path.is_file():
        raise ReproError(f"{path}: no such repro script")
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError) as e:
        raise ReproError(f"{path}: not a readable Python repro script ({e})") from None
    out: Dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in names:
                try:
                    out[node.targets[0].id] = ast.literal_eval(node.value)
                except ValueError:
                    raise ReproError(f"{path}: {node.targets[0].id} is not a literal; not a determ repro script") from None
    missing = [n for n in names if n not in out]
    if missing:
        raise ReproError(f"{path}: not a determ repro script (no {', '.join(missing)})")
    return out


def import_script(path: Union[str, Path]) -> types.ModuleType:
    """The script as a module (its ``main``, ``Repro``, ``load_args``...), without running ``main``."""
    path = Path(path).resolve()
    name = "_determ_repro_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        raise ReproError(f"{path}: cannot import what the repro needs ({e})") from None
    return module


def load_repro(path: Union[str, Path], device: Optional[str] = None) -> Tuple[fx.GraphModule, List[Any], Dict[str, Any]]:
    """``(gm, inputs, meta)`` of a repro script (written by :func:`write_repro`); config is not applied."""
    path = Path(path).resolve()
    meta = read_meta(path)
    if meta.get("torch_version") and meta["torch_version"] != torch.__version__:
        log.warning("%s was written with torch %s, this is torch %s; the failure may not reproduce",
                    path, meta["torch_version"], torch.__version__)
    module = import_script(path)
    missing = getattr(module, "missing_custom_op", lambda: None)()  # scripts written before it have none
    if missing:
        raise ReproError(missing)
    root = module.Repro()
    if device:
        root.to(device)
    inputs = module.load_args(device)
    gm = _retrace(root, getattr(module, "NODES", []), getattr(module, "SUBGRAPH_NODES", {}))
    return gm, inputs, dict(module.META)


class _NamingTracer(ReproTracer):
    """Traces ``Repro`` back into a graph whose call nodes get their original names and source lines (buffers
    read as attributes, augmented assignments kept in place: the runtime's tracer).

    Names are handed out in call order, so every call of the script must become a node: an op
    whose arguments hold no traced value (``iota``, ``full``, ``rand`` and what is computed from
    them) is recorded as a call too, not run while tracing and folded into a constant, which
    would also shift every later node's name onto another op.  A call that still runs while tracing
    (``torch._C._log_api_usage_once(...)``, ``torch._C._set_grad_enabled(False)`` of a graph after dynamo)
    makes no node: an entry that names its call (written since) goes to the next node making that call, and
    the entries of calls that made no node are passed over."""

    def __init__(self, nodes: Sequence[Sequence[Any]]):
        super().__init__()
        self._pending = [tuple(n) for n in nodes]

    def trace(self, root, concrete_args=None):
        with _RecordConstantOps(self):
            return super().trace(root, concrete_args)

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        src = None
        if kind in ("call_function", "call_method", "call_module") and self._pending:
            key = call_key(kind, target)
            k = next((j for j, n in enumerate(self._pending) if len(n) < 3 or n[2] == key), None)
            if k is not None:
                name, src = self._pending[k][:2]
                del self._pending[: k + 1]
        node = super().create_node(kind, target, args, kwargs, name, None if isinstance(type_expr, str) else type_expr)
        if src:
            node.meta["stack_trace"] = src
        return node


# Twin of _harness._EveryOpTraced (the scripts' torch-only runtime): importing that module here would close an
# import cycle (it reaches repro_tools.flows), and it tests for an op overload without determ's _torch_compat.
class _RecordConstantOps(torch.overrides.TorchFunctionMode):
    """While tracing: every operator call becomes a node, as it was in the graph -- one called on no
    traced value (a factory op), and one whose traced values sit inside a list (``full([2, s0], ...)``
    with a symbolic size), which the operator's own argument parser would refuse."""

    def __init__(self, tracer: fx.Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # a higher-order op (an autograd.Function, a checkpoint) is a node too: it takes its subgraphs as modules
        if tc.is_op_overload(func) or tc.is_higher_order_op(func):
            return self.tracer.create_proxy("call_function", func, args, kwargs)
        return func(*args, **kwargs)


def _subgraphs_retraced(mod: torch.nn.Module, nodes: Dict[str, Sequence[Sequence[Any]]], prefix: str = "") -> None:
    """Each subgraph module of ``mod`` written as a ``Repro_<name>`` class (the bodies a higher-order op takes) traced
    back into a GraphModule, in place: the op reads its ``graph``.  ``nodes``: the script's ``SUBGRAPH_NODES``
    (each subgraph's node names and user lines, by dotted path; older scripts have none)."""
    for name, child in list(mod.named_children()):
        if type(child).__name__.startswith("Repro_") and not isinstance(child, fx.GraphModule):
            _subgraphs_retraced(child, nodes, f"{prefix}{name}.")
            tracer = _NamingTracer(nodes.get(prefix + name, []))  # records every op call itself
            graph = tracer.trace(child)
            setattr(mod, name, fx.GraphModule(tracer.root, graph, class_name=type(child).__name__))


def _retrace(root: torch.nn.Module, nodes: Sequence[Sequence[Any]],
             subgraph_nodes: Dict[str, Sequence[Sequence[Any]]]) -> fx.GraphModule:
    tracer = _NamingTracer(nodes)
    try:
        _subgraphs_retraced(root, subgraph_nodes if isinstance(subgraph_nodes, dict) else {})
        graph = tracer.trace(root)
    except Exception as e:  # fx raises many kinds on untraceable code
        raise ReproError(f"the Repro module cannot be traced back into a graph ({type(e).__name__}: {e})") from e
    for n in graph.nodes:  # the script's "f32[4, 4]" annotations are comments, not types
        if isinstance(n.type, str):
            n.type = None
    return fx.GraphModule(tracer.root, graph, class_name="Repro")


def copy_repro(src: Union[str, Path], dst: Union[str, Path], updates: Optional[Dict[str, Any]] = None) -> Path:
    """Copy a repro script and the store files it needs to ``dst`` (a file path); returns ``dst``.

    ``updates`` changes ``META`` entries of the copy (e.g. ``{"launcher": False}``).  A different file
    already at ``dst`` is kept, renamed to ``<stem>.prev-N<suffix>`` (its store files stay next to it);
    ``dst`` being ``src`` itself is refused (the source would be lost)."""
    src, dst = Path(src).resolve(), Path(dst).resolve()
    if dst == src or (dst.exists() and os.path.samefile(src, dst)):
        raise ReproError(f"{dst}: is the repro being copied; refusing to overwrite it")
    lit = _literals(src, ("META", "INPUTS", "ATTRS"))
    sources = [src.parent / lit["META"].get("store", STORE_NAME), Path(lit["META"].get("store_abs") or src.parent)]
    dst_store = dst.parent / STORE_NAME
    keys = [spec["storage"] for spec in lit["INPUTS"] + lit["ATTRS"] if spec.get("storage")]
    copy_store_files(keys, sources, dst_store)
    text = src.read_text(encoding="utf-8")
    meta = dict(lit["META"], store=STORE_NAME, store_abs=str(dst_store), script_name=dst.name, **(updates or {}))
    text = _replace_meta(text, src, meta)
    _keep_previous(dst, text)
    atomic_write_text(dst, text)
    os.chmod(dst, 0o755)
    return dst


def _keep_previous(dst: Path, text: str) -> None:
    """Rename a file at ``dst`` that differs from ``text`` aside, so writing ``dst`` loses nothing."""
    if not dst.exists() or (dst.is_file() and dst.read_bytes() == text.encode("utf-8")):
        return
    n = 1
    while True:
        kept = dst.parent / f"{dst.stem}.prev-{n}{dst.suffix}"
        try:
            os.link(dst, kept)  # a second name for the old file; the atomic write then replaces only ``dst``
            break
        except FileExistsError:
            n += 1
    log.warning("%s existed; the previous file is kept as %s", dst, kept)


def _replace_meta(text: str, path: Path, meta: Dict[str, Any]) -> str:
    tree = ast.parse(text)
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "META":
            lines = text.splitlines(keepends=True)
            head, tail = "".join(lines[:node.lineno - 1]), "".join(lines[node.end_lineno:])
            return head + "META = " + pprint.pformat(meta, width=110, sort_dicts=True) + "\n" + tail
    raise ReproError(f"{path}: no META assignment")
