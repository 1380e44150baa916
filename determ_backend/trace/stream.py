"""Traces: the record schema and the trace file (``trace.jsonl``) written and read through the JSON Lines stream.

A trace is a :mod:`.jsonl` stream of format ``determ-trace``: a header line
``{"format": "determ-trace", "version": 1, "run": ..., "torch": ...}``, one line per
record, and the footer ``{"end": true, "count": N}`` written by
:meth:`TraceWriter.close`.  The partial-read rules (a missing footer, a cut last
line, a footer cut on a full disk) are the stream's, see :mod:`.jsonl`.  On top of
them the reader checks the type of every field of every record.

Record fields (see :class:`Record`): ``graph`` (graph id, e.g. ``g0``), ``stage``
(``dynamo``, ``aot_forward``, ``aot_backward``, ``inductor_forward``,
``inductor_backward``, ``eager``, ``api``...), ``call`` (invocation count of that
graph/stage), ``seq`` (order within the call), ``node`` (unique id within a
call), ``op``, ``kind`` (``input``, ``param``, ``node``, ``output``), ``source``
(user file:line), ``dtype``, ``shape``, ``hash`` (16 hex digits), ``stats``,
``inputs`` (ids of the records this one consumed), ``in_hashes`` (fingerprints of
the tensor inputs, in order), ``rank``, ``run``, ``payload`` (store key or null).

Also here: atomic file writes (:func:`atomic_path`, :func:`atomic_write_text`) and
:func:`dir_problem`.  Tensor payloads are :mod:`.store`'s; comparison of traces
lives in :mod:`determ_backend.compare`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import tempfile
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Union

import torch

from determ_backend.errors import TraceFormatError
from determ_backend.fingerprint import _native
from determ_backend.trace.jsonl import StreamFormat, StreamWriter, encode, encode_exact, fast_dumps, read_stream

__all__ = ["Record", "RecordTemplate", "TraceWriter", "TraceFile", "read_trace", "read_trace_file", "resolve_trace_path",
           "atomic_write_text", "atomic_path", "dir_problem", "format_hash", "dtype_name", "shape_of", "module_place", "is_module_place",
           "TRACE_NAME", "TRACE_FORMAT"]

TRACE_NAME = "trace.jsonl"
TRACE_FORMAT = StreamFormat("determ-trace", 1, "trace", "records", "the producing process may have died")


DTYPE_NAMES: Dict[torch.dtype, str] = {}  # dtype_name's memo (the native recorder reads it too)


def dtype_name(dtype: torch.dtype) -> str:
    """A record's ``dtype`` field: ``float32`` for ``torch.float32`` (memoized: the hot paths spell one per tensor)."""
    name = DTYPE_NAMES.get(dtype)
    if name is None:
        name = DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def shape_of(t: torch.Tensor) -> List[int]:
    """A record's ``shape`` field: the tensor's sizes, or [] for a nested tensor (its rows differ in length)."""
    return [] if t.is_nested else list(t.shape)


def module_place(path: str, cls_name: str) -> str:
    """A record's ``source`` when no user line is known, only the module the value was computed in (a compiled
    graph's node of torch's own modules: ``<module 1: ReLU>``)."""
    return f"<module {path}: {cls_name}>"


def is_module_place(source: Optional[str]) -> bool:
    """Whether a ``source`` names a module (:func:`module_place`) rather than a file and line."""
    return bool(source) and source.startswith("<module ")


def format_hash(h: int) -> str:
    return f"{h & ((1 << 64) - 1):016x}"


@dataclass
class Record:
    graph: str
    stage: str
    node: str
    op: str
    kind: str = "node"
    call: int = 0
    seq: int = 0
    source: Optional[str] = None
    dtype: Optional[str] = None
    shape: Optional[List[int]] = None
    hash: Optional[str] = None
    stats: Optional[Dict[str, Any]] = None
    inputs: List[str] = field(default_factory=list)
    in_hashes: List[str] = field(default_factory=list)
    rank: int = 0
    run: Optional[str] = None
    payload: Optional[str] = None
    extra: Optional[Dict[str, Any]] = None

    @property
    def key(self) -> tuple:
        """Identity used to pair records of two runs by name."""
        return (self.graph, self.stage, self.call, self.node)

    @property
    def signature(self) -> str:
        """Identity used to pair records by sequence alignment when names do not line up."""
        return f"{self.kind}|{self.op}|{self.dtype}|{self.shape}"

    def to_json(self) -> str:
        return self.to_line().decode("utf-8")

    def to_line(self) -> bytes:
        """The record as one JSON text in UTF-8: its fields in order, those that are None or an empty
        list or dict left out (``shape`` is always kept)."""
        return encode(self._as_dict())  # not dataclasses.asdict: it deep-copies and dominated tracing time

    def _as_dict(self) -> Dict[str, Any]:
        d = {"graph": self.graph, "stage": self.stage, "node": self.node, "op": self.op, "kind": self.kind,
             "call": self.call, "seq": self.seq}
        if None in d.values():
            d = {k: v for k, v in d.items() if v is not None}
        for k, v in (("source", self.source), ("dtype", self.dtype), ("shape", self.shape), ("hash", self.hash),
                     ("stats", self.stats), ("inputs", self.inputs), ("in_hashes", self.in_hashes), ("rank", self.rank),
                     ("run", self.run), ("payload", self.payload), ("extra", self.extra)):
            if v is not None and (v or k == "shape" or not isinstance(v, (list, dict))):
                d[k] = v
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Record":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})




