"""Comparing traces: alignment, per-pair metrics, verdicts and the root-cause rule.

* :func:`align` pairs the records of two traces: by ``(graph, stage, call, node)``
  when the names line up, else by sequence alignment of op signatures (one extra
  op, eager vs compiled, another device's decomposition).
* :func:`tensor_metrics` / :func:`fp64_close` measure two tensors (max abs/rel
  error with an epsilon, cosine, error vs an fp64 reference).
* :func:`compare_traces` applies a verdict to every pair and finds the **root
  cause**: the first divergent record whose inputs all agree.  Divergence that is
  merely inherited from upstream is not a culprit.

Reading and writing traces lives in :mod:`determ_backend.trace`.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .fingerprint import hash_tensor
from .trace import Record, TensorStore

__all__ = ["Pair", "Comparison", "align", "find_roots", "tensor_metrics", "fp64_close", "rmse", "compare_traces", "EPS"]

EPS = 1e-12


@dataclass
class Pair:
    a: Optional[Record]
    b: Optional[Record]
    equal: Optional[bool] = None
    metrics: Dict[str, Any] = field(default_factory=dict)
    root_cause: bool = False

    @property
    def rec(self) -> Record:
        return self.a if self.a is not None else self.b  # type: ignore[return-value]


def _groups(records: Sequence[Record]) -> Dict[tuple, List[Record]]:
    out: Dict[tuple, List[Record]] = {}
    for r in records:
        out.setdefault((r.graph, r.stage, r.call), []).append(r)
    return out


def align(a: Sequence[Record], b: Sequence[Record]) -> List[Pair]:
    """Pair the records of two traces, in the order of ``a``.

    Graph calls present in both traces are aligned call by call; inside a call,
    records pair by name when the two sides have the same structure, else by
    sequence alignment of op signatures (so one extra or missing op shifts
    nothing).  When the calls do not correspond at all (eager vs compiled,
    another device's graph), the whole traces are sequence-aligned.
    """
    ga, gb = _groups(a), _groups(b)
    if ga and set(ga) == set(gb):
        pairs: List[Pair] = []
        for key, recs in ga.items():
            pairs.extend(_align_group(recs, gb[key]))
        return pairs
    return _align_group(a, b)


def _align_group(a: Sequence[Record], b: Sequence[Record]) -> List[Pair]:
    if len(a) == len(b) and all(x.node == y.node and x.signature == y.signature for x, y in zip(a, b)):
        return [Pair(x, y) for x, y in zip(a, b)]
    return _align_by_sequence(a, b)


def _match(a: Sequence[Record], b: Sequence[Record], key: Callable[[Record], str],
           changed: Callable[[Sequence[Record], Sequence[Record]], List[Pair]]) -> List[Pair]:
    """Pair equal runs of ``key`` by sequence alignment; hand each changed block to ``changed``."""
    pairs: List[Pair] = []
    matcher = difflib.SequenceMatcher(None, [key(r) for r in a], [key(r) for r in b], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            pairs.extend(Pair(a[i], b[j]) for i, j in zip(range(i1, i2), range(j1, j2)))
        else:
            pairs.extend(changed(a[i1:i2], b[j1:j2]))
    return pairs


def _unmatched(a: Sequence[Record], b: Sequence[Record]) -> List[Pair]:
    return [Pair(r, None) for r in a] + [Pair(None, r) for r in b]


def _align_by_sequence(a: Sequence[Record], b: Sequence[Record]) -> List[Pair]:
    # by full signature; inside a changed block, records of the same op pair in order, the rest stay unmatched
    return _match(a, b, lambda r: r.signature, lambda x, y: _match(x, y, lambda r: r.op, _unmatched))


def rmse(x: torch.Tensor, y: torch.Tensor) -> float:
    d = x.detach().to(torch.float64) - y.detach().to(torch.float64)
    return math.sqrt(float(torch.mean(d * d))) if d.numel() else 0.0


def tensor_metrics(a: torch.Tensor, b: torch.Tensor, ref64: Optional[torch.Tensor] = None) -> Dict[str, Any]:
    """max abs/rel error (rel with an epsilon), cosine, bitwise flag; errors vs ``ref64`` when given."""
    out: Dict[str, Any] = {}
    if a.shape != b.shape:
        return {"bitwise": False, "shape_mismatch": [list(a.shape), list(b.shape)]}
    x = a.detach().to(torch.float64).cpu() if not a.is_complex() else a.detach().abs().double().cpu()
    y = b.detach().to(torch.float64).cpu() if not b.is_complex() else b.detach().abs().double().cpu()
    out["bitwise"] = a.dtype == b.dtype and hash_tensor(a) == hash_tensor(b)
    if x.numel() == 0:
        out.update(max_abs=0.0, max_rel=0.0, cosine=1.0)
        return out
    both_nan = torch.isnan(x) & torch.isnan(y)
    d = torch.where(both_nan, torch.zeros_like(x), (x - y).abs())
    d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)
    out["max_abs"] = float(d.max())
    out["max_rel"] = float((d / (y.abs() + EPS)).max())
    nx, ny = float(torch.linalg.vector_norm(x)), float(torch.linalg.vector_norm(y))
    if nx == 0 and ny == 0:
        out["cosine"] = 1.0
    elif nx == 0 or ny == 0 or not (math.isfinite(nx) and math.isfinite(ny)):
        out["cosine"] = float("nan") if not (math.isfinite(nx) and math.isfinite(ny)) else 0.0
    else:
        out["cosine"] = float(torch.dot(x.reshape(-1), y.reshape(-1)) / (nx * ny))
    if ref64 is not None:
        out["err_a_vs_fp64"] = rmse(a, ref64)
        out["err_b_vs_fp64"] = rmse(b, ref64)
    return out


def fp64_close(eager: torch.Tensor, compiled: torch.Tensor, ref64: Optional[torch.Tensor], tol: float = 1e-3,
               multiplier: float = 2.0) -> bool:
    """The ``same(..., fp64_ref)`` criterion: allclose, or compiled's RMSE vs fp64 within
    ``multiplier`` times eager's own RMSE vs fp64 (plus ``tol/10``)."""
    if eager.shape != compiled.shape:
        return False
    if not (eager.is_floating_point() or eager.is_complex()):
        return bool(torch.equal(eager.cpu(), compiled.cpu()))
    e, c = eager.detach().cpu(), compiled.detach().cpu().to(eager.dtype)
    if torch.allclose(e, c, atol=tol, rtol=tol, equal_nan=True):
        return True
    if ref64 is None:
        return False
    if torch.isnan(c).any() and not torch.isnan(e).any():
        return False
    res_err = rmse(ref64, c)
    ref_err = rmse(ref64, e)
    return res_err <= multiplier * ref_err + tol / 10.0


def _stats_metrics(a: Record, b: Record) -> Dict[str, Any]:
    out: Dict[str, Any] = {"bitwise": a.hash == b.hash}
    sa, sb = a.stats or {}, b.stats or {}
    for k in ("min", "max", "mean", "l2"):
        va, vb = sa.get(k), sb.get(k)
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)):
            out[f"{k}_diff"] = abs(va - vb) if not (math.isnan(va) and math.isnan(vb)) else 0.0
    if "l2" in sa and "l2" in sb and isinstance(sb["l2"], (int, float)):
        out["l2_rel"] = out.get("l2_diff", 0.0) / (abs(sb["l2"]) + EPS)
    for k in ("nan", "inf"):
        if sa.get(k) != sb.get(k):
            out[f"{k}_counts"] = [sa.get(k), sb.get(k)]
    return out


