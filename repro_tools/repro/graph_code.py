"""A GraphModule as Python source, and back; its input values as a tensor file of the one tensor store.

This is the minimal, pickle-free exchange format the minifier uses between its
own processes (the isolated oracle worker; ``repro-tools minify`` reads such a
directory too): ``graph.py`` holds ``class Repro(torch.nn.Module)`` whose
``forward`` is the graph's code, written by the one source writer,
:func:`repro_tools.repro.codegen.graph_source`; ``inputs.pt`` the input values.
Loading executes the generated source (written by us, never by a third party)
and re-traces it with :func:`torch.fx.symbolic_trace`.

``inputs.pt`` (and the worker's ``observed.pt``) keep their names, the graph
directory's documented layout, but are safetensors files of
:mod:`determ_backend.trace.store` (:func:`~determ_backend.trace.store.save_tensor_file`):
each distinct tensor once, keyed by its fingerprint, and the list's structure
(numbers, strings, dtypes, devices, nested lists) in the metadata.  A file of an
earlier release (``torch.save`` of the list) is still read, with
``weights_only=True``.

Standalone, user-facing repro scripts live in :mod:`repro_tools.repro.script`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple, Union

import torch
import torch.fx as fx

from determ_backend.errors import ReproError, TraceFormatError
from determ_backend.trace.store import is_safetensors, load_legacy, load_tensor_file, save_tensor_file
from determ_backend.trace.stream import atomic_write_text

from repro_tools.repro.codegen import graph_source

__all__ = ["graph_from_source", "save_tensors", "load_tensors", "write_graph_dir", "read_graph_dir"]


def graph_from_source(src: str, filename: str = "<graph>") -> fx.GraphModule:
    """Execute ``src`` (as written by :func:`graph_source`) and trace ``Repro`` back into a GraphModule."""
    ns: Dict[str, Any] = {"__name__": "determ_graph"}
    try:
        exec(compile(src, filename, "exec"), ns)  # our own generated code
    except SyntaxError as e:
        raise ReproError(f"{filename}: not a valid graph module: {e}") from e
    if "Repro" not in ns:
        raise ReproError(f"{filename}: expected a class Repro(torch.nn.Module)")
    return fx.symbolic_trace(ns["Repro"]())


_VALUES_FORMAT = "determ-graph-values"


def _encode(v: Any, named: Dict[str, torch.Tensor], path: Path) -> Dict[str, Any]:
    """One value as JSON, its tensors moved into ``named``."""
    if isinstance(v, torch.Tensor):
        name = str(len(named))
        named[name] = v
        return {"tensor": name}
    if isinstance(v, float):
        return {"float": repr(v)}  # inf and nan too
    if v is None or isinstance(v, (bool, int, str)):
        return {"value": v}
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).replace("torch.", "")}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    if isinstance(v, (list, tuple)):
        kind = "size" if isinstance(v, torch.Size) else "tuple" if isinstance(v, tuple) else "list"
        return {kind: [_encode(x, named, path) for x in v]}
    raise ReproError(f"{path}: a {type(v).__name__} cannot be saved (tensors, numbers, strings, dtypes, devices "
                     f"and lists of them)")


def _decode(spec: Dict[str, Any], tensors: Dict[str, torch.Tensor]) -> Any:
    ((kind, x),) = spec.items()
    if kind == "tensor":
        return tensors[x]
    if kind == "float":
        return float(x)
    if kind == "value":
        return x
    if kind == "dtype":
        dt = getattr(torch, x)
        if not isinstance(dt, torch.dtype):
            raise TypeError(x)
        return dt
    if kind == "device":
        return torch.device(x)
    items = [_decode(s, tensors) for s in x]
    return {"list": list, "tuple": tuple, "size": torch.Size}[kind](items)


def save_tensors(values: Sequence[Any], path: Union[str, Path]) -> None:
    """Atomically save a list of tensors / python scalars (safetensors, see the module's docstring)."""
    path = Path(path)
    named: Dict[str, torch.Tensor] = {}
    spec = [_encode(v, named, path) for v in values]
    save_tensor_file(path, named, {"format": _VALUES_FORMAT, "values": json.dumps(spec)})


def load_tensors(path: Union[str, Path]) -> List[Any]:
    """The list written by :func:`save_tensors` (or by ``torch.save`` in an earlier release); a clear
    :class:`ReproError` when missing or corrupt."""
    path = Path(path)
    if not path.is_file():
        raise ReproError(f"{path}: input file missing")
    if is_safetensors(path):
        try:
            tensors, meta = load_tensor_file(path)
            out = [_decode(s, tensors) for s in json.loads(meta["values"])]
        except TraceFormatError as e:
            raise ReproError(str(e)) from None
        except (KeyError, ValueError, TypeError, AttributeError, RuntimeError):
            raise ReproError(f"{path}: not a list of values written by determ (bad 'values' metadata)") from None
        return out
    try:
        out = load_legacy(path)
    except Exception as e:  # torch raises several unrelated types for a corrupt file
        raise ReproError(f"{path}: cannot load tensors ({type(e).__name__}: {e})") from e
    if not isinstance(out, list):
        raise ReproError(f"{path}: expected a list of inputs, got {type(out).__name__}")
    return out


def write_graph_dir(gm: fx.GraphModule, inputs: Sequence[Any], directory: Union[str, Path],
                    meta: Dict[str, Any] = None) -> Path:
    """Write ``graph.py``, ``inputs.pt`` and ``meta.json`` into ``directory``; returns the ``graph.py`` path."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_tensors(inputs, d / "inputs.pt")
    atomic_write_text(d / "meta.json", json.dumps(meta or {}, indent=1, sort_keys=True, default=str))
    atomic_write_text(d / "graph.py", graph_source(gm))
    return d / "graph.py"


def read_graph_dir(path: Union[str, Path]) -> Tuple[fx.GraphModule, List[Any], Dict[str, Any]]:
    """Inverse of :func:`write_graph_dir`; ``path`` is the directory or its ``graph.py``."""
    p = Path(path)
    d = p if p.is_dir() else p.parent
    src_path = d / "graph.py"
    if not src_path.is_file():
        raise ReproError(f"{p}: expected a graph directory holding graph.py")
    meta: Dict[str, Any] = {}
    if (d / "meta.json").is_file():
        try:
            meta = json.loads((d / "meta.json").read_text())
        except ValueError as e:
            raise ReproError(f"{d / 'meta.json'}: not JSON ({e})") from e
    gm = graph_from_source(src_path.read_text(), str(src_path))
    return gm, load_tensors(d / "inputs.pt"), meta
