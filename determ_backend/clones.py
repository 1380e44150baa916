"""Cloning a call's inputs: the one helper every check, replay and oracle uses.

:func:`clone_inputs` copies the tensors of a call's arguments so that the copy can
be run again (a second execution, an eager reference, a compile) without the
first run's in-place writes reaching it, and so that it looks to the callee like
the original: same sizes, strides, dtype, device and ``requires_grad``, and
tensors that share memory still share it (an expanded tensor stays expanded, two
views of one buffer stay views of one copy).  Only the bytes the tensors cover are
copied, so storage offsets are kept relative to that span (modulo a 16-byte
alignment); ``whole_storage=True`` copies each storage whole and keeps the offsets
exactly, for a callee that may re-stride its input in place (``as_strided_``).

Callers: :mod:`determ_backend.backends.checks` (the determinism twin, the accuracy
reference), :mod:`determ_backend.modes._bitwise` (an op's second run),
:mod:`determ_backend.backends.eager` (replays) and, in :mod:`repro_tools`, the
minifier's oracles and ``same_two_models``.  The standalone runtime of generated
repro scripts (:mod:`repro_tools.repro._harness`) imports torch alone and keeps
its own copy.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["clone_inputs"]

_ALIGN = 16
"""Bytes: a copied region starts at a multiple of every element size, so each view's offset stays whole."""


def clone_inputs(values: Sequence[Any], whole_storage: bool = False) -> List[Any]:
    """``values`` with every tensor replaced by a clone (module docstring); lists, tuples and dicts are
    walked (``clone_inputs([args, kwargs])`` clones an op's arguments), other values are kept as they are."""
    groups: Dict[Tuple, List[torch.Tensor]] = {}
    _walk(values, lambda t: _group(t, groups))
    clones: Dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for members in groups.values():
            _clone_group(members, clones, whole_storage)
    return [_rebuild(v, clones) for v in values]


def _walk(value: Any, fn) -> None:
    if isinstance(value, torch.Tensor):
        fn(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _walk(v, fn)
    elif isinstance(value, dict):
        for v in value.values():
            _walk(v, fn)


def _rebuild(value: Any, clones: Dict[int, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return clones[id(value)]
    if isinstance(value, list):
        return [_rebuild(v, clones) for v in value]
    if isinstance(value, tuple):
        return tuple(_rebuild(v, clones) for v in value)
    if isinstance(value, dict):
        return {k: _rebuild(v, clones) for k, v in value.items()}
    return value


def _group(t: torch.Tensor, groups: Dict[Tuple, List[torch.Tensor]]) -> None:
    """Tensors viewing one storage go into one group; a tensor without a plain storage is a group alone."""
    key: Tuple = ("alone", id(t))
    if t.layout == torch.strided and not t.is_conj() and not t.is_neg():
        try:
            key = (StorageWeakRef(t.untyped_storage()).cdata, str(t.device))
        except (RuntimeError, NotImplementedError, TypeError):  # a tensor subclass without a storage of its own
            pass
    members = groups.setdefault(key, [])
    if all(m is not t for m in members):
        members.append(t)


def _span(t: torch.Tensor) -> Tuple[int, int]:
    """``[first, last)`` bytes of its storage that ``t`` covers."""
    start = t.storage_offset() * t.element_size()
    if t.numel() == 0:
        return start, start
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    return start, start + extent * t.element_size()


def _clone_group(members: List[torch.Tensor], clones: Dict[int, torch.Tensor], whole_storage: bool) -> None:
    first = members[0]
    if len(members) == 1 and (first.layout != torch.strided or first.is_conj() or first.is_neg()
                              or (not whole_storage and _plain(first))):
        clones[id(first)] = _keep_grad(first.clone(), first)  # for a plain tensor the same as the span copy below
        return
    spans = [_span(t) for t in members]
    lo = min(s for s, _ in spans) // _ALIGN * _ALIGN
    hi = max(e for _, e in spans)
    try:
        raw = torch.empty(0, dtype=torch.uint8, device=first.device).set_(first.untyped_storage())
    except (RuntimeError, NotImplementedError, TypeError):  # no plain storage after all: each tensor alone
        for t in members:
            clones[id(t)] = _keep_grad(t.clone(), t)
        return
    if whole_storage:
        lo, hi = 0, raw.numel()
    copy = raw[lo:hi].clone().untyped_storage()
    for t, (start, _) in zip(members, spans):
        c = torch.empty(0, dtype=t.dtype, device=t.device)
        c.set_(copy, (start - lo) // t.element_size(), t.size(), t.stride())
        clones[id(t)] = _keep_grad(c, t)


def _plain(t: torch.Tensor) -> bool:
    """Contiguous and starting on the alignment: its span copy would be exactly ``t.clone()``."""
    return t.is_contiguous() and t.storage_offset() * t.element_size() % _ALIGN == 0


def _keep_grad(c: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return c.requires_grad_(t.requires_grad) if c.is_leaf and t.requires_grad else c
