"""The one GraphModule -> Python source writer: ``class Repro`` from a GraphModule, and a repro script's text.

:class:`CodeWriter` turns a GraphModule (and nested GraphModules of higher-order
ops, and torch.nn leaf modules of ``call_module`` nodes) into classes whose
``forward`` is the graph's code with the user's source lines as comments, and
collects the imports and the tensor attributes (parameters, buffers, constants)
to load from the content store.  Its two products:

* :func:`script_text` -- a whole repro script (config function, runtime, data
  descriptions); writing and reading the file lives in :mod:`repro_tools.repro.script`;
* :func:`graph_source` -- a self-contained module holding ``class Repro`` alone
  (no store, no comments), the graph file of the minifier's exchange format;
  reading it back and the inputs beside it live in :mod:`repro_tools.repro.graph_code`.
"""

from __future__ import annotations

import builtins
import keyword
import logging
import math
import os
import pprint
import re
import sys
import sysconfig
import types
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.fx as fx

from determ_backend import _torch_compat as tc
from determ_backend.errors import ReproError

from repro_tools.repro.store import StoreWriter

__all__ = ["CodeWriter", "script_text", "graph_source"]

log = logging.getLogger(__name__)

_BUILTIN_NAMESPACES = {"aten", "prims", "quantized", "higher_order", "_c10d_functional", "c10d_functional",
                       "_dtensor", "inductor", "profiler", "debugprims", "rngprims", "_quantized", "quantized_decomposed"}
_CALL_OPS = ("call_function", "call_method", "call_module")


def call_key(kind: str, target: Any) -> str:
    """What a call node calls, as text that is the same for the graph a script was written from and for the graph
    traced back from the script (``call_function:torch.nn.functional.relu``, ``call_method:view``): a script's
    ``NODES`` entry goes to the node that makes the same call, not merely the next one."""
    if isinstance(target, str):
        return f"{kind}:{target}"
    if tc.is_op_overload(target) or tc.is_op_overload_packet(target):
        return f"{kind}:{target}"
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    return f"{kind}:{getattr(target, '__module__', None) or ''}.{name}"
_RUNTIME = [Path(__file__).with_name("_inputs.py"), Path(__file__).with_name("_harness.py")]
_HEADER = "import torch\nimport torch.fx\nfrom torch import device\n"


_FX_WRAP = re.compile(r"^torch\.fx\._symbolic_trace\.wrap\(")


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


def _last_frame(stack_trace: str) -> str:
    """The innermost ``File ..., line N, in f`` line of a node's stack trace, with its code line."""
    lines = stack_trace.rstrip().splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.strip().startswith("File ")]
    return "\n".join(lines[starts[-1]:starts[-1] + 2]) if starts else stack_trace[-300:]


def _set_module(target: str, expr: str) -> str:
    """The ``__init__`` line that makes ``expr`` the submodule at ``target``: an assignment where the name is an
    identifier, else the script's ``install_module`` (``0``, ``layers.0``: an ``nn.Sequential`` traced by fx)."""
    if target.isidentifier() and not keyword.iskeyword(target):
        return f"self.{target} = {expr}"
    return f"install_module(self, {target!r}, {expr})"


