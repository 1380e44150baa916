"""The recorder: collects the tensors one graph call produces and turns them into
trace records with one host sync per call.

Small tensors are cloned at capture time (buffers are reused and mutated in
place later, so a reference is not enough) and fingerprinted as one batch at
:meth:`Recorder.end_call`; large tensors get their device-side fingerprint
computed immediately, so nothing large is copied.  With ``keep_values`` the
recorder also keeps a clone of every captured tensor, for checks that need
metrics rather than fingerprints.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from . import fingerprint as _fp
from .trace import Record, format_hash

__all__ = ["NodeInfo", "Recorder", "CallResult"]

_CLONE_LIMIT = 1 << 16  # bytes: below this, clone now and hash in a batch later


@dataclass(frozen=True)
class NodeInfo:
    """Static description of one capture point (known at instrumentation time)."""

    node: str
    op: str
    kind: str = "node"
    source: Optional[str] = None
    inputs: tuple = ()
    extra: Optional[Dict[str, Any]] = None


@dataclass
class CallResult:
    """Everything one call of an instrumented graph captured."""

    records: List[Record]
    values: Dict[str, torch.Tensor] = field(default_factory=dict)


class Recorder:
    """Per-graph capture state.  ``capture(i, value)`` is called from inside the graph."""

    def __init__(self, graph: str, stage: str, infos: Sequence[NodeInfo], stats: bool = True,
                 rank: int = 0, run: Optional[str] = None):
        self.graph, self.stage, self.infos = graph, stage, list(infos)
        self.stats, self.rank, self.run = stats, rank, run
        self.keep_values = False
        self.calls = 0
        self._local = threading.local()

    # -- called from the instrumented graph -------------------------------------------------
    def begin_call(self) -> None:
        self._local.items = []  # (info index, output index, tensor-or-None, device hash, device stats)

    def capture(self, i: int, value: Any) -> None:
        items = getattr(self._local, "items", None)
        if items is None:
            self.begin_call()
            items = self._local.items
        if isinstance(value, torch.Tensor):
            self._capture_tensor(items, i, None, value)
        elif isinstance(value, (list, tuple)):
            for j, v in enumerate(value):
                if isinstance(v, torch.Tensor):
                    self._capture_tensor(items, i, j, v)

    def _capture_tensor(self, items: list, i: int, j: Optional[int], t: torch.Tensor) -> None:
        if t.layout != torch.strided or t.device.type == "meta":
            return
        t = t.detach()
        keep = t.clone() if self.keep_values else None
        if t.numel() * t.element_size() <= _CLONE_LIMIT:
            items.append((i, j, keep if keep is not None else t.clone(), None, None, keep))
        else:
            h = _fp._hash_device_values([t])[0]
            s = trace_stats(t) if self.stats else None
            items.append((i, j, None, h, s, keep))
        # remember metadata now: the tensor object may change shape later (resize_)
        items[-1] = items[-1] + (str(t.dtype).replace("torch.", ""), list(t.shape))

    # -- called by the wrapper after the graph returns --------------------------------------
    def end_call(self, count: bool = True) -> CallResult:
        """Records of the call just finished.  ``count=False`` for a check's extra execution:
        it gets the same call index as the real one that follows."""
        items = getattr(self._local, "items", None) or []
        self._local.items = None
        call = self.calls
        if count:
            self.calls += 1
        items = self._merge_static(items)
        small = [k for k, it in enumerate(items) if it[2] is not None]
        if small:
            hs = _fp._hash_device_values([items[k][2] for k in small])
            for k, h in zip(small, hs):
                it = items[k]
                s = trace_stats(it[2]) if self.stats else None
                items[k] = (it[0], it[1], None, h, s, it[5], it[6], it[7])
        host = _to_host([it for it in items if it[3] is not None], self.stats)
        host_iter = iter(host)
        out = CallResult(records=[])
        for seq, it in enumerate(items):
            h, st = next(host_iter) if it[3] is not None else (None, None)
            info = self.infos[it[0]]
            node = info.node if it[1] is None else f"{info.node}.{it[1]}"
            rec = Record(graph=self.graph, stage=self.stage, node=node, op=info.op, kind=info.kind, call=call,
                         seq=seq, source=info.source, dtype=it[6], shape=it[7],
                         hash=format_hash(h) if h is not None else None, stats=st,
                         inputs=list(info.inputs), rank=self.rank, run=self.run, extra=info.extra)
            out.records.append(rec)
            if it[5] is not None:
                out.values[node] = it[5]
        return out


    def _merge_static(self, items: list) -> list:
        """Insert the records of views (not captured: their data is their input's) in graph order."""
        views = [i for i, info in enumerate(self.infos) if info.kind == "view"]
        if not views:
            return items
        merged: list = []
        vi = 0
        for it in items:
            while vi < len(views) and views[vi] < it[0]:
                merged.append(self._static(views[vi]))
                vi += 1
            merged.append(it)
        merged.extend(self._static(v) for v in views[vi:])
        return merged

    def _static(self, i: int) -> tuple:
        meta = self.infos[i].extra or {}
        return (i, None, None, None, None, None, meta.get("dtype"), meta.get("shape"))


def _to_host(items: list, stats: bool) -> List[tuple]:
    """One host transfer per device for all hashes and stats of a call."""
    result: List[tuple] = [None] * len(items)  # type: ignore[list-item]
    by_dev: Dict[torch.device, List[int]] = {}
    for k, it in enumerate(items):
        by_dev.setdefault(it[3].device, []).append(k)
    for idx in by_dev.values():
        hs = torch.stack([items[k][3] for k in idx])
        if stats:
            ss = torch.stack([items[k][4] for k in idx])
            packed = torch.cat([hs.view(torch.float64).reshape(-1, 1), ss], 1).cpu()
            hs_host = packed[:, 0].contiguous().view(torch.int64).tolist()
            ss_host = packed[:, 1:].tolist()
        else:
            hs_host, ss_host = hs.cpu().tolist(), [None] * len(idx)
        for k, h, s in zip(idx, hs_host, ss_host):
            result[k] = (h, _stats_dict(s) if s is not None else None)
    return result


def trace_stats(t: torch.Tensor) -> torch.Tensor:
    """Float64 device vector ``[min, max, mean, l2, nan, inf, numel]`` in four reduction passes.

    Cheaper than :func:`~determ_backend.fingerprint.tensor_stats`: one ``isfinite``
    count gives the non-finite total; it is split into nan/inf exactly when no
    NaN is present, else ``inf`` is reported as unknown (``None``).
    """
    n = t.numel()
    dev = t.device
    if n == 0 or t.is_quantized or t.is_complex():
        if n and (t.is_quantized or t.is_complex()):
            return _fp._stats_vector(t)
        return torch.tensor([math.nan, math.nan, math.nan, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64, device=dev)
    x = t
    if x.dtype == torch.bool or (x.is_floating_point() and x.element_size() == 1):
        x = x.float() if x.is_floating_point() else x.to(torch.uint8)
    flat = x.reshape(-1)
    mn, mx = torch.aminmax(flat)
    total = flat.sum(dtype=torch.float64)
    l2 = torch.linalg.vector_norm(flat if flat.is_floating_point() else flat.to(torch.float64), dtype=torch.float64)
    if x.is_floating_point():
        nonfinite = n - torch.isfinite(flat).sum()
        has_nan = torch.isnan(l2)
        nan = torch.where(has_nan, nonfinite, 0)
        inf = torch.where(has_nan, -1, nonfinite)
    else:
        nan = inf = torch.zeros((), dtype=torch.int64, device=dev)
    parts = [mn.to(torch.float64), mx.to(torch.float64), total / n, l2, nan.to(torch.float64), inf.to(torch.float64)]
    return torch.stack(parts + [torch.tensor(float(n), dtype=torch.float64, device=dev)])


def _stats_dict(v: List[float]) -> dict:
    d = _fp._stats_dict(v)
    if d.get("inf") == -1:
        d["inf"] = None
    return d
