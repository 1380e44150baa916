"""The recorder: collects the tensors one graph call produces and turns them into
trace records with one host sync per call.

Per captured tensor only the unavoidable work happens at capture time (buffers
are reused and mutated in place later): its fingerprint row sums are queued in a
:class:`~determ_backend.fingerprint.core.HashBatch` (small tensors are copied), and
statistics of large tensors are reduced on the spot.  Everything else -- the
fingerprint finish, statistics of all small tensors (segment reductions), the
host transfer -- happens once per call in :meth:`Recorder.end_call`.  With
``keep_values`` the recorder also keeps a clone of every captured tensor, for
checks that need metrics rather than fingerprints.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from determ_backend.fingerprint import core as _fp
from determ_backend.trace.stream import Record, format_hash

__all__ = ["NodeInfo", "Recorder", "CallResult", "trace_stats"]

_SMALL = 1 << 16  # bytes: statistics of tensors up to this size are batched per call
_NAN = math.nan
_DERIVE = -2.0  # marker: nan/inf counts derived on the host from min/max/l2


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


@dataclass
class _Item:
    info: int
    index: Optional[int]
    dtype: Optional[str]
    shape: Optional[list]
    device: Optional[torch.device] = None
    slot: int = -1                       # position in the device's HashBatch
    stats: Any = None                    # device vector (large) or a small clone for batched stats
    value: Optional[torch.Tensor] = None  # kept clone (accuracy checks)
    done: Optional[tuple] = None          # (hash, stats dict) already computed by the native CPU kernel


class _CallState:
    def __init__(self) -> None:
        self.items: List[_Item] = []
        self.batches: Dict[torch.device, _fp.HashBatch] = {}


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
        self._local.state = _CallState()

    def capture(self, i: int, value: Any) -> None:
        state = getattr(self._local, "state", None)
        if state is None:
            self.begin_call()
            state = self._local.state
        if isinstance(value, torch.Tensor):
            self._capture_tensor(state, i, None, value)
        elif isinstance(value, (list, tuple)):
            for j, v in enumerate(value):
                if isinstance(v, torch.Tensor):
                    self._capture_tensor(state, i, j, v)

    def _capture_tensor(self, state: _CallState, i: int, j: Optional[int], t: torch.Tensor) -> None:
        if t.layout != torch.strided or t.device.type == "meta":
            return
        t = t.detach()
        item = _Item(i, j, str(t.dtype).replace("torch.", ""), list(t.shape), t.device)
        nat = _fp.fingerprint_now(t, self.stats) if t.device.type == "cpu" else None
        if nat is not None:  # CPU: hash and statistics in one pass, right now
            item.done = (nat[0], _stats_dict(nat[1]) if self.stats else None)
        else:
            batch = state.batches.get(t.device)
            if batch is None:
                batch = state.batches[t.device] = _fp.HashBatch(t.device)
            item.slot = batch.add(t)
            if self.stats:
                small = t.numel() * t.element_size() <= _SMALL and not (t.is_complex() or t.is_quantized)
                item.stats = ("small", t.clone()) if small else trace_stats(t)
        if self.keep_values:
            item.value = t.clone()
        state.items.append(item)

    # -- called by the wrapper after the graph returns --------------------------------------
    def end_call(self, count: bool = True) -> CallResult:
        """Records of the call just finished.  ``count=False`` for a check's extra execution:
        it gets the same call index as the real one that follows."""
        state: _CallState = getattr(self._local, "state", None) or _CallState()
        self._local.state = None
        call = self.calls
        if count:
            self.calls += 1
        host = _resolve(state, self.stats)
        out = CallResult(records=[])
        for seq, (item, (h, st)) in enumerate(self._merge_static(list(zip(state.items, host)))):
            info = self.infos[item.info]
            node = info.node if item.index is None else f"{info.node}.{item.index}"
            out.records.append(Record(
                graph=self.graph, stage=self.stage, node=node, op=info.op, kind=info.kind, call=call, seq=seq,
                source=info.source, dtype=item.dtype, shape=item.shape,
                hash=format_hash(h) if h is not None else None, stats=st, inputs=list(info.inputs),
                rank=self.rank, run=self.run, extra=info.extra))
            if item.value is not None:
                out.values[node] = item.value
        return out

    def _merge_static(self, pairs: list) -> list:
        """Insert the records of views (not captured: their data is their input's) in graph order."""
        views = [i for i, info in enumerate(self.infos) if info.kind == "view"]
        if not views:
            return pairs
        merged: list = []
        vi = 0
        for pair in pairs:
            while vi < len(views) and views[vi] < pair[0].info:
                merged.append(self._static(views[vi]))
                vi += 1
            merged.append(pair)
        merged.extend(self._static(v) for v in views[vi:])
        return merged

    def _static(self, i: int) -> tuple:
        meta = self.infos[i].extra or {}
        return _Item(i, None, meta.get("dtype"), meta.get("shape")), (None, None)


def _resolve(state: _CallState, stats: bool) -> List[Tuple[Optional[int], Optional[dict]]]:
    """Hashes and statistics of every item, with one host transfer per device."""
    result: List[Tuple[Optional[int], Optional[dict]]] = [it.done or (None, None) for it in state.items]
    for dev, batch in state.batches.items():
        idx = [k for k, it in enumerate(state.items) if it.device == dev and it.done is None]
        hashes = batch.finish()[torch.tensor([state.items[k].slot for k in idx], device=dev)]
        if not stats:
            for k, h in zip(idx, hashes.cpu().tolist()):
                result[k] = (h, None)
            continue
        rows = _stats_rows([state.items[k].stats for k in idx], dev)
        packed = torch.cat([hashes.view(torch.float64).reshape(-1, 1), rows], 1).cpu()
        hs = packed[:, 0].contiguous().view(torch.int64).tolist()
        for k, h, s in zip(idx, hs, packed[:, 1:].tolist()):
            result[k] = (h, _stats_dict(s))
    return result


def _stats_rows(entries: list, dev: torch.device) -> torch.Tensor:
    """(n, 7) float64 statistics.  Small tensors' rows come from one batched segment reduction;
    large tensors' ``[min, max, sum, l2]`` vectors are completed here in one batch."""
    f64 = dict(dtype=torch.float64, device=dev)
    rows: List[Optional[torch.Tensor]] = [None] * len(entries)
    small = [k for k, e in enumerate(entries) if e[0] == "small"]
    if small:
        batched = _segment_stats([entries[k][1] for k in small], dev)
        for j, k in enumerate(small):
            rows[k] = batched[j]
    large = [k for k, e in enumerate(entries) if e[0] == "large"]
    if large:
        v = torch.stack([entries[k][1].to(torch.float64) for k in large])
        n = torch.tensor([float(entries[k][2]) for k in large], **f64)
        derive = torch.full_like(n, _DERIVE)
        block = torch.stack([v[:, 0], v[:, 1], v[:, 2] / n, v[:, 3], derive, derive, n], 1)
        for j, k in enumerate(large):
            rows[k] = block[j]
    for k, e in enumerate(entries):
        if e[0] == "full":
            rows[k] = e[1]
    return torch.stack(rows)  # type: ignore[arg-type]


def _segment_stats(tensors: List[torch.Tensor], dev: torch.device) -> torch.Tensor:
    lengths = torch.tensor([t.numel() for t in tensors], device=dev)
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
    m = len(tensors)
    seg = torch.repeat_interleave(torch.arange(m, device=dev), lengths)
    f64 = dict(dtype=torch.float64, device=dev)
    mn = torch.full((m,), math.inf, **f64).scatter_reduce_(0, seg, flat, "amin")
    mx = torch.full((m,), -math.inf, **f64).scatter_reduce_(0, seg, flat, "amax")
    total = torch.zeros(m, **f64).index_add_(0, seg, flat)
    l2 = torch.zeros(m, **f64).index_add_(0, seg, flat * flat).sqrt()
    nan = torch.zeros(m, **f64).index_add_(0, seg, torch.isnan(flat).to(torch.float64))
    inf = torch.zeros(m, **f64).index_add_(0, seg, torch.isinf(flat).to(torch.float64))
    n = lengths.to(torch.float64)
    empty = n == 0
    mn, mx = mn.masked_fill(empty, _NAN), mx.masked_fill(empty, _NAN)
    return torch.stack([mn, mx, total / n.clamp(min=1), l2, nan, inf, n], 1)


def trace_stats(t: torch.Tensor) -> tuple:
    """Statistics of a large tensor in three reduction passes, as ``("large", [min, max, sum, l2], numel)``
    (completed per call by :func:`_stats_rows`), or ``("full", 7-vector)`` for complex/quantized/empty.

    NaN/inf are not counted: a finite L2 norm proves there are none (counts 0); otherwise the
    counts are reported as unknown (``None``) -- ``min``/``max``/``l2`` show which kind is present.
    """
    n = t.numel()
    if n == 0:
        return ("full", torch.tensor([_NAN, _NAN, _NAN, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64, device=t.device))
    if t.is_complex() or t.is_quantized:
        return ("full", _fp._stats_vector(t))
    x = t
    if x.dtype == torch.bool or (x.is_floating_point() and x.element_size() == 1):
        x = x.float() if x.is_floating_point() else x.to(torch.uint8)
    flat = x.reshape(-1)
    acc = torch.float64 if (flat.dtype == torch.float64 or not flat.is_floating_point()) else torch.float32
    mn, mx = torch.aminmax(flat)
    total = flat.sum(dtype=acc)
    l2 = torch.linalg.vector_norm(flat, dtype=acc) if flat.is_floating_point() else torch.linalg.vector_norm(flat.to(acc))
    return ("large", torch.stack([mn.to(acc), mx.to(acc), total, l2]), n)


def _stats_dict(v: List[float]) -> dict:
    d = dict(zip(("min", "max", "mean", "l2", "nan", "inf"), v[:6]))
    if d["nan"] == _DERIVE:  # large tensors: derived from the L2 norm (see trace_stats)
        l2 = d["l2"]
        has_inf = math.isinf(d["min"]) or math.isinf(d["max"])
        d["nan"] = None if math.isnan(l2) else 0
        d["inf"] = None if math.isnan(l2) or (math.isinf(l2) and has_inf) else 0
        return _empty_fix(d, v)
    for k in ("nan", "inf"):
        d[k] = None if d[k] < 0 else int(d[k])
    return _empty_fix(d, v)


def _empty_fix(d: dict, v: List[float]) -> dict:
    if v[6] == 0:
        d["min"] = d["max"] = d["mean"] = None
    return d
