"""The recorder: collects the tensors one graph call produces and turns them into
trace records with one host sync per call.

Owns the capture state of an instrumented graph (which node produced which
tensor, in which call) and the records built from it.  Fingerprints and
statistics are computed by :class:`~determ_backend.fingerprint.core.FingerprintBatch`
with ``"trace"`` statistics: per captured tensor only the unavoidable work happens
at capture time (buffers are reused and mutated in place later), the rest once
per call in :meth:`Recorder.end_call`.  With ``keep_values`` the recorder also
keeps a clone of every captured tensor, for checks that need metrics rather than
fingerprints.  Instrumenting graphs is :mod:`determ_backend.backends.instrument`'s
job, writing records :mod:`determ_backend.trace.stream`'s.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch

from determ_backend.fingerprint.core import FingerprintBatch
from determ_backend.trace.stream import Record, format_hash

__all__ = ["NodeInfo", "Recorder", "CallResult"]


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
    slot: int = -1                        # position in the call's FingerprintBatch
    value: Optional[torch.Tensor] = None  # kept clone (accuracy checks)


class _CallState:
    def __init__(self, stats: bool) -> None:
        self.items: List[_Item] = []
        self.batch = FingerprintBatch("trace" if stats else None)


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
        self._local.state = _CallState(self.stats)

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
        item = _Item(i, j, str(t.dtype).replace("torch.", ""), list(t.shape))
        item.slot = state.batch.add(t)
        if self.keep_values:
            item.value = t.clone()
        state.items.append(item)

    # -- called by the wrapper after the graph returns --------------------------------------
    def end_call(self, count: bool = True) -> CallResult:
        """Records of the call just finished.  ``count=False`` for a check's extra execution:
        it gets the same call index as the real one that follows."""
        state: _CallState = getattr(self._local, "state", None) or _CallState(self.stats)
        self._local.state = None
        call = self.calls
        if count:
            self.calls += 1
        host = state.batch.resolve()
        out = CallResult(records=[])
        pairs = [(item, host[item.slot]) for item in state.items]
        for seq, (item, (h, st)) in enumerate(self._merge_static(pairs)):
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
