"""Turning a call's arguments and results into index entries.

An entry describes one argument: a tensor (``dtype``, ``shape``, ``hash``,
``stats``, ``param``, ``payload``) or, with the filter off, a scalar.  Tensor
values are snapshotted and fingerprinted by :mod:`.pipeline`; a per-session
cache keyed by tensor identity and version skips tensors already described (one
API's output is usually the next API's input).  :func:`batch_stats` computes the
statistics with float32 accumulation for speed (``max``, ``min``, ``mean``,
``l2``; ``nan``/``inf`` are only counted when a tensor holds a non-finite value).

What to record is decided in :mod:`.switch`.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch


__all__ = ["flatten", "batch_stats", "stats_from_vector", "FingerprintCache", "describe", "is_data_tensor", "call_items", "output_items"]

_HALF = (torch.float16, torch.bfloat16)
_CACHE_LIMIT = 8192


def flatten(value: Any, prefix: str, out: Optional[List[Tuple[str, Any]]] = None) -> List[Tuple[str, Any]]:
    """``[(name, leaf)]`` with ptdbg-style names: ``input.0``, ``input.0.1``, ``input.bias``."""
    out = [] if out is None else out
    if isinstance(value, (list, tuple)) and not _is_namedtuple_scalar(value):
        for i, v in enumerate(value):
            flatten(v, f"{prefix}.{i}", out)
    elif isinstance(value, dict):
        for k, v in value.items():
            flatten(v, f"{prefix}.{k}", out)
    else:
        out.append((prefix, value))
    return out


def _is_namedtuple_scalar(value: Any) -> bool:
    return isinstance(value, torch.Size)


def call_items(args: Sequence[Any], kwargs: Dict[str, Any]) -> List[Tuple[str, Any]]:
    items: List[Tuple[str, Any]] = []
    for i, a in enumerate(args):
        flatten(a, f"input.{i}", items)
    for k, v in kwargs.items():
        if k != "out":
            flatten(v, f"input.{k}", items)
    return items


def output_items(result: Any) -> List[Tuple[str, Any]]:
    if isinstance(result, (list, tuple, dict)) and not isinstance(result, torch.Size):
        return flatten(result, "output")
    return [("output", result)]


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def is_data_tensor(t: Any) -> bool:
    """A plain tensor whose values can be read and copied as bytes: strided, not meta, not quantized.
    Tensor subclasses (fake, distributed, wrapper tensors) are described by dtype and shape only."""
    return (type(t) in _PLAIN and t.layout == torch.strided and t.device.type != "meta"
            and not t.is_quantized)


def _stat_row(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.is_quantized:
        t = t.dequantize()
    if t.is_complex():
        t = t.abs()
    if not t.is_floating_point():
        t = t.to(torch.float64)
    elif t.element_size() == 1:  # float8 kinds have few kernels
        t = t.float()
    n = t.numel()
    if n == 0:
        return torch.tensor([math.nan, math.nan, math.nan, 0.0], dtype=torch.float64, device=t.device)
    flat = t.reshape(-1)
    acc = torch.float32 if t.dtype in _HALF else None
    mn, mx = torch.aminmax(flat)
    s = flat.sum(dtype=acc)
    l2 = torch.linalg.vector_norm(flat, dtype=acc)
    return torch.stack([mn.double(), mx.double(), s.double() / n, l2.double()])


def batch_stats(tensors: Sequence[torch.Tensor]) -> List[Dict[str, Any]]:
    """``{max, min, mean, l2, nan, inf}`` for each tensor; one host transfer per device."""
    if not tensors:
        return []
    rows = [_stat_row(t) for t in tensors]
    by_dev: Dict[torch.device, List[int]] = {}
    for i, r in enumerate(rows):
        by_dev.setdefault(r.device, []).append(i)
    host: List[List[float]] = [[]] * len(rows)
    for idx in by_dev.values():
        vals = torch.stack([rows[i] for i in idx]).cpu().tolist()
        for i, v in zip(idx, vals):
            host[i] = v
    out = []
    for t, (mn, mx, mean, l2) in zip(tensors, host):
        d = {"max": mx, "min": mn, "mean": mean, "l2": l2, "nan": 0, "inf": 0}
        if t.numel() == 0:
            d["max"] = d["min"] = d["mean"] = None
        elif (t.is_floating_point() or t.is_complex()) and not all(math.isfinite(v) for v in (mn, mx, mean, l2)):
            d["nan"] = int(torch.isnan(t).sum())
            d["inf"] = int(torch.isinf(t).sum())
        out.append(d)
    return out


def stats_from_vector(v: Sequence[float]) -> Dict[str, Any]:
    """The statistics entry of a ``[min, max, mean, l2, nan, inf, numel]`` vector (the native kernel's)."""
    d = {"max": v[1], "min": v[0], "mean": v[2], "l2": v[3], "nan": int(v[4]), "inf": int(v[5])}
    if v[6] == 0:
        d["max"] = d["min"] = d["mean"] = None
    return d


class FingerprintCache:
    """Fingerprints of recently seen tensors, valid while the tensor object lives and is not modified."""

    def __init__(self) -> None:
        self._entries: Dict[int, Tuple[Any, int, Dict[str, Any]]] = {}

    def get(self, t: torch.Tensor) -> Optional[Dict[str, Any]]:
        hit = self._entries.get(id(t))
        if hit is None:
            return None
        ref, version, fp = hit
        if ref() is not t or t._version != version:
            return None
        return fp

    def put(self, t: torch.Tensor, fp: Dict[str, Any]) -> None:
        if len(self._entries) >= _CACHE_LIMIT:
            self._entries.clear()
        try:
            self._entries[id(t)] = (weakref.ref(t), t._version, fp)
        except TypeError:  # tensors that do not support weak references are simply not cached
            pass

    def forget(self, items: Sequence[Tuple[str, Any]]) -> None:
        """Drop the tensors of ``items``: a call wrote into them (collectives do not bump ``_version``)."""
        for _, v in items:
            if isinstance(v, torch.Tensor):
                self._entries.pop(id(v), None)

    def clear(self) -> None:
        self._entries.clear()


def _scalar_entry(name: str, v: Any) -> Optional[Dict[str, Any]]:
    if isinstance(v, bool) or isinstance(v, (int, float)):
        return {"name": name, "type": type(v).__name__, "value": v}
    if v is None:
        return {"name": name, "type": "None"}
    if isinstance(v, (torch.dtype, torch.device, str, torch.Size, slice)):
        return {"name": name, "type": type(v).__name__, "value": str(v)}
    return None


def describe(items: Sequence[Tuple[str, Any]], cache: FingerprintCache, *, data: bool = True,
             keep_non_float: bool = True, pipeline=None) -> List[Dict[str, Any]]:
    """Index entries for ``items``.  ``data=False``: dtype/shape only (stack mode).  Otherwise each new
    tensor is snapshotted by ``pipeline`` and its entry gets an ``_fp`` future (hash, stats, payload) that
    the pipeline resolves before writing; tensors already seen (same object, same version) reuse theirs."""
    entries: List[Dict[str, Any]] = []
    for name, v in items:
        if isinstance(v, torch.Tensor):
            if not keep_non_float and not (v.is_floating_point() or v.is_complex()):
                continue
            e: Dict[str, Any] = {"name": name, "dtype": str(v.dtype), "shape": list(v.shape)}
            if isinstance(v, torch.nn.Parameter):
                e["param"] = True
            if v.device.type != "cpu":
                e["device"] = str(v.device)
            if data and pipeline is not None and is_data_tensor(v):
                fp = cache.get(v)
                if fp is None:
                    fp = pipeline.tensor(v)
                    cache.put(v, fp)
                e["_fp"] = fp
            entries.append(e)
        elif keep_non_float:
            e2 = _scalar_entry(name, v)
            if e2 is not None:
                entries.append(e2)
    if pipeline is not None:
        pipeline.commit()
    return entries


def tensor_leaves(items: Sequence[Tuple[str, Any]]) -> Iterator[Tuple[int, str, torch.Tensor]]:
    for i, (name, v) in enumerate(items):
        if isinstance(v, torch.Tensor):
            yield i, name, v
