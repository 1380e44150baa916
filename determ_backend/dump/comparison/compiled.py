"""Pairing the FX-node entries of compiled regions between two dumps (written by :mod:`.compiled`).

Node entries carry ``region`` (the region call they ran in) and ``fx`` (graph
index in the region, stage, call, node, kind).  They are kept out of the
top-level alignment of calls; once two region entries are paired, the nodes of
those two region calls (same direction) are paired with
:func:`determ_backend.compare.align`: by graph, stage, call and node name when
both sides traced the same graph, by sequence alignment of op signatures when
they did not (another decomposition, an extra op).  Node entries whose region
entry is absent from the dump stay top-level.

The root-cause rule is then applied to nodes like to API calls (their inputs
are the tensors they consumed); a region whose nodes show the divergence is
not itself a root cause -- the node is (:func:`explained_by_nodes`).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from determ_backend.compare import align
from determ_backend.trace.stream import Record

__all__ = ["split_entries", "region_key", "pair_nodes", "explained_by_nodes", "node_note", "nodes_unpaired",
           "OPAQUE_HINT", "UNPAIRED_HINT"]

Key = Tuple[str, str]

OPAQUE_HINT = "opaque torch.compile region: compile with determ_aot_eager / determ_inductor to compare its FX nodes"


def region_key(e: Optional[Dict[str, Any]]) -> Optional[Key]:
    """``(region call, direction)`` of a region entry (``Compiled_m_0_forward`` -> ``("Compiled_m_0", "forward")``)."""
    if e is None:
        return None
    d = e.get("dir", "")
    suffix = f"_{d}"
    return (e["name"][: -len(suffix)], d) if d and e["name"].endswith(suffix) else None


def split_entries(entries: Sequence[Dict[str, Any]]) -> Tuple[List[int], Dict[Key, List[int]]]:
    """``(indices of top-level entries, {(region call, direction): indices of its node entries})``."""
    names = {e["name"] for e in entries}
    top: List[int] = []
    inner: Dict[Key, List[int]] = {}
    for i, e in enumerate(entries):
        region = e.get("region")
        if region and f"{region}_{e.get('dir')}" in names:
            inner.setdefault((region, e.get("dir", "")), []).append(i)
        else:
            top.append(i)
    return top, inner


def _record(e: Dict[str, Any], i: int) -> Record:
    fx = e.get("fx") or {}
    out = next((t for t in e.get("outputs", []) if "dtype" in t), {})
    return Record(graph=str(fx.get("graph_index", 0)), stage=str(fx.get("stage", "")), call=int(fx.get("call", 0)),
                  node=str(fx.get("node", e["name"])), op=str(e.get("op")), kind=str(fx.get("kind", "node")),
                  dtype=out.get("dtype"), shape=out.get("shape"), extra={"i": i})


def pair_nodes(ea: Sequence[Dict[str, Any]], eb: Sequence[Dict[str, Any]], ia: Optional[List[int]],
               ib: Optional[List[int]]) -> List[Tuple[Optional[int], Optional[int]]]:
    """Pairs of node entry indices (``None`` for a node present on one side only), in ``a``'s order."""
    ia, ib = ia or [], ib or []
    if not ia or not ib:
        return [(i, None) for i in ia] + [(None, j) for j in ib]
    ra = [_record(ea[i], i) for i in ia]
    rb = [_record(eb[j], j) for j in ib]
    return [(p.a.extra["i"] if p.a is not None else None, p.b.extra["i"] if p.b is not None else None)
            for p in align(ra, rb)]


def explained_by_nodes(nodes: Sequence[Any]) -> bool:
    """Whether the paired node entries of a region call show a divergence (so the region is not a culprit)."""
    return any(getattr(p, "output_diverges", False) for p in nodes)


def node_note(e: Dict[str, Any]) -> Optional[str]:
    """``FX node addmm (aten.addmm.default) of graph g0, stage aot_forward, in compiled region Compiled_m_0,
    parameters fc1.weight, fc1.bias`` (the parameters name the layer)."""
    fx = e.get("fx")
    if not fx:
        return None
    params = [str(t["node"]) for t in e.get("inputs", []) if t.get("param") and t.get("node")]
    return (f"FX node {fx.get('node')} ({e.get('op')}) of graph {fx.get('graph')}, stage {fx.get('stage')}, "
            f"in compiled region {e.get('region')}" + (f", parameters {', '.join(params)}" if params else ""))


def nodes_unpaired(nodes: Sequence[Any]) -> bool:
    """Both sides traced FX nodes for a region call but not one node could be paired (e.g. ``determ_eager``'s
    torch-level graph against ``determ_aot_eager``'s aten graph): the region is judged as a whole."""
    return (any(p.a is not None for p in nodes) and any(p.b is not None for p in nodes)
            and not any(p.a is not None and p.b is not None for p in nodes))


UNPAIRED_HINT = ("the FX nodes of the two sides could not be paired (graphs traced at different levels, e.g. "
                 "determ_eager vs determ_aot_eager): compile both runs with the same determ backend")
