"""The one JSON Lines stream of determ: a header line, record lines, a footer line.

Owns the framing that traces (``trace.jsonl``, :mod:`.stream`) and API dump
indexes (``dump.pkl`` -- JSON Lines despite ptdbg's name, :mod:`determ_backend.dump`)
share, how it is written and the rules by which it is read back:

* line 1, the header: a JSON object whose ``format`` names the kind of stream
  (:class:`StreamFormat`) and whose ``version`` is an integer from 1 to the
  newest the reader knows;
* one JSON object per record;
* the footer ``{"end": true, "count": N, ...}``: exactly N records precede it.

:class:`StreamWriter` appends whole lines straight to the file descriptor (each
call one write, so what a crashed producer wrote stays on disk) and can drop its
footer again to append more (:meth:`StreamWriter.reopen`).  When a write fails (a full disk, a file size
limit) the file is cut back to its last whole line and closed with the footer
``{"end": true, "count": N, "complete": false, "cut": "<why>"}`` (the last records
give way when even the footer does not fit), then :class:`StreamWriteError`
names the file and how many records it kept.

Reading rules (:func:`read_stream`, one set for every stream):

1. the header must be there, name the expected format and a known version; a
   pickle is refused without being unpickled;
2. every other non-blank line is a JSON object; after the footer only blank
   lines may follow, and its count must match the records read;
3. no footer (the writer died): an error, unless ``allow_partial``, which keeps
   the records read and drops an undecodable (cut) last line; an undecodable line
   anywhere else is always an error;
4. a footer with ``"complete": false`` (the writer stopped early and said so):
   the file is whole up to there, so it is read, with one warning when it names
   its ``cut``, and reported incomplete.

What a record holds is the consumer's: the trace record schema lives in
:mod:`.stream`, dump entries in :mod:`determ_backend.dump.capture.entries`.
Tensor payloads live in :mod:`.store`.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Type, Union

from determ_backend.errors import DetermError, TraceFormatError

try:
    import orjson as _orjson
except ImportError:  # declared as a dependency; the standard library gives the same streams
    _orjson = None

__all__ = ["StreamFormat", "StreamWriter", "StreamWriteError", "Stream", "read_stream", "read_header", "write_all",
           "open_fresh", "encode", "encode_exact"]

log = logging.getLogger(__name__)

_IOV_MAX = 512  # buffers per writev call (the system limit is at least 1024)


class StreamWriteError(DetermError, OSError):
    """A stream or store file could not be written (disk full, file size limit, permissions); what was
    written before stays readable."""


@dataclass(frozen=True)
class StreamFormat:
    """One kind of stream: the header's ``format`` and newest ``version``, and the words messages use."""

    name: str
    version: int
    what: str
    items: str = "records"
    died: str = "the producing process may have died"


def open_fresh(path: Union[str, Path], flags: int = 0, parents: bool = False) -> int:
    """A descriptor open for writing on an empty ``path``: ``O_WRONLY | O_CREAT | flags``, as ``O_TRUNC`` would give.

    An existing regular file is unlinked and created again rather than truncated: on ext4 a file
    truncated from non-zero size is flushed to disk when closed (its ``auto_da_alloc``), about 130 us
    each time here, against 20 us for a new file -- a stream opened once per step paid that every step.
    A symbolic link (or anything not a regular file) is truncated through, as ``O_TRUNC`` does.
    ``parents``: create missing parent directories -- only once the open finds them missing, so a file
    written again where it was (a stream opened per step) costs no directory check."""
    path = os.fspath(path)
    base = os.O_WRONLY | os.O_CREAT | flags
    try:
        regular = stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        regular = False
    if regular:
        try:
            os.unlink(path)
        except OSError:  # e.g. a directory this user may not change, holding a file it may write: truncate it
            pass
        else:
            try:
                return os.open(path, base | os.O_EXCL, 0o644)
            except FileExistsError:  # made again in between: truncate that one
                pass
    try:
        return os.open(path, base | os.O_TRUNC, 0o644)
    except FileNotFoundError:
        if not parents or os.path.isdir(os.path.dirname(path) or "."):
            raise
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return os.open(path, base | os.O_TRUNC, 0o644)


