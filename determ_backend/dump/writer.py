"""Writing a dump to disk: the tensor payload pack and the JSON Lines index.

* :class:`PayloadWriter` appends each *distinct* tensor (keyed by its
  fingerprint) once to ``<data dir>/tensors.bin`` as raw bytes.  The caller's
  thread copies the bytes into a bounded ring buffer (so later in-place changes
  cannot tear them) and a background thread writes the ring to disk; file
  offsets are assigned at submission, so an index entry can name its payload
  (``[offset, nbytes]``) at once.  A write failure (disk full, file size limit)
  is raised as :class:`DumpWriteError` at the next submission or at close.
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
from typing import Any, Deque, Dict, Optional, Tuple, Union

import torch

from ..errors import DetermError, TraceFormatError

__all__ = ["DumpWriteError", "PayloadWriter", "IndexWriter", "read_payload", "PAYLOAD_FILE", "INDEX_FORMAT"]

PAYLOAD_FILE = "tensors.bin"
INDEX_FORMAT = "determ-dump"
_ALIGN = 16
_DEFAULT_RING = 128 << 20


class DumpWriteError(DetermError, OSError):
    """A dump file could not be written (disk full, size limit, permissions); the dump is incomplete."""


def _dtype_from_str(s: str) -> torch.dtype:
    dt = getattr(torch, s.replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise TraceFormatError(f"unknown dtype {s!r} in dump index")
    return dt


def _write_all(fd: int, mv: memoryview) -> None:
    while len(mv):
        n = os.write(fd, mv)
        mv = mv[n:]


class PayloadWriter:
    """Content-addressed, append-only tensor pack written by a background thread."""

    def __init__(self, path: Union[str, Path], ring_bytes: int = _DEFAULT_RING, append: bool = False,
                 index: Optional[Dict[str, Tuple[int, int]]] = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
        self._fd: Optional[int] = os.open(self.path, flags, 0o644)
        self.size = os.fstat(self._fd).st_size if append else 0
        self.index: Dict[str, Tuple[int, int]] = {} if index is None else index
        self.bytes_submitted = 0
        self._cap = ring_bytes
        self._ring: Optional[torch.Tensor] = None
        self._jobs: Deque[Tuple[int, int]] = collections.deque()
        self._cond = threading.Condition()
        self._put_lock = threading.Lock()
        self._error: Optional[BaseException] = None
        self._closing = False
        self._thread: Optional[threading.Thread] = None

    # ---- producer side -------------------------------------------------------------------------
    def put(self, key: str, t: torch.Tensor) -> Tuple[int, int]:
        """Store ``t`` under ``key`` unless already stored; returns ``(offset, nbytes)`` in the pack."""
        hit = self.index.get(key)
        if hit is not None:
            return hit
        with self._put_lock:
            self._raise_if_failed()
            n = t.numel() * t.element_size()
            loc = (self.size, n)
            if n > self._cap // 2:
                self._write_direct(t)
            elif n:
                pos = self._reserve(n)
                dst = self._ring[pos: pos + n].view(t.dtype).view(t.shape) if t.dim() else \
                    self._ring[pos: pos + n].view(t.dtype).reshape(())
                dst.copy_(t.detach())
                with self._cond:
                    self._jobs.append((pos, n))
                    self._cond.notify_all()
            self.size += n
            self.bytes_submitted += n
            self.index[key] = loc
            return loc

    def _ensure_started(self) -> None:
        if self._ring is None:
            self._ring = torch.empty(self._cap, dtype=torch.uint8)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="determ-dump-writer", daemon=True)
            self._thread.start()

    def _reserve(self, n: int) -> int:
        self._ensure_started()
        with self._cond:
            while True:
                self._raise_if_failed()
                pos = self._free_slot(n)
                if pos is not None:
                    return pos
                self._cond.wait()

    def _free_slot(self, n: int) -> Optional[int]:
        if not self._jobs:
            return 0
        tail = self._jobs[0][0]
        last_pos, last_n = self._jobs[-1]
        head = -(-(last_pos + last_n) // _ALIGN) * _ALIGN
        wrapped = last_pos < tail
        if not wrapped:
            if head + n <= self._cap:
                return head
            return 0 if n <= tail else None
        return head if head + n <= tail else None

    def _write_direct(self, t: torch.Tensor) -> None:
        """Large tensors: wait for the queue to drain, then write from this thread (no extra copy)."""
        self.flush()
        data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
        try:
            _write_all(self._fd, memoryview(data.numpy()))
        except OSError as e:
            self._error = e
            self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        e = self._error
        if e is not None:
            why = getattr(e, "strerror", None) or str(e)
            raise DumpWriteError(f"{self.path}: cannot write tensor payloads ({why}); the disk may be full or a "
                                 f"file size limit reached, and this dump is incomplete") from e

    # ---- writer thread ------------------------------------------------------------------------
    def _run(self) -> None:
        ring = self._ring.numpy()
        while True:
            with self._cond:
                while not self._jobs and not self._closing:
                    self._cond.wait()
                if not self._jobs:
                    return
                pos, n = self._jobs[0]
            try:
                _write_all(self._fd, memoryview(ring[pos: pos + n]))
            except OSError as e:
                with self._cond:
                    self._error = e
                    self._jobs.clear()
                    self._cond.notify_all()
                return
            with self._cond:
                self._jobs.popleft()
                self._cond.notify_all()

    def flush(self) -> None:
        """Wait until every submitted payload is on its way to disk; raise if a write failed."""
        with self._cond:
            while self._jobs and self._error is None:
                self._cond.wait()
        self._raise_if_failed()

    def close(self) -> None:
        if self._fd is None:
            return
        try:
            self.flush()
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            if self._thread is not None:
                self._thread.join()
                self._thread = None
            os.close(self._fd)
            self._fd = None
            self._ring = None
        self._raise_if_failed()


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
