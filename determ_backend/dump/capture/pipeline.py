"""The dump pipeline: snapshot tensors now, fingerprint and write them on a background thread.

Tensor mode: the recording thread only copies each new tensor into a bounded ring
buffer (a snapshot: later in-place changes cannot tear it) and queues it; a background
thread then computes its fingerprint and statistics (the package's one batcher,
:class:`~determ_backend.fingerprint.core.FingerprintBatch`, with ``"fast"``
statistics), stores its bytes once per distinct fingerprint in
``tensors.bin`` (tensor mode), and writes the index lines, in order.  An index
entry refers to its tensors through :class:`Fingerprint` futures, which the
background thread resolves before writing the entry, so the recording thread
never waits for a hash or a disk write unless the ring is full (the queue is
bounded by the ring's bytes).  Tensors larger than a quarter of the ring are
handled synchronously after the queue drains.  Statistics mode stores no bytes,
so a snapshot would be pure cost: tensors are fingerprinted in place, one batch
per call (:meth:`DumpPipeline.commit`), and only the index lines are written in
the background.

Payload bytes go to the dump's pack of the one tensor store
(:class:`~determ_backend.trace.store.PackWriter`): each batch the background
thread fingerprints appends one safetensors shard holding its new tensors, keyed
by fingerprint, and an entry records where its tensor's bytes lie
(``payload: [offset, nbytes]``).

A write failure (disk full, file size limit) or any error of the background
thread is raised as :class:`~.writer.DumpWriteError` at the next submission or
at :meth:`DumpPipeline.close`.
"""

from __future__ import annotations

import collections
import threading
from pathlib import Path
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import torch

from determ_backend.fingerprint.core import FingerprintBatch
from determ_backend.trace.stream import format_hash
from determ_backend.dump.capture.writer import DumpWriteError, IndexWriter
from determ_backend.trace.store import PackWriter

__all__ = ["Fingerprint", "DumpPipeline", "fill_fingerprints"]

_ALIGN = 16
_DEFAULT_RING = 128 << 20
_BATCH = 64


class Fingerprint:
    """Future fingerprint of one tensor snapshot: ``hash``, ``stats`` and ``payload`` once resolved."""

    __slots__ = ("hash", "stats", "payload", "pos", "n", "dtype", "shape", "tensor", "store")

    def __init__(self, pos: int, n: int, dtype: torch.dtype, shape: List[int], tensor=None, store: bool = True):
        self.pos, self.n, self.dtype, self.shape, self.tensor = pos, n, dtype, shape, tensor
        self.store = store  # False: fingerprint and statistics only, its bytes are not kept
        self.hash: Optional[str] = None
        self.stats: Optional[Dict[str, Any]] = None
        self.payload: Optional[List[int]] = None

    def fields(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"hash": self.hash}
        if self.stats is not None:
            d["stats"] = self.stats
        if self.payload is not None:
            d["payload"] = self.payload
        return d


def fill_fingerprints(entry: Dict[str, Any]) -> None:
    """Replace each tensor's resolved ``_fp`` future in ``entry`` by its fields (``hash``, ``stats``, ``payload``)."""
    for io in ("inputs", "outputs"):
        for t in entry.get(io, ()):
            fp = t.pop("_fp", None)
            if fp is not None:
                t.update(fp.fields())


