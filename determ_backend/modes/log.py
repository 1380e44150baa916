"""The human-readable ``HashDebugTrace`` log: writer and reader.

One block per op (or per tensor first seen as an input)::

    [000002] aten.mm.default
        source: /work/model.py:12
        stack: /work/model.py:12 in forward <- /work/train.py:30 in main
        in  args[0] = float32[4,8] cpu hash=0f3c... <- input@model.py:12#0
        arg args[2] = 1.0
        out aten.mm.default@model.py:12#0 = float32[4,8] cpu hash=9a1b... kind=node stats={"min":...}

Optional lines: ``backward of: MmBackward0`` and ``compiled region: ran eagerly``.
The file starts with ``# determ hash log v1`` and ends with ``# end: N records``
(N: the records in this log).  With ``max_ops_logged`` the log stops early: a
``# log limit reached`` line, then the footer gives both counts
(``# records in the run: 45``, ``# records in this log: 5 ...``).
:func:`read_hash_log` turns it back into trace :class:`~determ_backend.trace.stream.Record`
objects (so ``repro-tools diff a.log b.log`` works) and reports a missing end
line as a truncated log; :func:`read_hash_log_file` also says whether the log is
complete or limited.  The JSON Lines trace written next to the log holds the same
records, all of them even when the log is limited.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import List, Optional, Union

from determ_backend.errors import TraceFormatError
from determ_backend.trace.jsonl import encode, open_fresh, write_all
from determ_backend.trace.stream import Record, TraceFile

__all__ = ["LogWriter", "read_hash_log", "read_hash_log_file", "MAGIC"]

log = logging.getLogger(__name__)

MAGIC = "# determ hash log v1"
_RULE = "    " + "-" * 60
_RECORD_FLAGS = ("derived_hash", "unhashable", "non_deterministic")  # per-output extras (others are per op)
_HEAD = re.compile(r"^\[(\d+)\] (\S+)$")
_VALUE = re.compile(r"^(?P<dtype>[\w.]+)\[(?P<shape>[\d,]*)\] (?P<device>\S+) hash=(?P<hash>[0-9a-f]{16}|-)(?P<rest>.*)$")


def _shape(shape) -> str:
    return ",".join(str(int(s)) for s in (shape or []))


def _value(r: Record, device: str) -> str:
    return f"{r.dtype}[{_shape(r.shape)}] {device} hash={r.hash or '-'}"


def _short(v) -> str:
    """``repr(v)`` on one line (a storage's repr is one line per element: the log's readers read a line per field),
    cut at 120 characters."""
    s = repr(v).replace("\r", "\\r").replace("\n", "\\n")
    return s if len(s) <= 120 else s[:117] + "..."


class LogWriter:
    """Streams op blocks to a text file (and to stdout when ``echo``).  Text waits in memory until a
    flushing :meth:`write` (or :data:`_BUFFER` bytes of it), then goes to the file in one write: the
    header with the first batch, the footer at :meth:`close`."""

    _BUFFER = 1 << 16

    def __init__(self, path: Union[str, Path], run: Optional[str], torch_version: str, echo: bool = False,
                 max_ops: Optional[int] = None):
        self.path = Path(path)
        self._fd: Optional[int] = open_fresh(self.path, parents=True)
        self._pending: List[bytes] = []
        self._pending_bytes = 0
        self.echo, self.max_ops = echo, max_ops
        self.ops = self.records = 0
        self.limited = False
        self._emit([MAGIC, f"# run: {run or ''}", f"# torch: {torch_version}"])

    def _emit(self, lines: List[str]) -> None:
        text = "\n".join(lines) + "\n"
        if self._fd is not None:
            data = text.encode("utf-8")
            self._pending.append(data)
            self._pending_bytes += len(data)
            if self._pending_bytes >= self._BUFFER:
                self._flush()
        if self.echo:
            sys.stdout.write(text)

    def _flush(self) -> None:
        if self._pending and self._fd is not None:
            data, self._pending, self._pending_bytes = self._pending, [], 0
            write_all(self._fd, data)

    def _release(self) -> None:
        """Write what is held and give the descriptor back (once): at :meth:`close`, and for a writer dropped
        without it (its mode never closed), as a buffered file object would."""
        if getattr(self, "_fd", None) is None:  # closed, or the open failed
            return
        try:
            self._flush()
        finally:
            fd, self._fd = self._fd, None
            os.close(fd)

    __del__ = _release

    def write(self, events, flush: bool = False) -> None:
        lines: List[str] = []
        values: dict = {}  # the events hold their records: an id is not reused while this lives
        for ev in events:
            if self.max_ops is not None and self.ops >= self.max_ops:
                if not self.limited:
                    lines.append(f"# log limit reached: max_ops_logged={self.max_ops}; the JSONL trace has the rest")
                    self.limited = True
                break
            self.ops += 1
            self.records += len(ev.outs)
            lines.extend(self._block(ev, values))
        if lines:
            self._emit(lines)
        if flush:
            self._flush()

    def _block(self, ev, values: dict) -> List[str]:
        """The lines of one op; ``values``: the ``_value`` texts of this batch's records by ``id`` (a record is read
        by several ops: a weight forward and backward)."""
        out = [f"[{self.ops:06d}] {ev.op}", f"    source: {ev.source or '?'}"]
        if ev.stack:
            out.append("    stack: " + " <- ".join(ev.stack))
        if ev.backward:
            out.append(f"    backward of: {ev.backward}")
        if ev.compiled:
            out.append("    compiled region: ran eagerly")
        for path, rec, value, device in ev.args:
            if rec is None:
                out.append(f"    arg {path} = {_short(value)}")
            else:
                key = (id(rec), device)
                text = values.get(key)
                if text is None:
                    text = values[key] = _value(rec, device)
                out.append(f"    in  {path} = {text} <- {rec.node}")
        for r, device in zip(ev.outs, ev.devices or ["?"] * len(ev.outs)):
            text = values[(id(r), device)] = _value(r, device)
            line = f"    out {r.node} = {text} kind={r.kind}"
            if r.extra:
                for key in _RECORD_FLAGS:
                    if key in r.extra:
                        line += f" {key}={encode(r.extra[key]).decode()}"
            if r.stats:
                line += " stats=" + encode(r.stats).decode()
            out.append(line)
        out.append(_RULE)
        return out

    def close(self, total: int, notes: List[str] = (), aborted: Optional[str] = None) -> None:
        """Write the footer: ``total`` records in the run, ``notes`` (one comment line each), the end line;
        ``aborted``: why the run stopped early (the log is then read as incomplete)."""
        if self._fd is None:
            return
        lines = [f"# records in the run: {total}"] + ([f"# aborted: {aborted}"] if aborted else [])
        if self.limited:
            lines.append(f"# records in this log: {self.records} (limited by max_ops_logged={self.max_ops}; "
                         f"the JSONL trace has all {total})")
        self._emit(lines + [f"# {s}" for s in notes] + [f"# end: {self.records} records"])
        self._release()


def read_hash_log(path: Union[str, Path], allow_partial: bool = False) -> List[Record]:
    """Records of a ``HashDebugTrace`` log.  Raises :class:`TraceFormatError` naming the file and line."""
    return read_hash_log_file(path, allow_partial).records


def read_hash_log_file(path: Union[str, Path], allow_partial: bool = False) -> TraceFile:
    """:func:`read_hash_log` plus completeness.  ``allow_partial`` accepts a log whose run died: no end
    line, and a last line cut mid-write (no newline), which is dropped.  A log cut at ``max_ops_logged``
    is read as far as it goes and marked ``limited``."""
    p = Path(path)
    try:
        with open(p, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise TraceFormatError(f"{p}: cannot read HashDebugTrace log ({type(e).__name__})") from None
    lines = text.splitlines()
    if not lines or lines[0] != MAGIC:
        raise TraceFormatError(f"{p}: not a determ HashDebugTrace log (line 1 is not {MAGIC!r})")
    if allow_partial and not text.endswith("\n"):
        lines.pop()  # the writer died in the middle of this line
    parser = _Parser(p)
    for lineno, line in enumerate(lines[1:], start=2):
        parser.feed(lineno, line)
    if parser.end is None and not allow_partial:
        raise TraceFormatError(f"{p}: truncated HashDebugTrace log (no '# end' line; the run may have died)")
    if parser.end is not None and parser.end != len(parser.records):
        raise TraceFormatError(f"{p}: end line says {parser.end} records, found {len(parser.records)}")
    limited = None
    if parser.limited is not None:
        limited = f"text log cut at {parser.limited}: it holds the first {len(parser.records)} records"
        if parser.total is not None:
            limited += f" of {parser.total}"
    if parser.aborted is not None:
        log.warning("%s: incomplete HashDebugTrace log: %s", p, parser.aborted)
    return TraceFile(p, parser.records, complete=parser.end is not None and parser.aborted is None, limited=limited)


class _Parser:
    def __init__(self, path: Path):
        self.path = path
        self.records: List[Record] = []
        self.run: Optional[str] = None
        self.end: Optional[int] = None
        self.limited: Optional[str] = None  # "max_ops_logged=N" once the log says its limit was reached
        self.total: Optional[int] = None  # records in the whole run, from the footer
        self.aborted: Optional[str] = None  # why the run stopped early, when the footer says so
        self._block: Optional[dict] = None

    def _bad(self, lineno: int, what: str) -> TraceFormatError:
        return TraceFormatError(f"{self.path}:{lineno}: {what}")

    def feed(self, lineno: int, line: str) -> None:
        if self.end is not None and line.strip():
            raise self._bad(lineno, "data after the '# end' line")
        if line.startswith("# "):
            self._comment(lineno, line[2:])
        elif line.startswith("["):
            m = _HEAD.match(line)
            if not m:
                raise self._bad(lineno, "bad op header (expected '[N] op')")
            self._block = {"op": m.group(2), "source": None, "extra": {}, "inputs": [], "in_hashes": []}
        elif line == _RULE or not line.strip():
            self._block = None
        elif self._block is None:
            raise self._bad(lineno, "field line outside an op block")
        else:
            self._field(lineno, line.strip())

    def _comment(self, lineno: int, text: str) -> None:
        if text.startswith("run: "):
            self.run = text[5:] or None
        elif text.startswith("end: "):
            try:
                self.end = int(text[5:].split()[0])
            except (ValueError, IndexError):
                raise self._bad(lineno, "bad end line") from None
        elif text.startswith("log limit reached"):
            self.limited = text.partition(": ")[2].partition(";")[0] or "max_ops_logged"
        elif text.startswith("aborted: "):
            self.aborted = text[len("aborted: "):]
        elif text.startswith(("records in the run: ", "records: ")):
            self.total = _int_or_none(text.rpartition(": ")[2])

    def _field(self, lineno: int, text: str) -> None:
        b = self._block
        key, _, rest = text.partition(" ")
        if key == "source:":
            b["source"] = None if rest == "?" else rest
        elif key == "stack:":
            b["extra"]["stack"] = rest.split(" <- ")
        elif text.startswith("backward of: "):
            b["extra"]["backward"] = text[len("backward of: "):]
        elif text.startswith("compiled region:"):
            b["extra"]["compiled_region"] = "eager"
        elif key == "arg":
            pass
        elif key == "in":
            name, value = self._split(lineno, rest.strip())
            v = _VALUE.match(value)
            producer = value.rpartition(" <- ")[2] if " <- " in value else None
            if v is None or producer is None:
                raise self._bad(lineno, "bad input line")
            b["inputs"].append(producer)
            b["in_hashes"].append(None if v.group("hash") == "-" else v.group("hash"))
        elif key == "out":
            self.records.append(self._record(lineno, rest))
        else:
            raise self._bad(lineno, f"unknown field {key!r}")

    def _split(self, lineno: int, text: str):
        name, sep, value = text.partition(" = ")
        if not sep:
            raise self._bad(lineno, "expected 'NAME = VALUE'")
        return name, value

    def _record(self, lineno: int, rest: str) -> Record:
        b = self._block
        node, value = self._split(lineno, rest)
        v = _VALUE.match(value)
        if v is None:
            raise self._bad(lineno, "bad output line")
        fields = dict(_tokens(v.group("rest")))
        try:
            stats = json.loads(fields["stats"]) if "stats" in fields else None
        except json.JSONDecodeError:
            raise self._bad(lineno, "bad stats JSON") from None
        shape = [int(s) for s in v.group("shape").split(",") if s]
        extra = dict(b["extra"])
        try:
            extra.update({k: json.loads(fields[k]) for k in _RECORD_FLAGS if k in fields})
        except json.JSONDecodeError:
            raise self._bad(lineno, "bad flag value") from None
        rec = Record(graph="eager", stage="eager", node=node, op=b["op"], kind=fields.get("kind", "node"),
                     seq=len(self.records), source=b["source"], dtype=v.group("dtype"), shape=shape,
                     hash=None if v.group("hash") == "-" else v.group("hash"), stats=stats,
                     inputs=list(b["inputs"]), in_hashes=list(b["in_hashes"]), run=self.run,
                     extra=extra or None)
        return Record.from_dict(json.loads(rec.to_json()))  # exactly what the JSONL trace reads back as


def _int_or_none(text: str) -> Optional[int]:
    try:
        return int(text.split()[0])
    except (ValueError, IndexError):
        return None


def _tokens(rest: str):
    for tok in rest.split():
        k, sep, v = tok.partition("=")
        if sep:
            yield k, v