def write_all(fd: int, data: Union[bytes, memoryview, Sequence[Any]]) -> None:
    """Write ``data`` -- a bytes-like object or a sequence of them -- completely to ``fd``
    (``os.write``/``os.writev`` may write less than asked)."""
    if not isinstance(data, (list, tuple)):
        data = [data]
    bufs = [m for m in (memoryview(b).cast("B") for b in data) if len(m)]
    i = 0
    while i < len(bufs):
        n = os.writev(fd, bufs[i:i + _IOV_MAX]) if len(bufs) - i > 1 else os.write(fd, bufs[i])
        while n and i < len(bufs):
            if n >= len(bufs[i]):
                n -= len(bufs[i])
                i += 1
            else:
                bufs[i] = bufs[i][n:]
                n = 0


_STDLIB = json.JSONEncoder(separators=(",", ":"), allow_nan=True)
_STDLIB_STR = json.JSONEncoder(separators=(",", ":"), allow_nan=True, default=str)


def encode(obj: Any, default_str: bool = False) -> bytes:
    """``obj`` as one compact JSON text in UTF-8, NaN and infinities as the literals Python's ``json`` reads.

    The one JSON encoder of the streams.  ``orjson`` (a dependency) encodes it when it can hold every value
    as ``json`` would: its output is used unless it holds a ``null`` -- orjson writes NaN and infinities as
    ``null`` -- and anything else (``None`` values, non-string keys, huge ints, other types) goes to the
    standard library, which is always right and ten times slower.  ``default_str``: values JSON cannot hold
    are written as their ``str`` (else they raise ``TypeError``)."""
    if _orjson is not None:
        try:
            line = _orjson.dumps(obj)
        except TypeError:  # orjson.JSONEncodeError is a TypeError
            line = None
        if line is not None and b"null" not in line:
            return line
    return (_STDLIB_STR if default_str else _STDLIB).encode(obj).encode("utf-8")


def _encode_exact(obj: Any) -> bytes:
    return _STDLIB.encode(obj).encode("utf-8")


def fast_dumps() -> Optional[Callable[[Any], bytes]]:
    """orjson's ``dumps``, which :func:`encode` tries first (its output stands unless it holds a ``null``), or
    None when orjson is not installed."""
    return _orjson.dumps if _orjson is not None else None


encode_exact = _orjson.dumps if _orjson is not None else _encode_exact
""":func:`encode` for values holding no float and no None (a shape, a name): no check needed, so faster."""