def _fragment(d: Dict[str, Any]) -> bytes:
    """The encoding of ``d`` without its braces: ``"k":v,"k2":v2`` (empty for an empty dict)."""
    return encode(d)[1:-1]


_DTYPE_FRAGMENTS: Dict[str, bytes] = {}


class RecordTemplate:
    """The records one capture point writes, call after call: their fixed fields encoded once.

    :meth:`line` gives the text ``Record(...).to_line()`` gives for the same fields (same keys, same
    order) without building the record; :meth:`record` builds it.  The compile backends' recorder
    writes its traces through these, so a traced tensor costs well under a microsecond of encoding."""

    __slots__ = ("graph", "stage", "node", "op", "kind", "source", "inputs", "rank", "run", "extra", "_frags")

    def __init__(self, graph: str, stage: str, node: str, op: str, kind: str = "node", source: Optional[str] = None,
                 inputs: Iterable[str] = (), rank: int = 0, run: Optional[str] = None,
                 extra: Optional[Dict[str, Any]] = None):
        self.graph, self.stage, self.node, self.op, self.kind = graph, stage, node, op, kind
        self.source, self.inputs, self.rank, self.run, self.extra = source, list(inputs), rank, run, extra
        head = {"graph": graph, "stage": stage, "node": node, "op": op, "kind": kind}
        mid = {"inputs": self.inputs} if self.inputs else {}
        mid.update({k: v for k, v in (("rank", rank), ("run", run)) if v is not None})
        # the fixed fragments, in line order around the per-call fields: (head, source, mid, extra), the last
        # three None when absent; line() and the native encoder (stream.template_lines) read them
        self._frags = (b"{" + _fragment({k: v for k, v in head.items() if v is not None}),
                       _fragment({"source": source}) if source is not None else None,
                       _fragment(mid) if mid else None,
                       _fragment({"extra": extra}) if extra else None)

    def record(self, call: int, seq: int, dtype: Optional[str], shape: Optional[List[int]], hash: Optional[int],
               stats: Optional[Dict[str, Any]]) -> Record:
        """The record of one call (``hash``: the fingerprint as an int)."""
        return Record(self.graph, self.stage, self.node, self.op, self.kind, call, seq, self.source, dtype, shape,
                      None if hash is None else format_hash(hash), stats, list(self.inputs), [], self.rank, self.run,
                      None, self.extra)

    def line(self, call: int, seq: int, dtype: Optional[str], shape: Optional[List[int]], hash: Optional[int],
             stats: Optional[Dict[str, Any]]) -> bytes:
        """``self.record(...).to_line()``, encoded from the fixed fragments."""
        head, source, mid, extra = self._frags
        parts = [head, b'"call":%d,"seq":%d' % (call, seq)]
        if source is not None:
            parts.append(source)
        if dtype is not None:
            frag = _DTYPE_FRAGMENTS.get(dtype)
            if frag is None:
                frag = _DTYPE_FRAGMENTS[dtype] = b'"dtype":' + encode(dtype)
            parts.append(frag)
        if shape is not None:
            parts.append(b'"shape":' + encode_exact(shape))
        if hash is not None:
            parts.append(b'"hash":"%016x"' % (hash & 0xFFFFFFFFFFFFFFFF))
        if stats:
            parts.append(b'"stats":' + encode(stats))
        if mid is not None:
            parts.append(mid)
        if extra is not None:
            parts.append(extra)
        return b",".join(parts) + b"}"


