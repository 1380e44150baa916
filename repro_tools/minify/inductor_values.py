"""Per-node compiled values from one inductor compile: the buffers inductor materializes.

:class:`BufferValues` is a compiler for :func:`repro_tools.minify.oracles.check_observed`:
it compiles like ``inductor`` (``compile_fx``) or ``inductor_inner``
(``compile_fx_inner``), with the wrapper instrumentation of
:mod:`determ_backend.backends.inductor_instrument` (kernels untouched, so the numbers are
the plain compile's), and after the run :meth:`BufferValues.values` returns
``{node of the compiled graph: value}`` for the nodes whose output inductor wrote
to a buffer of its own.

Inductor names a buffer by the node of *its* graph (decomposed, post-grad) whose
lowering produced it (``origin_node``, set only for a non-view result); that
node's ``from_node`` provenance leads back to a node of the graph we compiled.
A value is kept only when the match is unambiguous: one buffer for the inner
node, one node of ours behind it, and the inner node is the only one of that
node's inner nodes whose value leaves them, with our node's shape and dtype
(for a tuple-valued node, the same for each ``getitem`` of it).  Fused
intermediates are never materialized, so a subset of the nodes is covered; how
the localizer works with that lives in :mod:`repro_tools.minify.passes.kernel_regions`.
"""

from __future__ import annotations

import operator
from collections import deque
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.fx as fx

from determ_backend import _torch_compat as tc
from determ_backend.backends.inductor_instrument import compile_with_origins, instrument_compiled
from determ_backend.backends.recorder import Recorder

__all__ = ["BufferValues", "SUPPORTED"]

SUPPORTED = ("inductor", "inductor_inner")
"""Compilers whose buffers :class:`BufferValues` can capture."""


class _Inner:
    """One inner compile: inductor's graph, its buffers' origins, the recorder of its wrapper."""

    def __init__(self, graph: fx.GraphModule, origins: Dict[str, Any], recorder: Recorder):
        self.graph, self.origins, self.recorder = graph, origins, recorder


class BufferValues:
    """Compile with inductor, capturing every materialized buffer; then per-node values of ``gm``."""

    def __init__(self) -> None:
        self.outer: Optional[fx.GraphModule] = None
        self.inners: List[_Inner] = []

    # ------------------------------------------------------------ compiling
    def compile(self, compiler: str, gm: fx.GraphModule, inputs: Sequence[Any]) -> Callable:
        """A :func:`repro_tools.minify.compilers.compile_graph` look-alike for ``compiler`` in :data:`SUPPORTED`."""
        self.outer = gm
        if compiler == "inductor_inner":
            compiled = self._inner_compile(gm, list(inputs))
            return lambda *args: compiled(list(args))
        with tc.autograd_cache_disabled():
            return tc.compile_fx(gm, list(inputs), inner_compile=self._inner_compile)

    def _inner_compile(self, fx_g: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
        compiled, origins = compile_with_origins(fx_g, inputs, **kwargs)

        def recorder(infos):
            rec = Recorder("g", "inductor", infos, stats=False)
            rec.keep_values = True
            return rec

        rec = instrument_compiled(compiled, fx_g, recorder, origins, {})
        if rec is not None:
            self.inners.append(_Inner(fx_g, origins, rec))
        return compiled

    # ------------------------------------------------------------ values
    def values(self, ref: Dict[str, Any]) -> Optional[Dict[str, torch.Tensor]]:
        """``{node name of the compiled graph: value}`` after one run (None when nothing was captured).

        ``ref``: eager values by node name (shapes and dtypes to match)."""
        ran = [(i, res) for i, res in ((i, i.recorder.end_call()) for i in self.inners) if res.records]
        if self.outer is None or len(ran) != 1:
            return None
        inner, result = ran[0]
        by_inner = _values_by_inner_node(inner, result)
        out: Dict[str, torch.Tensor] = {}
        for name, node in _outer_matches(inner.graph, self.outer, ref).items():
            v = by_inner.get(node)
            if v is not None:
                out[name] = v
        return out


def _values_by_inner_node(inner: _Inner, result) -> Dict[str, torch.Tensor]:
    """Inner node -> value of the one buffer inductor made exactly for it (its last write)."""
    buffers: Dict[str, set] = {}
    last: Dict[str, torch.Tensor] = {}
    for rec in result.records:
        buf = (rec.extra or {}).get("buffer")
        origin = inner.origins.get(buf, {}).get("origin") if buf else None
        value = result.values.get(rec.node)
        if rec.kind != "node" or origin is None or not isinstance(value, torch.Tensor):
            continue
        buffers.setdefault(origin, set()).add(buf)
        last[origin] = value
    return {n: v for n, v in last.items() if len(buffers[n]) == 1}


def _sources(node: fx.Node, outer_id: int) -> set:
    """Names of the nodes of the graph with id ``outer_id`` that ``node`` was made from."""
    found, queue, seen = set(), deque(node.meta.get("from_node") or ()), 0
    while queue and seen < 10_000:
        src = queue.popleft()
        seen += 1
        if getattr(src, "graph_id", None) == outer_id and getattr(src, "name", None):
            found.add(src.name)
        else:
            queue.extend(getattr(src, "from_node", None) or ())
    return found


def _outer_matches(inner: fx.GraphModule, outer: fx.GraphModule, ref: Dict[str, Any]) -> Dict[str, str]:
    """Outer node name -> the inner node holding exactly its value (unambiguous matches only)."""
    outer_names = {n.name for n in outer.graph.nodes}
    same_graph = inner.graph is outer.graph
    root: Dict[fx.Node, str] = {}
    for n in inner.graph.nodes:
        if n.op not in ("call_function", "call_method", "call_module"):
            continue
        names = _sources(n, id(outer.graph))
        if not names and same_graph and "from_node" not in n.meta and n.name in outer_names:
            names = {n.name}
        if len(names) == 1:
            root[n] = names.pop()
    groups: Dict[str, List[fx.Node]] = {}
    for n, x in root.items():
        groups.setdefault(x, []).append(n)
    by_name = {n.name: n for n in outer.graph.nodes}
    out: Dict[str, str] = {}
    for x, members in groups.items():
        exits = [n for n in members if any(root.get(u) != x for u in n.users)]
        wanted = _values_named_by(by_name.get(x), ref)
        for name, want in wanted.items():
            hits = [e for e in exits if _same_kind(e, want)]
            if len(hits) == 1 and sum(_same_kind(hits[0], w) for w in wanted.values()) == 1:
                out[name] = hits[0].name
    return out


def _values_named_by(node: Optional[fx.Node], ref: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """The tensor(s) outer node ``node`` stands for: itself, or each ``getitem`` of its tuple."""
    if node is None:
        return {}
    if isinstance(ref.get(node.name), torch.Tensor):
        return {node.name: ref[node.name]}
    return {u.name: ref[u.name] for u in node.users
            if u.op == "call_function" and u.target is operator.getitem and isinstance(ref.get(u.name), torch.Tensor)}


def _same_kind(inner_node: fx.Node, want: torch.Tensor) -> bool:
    val = inner_node.meta.get("val")
    return isinstance(val, torch.Tensor) and tuple(val.shape) == tuple(want.shape) and val.dtype == want.dtype