class CodeWriter:
    """Emits one class per (sub)graph; collects imports, custom-op modules and tensor attributes.

    ``store``: where tensor attributes go (the top-level class calls the runtime's ``install_attrs``);
    None for a self-contained class, which then cannot hold tensors.  ``verbose``: type annotations and
    the user's source lines as comments."""

    def __init__(self, store: Optional[StoreWriter], verbose: bool = True):
        self.store, self.verbose = store, verbose
        self.imports: Dict[str, str] = {}
        self.op_modules: List[str] = []
        self.attrs: List[Dict[str, Any]] = []
        self.classes: List[str] = []
        self.nodes: List[List[Any]] = []
        self.subgraph_nodes: Dict[str, List[List[Any]]] = {}  # the same of each subgraph, by its dotted path
        self.main_ops: Dict[str, str] = {}  # custom ops no module can give the script -> the file that defined them
        self.wraps: Dict[str, None] = {}  # fx wrap() lines of traced graphs, for the module's top level

    def module_class(self, gm: fx.GraphModule, cls_name: str, prefix: str = "") -> str:
        code = gm.graph.python_code(root_module="self", verbose=self.verbose)
        for k, v in sorted(code.globals.items()):
            line = _import_line(k, v)
            if line:
                self.imports.setdefault(k, line)
        self._scan_custom_ops(gm)
        nodes = [[n.name, _last_frame(n.meta["stack_trace"]) if n.meta.get("stack_trace") else None,
                  call_key(n.op, n.target)] for n in gm.graph.nodes if n.op in _CALL_OPS]
        if not prefix:
            self.nodes = nodes
        elif any(src for _, src, _ in nodes):  # a checkpoint's body: its nodes keep their names and user lines
            self.subgraph_nodes[prefix.rstrip(".")] = nodes
        init = self._init_lines(gm, prefix)
        # fx's ``wrap("math_sqrt")`` lines (a symbolically traced call to a wrapped function) keep the function a leaf
        # when the script traces its class back into a graph; fx refuses them anywhere but at a module's top level
        lines = []
        for ln in code.src.strip("\n").splitlines():
            if _FX_WRAP.match(ln):
                self.wraps.setdefault(ln.strip(), None)
            else:
                lines.append(ln)
        body = "\n".join("    " + ln if ln.strip() else "" for ln in lines)
        src = f"class {cls_name}(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        src += "".join(f"        {ln}\n" for ln in init)
        if not prefix and self.store is not None:
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
                lines.append(_set_module(n.target, f"{sub}()"))
            elif isinstance(value, torch.nn.Module):
                lines.append(_set_module(n.target, _leaf_module_expr(value, n.target)))
                for pname, p in list(value.named_parameters()) + list(value.named_buffers()):
                    self._attr(f"{full}.{pname}", p)
            elif isinstance(value, torch.Tensor):
                self._attr(full, value)
            else:
                raise ReproError(f"graph attribute {n.target!r} is a {type(value).__name__}; only tensors and "
                                 "modules can be written to a repro")
        return lines

    def _attr(self, name: str, t: torch.Tensor) -> None:
        if self.store is None:
            raise ReproError(f"graph attribute {name!r} is a tensor; a graph holding tensors is written as a repro "
                             "script (repro_tools.repro.script.write_repro), or with its tensors as inputs")
        spec = self.store.describe(t, name)
        spec["attr_kind"] = "parameter" if isinstance(t, torch.nn.Parameter) else "buffer"
        self.attrs.append(spec)

    def import_lines(self, modules: Sequence[str] = ()) -> str:
        """The imports the classes need: torch, ``modules`` (custom ops' homes), then each global.  A module that is
        not torch's is imported under a guard: run as a script where it cannot be imported, the script says so in
        one line and exits 2 (bad input), not with a traceback and exit 1 (which means "reproduced")."""
        return (_HEADER + "".join(_module_import(mod) for mod in dict.fromkeys([*modules, *self.op_modules]))
                + "\n".join(sorted(self.imports.values())) + "\n" + "".join(f"{w}\n" for w in self.wraps))

    def _scan_custom_ops(self, gm: fx.GraphModule) -> None:
        for n in gm.graph.nodes:
            if n.op != "call_function":
                continue
            # an overload (``torch.ops.ns.op.default``) or a packet (``torch.ops.ns.op``, as user code calls it)
            qual = tc.op_packet_name(n.target) if tc.is_op_overload_packet(n.target) else tc.op_schema_name(n.target)
            ns = qual.split("::", 1)[0] if qual and "::" in qual else None
            lazy = tc.op_registering_module(qual) if ns else None
            if lazy and lazy not in self.op_modules:  # a torch op that exists once that module ran (inductor's prims)
                self.op_modules.append(lazy)
            if ns and ns not in _BUILTIN_NAMESPACES:
                mod = tc.custom_op_module(qual)
                if mod and mod != "__main__" and mod not in self.op_modules:
                    self.op_modules.append(mod)
                elif not mod or mod == "__main__":
                    where = getattr(sys.modules.get("__main__"), "__file__", None) if mod == "__main__" else None
                    self.main_ops[qual] = where or "an unknown module"
                    log.warning("custom op %s is defined in %s%s: a repro script cannot import it; define it in a "
                                "module the program imports (or pass meta={'imports': [...]})", qual,
                                where or "an unknown module", " (the main script)" if where else "")


