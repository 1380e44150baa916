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

import collections
import json
import os
import threading
from pathlib import Path
from typing import Any, Deque, Dict, Optional, Union

import torch

from determ_backend.errors import DetermError, TraceFormatError

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
    """JSON Lines index: header, entries, footer.  :meth:`reopen` drops the footer to append again.

    Lines go straight to the file descriptor, whole: when the disk fills (or a file size limit is hit)
    the file is cut back to its last complete line, closed with a footer marked ``complete: false``
    and ``cut`` (the reason), and :class:`DumpWriteError` names the file and how many entries it kept;
    the index stays readable."""

    def __init__(self, path: Union[str, Path], header: Dict[str, Any]):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: Optional[int] = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._pos = 0
        self.count = 0
        self._footer_at: Optional[int] = None
        self._starts: Deque[int] = collections.deque(maxlen=self._KEEP_STARTS)
        self._lock = threading.Lock()
        with self._lock:
            self._append(json.dumps({"format": INDEX_FORMAT, "version": 1, **header}) + "\n")

    def _append(self, line: str) -> None:
        data = line.encode("utf-8")
        try:
            write_all(self._fd, memoryview(data))
        except OSError as e:
            self._cut(e)
            raise DumpWriteError(f"{self.path}: cannot write the dump index ({e.strerror or e}); it keeps the "
                                 f"{self.count} entries written before and is marked cut") from e
        self._pos += len(data)

    _KEEP_STARTS = 64
    """Line starts remembered, so a footer can take the place of the last entries on a full disk."""

    def _cut(self, e: OSError) -> None:
        """Back to the last complete line, a footer saying why if it fits, and closed."""
        fd, self._fd = self._fd, None
        try:
            while True:
                os.ftruncate(fd, self._pos)
                os.lseek(fd, self._pos, os.SEEK_SET)
                footer = json.dumps({"end": True, "count": self.count, "complete": False,
                                     "cut": e.strerror or str(e)}) + "\n"
                try:
                    write_all(fd, memoryview(footer.encode("utf-8")))
                    return
                except OSError:
                    if not self._starts:
                        raise
                    self._pos = self._starts.pop()  # no room for the footer: it takes the last entry's place
                    self.count -= 1
        except OSError:
            os.ftruncate(fd, self._pos)  # nothing fits: the last complete entry ends the file
        finally:
            os.close(fd)

    def write(self, entry: Dict[str, Any]) -> None:
        line = json.dumps(entry, separators=(",", ":"), allow_nan=True, default=str)
        with self._lock:
            if self._fd is None:
                raise DumpWriteError(f"{self.path}: the dump index is closed")
            start = self._pos
            self._append(line + "\n")
            self._starts.append(start)
            self.count += 1

    def close(self, **footer: Any) -> None:
        with self._lock:
            if self._fd is None:
                return
            self._footer_at = self._pos
            self._append(json.dumps({"end": True, "count": self.count, **footer}) + "\n")
            os.close(self._fd)
            self._fd = None

    @property
    def closed(self) -> bool:
        return self._fd is None

    def reopen(self) -> None:
        with self._lock:
            if self._fd is not None:
                return
            if self._footer_at is None:
                raise DumpWriteError(f"{self.path}: the dump index was cut and cannot be appended to")
            self._fd = os.open(self.path, os.O_WRONLY)
            os.ftruncate(self._fd, self._footer_at)
            os.lseek(self._fd, self._footer_at, os.SEEK_SET)
            self._pos = self._footer_at


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
