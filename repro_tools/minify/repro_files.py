"""Reading and writing the minifier's repro files, and the oracle a repro's metadata describes.

The minifier writes repro scripts (``repro.py`` with ``class Repro`` and a content
store: :mod:`repro_tools.repro.script`'s ``write_repro`` / ``load_repro``) and reads
those or graph directories (:func:`repro_tools.repro.graph_code.read_graph_dir`, the
format of its worker exchange).  :func:`spec_from_meta` turns a repro's metadata plus
command-line overrides into an :class:`~repro_tools.minify.oracles.OracleSpec`;
:func:`inherited_meta` is what a minimal repro keeps of its source's metadata.
Minifying a repro file end to end is :func:`repro_tools.minify.minifier.minify_repro`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch.fx as fx

from determ_backend.errors import ReproError

from repro_tools.repro.graph_code import read_graph_dir
from repro_tools.repro.script import load_repro, write_repro
from repro_tools.minify.oracles import KINDS, OracleSpec

__all__ = ["write_repro_any", "load_repro_any", "spec_from_meta", "inherited_meta", "regenerated_note"]

_KIND_ALIASES = {"any": "error"}
_NOT_INHERITED = frozenset({
    # the failure and the oracle: the minifier writes its own (from the spec, command-line overrides included)
    "kind", "oracle", "compiler", "config", "oracle_spec", "culprit", "tol", "multiplier", "strict", "devices",
    "runs", "timeout", "similarity", "batch_cuts",
    # the source file itself: its store, name, inputs, when and where it was written, its role
    "store", "store_abs", "script_name", "regenerated_inputs", "created", "device", "torch_version", "launcher",
    "minified", "source", "start_key",
})


def _user_paths() -> List[str]:
    """sys.path entries outside the interpreter's own prefix (where a ``module:function`` compiler may live)."""
    prefixes = {str(Path(p).resolve()) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    out = []
    for p in sys.path:
        if p and Path(p).is_dir() and not any(str(Path(p).resolve()).startswith(x) for x in prefixes):
            out.append(str(Path(p).resolve()))
    return out


def write_repro_any(gm: fx.GraphModule, inputs: Sequence[Any], directory: Union[str, Path],
                    meta: Optional[Dict[str, Any]] = None) -> Path:
    """Write a repro script of ``(gm, inputs)`` into ``directory``; returns the file to run / minify."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    meta = dict(meta or {})
    meta["sys_path"] = list(dict.fromkeys(list(meta.get("sys_path") or []) + _user_paths()))
    return Path(write_repro(gm, list(inputs), d / "repro.py", meta=meta))


def repro_target(given: Union[str, Path]) -> Path:
    """The repro file or graph directory a command loads for ``given``: a directory holding a repro script (a flow's
    ``repro/aot-0`` holds ``repro.py``, or only ``minifier_launcher.py`` at level 4 without minifying) stands for
    that script; a :class:`ReproError` for a directory holding none of them."""
    p = Path(given)
    if p.is_dir() and not (p / "graph.py").is_file():
        for name in ("repro.py", "minifier_launcher.py"):
            if (p / name).is_file():
                return p / name
        raise ReproError(f"{p}: a directory without repro.py, minifier_launcher.py or graph.py; expected a repro "
                         "script or a graph directory (graph.py + inputs.pt)")
    return p


def load_repro_any(path: Union[str, Path]) -> Tuple[fx.GraphModule, List[Any], Dict[str, Any]]:
    """``(gm, inputs, meta)`` from a repro script, or from an internal graph directory / its ``graph.py``."""
    p = Path(path)
    if not p.exists():
        raise ReproError(f"{p}: no such repro file or directory")
    graph_dir = p if p.is_dir() else p.parent
    if (graph_dir / "graph.py").is_file() and (p.is_dir() or p.name == "graph.py"):
        return read_graph_dir(graph_dir)
    gm, inputs, meta = load_repro(p)
    return gm, list(inputs), dict(meta or {})


def regenerated_note(meta: Dict[str, Any]) -> Optional[str]:
    """Why a clean answer about a repro may not be the program's: some of its tensors (inputs, weights) were
    regenerated from a fixed seed (their values were not saved: the fake inputs of an after-AOT launcher,
    ``save_data=False``).  None when every tensor holds the program's values.  (The script's runtime says the same
    in ``_harness._regenerated``.)"""
    n = meta.get("regenerated_inputs")
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        return None
    return (f"{n} tensor{'s were' if n > 1 else ' was'} regenerated from a fixed seed, not the values the program "
            "ran with: a failure that depends on the values may not show")


def inherited_meta(meta: Dict[str, Any]) -> Dict[str, Any]:
    """What a repro derived from one with ``meta`` (a checkpoint, the minimal repro) keeps of it: the
    original flow's settings (``after``, ``only_fwd``, ``stage``, ``error``, ``env``, ``config_other``,
    ``sys_path``, ``imports``, ``seed``, and any other entry), not what describes the source file or
    what the minifier states itself (failure kind, compiler, oracle settings)."""
    return {k: v for k, v in meta.items() if k not in _NOT_INHERITED}


def spec_from_meta(meta: Dict[str, Any], **overrides: Any) -> OracleSpec:
    """The oracle a repro describes (``kind``/``oracle``, ``compiler``, ``tol``, ...), with non-None overrides."""
    kind = overrides.pop("kind", None) or meta.get("oracle") or meta.get("kind") or "accuracy"
    kind = _KIND_ALIASES.get(kind, kind)
    if kind not in KINDS:
        raise ReproError(f"repro metadata: unknown failure kind {kind!r}; expected one of {', '.join(KINDS)}")
    base: Dict[str, Any] = {"kind": kind, "compiler": meta.get("compiler", "inductor")}
    for key in ("tol", "multiplier", "strict", "timeout", "similarity", "runs", "batch", "batch_dim"):
        if meta.get(key) is not None:
            base[key] = meta[key]
    if isinstance(meta.get("config"), dict):
        base["config"] = meta["config"]
    if meta.get("devices"):
        base["devices"] = tuple(meta["devices"])
    if kind == "accuracy" and meta.get("after") == "dynamo" and meta.get("only_fwd") is False:
        base["grads"] = True  # the after-dynamo check judged the training graph's gradients too
    base.update({k: v for k, v in overrides.items() if v is not None})
    if isinstance(base.get("devices"), str):
        base["devices"] = tuple(x.strip() for x in base["devices"].split(",") if x.strip())
    return OracleSpec(**base)
