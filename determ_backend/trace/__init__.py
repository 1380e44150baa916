"""Traces: the record schema, the JSON Lines stream and the tensor store.

Every producer (backends, eager modes, observer, API dump) writes through here
and every consumer reads through here: :mod:`.jsonl` (the one header/records/
footer stream and its partial-read rules, for traces and dump indexes),
:mod:`.stream` (trace records and ``trace.jsonl``), :mod:`.store` (the one
content-addressed tensor store, safetensors files).  Pairing and judging records
is :mod:`determ_backend.compare`.
"""

from determ_backend.trace.store import TensorStore, store_for
from determ_backend.trace.stream import (TRACE_NAME, Record, TraceFile, TraceWriter, atomic_path, atomic_write_text,
                                         format_hash, read_trace, read_trace_file, resolve_trace_path)

__all__ = ["Record", "TraceWriter", "TraceFile", "read_trace", "read_trace_file", "resolve_trace_path", "TensorStore",
           "store_for", "atomic_write_text", "atomic_path", "format_hash", "TRACE_NAME"]
