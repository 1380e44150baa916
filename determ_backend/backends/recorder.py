"""The recorder: collects the tensors one graph call produces and turns them into
trace records with one host sync per call.

Owns the capture state of an instrumented graph (which node produced which
tensor, in which call) and the records built from it.  Fingerprints and
statistics are computed by :class:`~determ_backend.fingerprint.core.FingerprintBatch`
with ``"trace"`` statistics: per captured tensor only the unavoidable work happens
at capture time (buffers are reused and mutated in place later), the rest once
per call in :meth:`Recorder.end_call`.  A backward graph's inputs that a forward
graph call returned (the tensors saved for the backward) take the fingerprints that
call computed, from the run's :class:`ValueMemo`, instead of being read again.
With ``keep_values`` the recorder also
keeps a clone of every captured tensor, for checks that need metrics rather than
fingerprints.  Instrumenting graphs is :mod:`determ_backend.backends.instrument`'s
job, writing records :mod:`determ_backend.trace.stream`'s.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

from determ_backend import _torch_compat
from determ_backend.fingerprint.core import FingerprintBatch
from determ_backend.trace.stream import Record, RecordTemplate, dtype_name, template_lines

__all__ = ["NodeInfo", "Recorder", "CallResult", "ValueMemo"]


@dataclass(frozen=True)
class NodeInfo:
    """Static description of one capture point (known at instrumentation time)."""

    node: str
    op: str
    kind: str = "node"
    source: Optional[str] = None
    inputs: tuple = ()
    extra: Optional[Dict[str, Any]] = None


class CallResult:
    """Everything one call of an instrumented graph captured.  ``records`` are built when first asked for
    (checks and record listeners ask); a trace-only run writes :meth:`lines` straight from the templates."""

    def __init__(self, call: int, rows: List[tuple], values: Optional[Dict[str, torch.Tensor]] = None) -> None:
        self.call = call
        self._rows = rows  # (template, dtype name, shape, hash int or None, stats dict or None) in graph order
        self.values: Dict[str, torch.Tensor] = values if values is not None else {}
        self._records: Optional[List[Record]] = None

    @property
    def records(self) -> List[Record]:
        if self._records is None:
            self._records = [tpl.record(self.call, seq, *row) for seq, (tpl, *row) in enumerate(self._rows)]
        return self._records

    def nonfinite(self) -> bool:
        """Whether any captured value holds a NaN or an Inf (per its statistics): the nan check's cheap gate."""
        for row in self._rows:
            st = row[4]
            if st is not None and (st.get("nan") or st.get("inf")):
                return True
        return False

    def lines(self) -> List[bytes]:
        """The trace lines of the records (as they are now, once built: a payload may have been added)."""
        if self._records is not None:
            return [r.to_line() for r in self._records]
        return template_lines(self.call, self._rows)


class ValueMemo:
    """The fingerprints of the tensors graph calls returned, for the backward graphs that take them as inputs.

    A forward graph returns the tensors its backward saves; the backward receives those very tensor
    objects.  An entry is used only for the same Python object (a live weak reference) with the same
    version counter, memory, shape, strides and dtype: any write through torch since (in place, through
    a view, or a compiled graph's input mutation, which AOT counts) bumps the version and the tensor is
    read again.  This is the rule autograd itself applies to saved tensors: a backward whose saved input
    was changed in place raises instead of running.  Shared by the recorders of one run; thread-safe.
    """

    def __init__(self) -> None:
        self._entries: Dict[int, tuple] = {}  # id(tensor) -> (weak ref, (version, data_ptr, shape, strides, dtype), hash, stats)
        self._lock = threading.Lock()
        self._limit = 4096  # entries before the dead ones are dropped (then twice what is alive)

    @staticmethod
    def state(t: torch.Tensor) -> Optional[tuple]:
        """What must be unchanged for an entry to hold; None for a tensor without a version counter."""
        try:
            return t._version, t.data_ptr(), t.shape, t.stride(), t.dtype
        except RuntimeError:  # an inference tensor has no version counter
            return None

    def put(self, t: torch.Tensor, state: tuple, hash: Optional[int], stats: Optional[dict]) -> None:
        try:
            ref = weakref.ref(t)
        except TypeError:  # a tensor subclass without weak references
            return
        with self._lock:
            self._entries[id(t)] = (ref, state, hash, stats)
            if len(self._entries) > self._limit:
                self._entries = {k: v for k, v in self._entries.items() if v[0]() is not None}
                self._limit = max(4096, 2 * len(self._entries))

    def get(self, t: torch.Tensor, stats: bool) -> Optional[tuple]:
        """``(hash, stats dict or None)`` recorded for ``t`` as it is now, or None."""
        ent = self._entries.get(id(t))
        if ent is None or ent[0]() is not t or (stats and ent[3] is None) or ent[1] != self.state(t):
            return None
        return ent[2], (dict(ent[3]) if stats else None)


class _CallState:
    __slots__ = ("items", "batch", "last", "returned")

    def __init__(self, stats: bool) -> None:
        # per captured tensor, in capture order: (info index, index in a tuple value or None, dtype name,
        # shape, kept clone or None, its slot in the batch)
        self.items: List[tuple] = []
        self.batch = FingerprintBatch("trace" if stats else None)
        self.last: Dict[int, tuple] = {}  # capture point -> (slot, data_ptr, shape, stride, dtype) of its latest tensor
        self.returned: List[tuple] = []  # (slot, tensor, its ValueMemo state) of the values the call returns


