"""Traces: the record schema, a streaming JSON Lines writer/reader, and the
content-addressed tensor payload store.

A trace file is JSON Lines: a header line ``{"format": "determ-trace", ...}``,
one line per record, and a footer ``{"end": true, "count": N}`` written by
:meth:`TraceWriter.close`.  A missing footer means the producer died; the reader
then reports the file as truncated (or tolerates it with ``allow_partial=True``).

Record fields (see :class:`Record`): ``graph`` (graph id, e.g. ``g0``), ``stage``
(``dynamo``, ``aot_forward``, ``aot_backward``, ``inductor_forward``,
``inductor_backward``, ``eager``, ``api``...), ``call`` (invocation count of that
graph/stage), ``seq`` (order within the call), ``node`` (unique id within a
call), ``op``, ``kind`` (``input``, ``param``, ``node``, ``output``), ``source``
(user file:line), ``dtype``, ``shape``, ``hash`` (16 hex digits), ``stats``,
``inputs`` (ids of the records this one consumed), ``in_hashes`` (fingerprints of
the tensor inputs, in order), ``rank``, ``run``, ``payload`` (store key or null).

Comparison of traces lives in :mod:`determ_backend.compare`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Union

import torch

from .errors import TraceFormatError

__all__ = ["Record", "TraceWriter", "read_trace", "resolve_trace_path", "TensorStore", "atomic_write_text", "atomic_path",
           "format_hash", "TRACE_NAME"]

FORMAT = "determ-trace"
VERSION = 1
TRACE_NAME = "trace.jsonl"


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
        d = {}
        for k in _FIELDS:  # not dataclasses.asdict: it deep-copies and dominated tracing time
            v = getattr(self, k)
            if v is None or (not v and isinstance(v, (list, dict)) and k != "shape"):
                continue
            d[k] = v
        return json.dumps(d, separators=(",", ":"), allow_nan=True)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Record":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


_FIELDS = tuple(Record.__dataclass_fields__)


@contextlib.contextmanager
def atomic_path(path: Union[str, Path]) -> Iterator[str]:
    """Yield a temp file name next to ``path``; on success it replaces ``path`` atomically, on any
    failure it is removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
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


class TraceWriter:
    """Streams records to a JSONL file (thread-safe).  Use as a context manager or call :meth:`close`."""

    def __init__(self, path: Union[str, Path], run: Optional[str] = None, meta: Optional[Dict[str, Any]] = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f: Optional[io.TextIOBase] = open(self.path, "w", encoding="utf-8")
        self._lock = threading.Lock()
        self.count = 0
        self.run = run
        header = {"format": FORMAT, "version": VERSION, "run": run, "torch": torch.__version__}
        header.update(meta or {})
        self._f.write(json.dumps(header) + "\n")

    def write(self, records: Iterable[Record]) -> None:
        lines = [r.to_json() for r in records]
        if not lines:
            return
        with self._lock:
            if self._f is None:
                raise TraceFormatError(f"{self.path}: trace writer already closed")
            self._f.write("\n".join(lines) + "\n")
            self.count += len(lines)

    def flush(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.flush()

    def close(self) -> None:
        with self._lock:
            if self._f is None:
                return
            self._f.write(json.dumps({"end": True, "count": self.count}) + "\n")
            self._f.close()
            self._f = None

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def resolve_trace_path(path: Union[str, Path]) -> Path:
    """A trace file, or a run directory holding ``trace.jsonl``."""
    p = Path(path)
    if p.is_dir():
        p = p / TRACE_NAME
    if not p.is_file():
        raise TraceFormatError(f"{path}: no such trace file (expected a {TRACE_NAME} file or a run directory holding one)")
    return p


def read_trace(path: Union[str, Path], allow_partial: bool = False) -> List[Record]:
    """Records of a trace file (or run dir).  Raises :class:`TraceFormatError` naming the file and line."""
    p = resolve_trace_path(path)
    records: List[Record] = []
    ended = False
    with open(p, encoding="utf-8") as f:
        try:
            first = f.readline()
            header = json.loads(first)
        except (json.JSONDecodeError, UnicodeDecodeError):
            header = None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise TraceFormatError(f"{p}: not a determ trace (line 1 has no determ-trace header)")
        for lineno, line in enumerate(f, start=2):
            if ended and line.strip():
                raise TraceFormatError(f"{p}:{lineno}: data after the end-of-trace line")
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                if allow_partial:
                    break
                raise TraceFormatError(f"{p}:{lineno}: corrupt or truncated JSON line") from None
            if d.get("end") is True:
                ended = True
                if d.get("count") != len(records):
                    raise TraceFormatError(f"{p}: footer says {d.get('count')} records, found {len(records)}")
                continue
            try:
                records.append(Record.from_dict(d))
            except TypeError as e:
                raise TraceFormatError(f"{p}:{lineno}: bad record ({e})") from None
    if not ended and not allow_partial:
        raise TraceFormatError(f"{p}: truncated trace (no end-of-trace line; the producing process may have died)")
    return records


class TensorStore:
    """Content-addressed tensor payloads: ``<root>/<hash>.pt``, each distinct tensor stored once.

    Files are written atomically with ``torch.save`` and read with ``torch.load(weights_only=True)``.
    """

    def __init__(self, root: Union[str, Path]):
        self.root = Path(root)

    def path(self, key: str) -> Path:
        return self.root / f"{key}.pt"

    def put(self, key: str, t: torch.Tensor) -> str:
        p = self.path(key)
        if p.exists():
            return key
        with atomic_path(p) as tmp:
            torch.save(t.detach().cpu().contiguous().clone(), tmp)
        return key

    def get(self, key: str, device: Union[str, torch.device] = "cpu") -> torch.Tensor:
        p = self.path(key)
        if not p.is_file():
            raise TraceFormatError(f"{p}: tensor payload missing from the store")
        try:
            t = torch.load(p, map_location=device, weights_only=True)
        except Exception as e:  # torch raises many types for corrupt files
            raise TraceFormatError(f"{p}: corrupt tensor payload ({type(e).__name__})") from None
        if not isinstance(t, torch.Tensor):
            raise TraceFormatError(f"{p}: payload is not a tensor")
        return t

    def __contains__(self, key: str) -> bool:
        return self.path(key).is_file()