def _stats_close(m: Dict[str, Any], b: Record, tol: float) -> bool:
    if "nan_counts" in m or "inf_counts" in m:
        return False
    scale = max((abs(v) for v in (b.stats or {}).values() if isinstance(v, float) and math.isfinite(v)), default=1.0)
    return all(m.get(f"{k}_diff", 0.0) <= tol * (1.0 + scale) for k in ("min", "max", "mean", "l2"))


@dataclass
class Comparison:
    pairs: List[Pair]
    root_causes: List[Pair]
    mode: str

    @property
    def identical(self) -> bool:
        return all(p.equal for p in self.pairs)

    @property
    def divergent(self) -> bool:
        return any(p.equal is False for p in self.pairs if p.a is not None and p.b is not None)

    @property
    def first_divergence(self) -> Optional[Pair]:
        if self.root_causes:
            return self.root_causes[0]
        return next((p for p in self.pairs if p.equal is False and p.a is not None and p.b is not None), None)

    def summary(self, checks: Sequence[str] = ()) -> Dict[str, Any]:
        fd = self.first_divergence
        return {
            "checks": list(checks),
            "divergent": self.divergent,
            "identical": self.identical,
            "mode": self.mode,
            "pairs": sum(1 for p in self.pairs if p.a is not None and p.b is not None),
            "unmatched_a": sum(1 for p in self.pairs if p.b is None),
            "unmatched_b": sum(1 for p in self.pairs if p.a is None),
            "divergent_pairs": sum(1 for p in self.pairs if p.equal is False and p.a is not None and p.b is not None),
            "first_divergence": describe(fd) if fd else None,
            "root_causes": [describe(p) for p in self.root_causes],
        }


