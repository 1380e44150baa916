"""Per-op records for the eager dispatch modes (:mod:`determ_backend.modes`).

:class:`OpRecorder` turns each aten op seen by a dispatch mode into trace
records (one per tensor the op returns or writes), with:

* ``node``: ``<op>@<file>:<function>+<line offset>#<k>`` -- the k-th call of that
  op from that user line (backward ops: ``.../bw#k``, named after the forward line
  that created their autograd node).  Names are stable when another line gains or
  loses an op, or lines move in another function, so two runs pair by name; ``.j``
  suffixes the outputs of multi-output ops; ``source`` keeps the absolute file:line;
* ``inputs``: the records that produced the op's tensor inputs (tensor identity
  and version counter, so in-place updates are followed); a tensor not produced
  under the mode (parameter, user input, a value made elsewhere) gets an
  ``input``/``param`` record of its own when first consumed;
* ``in_hashes`` / ``hash``: fingerprints, batched by
  :class:`~determ_backend._modes_hashing.PendingHashes` (device work at once, one
  host sync per batch of a few hundred ops); views get a hash derived from their
  base's instead of re-reading memory.

The mode classes, the human-readable log and the comparisons live elsewhere.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import _torch_compat as _compat
from ._modes_hashing import PendingHashes, hashable
from .trace import Record, format_hash

__all__ = ["OpRecorder", "OpEvent", "iter_args", "written_tensors", "user_frames"]

FORWARD_KEY = "determ_forward_source"  # autograd Node metadata key: (source, name location) of its forward op
_FLUSH_BYTES = 256 << 20  # also finish the fingerprint batch once this much data was captured
_INTERNAL_ROOTS = tuple(os.path.join(p, "") for p in (
    os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)),
    sysconfig.get_paths()["stdlib"]))


def _is_internal(filename: str) -> bool:
    return filename.startswith(_INTERNAL_ROOTS) or filename.startswith("<frozen")


class _FrameFilter:
    """Which code objects are user code (cached per code object)."""

    def __init__(self) -> None:
        self._cache: Dict[Any, bool] = {}

    def user_frames(self, frame, depth: int) -> list:
        out = []
        cache = self._cache
        while frame is not None:
            code = frame.f_code
            internal = cache.get(code)
            if internal is None:
                internal = cache[code] = _is_internal(code.co_filename)
            if not internal:
                out.append(frame)
                if len(out) >= depth:
                    break
            frame = frame.f_back
        return out


def user_frames(frame, depth: int = 8) -> List[str]:
    """``file:line in function`` of the first ``depth`` frames outside torch, determ and the stdlib."""
    return [f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}" for f in _FrameFilter().user_frames(frame, depth)]


def iter_args(args: Sequence, kwargs: Dict[str, Any], out: list, with_values: bool = False) -> list:
    """Append ``(path, value)`` for every tensor in ``args``/``kwargs``, also inside lists and tuples
    (non-tensor leaves too when ``with_values``).  Paths: ``args[0]``, ``args[1][2]``, ``weight=``."""
    for i, a in enumerate(args):
        _walk(f"args[{i}]", a, out, with_values)
    for k, v in kwargs.items():
        _walk(f"{k}=", v, out, with_values)
    return out


def _walk(path: str, a: Any, out: list, with_values: bool) -> None:
    if isinstance(a, torch.Tensor):
        out.append((path, a))
    elif isinstance(a, (list, tuple)) and a and not isinstance(a, torch.Size):
        for j, x in enumerate(a):
            _walk(f"{path}[{j}]", x, out, with_values)
    elif with_values:
        out.append((path, a))


def _schema_writes(func) -> Tuple[Tuple[int, str], ...]:
    """Positions and names of the arguments ``func`` writes to (``Tensor(a!)``)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return ()
    return tuple((i, a.name) for i, a in enumerate(schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


def _uninitialized(func) -> bool:
    """Ops whose outputs are uninitialized memory (``empty``, ``empty_like``, ``new_empty_strided``...)."""
    schema = getattr(func, "_schema", None)
    return schema is not None and "empty" in schema.name and not schema.is_mutable


def _uninitialized_hash(rec: Record) -> str:
    digest = hashlib.blake2b(f"uninitialized|{rec.dtype}|{rec.shape}".encode(), digest_size=8).digest()
    return format_hash(int.from_bytes(digest, "little"))


def _returns_view(func) -> bool:
    schema = getattr(func, "_schema", None)
    returns = schema.returns if schema is not None else ()
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def written_tensors(result: Any, writes: Tuple[Tuple[int, str], ...], args: Sequence, kwargs: Dict[str, Any]) -> list:
    """Tensors an op produced: those it returns, then those it wrote to but did not return."""
    outs: list = []
    _leaves(result, outs)
    if writes:
        seen = {id(t) for t in outs if isinstance(t, torch.Tensor)}
        for i, name in writes:
            a = args[i] if i < len(args) else kwargs.get(name)
            for t in _leaves(a, []):
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    outs.append(t)
    return outs


def _leaves(x: Any, out: list) -> list:
    if isinstance(x, (list, tuple)):
        for y in x:
            _leaves(y, out)
    elif isinstance(x, (torch.Tensor, bool, int, float)) and not isinstance(x, torch.SymInt):
        out.append(x)
    return out


def _version(t: Optional[torch.Tensor]) -> int:
    if t is None:
        return -1
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return -1


def _mem_key(t: torch.Tensor) -> Optional[tuple]:
    try:
        return (t.data_ptr(), t.dtype, t.shape, t.stride(), t.device)
    except RuntimeError:  # no storage (sparse, functional wrappers)
        return None


class OpEvent:
    """One op (or one first-seen input) as the log prints it."""

    __slots__ = ("op", "source", "stack", "args", "outs", "devices", "in_recs", "backward", "compiled")

    def __init__(self, op, source, stack, args, outs, devices, in_recs, backward=None, compiled=False):
        self.op, self.source, self.stack, self.args = op, source, stack, args  # args: (path, Record|None, value, device)
        self.outs, self.devices, self.in_recs = outs, devices, in_recs
        self.backward, self.compiled = backward, compiled


class OpRecorder:
    """Fingerprint records of the ops a dispatch mode sees.  Thread-safe.

    ``sink(events)`` is called with the finished :class:`OpEvent` batches in op order.
    ``names`` maps tensors (parameters, buffers) to names for their ``param`` records.
    """

    def __init__(self, sink: Callable[[List[OpEvent]], None], run: Optional[str] = None, stats: bool = False,
                 stack_depth: int = 1, names: Optional[Dict[int, Tuple[weakref.ref, str]]] = None,
                 describe_args: bool = False, batch: int = 512, rank: int = 0):
        self.sink, self.run, self.stats, self.stack_depth = sink, run, stats, max(1, stack_depth)
        self.describe_args, self.batch, self.rank = describe_args, batch, rank
        self.names = names or {}
        self.seq = 0
        self.compiled_ops = 0
        self.lock = threading.RLock()
        self._frames = _FrameFilter()
        self._producers: Dict[tuple, tuple] = {}  # memory key -> (StorageWeakRef, Record, version)
        self._counts: Dict[tuple, int] = {}
        self._writes: Dict[Any, tuple] = {}
        self._hashes = PendingHashes(stats)
        self._events: List[OpEvent] = []
        self._unsettled: List[tuple] = []  # (tensor, Record, is view) of the last op
        self._autograd_node = _compat.current_autograd_node_getter()

    # -- source lines --------------------------------------------------------------------------
    def _where(self, frame) -> Tuple[Optional[str], str, Optional[List[str]]]:
        """``(source file:line, location for names, stack)`` of the first user frame.

        The location is ``file:function+offset`` (line relative to the function's first
        line), so names survive lines added or removed in other functions."""
        frames = self._frames.user_frames(frame, self.stack_depth)
        if not frames:
            return None, "?", None
        f = frames[0]
        code = f.f_code
        source = f"{code.co_filename}:{f.f_lineno}"
        loc = f"{os.path.basename(code.co_filename)}:{code.co_name}+{f.f_lineno - code.co_firstlineno}"
        if self.stack_depth == 1:
            return source, loc, None
        return source, loc, [f"{g.f_code.co_filename}:{g.f_lineno} in {g.f_code.co_name}" for g in frames]

    def _name(self, op: str, loc: str, suffix: str = "") -> str:
        base = f"{op}@{loc}{suffix}"
        k = self._counts.get(base, 0)
        self._counts[base] = k + 1
        return f"{base}#{k}"

    # -- producers ---------------------------------------------------------------------------
    # Keyed by memory (address, dtype, shape, strides, device) rather than by Python object: a
    # tensor made inside a C++ kernel (``weight.t()`` in ``linear``) reaches the next op as a new
    # Python object.  An entry is valid while its storage is alive and its version is unchanged.
    def producer(self, t: torch.Tensor) -> Optional[Record]:
        if self._unsettled:
            self._settle()
        key = _mem_key(t)
        ent = self._producers.get(key) if key is not None else None
        if ent is not None and ent[2] == _version(t) and not ent[0].expired():
            return ent[1]
        return None

    def set_producer(self, t: torch.Tensor, rec: Record, view: bool = False) -> None:
        """``view``: ``t`` shares memory with an input, so an entry still valid for the same memory
        keeps its original producer (``detach``/``t().t()`` make no new values)."""
        key = _mem_key(t)
        if key is None:
            return
        version = _version(t)
        if view:
            ent = self._producers.get(key)
            if ent is not None and ent[2] == version and not ent[0].expired():
                return
        self._producers[key] = (StorageWeakRef(t.untyped_storage()), rec, version)

    def _settle(self) -> None:
        """Register the last op's outputs.  Deferred to the next op because autograd bumps the version
        counter of in-place results, and gives views their base's counter, after the op returns."""
        unsettled, self._unsettled = self._unsettled, []
        for t, rec, view in unsettled:
            self.set_producer(t, rec, view)

    def _input_record(self, t: torch.Tensor, source: Optional[str], loc: str, events: list) -> Record:
        named = self.names.get(id(t))
        if named is not None and named[0]() is t:
            k = self._counts.get(named[1], 0)
            self._counts[named[1]] = k + 1
            rec = self._record(named[1] if k == 0 else f"{named[1]}#{k}", "param", "param", source, t)
        else:
            rec = self._record(self._name("input", loc), "input", "input", source, t)
        self._capture(rec, t)
        self.set_producer(t, rec)
        events.append(OpEvent(rec.op, source, None, [], [rec], [str(t.device)], []))
        return rec

    def _record(self, node: str, op: str, kind: str, source: Optional[str], t, inputs=(), extra=None) -> Record:
        seq = self.seq
        self.seq += 1
        if isinstance(t, torch.Tensor):
            dtype, shape = str(t.dtype).replace("torch.", ""), list(t.shape)
        else:
            dtype, shape = f"py_{type(t).__name__}", []
        return Record(graph="eager", stage="eager", node=node, op=op, kind=kind, seq=seq, source=source,
                      dtype=dtype, shape=shape, inputs=[r.node for r in inputs], rank=self.rank, run=self.run,
                      extra=extra)

    # -- the two halves of an op -----------------------------------------------------------------
    def begin(self, func, args, kwargs, frame, compiled: bool) -> tuple:
        """Before the op runs: resolve its inputs (hashing first-seen ones as they are now)."""
        if self._unsettled:
            self._settle()
        node = self._autograd_node()
        backward = fwd = None
        if node is not None:
            backward = node.name()
            fwd = node.metadata.get(FORWARD_KEY)
        source, loc, stack = self._where(frame)
        if fwd is not None:  # name backward ops after the forward line that created their node
            source, loc = fwd
        found = iter_args(args, kwargs, [], self.describe_args)
        in_recs, arg_desc, events = [], [], []
        grad_on = node is None and torch.is_grad_enabled()
        for path, t in found:
            if not isinstance(t, torch.Tensor):
                arg_desc.append((path, None, t, None))
                continue
            rec = self.producer(t)
            if rec is None:
                rec = self._input_record(t, source, loc, events)
            elif grad_on and t.requires_grad:
                self._tag_grad_fn(t, rec)
            in_recs.append(rec)
            if self.describe_args:
                arg_desc.append((path, rec, None, str(t.device)))
        return (func, source, loc, stack, backward, compiled, in_recs, arg_desc, events)

    @staticmethod
    def _tag_grad_fn(t: torch.Tensor, rec: Record) -> None:
        gf = t.grad_fn
        if gf is not None:
            md = gf.metadata
            if FORWARD_KEY not in md and "@" in rec.node:
                loc = rec.node.split("@", 1)[1].rsplit("#", 1)[0]
                md[FORWARD_KEY] = (rec.source, loc[:-3] if loc.endswith("/bw") else loc)

    def end(self, ctx: tuple, result, args, kwargs, nondeterministic: bool = False) -> List[Record]:
        """After the op ran: one record per tensor (or Python scalar) it produced."""
        func, source, loc, stack, backward, compiled, in_recs, arg_desc, events = ctx
        info = self._writes.get(func)
        if info is None:
            info = self._writes[func] = (_schema_writes(func), _returns_view(func), _uninitialized(func))
        writes, is_view, uninit = info
        outs = written_tensors(result, writes, args, kwargs)
        view_of = in_recs[0] if is_view and in_recs and args and isinstance(args[0], torch.Tensor) else None
        op = str(func)
        base = self._name(op, loc, "/bw" if backward else "")
        extra = self._extra(stack, backward, compiled, nondeterministic)
        recs = []
        for j, t in enumerate(outs):
            rec = self._record(base if len(outs) == 1 else f"{base}.{j}", op, "node", source, t, in_recs, extra)
            if uninit:  # the memory holds garbage until written: hash what is defined, dtype and shape
                rec.hash = _uninitialized_hash(rec)
            elif view_of is not None and isinstance(t, torch.Tensor) and hashable(t) is None:
                self._hashes.add_view(rec, view_of, t, args[0])
            else:
                self._capture(rec, t)
            if isinstance(t, torch.Tensor):
                self._unsettled.append((t, rec, is_view))
            recs.append(rec)
        if compiled:
            self.compiled_ops += 1
        devices = [str(t.device) if isinstance(t, torch.Tensor) else "host" for t in outs] if self.describe_args else []
        events.append(OpEvent(op, source, stack, arg_desc, recs, devices, in_recs, backward, compiled))
        self._events.extend(events)
        if len(self._hashes) >= self.batch or self._hashes.nbytes >= _FLUSH_BYTES:
            self.flush()
        return recs

    @staticmethod
    def _extra(stack, backward, compiled, nondeterministic) -> Optional[dict]:
        extra = {}
        if stack:
            extra["stack"] = stack
        if backward:
            extra["backward"] = backward
        if compiled:
            extra["compiled_region"] = "eager"
        if nondeterministic:
            extra["non_deterministic"] = True
        return extra or None

    def add_external(self, node: str, op: str, kind: str, t: torch.Tensor, source: Optional[str],
                     stack: Optional[List[str]] = None, extra: Optional[dict] = None,
                     inputs: Sequence[Record] = ()) -> Record:
        """A record made outside dispatch (``observe``), produced by nothing the mode saw."""
        with self.lock:
            ex = dict(extra or {})
            if stack:
                ex["stack"] = stack
            rec = self._record(node, op, kind, source, t, inputs, ex or None)
            self._capture(rec, t)
            if isinstance(t, torch.Tensor):
                self.set_producer(t, rec)
            device = str(t.device) if isinstance(t, torch.Tensor) else "host"
            self._events.append(OpEvent(op, source, stack, [], [rec], [device], list(inputs)))
            return rec

    # -- fingerprints ----------------------------------------------------------------------------
    def _capture(self, rec: Record, t) -> None:
        why = hashable(t) if isinstance(t, torch.Tensor) else None
        if why is not None:
            rec.extra = dict(rec.extra or {}, unhashable=why)
            return
        self._hashes.add(rec, t)

    def flush(self) -> None:
        """Fingerprint everything pending (one host sync per device) and hand finished events to the sink."""
        with self.lock:
            events, self._events = self._events, []
            self._hashes.resolve()
            for ev in events:
                hashes = [r.hash for r in ev.in_recs]
                for r in ev.outs:
                    r.in_hashes = list(hashes)
            self._prune()
        if events:
            self.sink(events)

    def _prune(self) -> None:
        if len(self._producers) > 4096:
            self._producers = {k: v for k, v in self._producers.items() if not v[0].expired()}
