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
``run``, ``minify``, ``analyze``, ``get-args``) is :mod:`repro_tools._repro_harness`.

:func:`load_repro` reads a script back as ``(gm, inputs, meta)``.  The
minifier, the flows and ``analyze`` live elsewhere.
"""

from __future__ import annotations

import ast
import builtins
import datetime
import hashlib
import importlib.util
import json
import logging
import math
import os
import pprint
import shutil
import struct
import tempfile
import types
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.fx as fx

from determ_backend import _torch_compat as tc
from determ_backend.errors import ReproError
from determ_backend.trace import atomic_write_text

__all__ = ["write_repro", "load_repro", "read_meta", "copy_repro", "capture_compile_config", "capture_env",
           "compiler_ref", "FAILURE_KINDS", "STORE_NAME"]

log = logging.getLogger(__name__)

FAILURE_KINDS = ("compile_error", "runtime_error", "accuracy", "nondeterminism", "crash", "any")
STORE_NAME = "repro_store"
_KEY_LEN = 40
_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_COMPILE", "TORCH_LOGS", "PYTORCH_", "CUBLAS_",
                 "CUDA_LAUNCH_BLOCKING", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "DETERM_", "REPRO_")
_BUILTIN_NAMESPACES = {"aten", "prims", "quantized", "higher_order", "_c10d_functional", "c10d_functional",
                       "_dtensor", "inductor", "profiler", "debugprims", "rngprims", "_quantized", "quantized_decomposed"}
_HARNESS = Path(__file__).with_name("_repro_harness.py")


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
    """``(name, sys_path)`` naming ``compiler`` in another process: a backend name, or ``module:qualname``."""
    if isinstance(compiler, str):
        return compiler, []
    mod, qual = getattr(compiler, "__module__", None), getattr(compiler, "__qualname__", None)
    if not (mod and qual) or "<" in qual or mod == "__main__":
        raise ReproError(f"compiler {compiler!r} has no importable name; pass a backend name or a module-level function")
    module = importlib.import_module(mod)
    path: List[str] = []
    f = getattr(module, "__file__", None)
    if f:
        root = Path(f).resolve().parent
        for _ in range(mod.count(".") + (1 if Path(f).name == "__init__.py" else 0)):
            root = root.parent
        path = [str(root)]
    return f"{mod}:{qual}", path


# ------------------------------------------------------------------ content store

def _storage_bytes(t: torch.Tensor) -> memoryview:
    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    return memoryview(raw.detach().cpu().numpy())


def _write_store_file(store: Path, data: memoryview) -> str:
    key = hashlib.sha256(data).hexdigest()[:_KEY_LEN]
    path = store / f"{key}.safetensors"
    if path.is_file():
        return key
    store.mkdir(parents=True, exist_ok=True)
    header = json.dumps({"data": {"dtype": "U8", "shape": [len(data)], "data_offsets": [0, len(data)]},
                         "__metadata__": {"sha256_prefix": key}}).encode()
    header += b" " * (-len(header) % 8)
    fd, tmp = tempfile.mkstemp(dir=store, prefix=f".{key}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return key


class _StoreWriter:
    """Describes tensors for the script; writes each distinct storage once (when data is available)."""

    def __init__(self, store: Path, save_data: bool):
        self.store, self.save_data = store, save_data
        self.keys: Dict[Tuple[str, int, int], str] = {}
        self.regenerated = 0

    def describe(self, t: torch.Tensor, name: str) -> Dict[str, Any]:
        if t.layout != torch.strided:
            raise ReproError(f"input {name!r}: layout {t.layout} cannot be written to a repro (dense tensors only)")
        spec: Dict[str, Any] = {"kind": "tensor", "name": name, "dtype": str(t.dtype).replace("torch.", ""),
                                "shape": [_int(s) for s in t.shape], "stride": [_int(s) for s in t.stride()],
                                "offset": _int(t.storage_offset()), "device": str(t.device)}
        if t.requires_grad:
            spec["requires_grad"] = True
        if self.save_data and not tc.is_fake_tensor(t) and t.device.type != "meta":
            st = t.untyped_storage()
            ident = (str(t.device), st.data_ptr(), st.nbytes())
            if ident not in self.keys:
                self.keys[ident] = _write_store_file(self.store, _storage_bytes(t))
            spec["storage"] = self.keys[ident]
        else:
            self.regenerated += 1
        return spec


def _int(s: Any) -> int:
    return tc.symint_hint(s) if isinstance(s, torch.SymInt) else int(s)


def _describe_value(x: Any, name: str, store: _StoreWriter) -> Dict[str, Any]:
    if isinstance(x, torch.Tensor):
        return store.describe(x, name)
    if isinstance(x, torch.SymInt):
        return {"kind": "int", "name": name, "value": tc.symint_hint(x)}
    if isinstance(x, torch.SymFloat):
        return {"kind": "float", "name": name, "value": float(x)}
    if isinstance(x, torch.device):
        return {"kind": "device", "name": name, "value": str(x)}
    if isinstance(x, torch.dtype):
        return {"kind": "dtype", "name": name, "value": str(x).replace("torch.", "")}
    if x is None or isinstance(x, (bool, int, float, str)):
        return {"kind": type(x).__name__, "name": name, "value": _json_safe(x)}
    raise ReproError(f"input {name!r}: a {type(x).__name__} cannot be written to a repro "
                     "(tensors, ints, floats, bools, strings, devices and dtypes only)")


# ------------------------------------------------------------------ graph code

def _import_line(name: str, value: Any) -> Optional[str]:
    if getattr(builtins, name, None) is value or name in ("torch", "device"):
        return None
    if isinstance(value, types.ModuleType):
        return f"import {value.__name__} as {name}" if value.__name__ != name else f"import {name}"
    if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
        return f"{name} = float({str(value)!r})"
    if value is type(None):
        return f"{name} = type(None)"
    mod, qual = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if mod and qual and "<" not in qual and mod != "__main__":
        top, _, rest = qual.partition(".")
        return f"from {mod} import {top} as {name}" if not rest else f"import {mod}\n{name} = {mod}.{qual}"
    raise ReproError(f"graph uses the global {name!r} = {value!r}, which has no importable name; cannot write it as code")


def _fetch(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _leaf_module_expr(mod: torch.nn.Module, target: str) -> str:
    cls = type(mod)
    if not cls.__module__.startswith("torch.nn.modules") or any(True for _ in mod.children()):
        raise ReproError(f"graph calls submodule {target!r} ({cls.__name__}); only torch.nn leaf modules "
                         "and GraphModules can be written to a repro")
    return f"torch.nn.{repr(mod)}"


class _CodeWriter:
    """Emits one class per (sub)graph; collects imports, custom-op modules and tensor attributes."""

    def __init__(self, store: _StoreWriter):
        self.store = store
        self.imports: Dict[str, str] = {}
        self.op_modules: List[str] = []
        self.attrs: List[Dict[str, Any]] = []
        self.classes: List[str] = []

    def module_class(self, gm: fx.GraphModule, cls_name: str, prefix: str = "") -> str:
        code = gm.graph.python_code(root_module="self", verbose=True)
        for k, v in sorted(code.globals.items()):
            line = _import_line(k, v)
            if line:
                self.imports.setdefault(k, line)
        self._scan_custom_ops(gm)
        init = self._init_lines(gm, prefix)
        body = "\n".join("    " + ln if ln.strip() else "" for ln in code.src.strip("\n").splitlines())
        src = f"class {cls_name}(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        src += "".join(f"        {ln}\n" for ln in init)
        if not prefix:
            src += "        install_attrs(self)  # parameters, buffers and constants (ATTRS)\n"
        self.classes.append(src + "\n" + body.rstrip() + "\n")
        return cls_name

    def _init_lines(self, gm: fx.GraphModule, prefix: str) -> List[str]:
        lines, seen = [], set()
        for n in gm.graph.nodes:
            if n.op not in ("get_attr", "call_module") or n.target in seen:
                continue
            seen.add(n.target)
            value = _fetch(gm, n.target)
            full = prefix + n.target
            if isinstance(value, fx.GraphModule):
                sub = self.module_class(value, "Repro_" + full.replace(".", "_"), prefix=full + ".")
                lines.append(f"self.{n.target} = {sub}()")
            elif isinstance(value, torch.nn.Module):
                lines.append(f"self.{n.target} = {_leaf_module_expr(value, n.target)}")
                for pname, p in list(value.named_parameters()) + list(value.named_buffers()):
                    self._attr(f"{full}.{pname}", p)
            elif isinstance(value, torch.Tensor):
                self._attr(full, value)
            else:
                raise ReproError(f"graph attribute {n.target!r} is a {type(value).__name__}; only tensors and "
                                 "modules can be written to a repro")
        return lines

    def _attr(self, name: str, t: torch.Tensor) -> None:
        spec = self.store.describe(t, name)
        spec["attr_kind"] = "parameter" if isinstance(t, torch.nn.Parameter) else "buffer"
        self.attrs.append(spec)

    def _scan_custom_ops(self, gm: fx.GraphModule) -> None:
        for n in gm.graph.nodes:
            ns = getattr(n.target, "namespace", None)
            if n.op == "call_function" and ns and ns not in _BUILTIN_NAMESPACES:
                qual = n.target._schema.name
                mod = tc.custom_op_module(qual)
                if mod and mod != "__main__" and mod not in self.op_modules:
                    self.op_modules.append(mod)
                elif not mod or mod == "__main__":
                    log.warning("custom op %s: its defining module is not importable; pass meta={'imports': [...]}", qual)


# ------------------------------------------------------------------ writing

def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def _harness_source() -> str:
    src = _HARNESS.read_text(encoding="utf-8")
    start, end = src.index("# --- placeholders"), src.index("# --- end placeholders ---")
    body = src[:start] + src[end + len("# --- end placeholders ---\n"):]
    return body[body.index('"""', 3) + 3:].lstrip("\n")  # drop the module docstring


