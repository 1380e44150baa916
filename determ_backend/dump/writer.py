"""Dump files: the JSON Lines index writer, the payload reader, the write error.

* Payloads: each *distinct* tensor (keyed by its fingerprint) is stored once,
  as raw bytes, in ``<data dir>/tensors.bin``; an entry names its bytes as
  ``"payload": [offset, nbytes]`` next to ``dtype`` and ``shape``.  Writing is
  done by :mod:`.pipeline`.
* :class:`IndexWriter` streams one JSON object per line after a header; the
  footer ``{"end": true, ...}`` marks a complete index and is removed again when
  a dump is switched back on (so an index written in several on/off phases is
  still one file).
* :func:`read_payload` reads a payload back (no pickle).

Reading an index lives in :mod:`.parse`.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch

from ..errors import DetermError, TraceFormatError

__all__ = ["DumpWriteError", "IndexWriter", "read_payload", "write_all", "PAYLOAD_FILE", "INDEX_FORMAT"]

PAYLOAD_FILE = "tensors.bin"
INDEX_FORMAT = "determ-dump"


class DumpWriteError(DetermError, OSError):
    """A dump file could not be written (disk full, size limit, permissions); the dump is incomplete."""


def _dtype_from_str(s: str) -> torch.dtype:
    dt = getattr(torch, s.replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise TraceFormatError(f"unknown dtype {s!r} in dump index")
    return dt


def write_all(fd: int, mv: memoryview) -> None:
    while len(mv):
        n = os.write(fd, mv)
        mv = mv[n:]


class IndexWriter:
    """JSON Lines index: header, entries, footer.  :meth:`reopen` drops the footer to append again."""

    def __init__(self, path: Union[str, Path], header: Dict[str, Any]):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "w", encoding="utf-8")
        self._f.write(json.dumps({"format": INDEX_FORMAT, "version": 1, **header}) + "\n")
        self.count = 0
        self._footer_at: Optional[int] = None
        self._lock = threading.Lock()

    def write(self, entry: Dict[str, Any]) -> None:
        line = json.dumps(entry, separators=(",", ":"), allow_nan=True, default=str)
        with self._lock:
            self._f.write(line + "\n")
            self.count += 1

    def close(self, **footer: Any) -> None:
        with self._lock:
            if self._f is None:
                return
            self._f.flush()
            self._footer_at = self._f.tell()
            self._f.write(json.dumps({"end": True, "count": self.count, **footer}) + "\n")
            self._f.close()
            self._f = None

    @property
    def closed(self) -> bool:
        return self._f is None

    def reopen(self) -> None:
        with self._lock:
            if self._f is not None:
                return
            self._f = open(self.path, "r+", encoding="utf-8")
            self._f.seek(self._footer_at)
            self._f.truncate()


def read_payload(data_dir: Union[str, Path], entry: Dict[str, Any], device: Union[str, torch.device] = "cpu"
                 ) -> torch.Tensor:
    """The tensor stored for index ``entry`` (which has ``payload``, ``dtype``, ``shape``)."""
    path = Path(data_dir) / PAYLOAD_FILE
    off, n = entry["payload"]
    dtype = _dtype_from_str(entry["dtype"])
    shape = entry["shape"]
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise TraceFormatError(f"{path}: tensor payload file missing (was the dump written in statistics mode?)") from None
    if off + n > size:
        raise TraceFormatError(f"{path}: truncated payload file: {entry.get('name', 'a tensor')} needs bytes "
                               f"[{off}, {off + n}) but the file has {size} bytes")
    buf = bytearray(n)
    with open(path, "rb") as f:
        f.seek(off)
        f.readinto(buf)
    if n == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    t = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)
    return t.to(device) if str(device) != "cpu" else t