def _module_import(mod: str) -> str:
    if mod == "torch" or mod.startswith("torch."):
        return f"import {mod}\n"
    return (f"try:\n    import {mod}\n"
            f"except Exception as _e:  # where the graph's custom ops are defined (an import, a load_library failing)\n"
            f"    if __name__ != '__main__':\n        raise\n"
            f"    print(os.path.basename(__file__) + ': cannot import {mod}, which defines custom ops this graph calls (' "
            f"+ str(_e) + '); run it where {mod} can be imported (its directory on PYTHONPATH)', file=sys.stderr)\n"
            f"    sys.exit(2)\n")


def module_roots(modules: Sequence[str]) -> List[str]:
    """The directories ``modules`` (loaded now) are imported from, those outside the installed packages: a script
    that imports them extends ``sys.path`` with these first, so it runs from any working directory."""
    installed = {os.path.realpath(p) for p in (sysconfig.get_paths().get("purelib"), sysconfig.get_paths().get("platlib"))
                 if p}
    roots: List[str] = []
    for name in modules:
        f = getattr(sys.modules.get(name), "__file__", None)
        if not f or name == "__main__":
            continue
        p = Path(f).resolve()
        depth = name.count(".") + (1 if p.name == "__init__.py" else 0)
        root = str(p.parents[depth]) if depth < len(p.parents) else None
        if root and root not in installed and root not in roots:
            roots.append(root)
    return roots


def graph_source(gm: fx.GraphModule) -> str:
    """Source of a module holding ``class Repro(torch.nn.Module)`` whose forward is ``gm``'s graph, with
    nothing else to load: a graph whose tensors are all inputs (the minifier's candidates), with torch.nn
    leaf modules and nested GraphModules written as code."""
    writer = CodeWriter(None, verbose=False)
    writer.module_class(gm, "Repro")
    return writer.import_lines() + "\n\n" + "\n\n".join(writer.classes)


def _runtime_source() -> str:
    """The scripts' runtime: the two runtime modules without docstrings and placeholder blocks."""
    parts = []
    for path in _RUNTIME:
        src = path.read_text(encoding="utf-8")
        start, end = src.index("# --- placeholders"), src.index("# --- end placeholders ---")
        body = src[:start] + src[end + len("# --- end placeholders ---\n"):]
        parts.append(body[body.index('"""', 3) + 3:].strip("\n") + "\n")
    return "\n\n".join(parts)


def _config_function(config: Dict[str, Dict[str, Any]]) -> str:
    lines = ["def compile_config():",
             '    """Compile-time config that differed from the defaults when the graph was compiled.\n\n'
             '    ``(config module, {name: value})`` pairs, applied with ``module.patch(...)`` while compiling."""']
    items = []
    for module, entries in sorted(config.items()):
        if not entries:
            continue
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


def script_text(m: Dict[str, Any], specs: List[Dict[str, Any]], writer: CodeWriter) -> str:
    env = {k: v for k, v in m.get("env", {}).items() if not k.endswith("CACHE_DIR") and not k.startswith(("DETERM_", "REPRO_"))}
    parts = ["#!/usr/bin/env python3\n" + _docstring(m),
             "import os\nimport sys\n",
             f"if __name__ == '__main__':  # env vars set when the graph was compiled (before torch is imported)\n"
             f"    for _k, _v in {env!r}.items():\n        os.environ.setdefault(_k, _v)\n",
             *([f"sys.path.extend(_p for _p in {list(m['sys_path'])!r} if _p not in sys.path)  # where the modules "
                f"below were imported from\n"] if m.get("sys_path") else []),
             writer.import_lines(m.get("imports", [])),
             "META = " + pprint.pformat(m, width=110, sort_dicts=True) + "\n",
             "INPUTS = " + pprint.pformat(specs, width=110) + "\n",
             "ATTRS = " + pprint.pformat(writer.attrs, width=110) + "\n",
             "NODES = " + pprint.pformat(writer.nodes, width=110) + "  # [node name, user source line, call], in order\n",
             *(["SUBGRAPH_NODES = " + pprint.pformat(writer.subgraph_nodes, width=110) + "  # NODES of each subgraph\n"]
               if writer.subgraph_nodes else []),
             _config_function({"inductor": m.get("config", {}), **m.get("config_other", {})}),
             *writer.classes,
             "\n# ---- runtime (written by determ's repro_tools; needs only torch) ----\n" + _runtime_source(),
             "\nif __name__ == '__main__':\n    sys.exit(main())\n"]
    return "\n\n".join(p.rstrip("\n") + "\n" for p in parts)