def _config_function(config: Dict[str, Dict[str, Any]]) -> str:
    lines = ["def compile_config():",
             '    """Compile-time config that differed from the defaults when the graph was compiled.\n\n'
             '    ``(config module, {name: value})`` pairs, applied with ``module.patch(...)`` while compiling."""']
    items = []
    for module, entries in sorted(config.items()):
        lines.append(f"    import torch._{module}.config")
        literal = {k: v for k, v in sorted(entries.items()) if not k.startswith("<")}
        lines.extend(f"    # not restored (not a literal): torch._{module}.config.{k[1:-1]} = {v}"
                     for k, v in sorted(entries.items()) if k.startswith("<"))
        if literal:
            items.append(f"        (torch._{module}.config, {literal!r}),")
    lines.append("    return [\n" + "\n".join(items) + "\n    ]" if items else "    return []")
    return "\n".join(lines) + "\n"


def _docstring(meta: Dict[str, Any]) -> str:
    err = (meta.get("error") or "").strip()
    err = "\n".join("    " + ln for ln in err.splitlines()[-12:]).replace('"""', "'''").replace("\\", "\\\\")
    what = "Minifier launcher" if meta.get("launcher") else "Repro"
    s = (f'"""{what}: {meta.get("kind")} with compiler {meta.get("compiler")!r} (intercepted after '
         f'{meta.get("after")}), torch {meta.get("torch_version")}, device {meta.get("device")}.\n\n')
    if err:
        s += f"Original failure:\n{err}\n\n"
    default = "minify" if meta.get("launcher") else "run"
    s += (f"Usage: python {meta.get('script_name', 'repro.py')} [run|minify|analyze|get-args] [--help]   (default: {default})\n"
          "  run       exit 1 and print the failure when it reproduces, exit 0 when it does not (torch alone)\n"
          "  minify    shrink the graph to a minimal repro (needs determ)\n"
          "  analyze   per-node compiled vs eager vs fp64 and determinism report (needs determ)\n"
          "  get-args  describe (or --out FILE: save) the inputs\n"
          'Inputs: the content store "repro_store/" next to this file, or regenerated with a fixed seed.\n"""\n')
    return s