class DumpPipeline:
    """Ring buffer + background thread turning tensor snapshots and entries into files."""

    def __init__(self, index: IndexWriter, payload_path: Optional[Path], stats: bool = True,
                 ring_bytes: int = _DEFAULT_RING, append: bool = False,
                 payload_index: Optional[Dict[str, Tuple[int, int]]] = None):
        self.index_writer = index
        self.stats = stats
        self.payload_path = payload_path
        self.payload_index: Dict[str, Tuple[int, int]] = {} if payload_index is None else payload_index
        self._pack: Optional[PackWriter] = None
        if payload_path is not None:
            self._pack = PackWriter(payload_path, append=append, index=self.payload_index)
        self._cap = ring_bytes
        self._ring: Optional[torch.Tensor] = None
        self._regions: Deque[Tuple[int, int]] = collections.deque()
        self._queue: Deque[Tuple[str, Any]] = collections.deque()
        self._pending: List[Fingerprint] = []
        self._cond = threading.Condition()
        self._lock = threading.RLock()
        self._error: Optional[BaseException] = None
        self._busy = False
        self._closing = False
        self._thread: Optional[threading.Thread] = None
        self.on_entry: Optional[Callable[[Dict[str, Any]], Any]] = None
        """Called with each entry once its fingerprints are resolved, just before it is written (the online
        baseline), on the writer's thread."""

    # ---- recording thread --------------------------------------------------------------------
    def tensor(self, t: torch.Tensor, store: bool = True) -> Fingerprint:
        """Snapshot ``t``; its fingerprint is computed later (or now, for a large tensor).  ``store=False``: its
        fingerprint and statistics only, never its bytes (a tensor the dump's filter leaves out, fingerprinted so
        that a comparison still sees whether it differs)."""
        with self._lock:
            self._raise_if_failed()
            t = t.detach()
            n = t.numel() * t.element_size()
            if self._pack is None:  # statistics only: no payload, so no snapshot; fingerprinted at commit()
                fp = Fingerprint(0, n, t.dtype, list(t.shape), tensor=t)
                self._pending.append(fp)
                return fp
            if n > self._cap // 4:
                return self._now(t, n, store)
            pos = self._reserve(n) if n else 0
            fp = Fingerprint(pos, n, t.dtype, list(t.shape), store=store)
            if n:
                self._ring[pos: pos + n].view(t.dtype).view(t.shape).copy_(t)
            with self._cond:
                self._queue.append(("fp", fp))
                self._cond.notify_all()
            return fp

    def commit(self) -> None:
        """Statistics mode: fingerprint, in one batch, the tensors taken since the last commit (before the
        recording thread goes on and they may change)."""
        if self._pending:
            fps, self._pending = self._pending, []
            self._resolve(fps)

    def submit(self, entry: Dict[str, Any]) -> None:
        """Queue an index entry (its tensors' ``_fp`` futures are resolved before it is written)."""
        with self._lock:
            self._raise_if_failed()
            self._start()
            with self._cond:
                self._queue.append(("entry", entry))
                self._cond.notify_all()

    def _now(self, t: torch.Tensor, n: int, store: bool = True) -> Fingerprint:
        """A large tensor: drain the queue, then fingerprint and store it from this thread (no copy)."""
        self.flush()
        fp = Fingerprint(0, n, t.dtype, list(t.shape), tensor=t, store=store)
        try:
            self._resolve([fp])
        except OSError as e:
            self._error = e
            self._raise_if_failed()
        return fp

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="determ-dump-writer", daemon=True)
            self._thread.start()

    def _reserve(self, n: int) -> int:
        if self._ring is None:
            self._ring = torch.empty(self._cap, dtype=torch.uint8)
        self._start()
        with self._cond:
            while True:
                self._raise_if_failed()
                pos = self._free_slot(n)
                if pos is not None:
                    self._regions.append((pos, n))
                    return pos
                self._cond.wait()

    def _free_slot(self, n: int) -> Optional[int]:
        if not self._regions:
            return 0
        tail = self._regions[0][0]
        last_pos, last_n = self._regions[-1]
        head = -(-(last_pos + last_n) // _ALIGN) * _ALIGN
        if last_pos >= tail:  # not wrapped
            if head + n <= self._cap:
                return head
            return 0 if n <= tail else None
        return head if head + n <= tail else None

    def _raise_if_failed(self) -> None:
        e = self._error
        if e is None:
            return
        if isinstance(e, DumpWriteError):  # the index writer's own: it names its file and what it kept
            raise DumpWriteError(str(e)) from e
        if isinstance(e, OSError):
            why = e.strerror or str(e)
            raise DumpWriteError(f"{self.payload_path}: cannot write tensor payloads ({why}); the disk may be full "
                                 f"or a file size limit reached, and this dump is incomplete") from e
        raise DumpWriteError(f"{self.index_writer.path}: the dump writer failed ({type(e).__name__}: {e}); this dump "
                             f"is incomplete") from e

    # ---- background thread -------------------------------------------------------------------
    def _view(self, fp: Fingerprint) -> torch.Tensor:
        if fp.tensor is not None:
            return fp.tensor
        if fp.n == 0:
            return torch.empty(fp.shape, dtype=fp.dtype)
        return self._ring[fp.pos: fp.pos + fp.n].view(fp.dtype).view(fp.shape)

    def _resolve(self, fps: List[Fingerprint]) -> None:
        views = [self._view(f) for f in fps]
        hashes, stats = _fingerprints(views, self.stats)
        for f, h, st in zip(fps, hashes, stats):
            f.hash, f.stats = format_hash(h), st
        kept = [(f, v) for f, v in zip(fps, views) if f.store]
        if self._pack is not None and kept:  # the batch's new tensors: one shard
            for (f, _), span in zip(kept, self._pack.put_many([(f.hash, v) for f, v in kept])):
                f.payload = list(span)
        for f in fps:
            f.tensor = None

    @property
    def size(self) -> int:
        """Bytes of the distinct tensors stored (shard headers not counted)."""
        return self._pack.size if self._pack is not None else 0

    def _write_entry(self, entry: Dict[str, Any]) -> None:
        fill_fingerprints(entry)
        if self.on_entry is not None:  # never raises: see OnlineBaseline.check
            self.on_entry(entry)
        self.index_writer.write(entry)

    def _take(self) -> Optional[List[Tuple[str, Any]]]:
        with self._cond:
            while not self._queue and not self._closing:
                self._cond.wait()
            if not self._queue:
                return None
            batch = []
            while self._queue and len(batch) < _BATCH:
                batch.append(self._queue.popleft())
            self._busy = True
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            fps = [x for kind, x in batch if kind == "fp"]
            try:
                if fps:  # first every snapshot of the batch (one fingerprint batch, one payload shard) ...
                    self._resolve(fps)
                for kind, entry in batch:  # ... then the entries, which only refer to snapshots queued before them
                    if kind == "entry":
                        self._write_entry(entry)
            except BaseException as e:  # surfaced in the recording thread as DumpWriteError
                with self._cond:
                    self._error = e
                    self._queue.clear()
                    self._regions.clear()
                    self._busy = False
                    self._cond.notify_all()
                return
            with self._cond:
                for fp in fps:
                    if fp.n:  # queued snapshots live in the ring, in queue order
                        self._regions.popleft()
                self._busy = False
                self._cond.notify_all()

    def flush(self) -> None:
        """Wait until everything queued is written; raise if writing failed."""
        with self._cond:
            while (self._queue or self._busy) and self._error is None:
                self._cond.wait()
        self._raise_if_failed()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            if self._thread is not None:
                self._thread.join()
                self._thread = None
            if self._pack is not None:
                self._pack.close()
            self._ring = None


def _fingerprints(views: List[torch.Tensor], stats: bool) -> Tuple[List[int], List[Optional[Dict[str, Any]]]]:
    """Hash (and statistics) of each tensor, in one batch: one host transfer per device."""
    # snapshots, or tensors taken in this call: unchanged until resolved; statistics in a dump entry's order
    batch = FingerprintBatch("fast" if stats else None, stable=True, max_first=True)
    for v in views:
        batch.add(v)
    hashes, stats_ = zip(*batch.resolve()) if views else ((), ())
    return list(hashes), list(stats_)
