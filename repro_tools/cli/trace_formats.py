"""Loading any trace-like file the CLI accepts: determ JSONL traces and run
directories, and ``HashDebugTrace`` text logs (``*.log``, or any file whose first
line is the log's magic line); other producers register a loader here."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, List, Tuple

from determ_backend.errors import TraceFormatError
from determ_backend.trace.stream import Record, TraceFile, read_trace_file

__all__ = ["load_any", "load_file", "LOADERS"]


def _is_text_log(path: Path) -> bool:
    from determ_backend.modes.log import MAGIC

    if not path.is_file():
        return False
    if path.suffix == ".log":
        return True
    try:
        with open(path, "rb") as f:
            return f.readline().rstrip(b"\r\n") == MAGIC.encode()
    except OSError as e:
        raise TraceFormatError(f"{path}: cannot read ({e.strerror})") from None


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


def load_any(path: str, allow_partial: bool = False) -> List[Record]:
    return load_file(path, allow_partial).records