def template_lines(call: int, rows: Sequence[tuple]) -> List[bytes]:
    """The lines of one call's records from ``(template, dtype, shape, hash, stats)`` rows, the ``seq`` of a
    row being its position: ``[tpl.line(call, seq, ...)]``, encoded in one C loop where the native extension
    is built (the statistics by orjson, as :func:`~determ_backend.trace.jsonl.encode` does)."""
    dumps = fast_dumps()
    native = _native.line_encoder() if dumps is not None else None
    if native is not None:
        return native(call, rows if isinstance(rows, list) else list(rows), dumps)
    return [tpl.line(call, seq, *row) for seq, (tpl, *row) in enumerate(rows)]


@functools.lru_cache(maxsize=1)
def _umask() -> int:
    """The process's umask, read once (by setting it and putting it back at once: there is no other way)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: Union[str, Path]) -> Iterator[str]:
    """Yield a temp file name next to ``path``; on success it replaces ``path`` atomically, on any
    failure it is removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes it 0600; the file gets the mode a plain open would give
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Union[str, Path], text: str) -> None:
    """Write ``text`` to ``path`` via a temp file in the same directory and ``os.replace``."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)


def dir_problem(target: Union[str, Path]) -> Optional[str]:
    """Why directory ``target`` cannot be used (None when it can): it is a file or a broken symbolic link, or its
    nearest existing ancestor is one, or a directory this process may not write into (tried, not taken from the
    permission bits)."""
    target = Path(target)
    anc = target
    while not os.path.lexists(anc) and anc != anc.parent:
        anc = anc.parent
    if anc.is_symlink() and not anc.exists():  # a link to a disk that is not mounted
        return f"{anc} is a broken symbolic link"
    if not anc.is_dir():
        return f"{anc} is a file, not a directory"
    if anc == target:
        return None if os.access(anc, os.W_OK | os.X_OK) and _can_create_in(anc) else \
            f"{anc} is read-only or not ours to write"
    if not os.access(anc, os.W_OK | os.X_OK) or not _can_create_in(anc):
        return f"cannot create it in {anc} (read-only or no permission)"
    return None


def _can_create_in(parent: Path) -> bool:
    """Whether a directory can be made in ``parent``, tried (and removed at once): permission bits do not say so
    for root, nor on a file system that refuses new entries (``/proc``)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".determ_probe_", dir=parent))
        return True
    except OSError:
        return False


class TraceWriter:
    """Streams records to a JSONL trace (thread-safe), through :class:`~.jsonl.StreamWriter`.  Use as a
    context manager or call :meth:`close`."""

    def __init__(self, path: Union[str, Path], run: Optional[str] = None, meta: Optional[Dict[str, Any]] = None):
        self.run = run
        self._stream = StreamWriter(path, TRACE_FORMAT, {"run": run, "torch": torch.__version__, **(meta or {})})
        self.path = self._stream.path

    @property
    def count(self) -> int:
        return self._stream.count

    def write(self, records: Iterable[Record]) -> None:
        self._stream.write_lines([r.to_line() for r in records])

    def write_lines(self, lines: List[bytes]) -> None:
        """Append records already encoded (:meth:`Record.to_line`, :meth:`RecordTemplate.line`)."""
        self._stream.write_lines(lines)

    def flush(self) -> None:
        """Nothing to do: every :meth:`write` is on disk when it returns (kept for callers that flush)."""

    def close(self, aborted: Optional[str] = None) -> None:
        """Write the footer; ``aborted``: why the run stopped early (the trace is then read as incomplete)."""
        if aborted:
            self._stream.close(complete=False, cut=aborted)
        else:
            self._stream.close()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def rank_subdirs(root: Union[str, Path]) -> Dict[int, Path]:
    """``{rank: path}`` of the ``rank<N>`` directories directly under ``root`` (a multi-rank run or dump), in rank
    order; empty when ``root`` is no directory."""
    p = Path(root)
    if not p.is_dir():
        return {}
    found = {int(d.name[4:]): d for d in p.iterdir() if d.is_dir() and d.name.startswith("rank") and d.name[4:].isdigit()}
    return dict(sorted(found.items()))


def resolve_trace_path(path: Union[str, Path]) -> Path:
    """A trace file, or a run directory holding ``trace.jsonl``."""
    p = Path(path)
    if p.is_dir():
        ranks = rank_subdirs(p)
        if ranks and not (p / TRACE_NAME).is_file():
            names = ", ".join(d.name for d in ranks.values())
            raise TraceFormatError(f"{path}: holds rank directories ({names}), one trace per rank; pass one rank's "
                                   f"directory ({Path(path) / next(iter(ranks.values())).name}) and compare rank by rank")
        p = p / TRACE_NAME
    if not p.is_file():
        raise TraceFormatError(f"{path}: no such trace file (expected a {TRACE_NAME} file or a run directory holding one)")
    return p


