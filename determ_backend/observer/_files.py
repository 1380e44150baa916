"""Observer run files: ``<dump_dir>/<name>.jsonl`` (the trace) and ``<name>.safetensors``
(tensors marked non-deterministic).

The trace is a :mod:`determ_backend.trace.stream` trace.  The tensors file is a
tensor file of the one store (:func:`determ_backend.trace.store.save_tensor_file`):
each distinct tensor once, keyed by its fingerprint, the observation names in its
metadata.  Both are written atomically and read without unpickling anything; the
files of earlier determ releases (tensors under their names) stay readable.  The
observer logic lives in :mod:`determ_backend.observer.core`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from determ_backend.errors import TraceFormatError
from determ_backend.trace.store import load_tensor_file, save_tensor_file
from determ_backend.trace.stream import Record, TraceWriter, atomic_path, read_trace_file

__all__ = ["write_run", "load_reference", "tensors_path_for"]

_FORMAT = "determ-observer-tensors"


def tensors_path_for(trace_path: Path) -> Path:
    return trace_path.with_suffix(".safetensors")


def write_run(trace_path: Path, records: Sequence[Record], tensors: Dict[str, torch.Tensor], run: str) -> None:
    """Write the run's trace and (when there are any) its non-deterministic tensors, atomically."""
    meta = {"producer": "ObserverContext", "saved_values": len(tensors)}  # a reader knows the tensors file is due
    with atomic_path(trace_path) as tmp, TraceWriter(tmp, run=run, meta=meta) as w:
        w.write(records)
    tpath = tensors_path_for(trace_path)
    if not tensors:
        if tpath.exists():
            tpath.unlink()  # a stale file from an earlier run of the same name would mislead
        return
    save_tensor_file(tpath, tensors, metadata={"format": _FORMAT, "run": run})


def load_reference(path) -> Tuple[List[Record], Optional[Dict[str, torch.Tensor]], Path]:
    """``(records, tensors, tensors path)`` of a reference run written by ``ObserverContext``: ``tensors`` is empty
    when the run saved no marked value, None when the tensors file is missing and the trace does not say whether it
    saved any (a trace of an earlier release).  A missing file the trace says holds saved values is an error."""
    p = Path(path)
    if not p.is_file():
        what = "not a file" if p.exists() else "no such file"
        raise TraceFormatError(f"reference_hash_file: {path}: {what} (expected the .jsonl trace an "
                               f"ObserverContext wrote)")
    try:
        trace = read_trace_file(p)
    except TraceFormatError as e:
        raise TraceFormatError(f"reference_hash_file: {e} (expected the .jsonl trace an ObserverContext wrote; "
                               f"pickle files are never read)") from None
    records, saved = trace.records, trace.header.get("saved_values")
    tpath = tensors_path_for(p)
    if not tpath.is_file():
        if isinstance(saved, int) and saved > 0:
            raise TraceFormatError(f"{tpath}: no such file; the reference run saved {saved} marked value(s) there "
                                   f"(keep it next to its trace {p.name})")
        return records, ({} if saved == 0 else None), tpath
    tensors, _ = load_tensor_file(tpath)
    return records, tensors, tpath