class Recorder:
    """Per-graph capture state.  ``capture(i, value)`` is called from inside the graph."""

    def __init__(self, graph: str, stage: str, infos: Sequence[NodeInfo], stats: bool = True,
                 rank: int = 0, run: Optional[str] = None, memo: Optional[ValueMemo] = None,
                 eager_writes: bool = False):
        self.graph, self.stage, self.infos = graph, stage, list(infos)
        self.stats, self.rank, self.run = stats, rank, run
        # A forward graph's returned values go into the run's memo; a backward graph's inputs come out of it.
        # A value is remembered as it was when captured, with its version then: so the capture of a returned
        # node serves only when every write of the graph goes through torch ops, which bump versions
        # (``eager_writes``: FX graphs run op by op); a compiled wrapper's kernels write buffers in place
        # unseen, so there only its ``output`` capture points, taken at the return, are remembered.
        self.memo = memo
        backward = stage.endswith("backward")
        self._returns = frozenset() if memo is None or backward else frozenset(
            i for i, info in enumerate(self.infos)
            if info.kind == "output" or (eager_writes and "outputs" in (info.extra or {})))
        self._takes = frozenset() if memo is None or not backward else \
            frozenset(i for i, info in enumerate(self.infos) if info.kind in ("input", "param"))
        self.keep_values = False
        self.calls = 0
        self._views = [i for i, info in enumerate(self.infos) if info.kind == "view"]
        self._templates: Dict[tuple, RecordTemplate] = {}
        self.reused: frozenset = frozenset()  # capture points whose value a later capture_same may reuse
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

    def capture_unwrapped(self, i: int, value: Any) -> None:
        """:meth:`capture` in a graph that runs ``torch.func`` transforms (``vmap``, ``grad``): inside one, a value
        is a wrapper with no memory of its own, captured as the tensor it wraps (the whole batch), read outside."""
        if not _torch_compat.functorch_active():
            self.capture(i, value)
            return
        with _torch_compat.functorch_disabled():
            self.capture(i, _torch_compat.functorch_unwrapped(value))

    def _capture_tensor(self, state: _CallState, i: int, j: Optional[int], t: torch.Tensor) -> None:
        if t.is_meta or t.layout is not torch.strided:
            return
        known = self.memo.get(t, self.stats) if i in self._takes else None
        slot = state.batch.add(t) if known is None else state.batch.add_known(*known)
        state.items.append((i, j, dtype_name(t.dtype), list(t.shape),
                            t.detach().clone() if self.keep_values else None, slot))
        if j is None and i in self.reused:
            state.last[i] = (slot, t.data_ptr(), t.shape, t.stride(), t.dtype)
        if i in self._returns:
            self._returned(state, slot, t)

    @staticmethod
    def _returned(state: _CallState, slot: int, t: torch.Tensor) -> None:
        st = ValueMemo.state(t)
        if st is not None:
            state.returned.append((slot, t, st))

    def capture_same(self, i: int, src: int, value: Any) -> None:
        """Capture point ``i`` holds the value capture point ``src`` captured last in this call (the planner
        proved nothing wrote it since): its fingerprint is reused.  Checked cheaply: the same memory, shape,
        strides and dtype, else ``value`` is read like any other."""
        state = getattr(self._local, "state", None)
        seen = state.last.get(src) if state is not None else None
        if (seen is None or not isinstance(value, torch.Tensor)
                or seen[1:] != (value.data_ptr(), value.shape, value.stride(), value.dtype)):
            self.capture(i, value)
            return
        state.items.append((i, None, dtype_name(value.dtype), list(value.shape),
                            value.detach().clone() if self.keep_values else None, seen[0]))
        if i in self._returns:
            self._returned(state, seen[0], value)

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
        for slot, t, st in state.returned:
            self.memo.put(t, st, *host[slot])
        rows: List[tuple] = []
        values: Dict[str, torch.Tensor] = {}
        views, vi = self._views, 0
        template = self._template
        for item in state.items:
            while vi < len(views) and views[vi] < item[0]:  # views (not captured) go in graph order
                rows.append(self._view_row(views[vi]))
                vi += 1
            h, st = host[item[5]]
            tpl = template(item[0], item[1])
            rows.append((tpl, item[2], item[3], h, st))
            if item[4] is not None:
                values[tpl.node] = item[4]
        rows.extend(self._view_row(v) for v in views[vi:])
        return CallResult(call, rows, values)

    def _template(self, i: int, j: Optional[int]) -> RecordTemplate:
        """The record template of capture point ``i`` (element ``j`` of a tuple value), made once."""
        tpl = self._templates.get((i, j))
        if tpl is None:
            info = self.infos[i]
            tpl = self._templates[(i, j)] = RecordTemplate(
                self.graph, self.stage, info.node if j is None else f"{info.node}.{j}", info.op, info.kind, info.source,
                info.inputs, self.rank, self.run, info.extra)
        return tpl

    def _view_row(self, i: int) -> tuple:
        """The record of a view: not captured (its data is its input's), described from its metadata."""
        meta = self.infos[i].extra or {}
        return self._template(i, None), meta.get("dtype"), meta.get("shape"), None, None
