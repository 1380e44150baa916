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
            s = _fp._stats_vector(t) if self.stats else None
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
        small = [k for k, it in enumerate(items) if it[2] is not None]
        if small:
            hs = _fp._hash_device_values([items[k][2] for k in small])
            for k, h in zip(small, hs):
                it = items[k]
                s = _fp._stats_vector(it[2]) if self.stats else None
                items[k] = (it[0], it[1], None, h, s, it[5], it[6], it[7])
        host = _to_host(items, self.stats)
        out = CallResult(records=[])
        for seq, (it, (h, st)) in enumerate(zip(items, host)):
            info = self.infos[it[0]]
            node = info.node if it[1] is None else f"{info.node}.{it[1]}"
            rec = Record(graph=self.graph, stage=self.stage, node=node, op=info.op, kind=info.kind, call=call,
                         seq=seq, source=info.source, dtype=it[6], shape=it[7], hash=format_hash(h), stats=st,
                         inputs=list(info.inputs), rank=self.rank, run=self.run, extra=info.extra)
            out.records.append(rec)
            if it[5] is not None:
                out.values[node] = it[5]
        return out


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
            result[k] = (h, _fp._stats_dict(s) if s is not None else None)
    return result
