"""Loading any trace-like file the CLI accepts: determ JSONL traces and run
directories, and ``HashDebugTrace`` text logs (any file whose first line is the log's
magic line, or a ``*.log`` file that holds no JSONL trace); decided by content, not
by name; other producers register a loader here."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, List, Tuple

from determ_backend.errors import TraceFormatError
from determ_backend.trace.stream import Record, TraceFile, read_trace_file

__all__ = ["load_any", "load_file", "load_compared", "is_trace_file", "LOADERS"]


def _first_line(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.readline(4096).rstrip(b"\r\n")
    except OSError as e:
        raise TraceFormatError(f"{path}: cannot read ({e.strerror})") from None


def _is_text_log(path: Path) -> bool:
    """A text log by its first line; a ``*.log`` file that is no JSONL trace either (read as a log, to be told
    what is wrong with it).  Not by name alone: a JSONL trace saved as ``run.log`` is a trace."""
    from determ_backend.modes.log import MAGIC

    if not path.is_file():
        return False
    first = _first_line(path)
    if first == MAGIC.encode():
        return True
    return path.suffix == ".log" and not _is_jsonl_trace_line(first)


def _is_jsonl_trace_line(first: bytes) -> bool:
    return first.startswith(b"{") and b'"determ-trace"' in first


def is_trace_file(path: Path) -> bool:
    """Whether ``path`` is a file holding a trace by its content: a JSONL trace's header, or a text log's magic
    line (whatever its name)."""
    from determ_backend.modes.log import MAGIC

    if not path.is_file():
        return False
    first = _first_line(path)
    return first == MAGIC.encode() or _is_jsonl_trace_line(first)


def _load_text_log(path: Path, allow_partial: bool) -> TraceFile:
    from determ_backend.modes.core import read_hash_log_file  # provided by the eager tools

    return read_hash_log_file(path, allow_partial=allow_partial)


LOADERS: Tuple[Tuple[Callable[[Path], bool], Callable[[Path, bool], TraceFile]], ...] = (
    (_is_text_log, _load_text_log),
)


def load_file(path: str, allow_partial: bool = False) -> TraceFile:
    """The records of ``path`` and how complete the file is (see :class:`~determ_backend.trace.stream.TraceFile`)."""
    p = Path(path)
    if not p.exists():
        raise TraceFormatError(f"{path}: no such file or directory")
    for accepts, loader in LOADERS:
        if accepts(p):
            return loader(p, allow_partial)
    return read_trace_file(p, allow_partial=allow_partial)


def load_compared(path: str, allow_partial: bool = False) -> TraceFile:
    """:func:`load_file` of a trace to compare with another: one holding no records is an input error, never a run
    shown identical to anything."""
    tf = load_file(path, allow_partial)
    if not tf.records:
        why = f" ({tf.limited})" if tf.limited else "" if tf.complete else " (partial trace: the producer died early)"
        raise TraceFormatError(f"{path}: the trace holds no records, nothing to compare{why}")
    return tf


def load_any(path: str, allow_partial: bool = False) -> List[Record]:
    return load_file(path, allow_partial).records
