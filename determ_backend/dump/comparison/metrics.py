"""Per-tensor comparison of two dump entries: ptdbg's metrics and our verdicts.

From payloads: Cosine, MaxAbsErr, MaxRelativeErr (``|a-b| / (|b| + eps)``),
One/Five Thousandths Err Ratio (share of elements within 0.1% / 0.5% relative
error); from statistics: the max/min/mean/L2 differences.  ``Accuracy Reached
or Not`` follows ptdbg: ``No`` when Cosine < 0.99 and MaxAbsErr > 0.001, or
Cosine < 0.9, or MaxAbsErr > 1.  Statistics-only pairs are judged on their
statistics (nan/inf counts equal, max/min/L2 within 1e-3 + 1% relative).

The verdict the root-cause rule uses is the compare core's (see :mod:`.compare`).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch

from determ_backend.compare import EPS, tensor_metrics
from determ_backend.trace.stream import Record

__all__ = ["payload_metrics", "stats_metrics", "accuracy_reached", "tensor_record", "STATS_RTOL", "STATS_ATOL"]

STATS_RTOL = 1e-2
STATS_ATOL = 1e-3


def payload_metrics(a: torch.Tensor, b: torch.Tensor) -> Dict[str, Any]:
    """Cosine / max abs / max rel / thousandths ratios of two tensors (``b`` is the benchmark)."""
    if tuple(a.shape) != tuple(b.shape):
        return {"error": f"shape mismatch {list(a.shape)} vs {list(b.shape)}"}
    m = tensor_metrics(a, b)
    out: Dict[str, Any] = {"cosine": m["cosine"], "max_abs": m["max_abs"], "max_rel": m["max_rel"]}
    if a.numel() == 0:
        out.update(one=1.0, five=1.0)
        return out
    x = (a.detach().abs() if a.is_complex() else a.detach()).to(torch.float64).reshape(-1)
    y = (b.detach().abs() if b.is_complex() else b.detach()).to(torch.float64).reshape(-1)
    both_nan = torch.isnan(x) & torch.isnan(y)
    ny = float(torch.linalg.vector_norm(y))
    nd = float(torch.linalg.vector_norm(torch.where(both_nan, torch.zeros_like(x), x - y)))
    # the error relative to the benchmark's size: what carries from a call's inputs to its outputs
    out["rel_l2"] = nd / ny if ny > 0 else (0.0 if nd == 0 else math.inf)
    rel = (x - y).abs() / (y.abs() + EPS)
    rel = torch.where(both_nan, torch.zeros_like(rel), rel)
    out["one"] = float((rel <= 1e-3).double().mean())
    out["five"] = float((rel <= 5e-3).double().mean())
    return out


def _num(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def stats_metrics(sa: Dict[str, Any], sb: Dict[str, Any]) -> Dict[str, Any]:
    """Differences of the statistics (``a - b``) and whether they are close."""
    out: Dict[str, Any] = {}
    close = sa.get("nan") == sb.get("nan") and sa.get("inf") == sb.get("inf")
    for k in ("max", "min", "mean", "l2"):
        va, vb = _num(sa.get(k)), _num(sb.get(k))
        if va is None or vb is None:
            continue
        d = 0.0 if (math.isnan(va) and math.isnan(vb)) or va == vb else va - vb
        out[f"{k}_diff"] = d
        if k != "mean" and not (abs(d) <= STATS_ATOL + STATS_RTOL * max(abs(va), abs(vb))):
            close = False
    out["stats_close"] = bool(close)
    return out


def accuracy_reached(m: Dict[str, Any]) -> str:
    """ptdbg's ``Accuracy Reached or Not``: ``Yes`` / ``No`` (``N/A`` when nothing could be measured)."""
    if m.get("bitwise"):
        return "Yes"
    if "error" in m:
        return "No"
    if "cosine" in m:
        cos, mae = m["cosine"], m["max_abs"]
        if math.isnan(cos) or math.isnan(mae):
            return "No"
        if (cos < 0.99 and mae > 1e-3) or cos < 0.9 or mae > 1:
            return "No"
        return "Yes"
    if "stats_close" in m:
        return "Yes" if m["stats_close"] else "No"
    return "N/A"


def tensor_record(t: Dict[str, Any]) -> Record:
    """A dump entry's tensor as the compare core's :class:`Record` (dtype, shape, hash, statistics), for
    :func:`~determ_backend.compare.judge_records`."""
    return Record(graph="", stage="", node=t.get("name", ""), op="", dtype=t.get("dtype"), shape=t.get("shape"),
                  hash=t.get("hash"), stats=t.get("stats"))