def _fill_meta(meta: Optional[Dict[str, Any]], inputs: Sequence[Any], path: Path) -> Dict[str, Any]:
    m = dict(meta or {})
    m.setdefault("kind", "any")
    if m["kind"] not in FAILURE_KINDS:
        raise ReproError(f"meta['kind']={m['kind']!r}: expected one of {', '.join(FAILURE_KINDS)}")
    if "compiler" in m and not isinstance(m["compiler"], str):
        m["compiler"], m["sys_path"] = compiler_ref(m["compiler"])
    m.setdefault("compiler", "eager")
    m.setdefault("after", "dynamo")
    m.setdefault("torch_version", torch.__version__)
    devices = sorted({str(x.device) for x in inputs if isinstance(x, torch.Tensor)}) or ["cpu"]
    m.setdefault("device", devices[0] if len(devices) == 1 else ",".join(devices))
    if "config" not in m:
        m["config"] = capture_compile_config()
    m.setdefault("env", capture_env())
    m.setdefault("seed", 1234)
    m.setdefault("created", datetime.datetime.now().isoformat(timespec="seconds"))
    m["script_name"] = path.name
    return _json_safe(m)


def write_repro(gm: fx.GraphModule, inputs: Sequence[Any], path: Union[str, Path], *,
                meta: Optional[Dict[str, Any]] = None, save_data: bool = True,
                store_dir: Union[str, Path, None] = None) -> Path:
    """Write ``gm`` and ``inputs`` as a standalone script at ``path`` (atomically); returns the path.

    ``meta`` keys read by the script: ``kind`` (one of :data:`FAILURE_KINDS`), ``compiler`` (a backend
    name, ``"inductor_inner"``, ``"eager"``, ``"module:function"`` or an importable callable), ``after``
    (``dynamo``/``aot``), ``error``, ``config`` (from :func:`capture_compile_config`, captured now if
    absent), ``launcher`` (default subcommand ``minify``), ``tol``, ``multiplier``, ``strict``,
    ``only_fwd``, ``imports``; every other JSON-like key round-trips through :func:`load_repro`.
    Inputs keep their data in ``<store_dir or path's dir>/repro_store`` unless ``save_data`` is False
    or they are fake tensors, in which case they are regenerated from a fixed seed.
    """
    path = Path(path).resolve()
    store_path = Path(store_dir).resolve() if store_dir else path.parent / STORE_NAME
    m = _fill_meta(meta, inputs, path)
    store = _StoreWriter(store_path, save_data)
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise ReproError(f"graph has {len(placeholders)} inputs but {len(inputs)} values were given")
    specs = [_describe_value(x, name, store) for x, name in zip(inputs, placeholders)]
    writer = _CodeWriter(store)
    writer.module_class(gm, "Repro")
    m["store"] = os.path.relpath(store_path, path.parent)
    m["store_abs"] = str(store_path)
    m["regenerated_inputs"] = store.regenerated
    if writer.op_modules:
        m["imports"] = list(dict.fromkeys(list(m.get("imports", [])) + writer.op_modules))
    text = _script_text(m, specs, writer)
    atomic_write_text(path, text)
    os.chmod(path, 0o755)
    return path


