"""One dump output: ``<root>/rank{R}/<name>.pkl`` (a JSON Lines index, never a pickle)
and ``<root>/rank{R}/<name>/tensors.bin`` (the payload pack) -- ``name`` is ``dump``,
``api_stack_dump``... or, when ``set_dump_path`` named a file, that file's stem
(``npu_dump``, ``api_stack_npu_dump``, ``Overflow_info_<time>``); see :mod:`.control`.

A :class:`DumpSession` owns the files, the per-API call counters, the
fingerprint cache and the order of records.  It can be closed (footer written,
payloads flushed) and reopened to append, so a dump switched off and on again
stays one index.  The ``.pkl`` name is kept for ptdbg compatibility only.

What gets recorded is decided in :mod:`.switch`; how, in :mod:`.hooks`.
"""

from __future__ import annotations

import collections
import os
import threading
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch

from determ_backend.dump.capture.entries import FingerprintCache
from determ_backend.dump.capture.pipeline import DumpPipeline
from determ_backend.dump.capture.writer import PAYLOAD_FILE, IndexWriter

__all__ = ["DumpSession", "INDEX_SUFFIX"]

INDEX_SUFFIX = ".pkl"
"""The index's file suffix: ptdbg's, kept so that existing compare scripts find the file."""


class DumpSession:
    """Files, counters and cache of one dump (one rank, one file name)."""

    def __init__(self, rank_dir: Path, name: str, header: Dict[str, Any], tensors: bool,
                 ring_bytes: Optional[int] = None):
        self.rank_dir = Path(rank_dir)
        self.name = name
        self.index_path = self.rank_dir / f"{name}{INDEX_SUFFIX}"
        self.data_dir = self.rank_dir / name
        self.rank_dir.mkdir(parents=True, exist_ok=True)
        self.header = header
        self.index = IndexWriter(self.index_path, header)
        self.tensors = tensors
        self._ring_bytes = ring_bytes
        self.payload_index: Dict[str, Any] = {}
        self.cache = FingerprintCache()
        self.counters: Dict[str, int] = collections.defaultdict(int)
        self.seq = 0
        self._lock = threading.Lock()
        self._closed = False  # by close(): the index may close itself earlier, when a write cuts it
        if not tensors:
            self._remove_stale_payloads()
        self.pipeline = self._open_pipeline(append=False)

    def _open_pipeline(self, append: bool) -> DumpPipeline:
        kw = {} if self._ring_bytes is None else {"ring_bytes": self._ring_bytes}
        path = self.data_dir / PAYLOAD_FILE if self.tensors else None
        return DumpPipeline(self.index, path, append=append, payload_index=self.payload_index, **kw)

    def _remove_stale_payloads(self) -> None:
        stale = self.data_dir / PAYLOAD_FILE
        if stale.exists():
            os.unlink(stale)

    def next_call(self, key: str) -> int:
        with self._lock:
            n = self.counters[key]
            self.counters[key] = n + 1
            return n

    def write(self, entry: Dict[str, Any], judge: Optional[Callable[[Dict[str, Any]], None]] = None) -> None:
        """Number ``entry`` (``seq``) and hand it to the pipeline; ``judge(entry)`` runs in between, so an online
        baseline sees the entries in ``seq`` order with their numbers."""
        with self._lock:
            entry["seq"] = self.seq
            self.seq += 1
            if judge is not None:
                judge(entry)
            self.pipeline.submit(entry)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Finish the pipeline, then write the index footer (a complete index implies complete payloads);
        a write that failed, here or on the pipeline's thread, is raised here once."""
        if self._closed:
            return
        self._closed = True
        error: Optional[BaseException] = None
        try:
            self.pipeline.close()
        except BaseException as e:  # still close the index, marked incomplete, then re-raise
            error = e
        self.index.close(payload_bytes=self.pipeline.size, complete=error is None)
        self.cache.clear()
        if error is not None:
            raise error

    def reopen(self) -> None:
        if not self._closed:
            return
        self.index.reopen()
        self._closed = False
        self.pipeline = self._open_pipeline(append=True)  # shares payload_index: dedup across on/off phases


def default_header(rank: int, world_size: int, mode: str, task: str) -> Dict[str, Any]:
    return {"rank": rank, "world_size": world_size, "mode": mode, "task": task, "torch": torch.__version__,
            "pid": os.getpid()}
