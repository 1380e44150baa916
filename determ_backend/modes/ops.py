"""What the eager modes need to know about an op call and about the caller.

* user code: which frames are outside torch, determ and the standard library
  (:class:`FrameFilter`, :func:`user_frames`);
* arguments and results: tensors anywhere in ``args``/``kwargs`` (also inside
  lists), the tensors an op returns or writes (:func:`written_tensors`), schema
  facts (writes, views, uninitialized outputs, pure copies);
* tensor identity: a memory key and version counter that survive a tensor crossing
  C++ and coming back as a new Python object;
* :func:`unseen`: run a mode's own work (fingerprints, metrics) below every dispatch
  mode, so an outer mode does not record it as the user's ops.

The recording itself lives in :mod:`determ_backend.modes._record`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sysconfig
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import _disable_current_modes, _len_torch_dispatch_stack

from determ_backend.trace.stream import Record, format_hash

__all__ = ["FrameFilter", "user_frames", "iter_args", "written_tensors", "schema_writes", "returns_view",
           "uninitialized", "uninitialized_hash", "COPIES", "same_layout", "version", "mem_key", "unseen"]

_INTERNAL_ROOTS = tuple(os.path.join(p, "") for p in (
    os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    sysconfig.get_paths()["stdlib"]))


def _is_internal(filename: str) -> bool:
    return filename.startswith(_INTERNAL_ROOTS) or filename.startswith("<frozen")


class FrameFilter:
    """Which code objects are user code (cached per code object)."""

    def __init__(self) -> None:
        self._cache: Dict[Any, bool] = {}

    def user_frames(self, frame, depth: int) -> list:
        out = []
        cache = self._cache
        while frame is not None:
            code = frame.f_code
            internal = cache.get(code)
            if internal is None:
                internal = cache[code] = _is_internal(code.co_filename)
            if not internal:
                out.append(frame)
                if len(out) >= depth:
                    break
            frame = frame.f_back
        return out


def user_frames(frame, depth: int = 8) -> List[str]:
    """``file:line in function`` of the first ``depth`` frames outside torch, determ and the stdlib."""
    return [f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}" for f in FrameFilter().user_frames(frame, depth)]


def iter_args(args: Sequence, kwargs: Dict[str, Any], out: list, with_values: bool = False) -> list:
    """Append ``(path, value)`` for every tensor in ``args``/``kwargs``, also inside lists and tuples
    (non-tensor leaves too when ``with_values``).  Paths: ``args[0]``, ``args[1][2]``, ``weight=``."""
    for i, a in enumerate(args):
        _walk(f"args[{i}]", a, out, with_values)
    for k, v in kwargs.items():
        _walk(f"{k}=", v, out, with_values)
    return out


def _walk(path: str, a: Any, out: list, with_values: bool) -> None:
    if isinstance(a, torch.Tensor):
        out.append((path, a))
    elif isinstance(a, (list, tuple)) and a and not isinstance(a, torch.Size):
        for j, x in enumerate(a):
            _walk(f"{path}[{j}]", x, out, with_values)
    elif with_values:
        out.append((path, a))


def schema_writes(func) -> Tuple[Tuple[int, str], ...]:
    """Positions and names of the arguments ``func`` writes to (``Tensor(a!)``)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return ()
    return tuple((i, a.name) for i, a in enumerate(schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


# ops whose output holds exactly the values of one input (when dtype and shape match): schema name -> arg index
COPIES = {"aten::clone": 0, "aten::_to_copy": 0, "aten::copy_": 1, "aten::detach": 0, "aten::alias": 0,
           "aten::lift_fresh": 0, "aten::lift_fresh_copy": 0}


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.stride() == b.stride() and a.storage_offset() == b.storage_offset()


def uninitialized(func) -> bool:
    """Ops whose outputs are uninitialized memory (``empty``, ``empty_like``, ``new_empty_strided``...)."""
    schema = getattr(func, "_schema", None)
    return schema is not None and "empty" in schema.name and not schema.is_mutable


def uninitialized_hash(rec: Record) -> str:
    digest = hashlib.blake2b(f"uninitialized|{rec.dtype}|{rec.shape}".encode(), digest_size=8).digest()
    return format_hash(int.from_bytes(digest, "little"))


def returns_view(func) -> bool:
    schema = getattr(func, "_schema", None)
    returns = schema.returns if schema is not None else ()
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def written_tensors(result: Any, writes: Tuple[Tuple[int, str], ...], args: Sequence, kwargs: Dict[str, Any]) -> list:
    """Tensors an op produced: those it returns, then those it wrote to but did not return."""
    outs: list = []
    _leaves(result, outs)
    if writes:
        seen = {id(t) for t in outs if isinstance(t, torch.Tensor)}
        for i, name in writes:
            a = args[i] if i < len(args) else kwargs.get(name)
            for t in _leaves(a, []):
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    outs.append(t)
    return outs


def _leaves(x: Any, out: list) -> list:
    if isinstance(x, (list, tuple)):
        for y in x:
            _leaves(y, out)
    elif isinstance(x, (torch.Tensor, bool, int, float)) and not isinstance(x, torch.SymInt):
        out.append(x)
    return out


def version(t: Optional[torch.Tensor]) -> int:
    if t is None:
        return -1
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return -1


def mem_key(t: torch.Tensor) -> Optional[tuple]:
    try:
        return (t.data_ptr(), t.dtype, t.shape, t.stride(), t.device)
    except RuntimeError:  # no storage (sparse, functional wrappers)
        return None


def unseen():
    """Context for a mode's own torch ops (fingerprints, metrics): no dispatch mode sees them.

    Inside ``__torch_dispatch__`` the running mode is already off the stack, but an outer mode
    (nested eager tools) is not; free when no mode is active."""
    return _disable_current_modes() if _len_torch_dispatch_stack() else contextlib.nullcontext()