def describe(p: Pair) -> Dict[str, Any]:
    r = p.a if p.a is not None else p.b
    other = p.b if p.a is not None else None
    d = {"graph": r.graph, "stage": r.stage, "call": r.call, "node": r.node, "op": r.op, "kind": r.kind,
         "source": r.source, "rank": r.rank, "dtype": r.dtype, "shape": r.shape, "metrics": p.metrics,
         "root_cause": p.root_cause}
    if other is not None and other.node != r.node:
        d["node_b"] = other.node
    return d


def _judge(p: Pair, tol: Optional[float], store_a: Optional[TensorStore], store_b: Optional[TensorStore]) -> None:
    a, b = p.a, p.b
    if a is None or b is None or (a.kind == "view" and b.kind == "view" and a.hash is None):
        p.equal = None  # views are judged from their inputs in find_roots
        return
    if a.hash is not None and a.hash == b.hash and a.dtype == b.dtype and a.shape == b.shape:
        p.equal, p.metrics = True, {"bitwise": True}
        return
    if a.shape != b.shape:
        p.equal, p.metrics = False, {"bitwise": False, "shape_mismatch": [a.shape, b.shape]}
        return
    if store_a is not None and store_b is not None and a.payload and b.payload and a.payload in store_a and b.payload in store_b:
        p.metrics = tensor_metrics(store_a.get(a.payload), store_b.get(b.payload))
        p.metrics["bitwise"] = False
        if tol is None:
            p.equal = False
        else:
            m = p.metrics
            p.equal = "shape_mismatch" not in m and (m["max_abs"] <= tol or m["max_rel"] <= tol)
        return
    p.metrics = _stats_metrics(a, b)
    p.equal = False if tol is None else _stats_close(p.metrics, b, tol)


def _inputs_agree(p: Pair, by_id: Dict[tuple, Pair]) -> bool:
    a, b = p.a, p.b
    if a.inputs:
        verdicts = []
        for name in a.inputs:
            q = by_id.get((a.graph, a.stage, a.call, name))
            verdicts.append(None if q is None else q.equal)
        if all(v is True for v in verdicts):
            return True
        if any(v is False for v in verdicts):
            return False
    if a.in_hashes or b.in_hashes:
        return a.in_hashes == b.in_hashes
    return not a.inputs  # a source record (graph input, parameter) with nothing upstream


def compare_traces(a: Sequence[Record], b: Sequence[Record], tol: Optional[float] = None,
                   store_a: Optional[TensorStore] = None, store_b: Optional[TensorStore] = None,
                   pairs: Optional[List[Pair]] = None) -> Comparison:
    """Align ``a`` with ``b``, judge every pair (bitwise, or within ``tol``), and find the root causes."""
    pairs = align(a, b) if pairs is None else pairs
    for p in pairs:
        _judge(p, tol, store_a, store_b)
    return find_roots(pairs, "bitwise" if tol is None else f"tol={tol:g}")


def find_roots(pairs: List[Pair], mode: str) -> Comparison:
    """Mark the root causes among already-judged ``pairs``: divergent records whose inputs all agree."""
    by_id: Dict[tuple, Pair] = {p.a.key: p for p in pairs if p.a is not None}
    for p in pairs:
        if p.a is not None and p.b is not None and p.a.kind == "view" and p.equal is None:
            verdicts = [by_id[(p.a.graph, p.a.stage, p.a.call, n)].equal for n in p.a.inputs
                        if (p.a.graph, p.a.stage, p.a.call, n) in by_id]
            if verdicts and all(v is True for v in verdicts):
                p.equal = True
            elif any(v is False for v in verdicts):
                p.equal, p.metrics = False, {"inherited_view": True}
    roots = []
    for p in pairs:
        if (p.equal is False and p.a is not None and p.b is not None and p.a.kind != "view"
                and _inputs_agree(p, by_id)):
            p.root_cause = True
            roots.append(p)
    return Comparison(pairs, roots, mode)