class StreamWriter:
    """Appends a header, records and a footer to ``path`` as whole lines (thread-safe); each
    :meth:`write`/:meth:`write_lines` call is written at once.  ``error``: the :class:`StreamWriteError`
    subclass raised when a write fails."""

    _KEEP_STARTS = 256
    """Line starts remembered, so a footer can take the place of the last records on a full disk."""

    def __init__(self, path: Union[str, Path], fmt: StreamFormat, header: Dict[str, Any],
                 error: Type[StreamWriteError] = StreamWriteError):
        self.path = Path(path)
        self.fmt = fmt
        self._error = error
        self._fd: Optional[int] = open_fresh(self.path, parents=True)
        self._pos = 0  # bytes on disk: whole lines only
        self.count = 0
        self._footer_at: Optional[int] = None
        self._starts: Deque[int] = collections.deque(maxlen=self._KEEP_STARTS)
        self._lock = threading.Lock()
        with self._lock:
            self._append([json.dumps({"format": fmt.name, "version": fmt.version, **header}) + "\n"], records=False)

    # ---- appending (under the lock) ------------------------------------------------------------
    def _append(self, lines: Sequence[Union[str, bytes]], records: bool = True) -> None:
        """Write ``lines`` (each ending in a newline) in one go; when that fails, cut the file and raise."""
        data = [line if isinstance(line, bytes) else line.encode("utf-8") for line in lines]
        self._write(b"".join(data), [len(d) for d in data] if records else None)

    def _write(self, blob: bytes, sizes: Optional[Sequence[int]]) -> None:
        """Write ``blob``, whole lines of ``sizes`` bytes each (None: not records); when that fails, cut the
        file and raise."""
        try:
            write_all(self._fd, blob)
        except OSError as e:
            kept = self._cut(e)
            raise self._error(f"{self.path}: cannot write the {self.fmt.what} ({e.strerror or e}); it keeps the "
                              f"{kept} {self.fmt.items} written before and is marked cut") from e
        if sizes is None:
            self._pos += len(blob)
            return
        pos = self._pos
        # only the last line starts are kept (the deque's length): the others are never looked at
        skip = max(0, len(sizes) - self._KEEP_STARTS)
        if skip:
            pos += sum(sizes[:skip])
        starts = self._starts
        for n in sizes[skip:]:
            starts.append(pos)
            pos += n
        self._pos = pos
        self.count += len(sizes)

    def _cut(self, e: OSError) -> int:
        """Back to the last whole line, a footer saying why if it fits, and closed; the records kept."""
        fd, self._fd = self._fd, None
        self._footer_at = None
        try:
            while True:
                os.ftruncate(fd, self._pos)
                os.lseek(fd, self._pos, os.SEEK_SET)
                footer = json.dumps({"end": True, "count": self.count, "complete": False,
                                     "cut": e.strerror or str(e)}) + "\n"
                try:
                    write_all(fd, footer.encode("utf-8"))
                    return self.count
                except OSError:
                    if not self._starts:
                        raise
                    self._pos = self._starts.pop()  # no room for the footer: it takes the last record's place
                    self.count -= 1
        except OSError:
            try:
                os.ftruncate(fd, self._pos)  # nothing fits: the last whole record ends the file
            except OSError:
                pass
            return self.count
        finally:
            os.close(fd)

    def _check_open(self) -> None:
        if self._fd is None:
            raise self._error(f"{self.path}: the {self.fmt.what} is closed")

    # ---- public ----------------------------------------------------------------------------------
    def write(self, record: Dict[str, Any]) -> None:
        """Append one record (a JSON object; values JSON cannot hold are written as their ``str``)."""
        self.write_lines([encode(record, default_str=True)])

    def write_lines(self, lines: Sequence[Union[str, bytes]]) -> None:
        """Append records already serialized, one JSON object text (no newline; ``str``, or UTF-8 ``bytes``)
        each."""
        if not lines:
            return
        with self._lock:
            self._check_open()
            if all(type(line) is bytes for line in lines):  # one join, and the newlines go in with it
                self._write(b"\n".join(lines) + b"\n", [len(line) + 1 for line in lines])
            else:
                self._append([line + (b"\n" if isinstance(line, bytes) else "\n") for line in lines])

    def close(self, **footer: Any) -> None:
        """Write the footer ``{"end": true, "count": N, **footer}`` and close; a no-op once closed."""
        with self._lock:
            if self._fd is None:
                return
            at = self._pos
            self._append([json.dumps({"end": True, "count": self.count, **footer}) + "\n"], records=False)
            self._footer_at = at
            os.close(self._fd)
            self._fd = None

    @property
    def closed(self) -> bool:
        return self._fd is None

    def reopen(self) -> None:
        """Drop the footer written by :meth:`close` and append again (not after a cut)."""
        with self._lock:
            if self._fd is not None:
                return
            if self._footer_at is None:
                raise self._error(f"{self.path}: the {self.fmt.what} was cut and cannot be appended to")
            self._fd = os.open(self.path, os.O_WRONLY)
            os.ftruncate(self._fd, self._footer_at)
            os.lseek(self._fd, self._footer_at, os.SEEK_SET)
            self._pos = self._footer_at

    def __enter__(self) -> "StreamWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class Stream:
    """A stream as read: its header, records (as the consumer parsed them) and footer (``{}`` when the
    writer died before writing one)."""

    path: Path
    header: Dict[str, Any]
    records: List[Any]
    footer: Dict[str, Any] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """A footer is there and does not say the writer stopped early."""
        return bool(self.footer) and self.footer.get("complete") is not False

    @property
    def cut(self) -> Optional[str]:
        """Why the writer cut the stream short (a full disk, a size limit), else None."""
        return self.footer.get("cut") if self.footer.get("complete") is False else None