@dataclass
class TraceFile:
    """A trace as read from disk: its records and how complete the file is.

    ``complete`` is False when the producer died (no end line; read with ``allow_partial``).
    ``limited`` says why the file holds only part of the run's records on purpose (e.g. a
    ``HashDebugTrace`` text log cut at ``max_ops_logged``), else None.  ``header``: the trace's
    header line (run, torch version, rank, device, ...), when the format has one.
    """

    path: Path
    records: List[Record]
    complete: bool = True
    limited: Optional[str] = None
    header: Dict[str, Any] = field(default_factory=dict)


def read_trace(path: Union[str, Path], allow_partial: bool = False) -> List[Record]:
    """Records of a trace file (or run dir).  Raises :class:`TraceFormatError` naming the file and line."""
    return read_trace_file(path, allow_partial).records


def read_trace_file(path: Union[str, Path], allow_partial: bool = False,
                    calls: Optional[Iterable[int]] = None) -> TraceFile:
    """:func:`read_trace` plus completeness, by the reading rules of :mod:`.jsonl`: ``allow_partial`` accepts a
    trace whose producer died (no end line; a corrupt, cut last line is dropped); a corrupt line anywhere else is
    an error; a trace its writer cut on a full disk is read (one warning) and reported incomplete.

    ``calls``: keep only the records of these graph calls; the others are rejected on their raw text, never
    decoded (a long run's trace holds thousands of calls: reading one costs a scan, not a parse of them all)."""
    skip = None
    if calls is not None:
        wanted = {int(c) for c in calls}
        marks = tuple(b'"call":%d,' % c for c in wanted)

        def skip(raw: bytes) -> bool:  # a line written otherwise (spaces, no call key) is decoded and judged
            return b'"call":' in raw and b'"call": ' not in raw and not any(m in raw for m in marks)
    s = read_stream(resolve_trace_path(path), TRACE_FORMAT, allow_partial, _parse_record, skip)
    records = s.records if calls is None else [r for r in s.records if r.call in wanted]
    return TraceFile(s.path, records, complete=s.complete, header=s.header)


_HEX16 = re.compile(r"[0-9a-f]{16}")
_NUMBER_TYPES = frozenset({int, float, type(None)})


def _is_hash(v: Any) -> bool:
    return type(v) is str and len(v) == 16 and _HEX16.fullmatch(v) is not None


def _only(types_: frozenset, values) -> bool:
    return set(map(type, values)) <= types_  # C-level loops: reading stays fast on big traces


_STR = (lambda v: type(v) is str, "a string")
_OPT_STR = (lambda v: v is None or type(v) is str, "a string or null")
_INT = (lambda v: type(v) is int, "an integer")
_CHECKS = types.MappingProxyType({  # field -> (check, what it must be)
    "graph": _STR, "stage": _STR, "node": _STR, "op": _STR, "kind": _STR,
    "call": _INT, "seq": _INT, "rank": _INT,
    "source": _OPT_STR, "dtype": _OPT_STR, "run": _OPT_STR, "payload": _OPT_STR,
    "shape": (lambda v: v is None or (type(v) is list and _only(frozenset({int}), v) and min(v, default=0) >= 0),
              "a list of non-negative integers or null"),
    "hash": (lambda v: v is None or _is_hash(v), "16 lowercase hex digits or null"),
    "stats": (lambda v: v is None or (type(v) is dict and _only(_NUMBER_TYPES, v.values())),
              "an object of numbers or null"),
    "inputs": (lambda v: type(v) is list and _only(frozenset({str}), v), "a list of strings"),
    "in_hashes": (lambda v: type(v) is list and all(x is None or _is_hash(x) for x in v),
                  "a list of hashes (16 hex digits) or nulls"),
    "extra": (lambda v: v is None or type(v) is dict, "an object or null"),
})
_REQUIRED = ("graph", "stage", "node", "op")


def _parse_record(p: Path, lineno: int, d: Dict[str, Any]) -> Record:
    """A :class:`Record` from one decoded line, every field of the expected type."""
    for k in _REQUIRED:
        if k not in d:
            raise TraceFormatError(f"{p}:{lineno}: bad record (missing field {k!r})")
    for k, v in d.items():
        check = _CHECKS.get(k)
        if check is not None and not check[0](v):
            raise TraceFormatError(f"{p}:{lineno}: bad record (field {k!r} must be {check[1]}, got {_short(v)})")
    return Record.from_dict(d)


def _short(v: Any) -> str:
    s = json.dumps(v)
    return s if len(s) <= 40 else s[:37] + "..."
