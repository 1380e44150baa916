"""Turning a call's arguments and results into index entries.

An entry describes one argument: a tensor (``dtype``, ``shape``, ``hash``,
``stats``, ``param``, ``payload``) or, with the filter off, a scalar.  Tensor
values are snapshotted and fingerprinted by :mod:`.pipeline` (hash and statistics
come from :class:`determ_backend.fingerprint.core.FingerprintBatch`); a per-session
cache keyed by tensor identity and version skips tensors already described (one
API's output is usually the next API's input).

What to record is decided in :mod:`.switch`.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from determ_backend import _torch_compat
from determ_backend.modes.ops import storage_start
from determ_backend.trace.stream import shape_of

__all__ = ["flatten", "FingerprintCache", "describe", "is_data_tensor", "call_items", "output_items"]

_CACHE_LIMIT = 8192


def flatten(value: Any, prefix: str, out: Optional[List[Tuple[str, Any]]] = None) -> List[Tuple[str, Any]]:
    """``[(name, leaf)]`` with ptdbg-style names: ``input.0``, ``input.0.1``, ``input.bias``."""
    out = [] if out is None else out
    if isinstance(value, (list, tuple)) and not _is_namedtuple_scalar(value):
        for i, v in enumerate(value):
            flatten(v, f"{prefix}.{i}", out)
    elif isinstance(value, dict):
        for k, v in value.items():
            flatten(v, f"{prefix}.{k}", out)
    else:
        out.append((prefix, value))
    return out


def _is_namedtuple_scalar(value: Any) -> bool:
    return isinstance(value, torch.Size)


def call_items(args: Sequence[Any], kwargs: Dict[str, Any]) -> List[Tuple[str, Any]]:
    items: List[Tuple[str, Any]] = []
    for i, a in enumerate(args):
        flatten(a, f"input.{i}", items)
    for k, v in kwargs.items():
        if k != "out":
            flatten(v, f"input.{k}", items)
    return items


def output_items(result: Any) -> List[Tuple[str, Any]]:
    if isinstance(result, (list, tuple, dict)) and not isinstance(result, torch.Size):
        return flatten(result, "output")
    return [("output", result)]


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def is_data_tensor(t: Any) -> bool:
    """A plain tensor whose values can be read and copied as bytes: strided, not meta, not quantized.
    Tensor subclasses (fake, distributed, wrapper tensors) are described by dtype and shape only."""
    return (type(t) in _PLAIN and t.layout == torch.strided and t.device.type != "meta"
            and not t.is_quantized and not t.is_nested)


class FingerprintCache:
    """Fingerprints of recently seen tensors, valid while the tensor object lives and is not modified.

    Modified means its version counter moved, or :meth:`forget` was told of a write into its memory through any
    tensor (``p.data.mul_(0.9)`` writes ``p`` through another object with a counter of its own), or :meth:`clear`
    (after every optimizer step: a fused optimizer, ``torch._fused_adamw_``, writes the parameters without moving
    their counters)."""

    def __init__(self) -> None:
        self._entries: Dict[int, Tuple[Any, int, Dict[str, Any]]] = {}
        self._by_storage: Dict[int, set] = {}  # first byte of a storage -> ids of its cached tensors

    def get(self, t: torch.Tensor) -> Optional[Dict[str, Any]]:
        hit = self._entries.get(id(t))
        if hit is None:
            return None
        ref, version, fp = hit
        if ref() is not t or _torch_compat.tensor_version(t) != version:
            return None
        return fp

    def put(self, t: torch.Tensor, fp: Dict[str, Any]) -> None:
        if len(self._entries) >= _CACHE_LIMIT or len(self._by_storage) >= _CACHE_LIMIT:
            self.clear()
        try:
            self._entries[id(t)] = (weakref.ref(t), _torch_compat.tensor_version(t), fp)
        except (TypeError, RuntimeError):  # no weak references, or an inference tensor (no version counter, so a
            return                         # write in inference mode would go unseen): not cached
        where = storage_start(t)
        if where:
            self._by_storage.setdefault(where, set()).add(id(t))

    def forget(self, items: Sequence[Tuple[str, Any]]) -> None:
        """Drop the tensors of ``items``, and every tensor sharing memory with them: a call wrote into them
        (collectives do not bump ``_version``; a write through ``.data`` bumps another counter)."""
        for _, v in items:
            if isinstance(v, torch.Tensor):
                self._entries.pop(id(v), None)
                for i in self._by_storage.pop(storage_start(v), ()):
                    self._entries.pop(i, None)

    def clear(self) -> None:
        self._entries.clear()
        self._by_storage.clear()


def _scalar_entry(name: str, v: Any) -> Optional[Dict[str, Any]]:
    if isinstance(v, bool) or isinstance(v, (int, float)):
        return {"name": name, "type": type(v).__name__, "value": v}
    if v is None:
        return {"name": name, "type": "None"}
    if isinstance(v, (torch.dtype, torch.device, str, torch.Size, slice)):
        return {"name": name, "type": type(v).__name__, "value": str(v)}
    return None


def describe(items: Sequence[Tuple[str, Any]], cache: FingerprintCache, *, data: bool = True,
             keep_non_float: bool = True, pipeline=None,
             refs: Optional[Dict[int, torch.Tensor]] = None) -> List[Dict[str, Any]]:
    """Index entries for ``items``.  ``data=False``: dtype/shape only (stack mode).  Otherwise each new
    tensor is snapshotted by ``pipeline`` and its entry gets an ``_fp`` future (hash, stats, payload) that
    the pipeline resolves before writing; tensors already seen (same object, same version) reuse theirs.
    ``keep_non_float=False`` (the dump's filter): non-tensor values are left out, and integer and bool tensors
    get a ``filtered`` entry with their fingerprint and statistics but no payload.
    ``refs``: filled with ``{id(entry): tensor}`` for the tensors described (the online baseline keeps some).

    Inside a ``torch.func`` transform the tensors are wrappers with no memory of their own: each is described by
    the tensor it wraps (under ``vmap`` the whole batch, batch dimension included), read outside the transform."""
    if _torch_compat.functorch_active():
        with _torch_compat.functorch_disabled():
            items = [(name, _torch_compat.functorch_unwrapped(v)) for name, v in items]
            return _describe(items, cache, data, keep_non_float, pipeline, refs)
    return _describe(items, cache, data, keep_non_float, pipeline, refs)


def _describe(items: Sequence[Tuple[str, Any]], cache: FingerprintCache, data: bool, keep_non_float: bool, pipeline,
              refs: Optional[Dict[int, torch.Tensor]]) -> List[Dict[str, Any]]:
    entries: List[Dict[str, Any]] = []
    for name, v in items:
        if isinstance(v, torch.Tensor):
            if not keep_non_float and not (v.is_floating_point() or v.is_complex()):
                # filtered out (integer ids, indices, masks): no values stored, but a fingerprint, so that a
                # comparison knows whether the call was fed other ids instead of taking its inputs for equal
                if data and pipeline is not None and is_data_tensor(v):
                    entries.append({"name": name, "dtype": str(v.dtype), "shape": shape_of(v), "filtered": True,
                                    "_fp": pipeline.tensor(v, store=False)})
                continue
            e: Dict[str, Any] = {"name": name, "dtype": str(v.dtype), "shape": shape_of(v)}
            if isinstance(v, torch.nn.Parameter) or isinstance(_torch_compat.view_base(v), torch.nn.Parameter):
                e["param"] = True  # a weight, or a view of one (``input @ self.weight.T``): its values are the weight's
            if v.device.type != "cpu":
                e["device"] = str(v.device)
            if data and pipeline is not None and is_data_tensor(v):
                fp = cache.get(v)
                if fp is None:
                    fp = pipeline.tensor(v)
                    cache.put(v, fp)
                e["_fp"] = fp
                if refs is not None:
                    refs[id(e)] = v.detach()
            entries.append(e)
        elif keep_non_float:
            e2 = _scalar_entry(name, v)
            if e2 is not None:
                entries.append(e2)
    if pipeline is not None:
        pipeline.commit()
    return entries
