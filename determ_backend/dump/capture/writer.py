"""Dump files: the index stream's format and writer, where payloads go, the write error.

* The index (``dump.pkl``, ``api_stack_dump.pkl``...: JSON Lines despite ptdbg's
  name) is a :mod:`determ_backend.trace.jsonl` stream of format ``determ-dump``
  (:data:`DUMP_STREAM`): a header, one entry per recorded call and the footer
  ``{"end": true, "count": N, ...}``.  :class:`IndexWriter` writes it whole line by
  whole line, removes the footer again when a dump is switched back on (so an
  index written in several on/off phases is still one file) and, on a full disk,
  cuts it back and closes it with a ``complete: false``/``cut`` footer -- the
  stream's rules, see :mod:`~determ_backend.trace.jsonl`.
* Payloads: each *distinct* tensor (keyed by its fingerprint) is stored once in
  ``<data dir>/tensors.bin`` (:data:`PAYLOAD_FILE`), a pack of safetensors shards
  of the one tensor store (:class:`~determ_backend.trace.store.PackWriter`); an
  entry names its bytes as ``"payload": [offset, nbytes]`` next to ``dtype`` and
  ``shape``.  Dumps written before shards hold the raw bytes back to back; the
  same spans read both.  Writing is done by :mod:`.pipeline`.

Reading an index and its payloads lives in :mod:`determ_backend.dump.comparison.parse`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Union

from determ_backend.trace.jsonl import StreamFormat, StreamWriter, StreamWriteError

__all__ = ["DumpWriteError", "IndexWriter", "PAYLOAD_FILE", "INDEX_FORMAT", "DUMP_STREAM"]

PAYLOAD_FILE = "tensors.bin"
INDEX_FORMAT = "determ-dump"
DUMP_STREAM = StreamFormat(INDEX_FORMAT, 1, "dump index", "entries",
                           "the dump was not switched off, or the process died")


class DumpWriteError(StreamWriteError):
    """A dump file could not be written (disk full, size limit, permissions); the dump is incomplete."""


class IndexWriter(StreamWriter):
    """The JSON Lines index of one dump: ``header`` (rank, mode, task...) after the format line fields, entries,
    footer; :meth:`reopen` drops the footer to append again.  Write failures raise :class:`DumpWriteError`."""

    def __init__(self, path: Union[str, Path], header: Dict[str, Any]):
        super().__init__(path, DUMP_STREAM, header, error=DumpWriteError)