def _check_header(p: Path, first: bytes, fmt: StreamFormat) -> Dict[str, Any]:
    if first[:1] == b"\x80":
        raise TraceFormatError(f"{p}: a pickle file (ptdbg/msprobe?), not a determ {fmt.what}; determ never "
                               f"unpickles files")
    try:
        header = json.loads(first)
    except (json.JSONDecodeError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict) or header.get("format") != fmt.name:
        raise TraceFormatError(f"{p}: not a determ {fmt.what} (line 1 has no {fmt.name} header)")
    v = header.get("version")
    if type(v) is not int or v < 1:
        raise TraceFormatError(f"{p}:1: bad {fmt.what} format version {v!r} (expected an integer from 1 to "
                               f"{fmt.version})")
    if v > fmt.version:
        raise TraceFormatError(f"{p}:1: {fmt.what} format version {v} is newer than this determ reads (up to "
                               f"{fmt.version}); read it with the determ release that wrote it")
    return header


def read_header(path: Union[str, Path], fmt: StreamFormat) -> Dict[str, Any]:
    """The header of a stream (its first line only; the records are not read)."""
    p = Path(path)
    with open(p, "rb") as f:
        return _check_header(p, f.readline(), fmt)


def read_stream(path: Union[str, Path], fmt: StreamFormat, allow_partial: bool = False,
                parse: Optional[Callable[[Path, int, Dict[str, Any]], Any]] = None,
                skip: Optional[Callable[[bytes], bool]] = None) -> Stream:
    """Read a stream by the rules in this module's docstring; ``parse(path, lineno, obj)`` turns each record
    object into the consumer's record (and raises :class:`TraceFormatError` for a bad one).  Every error is a
    one-line :class:`TraceFormatError` naming the file (and line).

    ``skip(raw line)``: True for a record line the caller does not want, decided on the raw bytes before any
    JSON is decoded (a quick reject; the caller still filters what it keeps).  Skipped lines count for the
    footer, so the file is checked whole, but are not decoded: a corrupt line among them goes unnoticed."""
    p = Path(path)
    records: List[Any] = []
    skipped = 0
    footer: Dict[str, Any] = {}
    cut: Optional[int] = None  # line number of an undecodable line, tolerated only if nothing follows it
    with open(p, "rb") as f:
        header = _check_header(p, f.readline(), fmt)
        for lineno, raw in enumerate(f, start=2):
            if not raw.strip():
                continue
            if cut is not None:
                raise TraceFormatError(f"{p}:{cut}: corrupt JSON line in the middle of the {fmt.what} (a file is "
                                       f"read up to a cut last line, as its writer left it when killed, but never "
                                       f"past a corrupt line)")
            if footer:
                raise TraceFormatError(f"{p}:{lineno}: data after the end line")
            if skip is not None and skip(raw) and not raw.startswith(b'{"end"'):
                skipped += 1
                continue
            try:
                d = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                if not allow_partial:
                    raise TraceFormatError(f"{p}:{lineno}: corrupt or truncated JSON line") from None
                cut = lineno
                continue
            if not isinstance(d, dict):
                raise TraceFormatError(f"{p}:{lineno}: expected a JSON object, got {type(d).__name__}")
            if d.get("end") is True:
                if d.get("count") != len(records) + skipped:
                    raise TraceFormatError(f"{p}: end line says {d.get('count')} {fmt.items}, found "
                                           f"{len(records) + skipped}")
                footer = d
                continue
            records.append(parse(p, lineno, d) if parse is not None else d)
    if not footer and not allow_partial:
        raise TraceFormatError(f"{p}: truncated {fmt.what} (no end line; {fmt.died})")
    s = Stream(p, header, records, footer)
    if s.cut:
        log.warning("%s: incomplete %s: the %s was cut (%s) after %d %s", p, fmt.what, fmt.what, s.cut,
                    len(records), fmt.items)
    return s