def _script_text(m: Dict[str, Any], specs: List[Dict[str, Any]], writer: _CodeWriter) -> str:
    env = {k: v for k, v in m.get("env", {}).items() if not k.endswith("CACHE_DIR") and not k.startswith(("DETERM_", "REPRO_"))}
    parts = ["#!/usr/bin/env python3\n" + _docstring(m),
             "import os\nimport sys\n",
             f"if __name__ == '__main__':  # env vars set when the graph was compiled (before torch is imported)\n"
             f"    for _k, _v in {env!r}.items():\n        os.environ.setdefault(_k, _v)\n",
             "import torch\nimport torch.fx\nfrom torch import device\n" + "".join(f"import {mod}\n" for mod in m.get("imports", []))
             + "\n".join(sorted(writer.imports.values())) + "\n",
             "META = " + pprint.pformat(m, width=110, sort_dicts=True) + "\n",
             "INPUTS = " + pprint.pformat(specs, width=110) + "\n",
             "ATTRS = " + pprint.pformat(writer.attrs, width=110) + "\n",
             _config_function(m.get("config", {})),
             *writer.classes,
             "\n# ---- runtime (written by determ's repro_tools; needs only torch) ----\n" + _harness_source(),
             "\nif __name__ == '__main__':\n    sys.exit(main())\n"]
    return "\n\n".join(p.rstrip("\n") + "\n" for p in parts)


