"""Loading any trace-like file the CLI accepts: determ JSONL traces and run
directories; other producers (e.g. text logs) register a loader here."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, List, Tuple

from determ_backend.errors import TraceFormatError
from determ_backend.trace import Record, read_trace

__all__ = ["load_any", "LOADERS"]


def _is_text_log(path: Path) -> bool:
    return path.is_file() and path.suffix == ".log"


def _load_text_log(path: Path, allow_partial: bool) -> List[Record]:
    from determ_backend.modes import read_hash_log  # provided by the eager tools

    return read_hash_log(path, allow_partial=allow_partial)


LOADERS: Tuple[Tuple[Callable[[Path], bool], Callable[[Path, bool], List[Record]]], ...] = (
    (_is_text_log, _load_text_log),
)


def load_any(path: str, allow_partial: bool = False) -> List[Record]:
    p = Path(path)
    if not p.exists():
        raise TraceFormatError(f"{path}: no such file or directory")
    for accepts, loader in LOADERS:
        if accepts(p):
            return loader(p, allow_partial)
    return read_trace(p, allow_partial=allow_partial)
