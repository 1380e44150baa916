"""Per-op records for the eager dispatch modes (:mod:`determ_backend.modes.core`).

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
  :class:`~determ_backend.modes._hashing.PendingHashes` (device work at once, one
  host sync per batch of a few hundred ops); views get a hash derived from their
  base's instead of re-reading memory.

The mode classes, the human-readable log and the comparisons live elsewhere;
which frames are user code is :mod:`determ_backend._frames`' decision, and private
torch (operator schemas, the running autograd node) is reached through
:mod:`determ_backend._torch_compat`.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from determ_backend import _torch_compat as _compat
from determ_backend.modes._hashing import PendingHashes, hashable
from determ_backend._frames import FrameFilter
from determ_backend.modes.ops import (COPIES, adopts_storage, byte_span, iter_args, mem_key, out_args, out_tensor_ids,
                                      returns_view, same_layout, schema_writes, storage_start, tensor_args,
                                      uninitialized, uninitialized_hash, version, written_tensors)
from determ_backend.trace.stream import DTYPE_NAMES, Record, dtype_name, shape_of

__all__ = ["OpRecorder", "OpEvent", "FORWARD_KEY", "op_info", "recorder_ops"]

_version = _compat.tensor_version  # a C attribute getter: the hot paths call it per tensor without a Python frame
_storage_weak_ref, _storage_release = _compat.storage_weak_ref, _compat.storage_release

# Facts that depend only on code objects and operators, shared by every recorder of the process (a mode
# made per step starts warm): which frames are user code, each user line's names, each op's schema facts.
_FRAMES = FrameFilter()
_LINES: Dict[tuple, tuple] = {}  # (id(code), line) -> (source, name location, code); the code keeps its id
_OP_INFO: Dict[int, tuple] = {}  # id(op) -> (writes, is view, uninitialized, copied arg, name, op, collective, out args,
#                                           adopts storage)
_LINES_LIMIT = 1 << 16  # user lines remembered (generated code makes new ones)

FORWARD_KEY = "determ_forward_source"  # autograd Node metadata key: (source, name location) of its forward op
_FLUSH_BYTES = 256 << 20  # also finish the fingerprint batch once this much data was captured
# A batch the host has finished already (the native CPU kernel read every capture: nothing waits on a device) is
# handed on at this many records instead of at ``batch``, so its records die young.  Held for a few hundred ops,
# they outlived the collector's second generation and were promoted to the oldest, and in a long run every few
# thousand ops a full collection then walked the whole heap: 4 collections of ~165 ms in 1,000 small training
# steps of a process with transformers loaded, 0.67 ms a step.  The producer table is still pruned per ``batch``.
_HOST_BATCH = 64
_SILENT_LIMIT = 64  # storages written by collectives that are remembered (DDP: one per gradient bucket)


def op_info(func) -> tuple:
    """What the recorder needs to know of an op, once per op of the process: ``(writes, is view, uninitialized,
    copied arg, name, op, collective, out args, adopts storage)`` (``collective``: a ``torch.distributed`` op, whose
    outputs are final only once its work is done; ``out args``: its ``out=`` arguments, :func:`~.ops.out_args`;
    ``adopts storage``: :func:`~.ops.adopts_storage`, recorded as nothing: the tensor is an input where it is used)."""
    info = _OP_INFO.get(id(func))  # by id: OpOverload's __hash__ is Python code
    if info is None or info[5] is not func:
        info = _OP_INFO[id(func)] = (schema_writes(func, undeclared=True), returns_view(func), uninitialized(func),
                                     COPIES.get(_compat.op_schema_name(func)), str(func), func,
                                     str(getattr(func, "namespace", "")) == "c10d", out_args(func),
                                     adopts_storage(func))
    return info


@functools.lru_cache(maxsize=None)
def _setup(setup: Callable) -> None:
    """Give the C recorder the objects it works with (once per loaded module)."""
    from determ_backend.fingerprint import _native
    from determ_backend.fingerprint._words import key
    from determ_backend.fingerprint.core import stats_dict

    setup({"Tensor": torch.Tensor, "Parameter": torch.nn.Parameter, "Size": torch.Size, "Record": Record,
           "OpEvent": OpEvent, "strided": torch.strided, "FORWARD_KEY": FORWARD_KEY, "OP_INFO": _OP_INFO,
           "op_info": op_info, "LINES": _LINES, "FRAMES": _FRAMES, "FRAMES_CACHE": _FRAMES.cache,
           "engine": _compat.autograd_engine_entry(), "DTYPE_NAMES": DTYPE_NAMES, "dtype_name": dtype_name,
           "autograd_node": _compat.current_autograd_node_getter(), "is_grad_enabled": torch.is_grad_enabled,
           "written_tensors": written_tensors, "SUPPORTED": _native.SUPPORTED, "key": key,
           "is_zero_tensor": _compat.is_zero_tensor, "stats_dict": stats_dict, "HOST_BATCH": _HOST_BATCH,
           "FLUSH_BYTES": _FLUSH_BYTES, "storage_weak_ref": _storage_weak_ref,
           "storage_expired": _compat.storage_expired, "storage_release": _storage_release,
           "uninitialized_hash": uninitialized_hash})


def recorder_ops() -> Tuple[Callable, Callable]:
    """``(begin, end)``, called as ``begin(recorder, ...)`` and ``end(recorder, ...)`` with the arguments of
    :meth:`OpRecorder.begin` and :meth:`OpRecorder.end`: the native module's, which do the common case of an op in C
    with the same tables and give the same records (any other case, whole or in part, through these methods), when
    it is loaded as an extension module; else those methods.  Read when a mode is made (``DETERM_NATIVE``)."""
    from determ_backend.fingerprint import _native

    global _SET_UP
    ops = _native.recorder_ops()
    if ops is None:
        return OpRecorder.begin, OpRecorder.end
    if ops[0] is not _SET_UP:  # the objects it is given live as long as this module, and are changed in place
        _setup(ops[0])
        _SET_UP = ops[0]
    return ops[1], ops[2]


_SET_UP: Optional[Callable] = None  # the native setup_recorder last called


def _release_storages(producers: Dict[tuple, tuple]) -> None:
    for ent in producers.values():
        _compat.storage_release(ent[0])
    producers.clear()


def _release_refs(refs: Dict[int, object]) -> None:
    for ref in refs.values():
        _compat.storage_release(ref)
    refs.clear()


def _release_silent(silent: List[tuple]) -> None:
    for e in silent:
        _compat.storage_release(e[4])
    silent.clear()


class OpEvent:
    """One op (or one first-seen input) as the log prints it."""

    __slots__ = ("op", "source", "stack", "args", "outs", "devices", "in_recs", "backward", "compiled")

    def __init__(self, op, source, stack, args, outs, devices, in_recs, backward=None, compiled=False):
        self.op, self.source, self.stack, self.args = op, source, stack, args  # args: (path, Record|None, value, device)
        self.outs, self.devices, self.in_recs = outs, devices, in_recs
        self.backward, self.compiled = backward, compiled


class OpRecorder:
    """Fingerprint records of the ops a dispatch mode sees.  Thread-safe.

    ``sink(events, early)`` is called with the finished :class:`OpEvent` batches in op order (see :meth:`flush`).
    ``names`` maps tensors (parameters, buffers) to names for their ``param`` records.
    """

    def __init__(self, sink: Callable[[List[OpEvent]], None], run: Optional[str] = None, stats: bool = False,
                 stack_depth: int = 1, names: Optional[Dict[int, Tuple[weakref.ref, str]]] = None,
                 describe_args: bool = False, batch: int = 512, rank: int = 0):
        self.sink, self.run, self.stats, self.stack_depth = sink, run, stats, max(1, stack_depth)
        self.describe_args, self.batch, self.rank = describe_args, batch, rank
        self.names = names or {}
        self.seq = 0
        self._pruned_at = 0  # seq at the last prune of the producer table
        self.compiled_ops = 0
        self.lock = threading.RLock()
        # memory key -> (weak reference to the storage, Record, version, id of the tensor that holds it); the references
        # are given back when an entry is replaced or pruned, and the rest when the recorder goes
        self._producers: Dict[tuple, tuple] = {}
        # given back when the recorder is collected, not at interpreter exit (a mode may still run then: a
        # reference left at exit is only a small leak)
        weakref.finalize(self, _release_storages, self._producers).atexit = False
        self._by_object: Dict[int, tuple] = {}  # id(tensor) -> (weakref to it, Record, version): the fast path
        # storages a write changed without moving their version counter (torch.distributed ops): (first byte, end,
        # seq of the write's record, that record); an entry of an alias of such memory made before is stale
        self._silent: List[tuple] = []  # (first byte, end, seq, record, storage reference): changed in place
        weakref.finalize(self, _release_silent, self._silent).atexit = False
        # first byte of each storage an op wrote through a view (``w[0, 0] += e``, ``buf[:2] = h``): the base,
        # read next as an object no op returned, holds what those writes left, not a value of its own
        self._view_written: Dict[int, object] = {}  # first byte -> a weak reference to that storage
        weakref.finalize(self, _release_refs, self._view_written).atexit = False
        self._counts: Dict[tuple, int] = {}
        # (location, record, seq after it) of the last collective: a tensor first seen by the very next op of that
        # line is a buffer the collective's own completion code reads (gloo's reduce_scatter copies its result out of
        # one in ``work.wait()``), made of its value, not an input of the program's
        self._collective_at: Optional[tuple] = None
        self._hashes = PendingHashes(stats)
        self._events: List[OpEvent] = []
        self._unsettled: List[tuple] = []  # (tensor, Record, is view) of the last op
        self._autograd_node = _compat.current_autograd_node_getter()

    # -- source lines --------------------------------------------------------------------------
    def _where(self, frame) -> Tuple[Optional[str], str, Optional[List[str]]]:
        """``(source file:line, location for names, stack)`` of the first user frame.

        The location is ``file:function+offset`` (line relative to the function's first
        line), so names survive lines added or removed in other functions."""
        frames = _FRAMES.user_frames(frame, self.stack_depth)
        if not frames:
            return None, "?", None
        f = frames[0]
        code = f.f_code
        key = (id(code), f.f_lineno)  # not the code itself: hashing a code object hashes its bytecode
        where = _LINES.get(key)
        if where is None or where[2] is not code:
            if len(_LINES) >= _LINES_LIMIT:
                _LINES.clear()
            where = _LINES[key] = (f"{code.co_filename}:{f.f_lineno}", f"{os.path.basename(code.co_filename)}:"
                                        f"{code.co_name}+{f.f_lineno - code.co_firstlineno}", code)
        source, loc, _ = where
        if self.stack_depth == 1:
            return source, loc, None
        return source, loc, [f"{g.f_code.co_filename}:{g.f_lineno} in {g.f_code.co_name}" for g in frames]

    @staticmethod
    def _run_by_user(frame) -> bool:
        """Whether an op dispatched during backward was called by the user's Python (a custom ``Function``'s
        backward, a hook): a user frame comes before the engine's entry on the way out from ``frame``."""
        engine = _compat.autograd_engine_entry()
        while frame is not None:
            code = frame.f_code
            if code is engine:
                return False
            if not _FRAMES.internal(code):
                return True
            frame = frame.f_back
        return False

    def _name(self, op: str, loc: str, suffix: str = "") -> str:
        base = f"{op}@{loc}{suffix}"
        k = self._counts.get(base, 0)
        self._counts[base] = k + 1
        return f"{base}#{k}"

    # -- producers ---------------------------------------------------------------------------
    # Keyed by memory (address, dtype, shape, strides, device) rather than by Python object: a
    # tensor made inside a C++ kernel (``weight.t()`` in ``linear``) reaches the next op as a new
    # Python object.  An entry is valid while its storage is alive and its version is unchanged.
    # Most inputs are the very Python objects an earlier op returned: those are found by identity
    # first (a live weak reference to the same object, same version), which gives what the memory key
    # would (views share their base's version counter, so a write through any alias is seen).
    def producer(self, t: torch.Tensor) -> Optional[Record]:
        with self.lock:  # the table holds storage references given back once: one thread changes it at a time
            return self._producer(t)

    def _producer(self, t: torch.Tensor) -> Optional[Record]:
        if self._unsettled:
            self._settle()
        v = version(t)
        ent = self._by_object.get(id(t))
        if ent is not None and ent[2] == v and ent[0]() is t:
            return ent[1]
        return self._producer_by_memory(t, v)

    def _producer_by_memory(self, t: torch.Tensor, v: int) -> Optional[Record]:
        """The producer of ``t``'s memory (same address, dtype, shape, strides, device), when ``t`` is not an
        object an earlier op returned."""
        key = mem_key(t)
        ent = self._producers.get(key) if key is not None else None
        if ent is not None and ent[2] == v and not _compat.storage_expired(ent[0]):
            self._remember(t, ent[1], v)
            return ent[1]
        return None

    def _remember(self, t: torch.Tensor, rec: Record, v: int) -> None:
        try:
            self._by_object[id(t)] = (weakref.ref(t), rec, v)
        except TypeError:  # a tensor subclass without weak references: the memory key alone
            pass

    def set_producer(self, t: torch.Tensor, rec: Record, view: bool = False) -> None:
        """``view``: ``t`` shares memory with an input, so an entry still valid for the same memory
        keeps its original producer (``detach``/``t().t()`` make no new values)."""
        key = mem_key(t)
        try:
            v = _version(t)
        except RuntimeError:  # inference tensors have no version counter
            v = -1
        if key is None:  # no memory of its own to key (a sparse tensor): found by identity alone, by its readers
            self._remember(t, rec, v)
            return
        producers = self._producers
        ent = producers.get(key)
        if ent is not None and view and ent[2] == v and not _compat.storage_expired(ent[0]):
            self._remember(t, ent[1], v)
            return
        holder = id(t)
        if ent is not None and view and not _compat.storage_expired(ent[0]):
            # a view with a version counter of its own (``p.data``, which reaches the mode as ``detach``): the tensor
            # holding the memory's record stays the one to forget when the view is written
            holder = ent[3]
        producers[key] = (_storage_weak_ref(t), rec, v, holder)
        if ent is not None:  # given back once it is out of the table (an interrupt in between leaks, never frees twice)
            if not view and ent[3] != id(t) and not _compat.storage_expired(ent[0]):
                # written through another tensor of the same memory with a version counter of its own (``p.data``):
                # the object that held the old record does not hold it any more, nor do the views made of it before
                self._by_object.pop(ent[3], None)
                self._forget_overlapping(key)
                self._written_through_view((t,), alias=True)
            _storage_release(ent[0])
        try:
            self._by_object[id(t)] = (weakref.ref(t), rec, v)
        except TypeError:  # a tensor subclass without weak references: the memory key alone
            pass

    def _overlapping(self, key: tuple) -> List[tuple]:
        """The keys of the producer table whose bytes overlap ``key``'s (``key`` itself among them, when present)."""
        lo, hi = byte_span(key)
        return [k for k in self._producers if k[0] < hi and byte_span(k)[1] > lo]

    def _records_over(self, t: torch.Tensor) -> List[Record]:
        """The live records written into the bytes ``t`` covers, in order: what a tensor written through views of
        it holds (a sibling view of the same storage is not made of them)."""
        key = mem_key(t)
        if key is None:
            return []
        producers = self._producers
        return sorted((producers[k][1] for k in self._overlapping(key) if not _compat.storage_expired(producers[k][0])),
                      key=lambda r: r.seq)

    def _forget_overlapping(self, key: tuple) -> None:
        """Drop the entries of other tensors over the bytes of ``key`` (a write their version counters did not see
        changed them), and the identity entries holding their records."""
        producers = self._producers
        gone = [k for k in self._overlapping(key) if k != key]
        if not gone:
            return
        stale = set()
        for k in gone:
            ent = producers.pop(k)
            stale.add(id(ent[1]))
            _storage_release(ent[0])
        for i in [i for i, e in self._by_object.items() if id(e[1]) in stale]:
            del self._by_object[i]

    def _settle(self) -> None:
        """Register the last op's outputs.  Deferred to the next op because autograd bumps the version
        counter of in-place results, and gives views their base's counter, after the op returns."""
        unsettled, self._unsettled = self._unsettled, []
        for t, rec, view in unsettled:
            self.set_producer(t, rec, view)

    def _input_record(self, t: torch.Tensor, source: Optional[str], loc: str, events: list,
                      unread: bool = False, gathered: bool = False) -> Record:
        """A first-seen input's record; ``unread``: an ``out=`` tensor, whose values the op overwrites unread: its
        memory may hold anything (DDP's gradient bucket before the first backward), so only its dtype and shape
        are fingerprinted, as for ``empty``'s; ``gathered``: the input of a collective, which may be memory earlier
        ops wrote through views (:meth:`_silent_alias`)."""
        if (self._silent or gathered) and not unread:
            alias = self._silent_alias(t, source, loc, events, gathered)
            if alias is not None:
                return alias
        after = self._collective_at
        if (after is not None and after[0] == loc and after[2] == self.seq and not unread and not gathered
                and not t.requires_grad and id(t) not in self.names):  # never a parameter, nor a value autograd tracks
            return self._alias_of(t, source, loc, events, [after[1]], after[1])
        if self._view_written and not unread and not gathered and self._written_through_view_before(t):
            alias = self._alias_of(t, source, loc, events, self._records_over(t), None)  # the writes into its bytes
            if alias is not None:
                return alias
        named = self.names.get(id(t))
        if named is not None and named[0]() is t:
            k = self._counts.get(named[1], 0)
            self._counts[named[1]] = k + 1
            rec = self._record(named[1] if k == 0 else f"{named[1]}#{k}", "param", "param", source, t)
        else:
            rec = self._record(self._name("input", loc), "input", "input", source, t)
        if unread:
            rec.hash = uninitialized_hash(rec)
        else:
            self._capture(rec, t)
        self.set_producer(t, rec)
        events.append(OpEvent(rec.op, source, None, (), [rec], [str(t.device)], ()))
        return rec

    def _record(self, node: str, op: str, kind: str, source: Optional[str], t, inputs=(), extra=None) -> Record:
        seq = self.seq
        self.seq += 1
        if isinstance(t, torch.Tensor):
            dtype, shape = dtype_name(t.dtype), shape_of(t)
        else:
            dtype, shape = f"py_{type(t).__name__}", []
        # positional, in the field order (graph, stage, node, op, kind, call, seq, source, dtype, shape, hash, stats,
        # inputs, in_hashes, rank, run, payload, extra): half the cost of keywords, once per record
        return Record("eager", "eager", node, op, kind, 0, seq, source, dtype, shape, None, None,
                      [r.node for r in inputs], [], self.rank, self.run, None, extra)

    # -- the two halves of an op -----------------------------------------------------------------
    def begin(self, func, args, kwargs, frame, compiled: bool) -> tuple:
        """Before the op runs: resolve its inputs (hashing first-seen ones as they are now).  Returns the context
        :meth:`end` takes; its first item is the op's :func:`op_info` (the mode reads whether it is a collective)."""
        info = _OP_INFO.get(id(func))  # by id: OpOverload's __hash__ is Python code
        if info is None or info[5] is not func:
            info = op_info(func)
        if self._unsettled:
            self._settle()
        node = self._autograd_node()
        backward = fwd = None
        if node is not None:
            backward = node.name()
            # autograd's own formulas are named after the forward line that made their node; ops the user's Python
            # runs during backward (a custom Function's backward, a tensor hook) are named after that code
            fwd = node.metadata.get(FORWARD_KEY) if not self._run_by_user(frame) else None
        if fwd is not None and self.stack_depth == 1:  # named after its forward line: no frames to walk
            source, loc = fwd
            stack = None
        else:
            source, loc, stack = self._where(frame)
            if fwd is not None:  # name backward ops after the forward line that created their node
                source, loc = fwd
        in_recs, events = [], []
        grad_on = node is None and torch.is_grad_enabled()
        unread = out_tensor_ids(info[7], args, kwargs) if info[7] else None  # out= tensors: written, not read
        if self.describe_args:
            arg_desc = []
            for path, t in iter_args(args, kwargs, [], True):
                if not isinstance(t, torch.Tensor):
                    arg_desc.append((path, None, t, None))
                    continue
                rec = self._input(t, source, loc, events, grad_on, unread is not None and id(t) in unread, info[6])
                in_recs.append(rec)
                arg_desc.append((path, rec, None, str(t.device)))
        else:
            arg_desc = ()  # described for the text log only: no list per op to allocate (and collect) otherwise
            by_object = self._by_object
            for t in tensor_args(args, kwargs):  # _input, with its common case (an object an op returned) inline
                try:
                    v = _version(t)
                except RuntimeError:  # inference tensors have no version counter
                    v = -1
                ent = by_object.get(id(t))
                if ent is not None and ent[2] == v and ent[0]() is t:
                    rec = ent[1]
                else:
                    rec = self._producer_by_memory(t, v)
                    if rec is None:
                        in_recs.append(self._input_record(t, source, loc, events,
                                                          unread is not None and id(t) in unread, info[6]))
                        continue
                if self._silent:
                    rec = self._fresh(t, rec, source, loc, events)
                if grad_on and t.requires_grad:
                    self._tag_grad_fn(t, rec)
                in_recs.append(rec)
        return (info, source, loc, stack, backward, compiled, in_recs, arg_desc, events)

    def _input(self, t: torch.Tensor, source: Optional[str], loc: str, events: list, grad_on: bool,
               unread: bool = False, gathered: bool = False) -> Record:
        """The record of input ``t``: its producer's, else a new ``input``/``param`` record (``unread``,
        ``gathered``: as for :meth:`_input_record`)."""
        rec = self._producer(t)  # under the lock (begin holds it)
        if rec is None:
            return self._input_record(t, source, loc, events, unread, gathered)
        if self._silent:
            rec = self._fresh(t, rec, source, loc, events)
        if grad_on and t.requires_grad:
            self._tag_grad_fn(t, rec)
        return rec

    def _fresh(self, t: torch.Tensor, rec: Record, source: Optional[str], loc: str, events: list) -> Record:
        """``rec``, unless a write that left the version counter as it was (a ``torch.distributed`` op: DDP's
        all-reduce of a gradient bucket) changed ``t``'s memory after ``rec`` was made: then :meth:`_silent_alias`
        (the bucket view DDP copies into ``.grad`` held the local gradient's record, and its fingerprint, before the
        all-reduce)."""
        try:
            ptr = t.data_ptr()
        except RuntimeError:  # no storage
            return rec
        for e in self._silent:
            if e[0] <= ptr < e[1] and not _compat.storage_expired(e[4]):  # the first live write holding ptr
                return (self._silent_alias(t, source, loc, events, written=e) or rec) if rec.seq < e[2] else rec
        return rec

    def _silent_alias(self, t: torch.Tensor, source: Optional[str], loc: str, events: list,
                      gathered: bool = False, written: Optional[tuple] = None) -> Optional[Record]:
        """A new ``alias`` record of ``t``'s values as they are now, made of the writes into its memory: when ``t``
        lies in memory a collective wrote (:meth:`_written_silently`), that write and the records written into the
        same memory since; with ``gathered`` (a collective's input seen for the first time), the records written
        into ``t``'s storage.  DDP writes each gradient into its bucket through a view (``mul.out``), then
        all-reduces the whole bucket, an object first seen there.  ``written``: the entry of :attr:`_silent` that
        holds ``t``'s memory, when the caller found it already.  None when neither applies."""
        writer, lo, hi, seq = None, 0, 0, -1
        if written is None:
            try:
                ptr = t.data_ptr()
            except RuntimeError:
                return None
            for e in self._silent:
                if e[0] <= ptr < e[1] and not _compat.storage_expired(e[4]):  # memory freed since is another's now
                    written = e
                    break
        if written is not None:
            lo, hi, seq, writer = written[:4]
        if writer is None:
            if not gathered:
                return None
            try:
                st = t.untyped_storage()
                lo, hi = st.data_ptr(), st.data_ptr() + st.nbytes()
            except RuntimeError:
                return None
        inputs = [writer] if writer is not None else []
        inputs += sorted((ent[1] for key, ent in self._producers.items()
                          if lo <= key[0] < hi and ent[1].seq > seq and ent[1] is not writer
                          and not _compat.storage_expired(ent[0])), key=lambda r: r.seq)
        return self._alias_of(t, source, loc, events, inputs, writer)

    def _alias_of(self, t: torch.Tensor, source: Optional[str], loc: str, events: list, inputs: List[Record],
                  writer: Optional[Record]) -> Optional[Record]:
        """The ``alias`` record of ``t`` made of ``inputs`` (None when there are none)."""
        if not inputs:
            return None
        rec = self._record(self._name("alias", loc), "alias", "node", source, t, inputs,
                           {"aliases": writer.node} if writer is not None else None)
        self._capture(rec, t)
        self.set_producer(t, rec)
        device = str(t.device)  # the text log names the writes it is made of, as an op's inputs
        args = [(f"written.{k}", r, None, device) for k, r in enumerate(inputs)] if self.describe_args else ()
        events.append(OpEvent(rec.op, source, None, args, [rec], [device], inputs))
        return rec

    def _written_through_view(self, outs: Sequence, alias: bool = False) -> None:
        """Remember the storages of the views among ``outs`` (what an in-place op wrote; ``alias``: every tensor of
        ``outs`` wrote memory another object holds), for :meth:`_input_record`."""
        for t in outs:
            if isinstance(t, torch.Tensor) and (alias or t._base is not None):
                start = storage_start(t)
                old = self._view_written.get(start) if start is not None else None
                if start is None or (old is not None and not _compat.storage_expired(old)):
                    continue
                if old is not None:  # memory freed since, now another storage's
                    _storage_release(self._view_written.pop(start))
                if len(self._view_written) >= _LINES_LIMIT:  # mostly storages freed since
                    _release_refs(self._view_written)
                self._view_written[start] = _storage_weak_ref(t)

    def _written_through_view_before(self, t: torch.Tensor) -> bool:
        """Whether an op wrote through a view into ``t``'s storage, which is still alive (memory freed and taken by
        another tensor at the same address is not it: runs would differ by where the allocator put things)."""
        start = storage_start(t)
        ref = self._view_written.get(start) if start is not None else None
        if ref is None:
            return False
        if _compat.storage_expired(ref):
            _storage_release(self._view_written.pop(start))
            return False
        return True

    def _written_silently(self, outs: Sequence, recs: List[Record]) -> None:
        """A collective wrote ``outs`` without moving their version counters: remember their storages, so that
        aliases recorded before are not taken for what the memory holds now (:meth:`_fresh`)."""
        for t, rec in zip(outs, recs):
            if not isinstance(t, torch.Tensor):
                continue
            try:
                st = t.untyped_storage()
                lo = st.data_ptr()
                hi = lo + st.nbytes()
            except RuntimeError:
                continue
            keep = [e for e in self._silent if e[0] != lo and not _compat.storage_expired(e[4])][-(_SILENT_LIMIT - 1):]
            gone = [e for e in self._silent if not any(e is k for k in keep)]
            self._silent[:] = keep + [(lo, hi, rec.seq, rec, _storage_weak_ref(t))]
            for e in gone:  # given back once out of the list
                _storage_release(e[4])

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
        info, source, loc, stack, backward, compiled, in_recs, arg_desc, events = ctx
        if info[8]:  # memory taken from elsewhere (set_ of a storage): no record; the version it bumped makes the
            self._events.extend(events)  # tensor a first-seen input where an op uses it, in the program's order
            return []
        writes, is_view, uninit, copy_arg, op = info[:5]
        outs = (result,) if not writes and isinstance(result, torch.Tensor) else written_tensors(result, writes, args,
                                                                                                 kwargs)
        base = self._name(op, loc, "/bw" if backward else "")
        extra = (self._extra(stack, backward, compiled, nondeterministic)
                 if stack or backward or compiled or nondeterministic else None)
        recs = []
        for j, t in enumerate(outs):
            rec = self._record(base if len(outs) == 1 else f"{base}.{j}", op, "node", source, t, in_recs, extra)
            if j in uninit:  # the memory holds garbage until written: hash what is defined, dtype and shape
                rec.hash = uninitialized_hash(rec)
            elif nondeterministic:  # values may have been substituted after the op: read them
                self._capture(rec, t)
            else:
                self._hash_output(rec, t, is_view, copy_arg, args, in_recs)
            if isinstance(t, torch.Tensor):
                self._unsettled.append((t, rec, is_view))
            recs.append(rec)
        if info[6]:  # a collective returns the tensors it wrote (its schema declares no writes)
            self._written_silently(outs, recs)
            if recs:
                self._collective_at = (loc, recs[-1], self.seq)
        elif writes:
            self._written_through_view(outs)
        if compiled:
            self.compiled_ops += 1
        devices = [str(t.device) if isinstance(t, torch.Tensor) else "host" for t in outs] if self.describe_args else ()
        events.append(OpEvent(op, source, stack, arg_desc, recs, devices, in_recs, backward, compiled))
        self._events.extend(events)
        self._flush_due()
        return recs

    def _flush_due(self) -> None:
        """The flush an op's end asks for: a whole batch, or a host batch handed on early (see ``_HOST_BATCH``)."""
        pending = len(self._hashes)
        if pending >= self.batch or self._hashes.nbytes >= _FLUSH_BYTES:
            self.flush()
        elif pending >= _HOST_BATCH and self._hashes.on_host:
            self.flush(prune=self.seq - self._pruned_at >= self.batch, early=True)

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
    def _hash_output(self, rec: Record, t, is_view: bool, copy_arg: Optional[int], args, in_recs) -> None:
        """Fingerprint ``t``, or take it from its source when the op only copies or re-views values."""
        if copy_arg is None and not is_view:  # most ops: new values, read them
            self._capture(rec, t)
            return
        src_i = copy_arg if copy_arg is not None else 0
        src = args[src_i] if src_i < len(args) else None
        if (isinstance(src, torch.Tensor) and isinstance(t, torch.Tensor) and len(in_recs) > src_i
                and all(isinstance(a, torch.Tensor) for a in args[:src_i]) and hashable(t) is None):
            if t.dtype == src.dtype and t.shape == src.shape and (not is_view or same_layout(t, src)):
                self._hashes.add_same(rec, in_recs[src_i])  # same logical values: same fingerprint
                return
            if is_view:
                self._hashes.add_view(rec, in_recs[src_i], t, src)
                return
        self._capture(rec, t)

    def _capture(self, rec: Record, t) -> None:
        why = hashable(t) if isinstance(t, torch.Tensor) else None
        if why is not None and not t.is_nested and (t.is_meta or _compat.is_fake_tensor(t)):
            # no values (a meta tensor, a FakeTensor torch.export or a compile traces with): dtype and shape are all
            rec.hash = uninitialized_hash(rec)
            return
        if why is not None and not t.is_nested:
            inner = _compat.wrapped_tensor(t)  # a DTensor: its values on this rank are its local shard's
            if inner is not None and inner.layout is torch.strided and not inner.is_meta:
                rec.extra = dict(rec.extra or {}, local=type(t).__name__)
                self._hashes.add(rec, inner)
                return
        if why is not None:
            rec.extra = dict(rec.extra or {}, unhashable=why)
            return
        self._hashes.add(rec, t)

    def flush(self, prune: bool = True, early: bool = False) -> None:
        """Fingerprint everything pending (one host sync per device) and hand finished events to the sink,
        ``sink(events, early)``.  ``prune=False``: keep the producer table as it is (the last flush of a recorder
        that is done, or a host batch handed on early).  ``early``: a host batch handed on before ``batch`` ops
        (the sink may hold what it writes until the next flush that is not)."""
        with self.lock:
            events, self._events = self._events, []
            self._hashes.resolve()
            for ev in events:
                outs = ev.outs
                hashes = [r.hash for r in ev.in_recs]
                if len(outs) == 1:
                    outs[0].in_hashes = hashes
                else:
                    for r in outs:
                        r.in_hashes = list(hashes)
            if prune:
                self._prune()
        if events:
            self.sink(events, early)

    def _prune(self) -> None:
        """Drop the entries of freed storages at every flush: kept, they held on to the memory of the
        tensors they named (a mode left on grew by a step's activations every step)."""
        self._pruned_at = self.seq
        producers = self._producers  # changed in place: the finalizer holds this dict
        for k in [k for k, ent in producers.items() if _compat.storage_expired(ent[0])]:
            _compat.storage_release(producers.pop(k)[0])
        # the identity table is only a shortcut to the producers' answers (a tensor it misses is found by memory and
        # entered again): emptied whole, instead of testing every entry's reference, it holds no record of a
        # tensor gone since the last prune
        self._by_object = {}