# ------------------------------------------------------------------ reading

def read_meta(path: Union[str, Path]) -> Dict[str, Any]:
    """``META`` of a repro script, read without executing it."""
    literals = _literals(Path(path), ("META",))
    return literals["META"]


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


def _import_script(path: Path) -> types.ModuleType:
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
    module = _import_script(path)
    root = module.Repro()
    if device:
        root.to(device)
    inputs = module.load_args(device)
    gm = fx.GraphModule(root, _retrace(root).graph, class_name="Repro")
    return gm, inputs, dict(module.META)


def _retrace(root: torch.nn.Module) -> fx.GraphModule:
    try:
        return fx.symbolic_trace(root)
    except Exception as e:  # fx raises many kinds on untraceable code
        raise ReproError(f"the Repro module cannot be traced back into a graph ({type(e).__name__}: {e})") from e


def copy_repro(src: Union[str, Path], dst: Union[str, Path]) -> Path:
    """Copy a repro script and the store files it needs to ``dst`` (a file path); returns ``dst``."""
    src, dst = Path(src).resolve(), Path(dst).resolve()
    lit = _literals(src, ("META", "INPUTS", "ATTRS"))
    src_store = src.parent / lit["META"].get("store", STORE_NAME)
    dst_store = dst.parent / STORE_NAME
    for spec in lit["INPUTS"] + lit["ATTRS"]:
        key = spec.get("storage")
        if key and not (dst_store / f"{key}.safetensors").is_file():
            found = [p for p in (src_store / f"{key}.safetensors", Path(lit["META"].get("store_abs", "")) / f"{key}.safetensors") if p.is_file()]
            if not found:
                raise ReproError(f"{src_store / (key + '.safetensors')}: missing input file; cannot copy {src}")
            dst_store.mkdir(parents=True, exist_ok=True)
            tmp = dst_store / f".{key}.copy.tmp"
            shutil.copyfile(found[0], tmp)
            os.replace(tmp, dst_store / f"{key}.safetensors")
    text = src.read_text(encoding="utf-8")
    meta = dict(lit["META"], store=STORE_NAME, store_abs=str(dst_store), script_name=dst.name)
    text = _replace_meta(text, src, meta)
    atomic_write_text(dst, text)
    os.chmod(dst, 0o755)
    return dst


def _replace_meta(text: str, path: Path, meta: Dict[str, Any]) -> str:
    tree = ast.parse(text)
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "META":
            lines = text.splitlines(keepends=True)
            head, tail = "".join(lines[:node.lineno - 1]), "".join(lines[node.end_lineno:])
            return head + "META = " + pprint.pformat(meta, width=110, sort_dicts=True) + "\n" + tail
    raise ReproError(f"{path}: no META assignment")
