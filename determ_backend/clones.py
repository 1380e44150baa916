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

A graph can also write into tensors it does not take as inputs: its module's attributes
(``get_attr``; a compiled optimizer step holds the parameters and their state there, and updates
them in place).  :class:`AttributeState` saves and puts back those a graph writes, so a run determ
adds starts from the values the program's call started from and leaves the ones the program's
call left; :func:`mark_written` names them on the graph, and an eager run of it
(:class:`~determ_backend.backends.eager.EagerInterpreter`) then writes into copies of them
(:func:`read_attributes_in`: and reads float ones in another dtype, for a float64 reference).

Callers: :mod:`determ_backend.backends.checks` (the determinism twin, the accuracy
reference), :mod:`determ_backend.modes._bitwise` (an op's second run),
:mod:`determ_backend.backends.eager` (replays) and, in :mod:`repro_tools`, the
minifier's oracles and ``same_two_models``.  The standalone runtime of generated
repro scripts (:mod:`repro_tools.repro._harness`) imports torch alone and keeps
its own copy.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from determ_backend.fingerprint._words import same_size_int

__all__ = ["clone_inputs", "AttributeState", "mark_written", "written_attributes", "read_attributes_in",
           "attributes_dtype", "same_bits", "attribute_tensors"]

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


# -- tensors a graph reads from its module -------------------------------------------------------------------

WRITTEN_KEY = "determ_written_attributes"
"""``GraphModule.meta`` key: the ``get_attr`` targets the graph writes (see :func:`mark_written`)."""


def mark_written(gm: Any, targets: Sequence[str]) -> None:
    """Name on ``gm`` the ``get_attr`` targets its graph writes: an eager run of it writes into copies."""
    meta = getattr(gm, "meta", None)
    if isinstance(meta, dict):
        meta[WRITTEN_KEY] = frozenset(targets)


def written_attributes(gm: Any) -> FrozenSet[str]:
    """The targets :func:`mark_written` named on ``gm`` (empty when none were)."""
    meta = getattr(gm, "meta", None)
    return meta.get(WRITTEN_KEY, frozenset()) if isinstance(meta, dict) else frozenset()


DTYPE_KEY = "determ_attributes_dtype"
"""``GraphModule.meta`` key: the dtype an eager run reads the graph's float tensor attributes in."""


def read_attributes_in(gm: Any, dtype: Optional[torch.dtype]) -> None:
    """An eager run of ``gm`` reads its float tensor attributes as copies in ``dtype`` (a float64 reference
    whose inputs are float64 then meets no float32 state); None: as they are."""
    meta = getattr(gm, "meta", None)
    if isinstance(meta, dict):
        meta[DTYPE_KEY] = dtype


def attributes_dtype(gm: Any) -> Optional[torch.dtype]:
    """The dtype :func:`read_attributes_in` set on ``gm``, or None."""
    meta = getattr(gm, "meta", None)
    return meta.get(DTYPE_KEY) if isinstance(meta, dict) else None


def attribute_tensors(gm: Any, graph: Any = None) -> Dict[str, torch.Tensor]:
    """The plain tensors of ``gm`` that ``graph`` (default: ``gm``'s) reads with ``get_attr``, by target (one
    target per tensor)."""
    graph = getattr(gm, "graph", None) if graph is None else graph
    out: Dict[str, torch.Tensor] = {}
    if graph is None:
        return out
    seen = set()
    for n in graph.nodes:
        if n.op != "get_attr" or n.target in out:
            continue
        try:
            v = functools.reduce(getattr, str(n.target).split("."), gm)
        except AttributeError:
            continue
        if type(v) in (torch.Tensor, torch.nn.Parameter) and v.layout == torch.strided and id(v) not in seen:
            seen.add(id(v))
            out[str(n.target)] = v
    return out


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter
        return -1


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (NaN payloads and signed zeros count): compared as the integers of their
    element size."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_complex():
        a, b = torch.view_as_real(a.resolve_conj()), torch.view_as_real(b.resolve_conj())
    return torch.equal(same_size_int(a.reshape(-1)), same_size_int(b.reshape(-1)))


Saved = Dict[str, Tuple[torch.Tensor, int]]


class AttributeState:
    """The tensor attributes of a graph module that its calls write, saved and put back.

    The program's first call shows which ones a call writes (its version counter moved, or its bits
    changed); until then every tensor attribute is saved, afterwards only those (often none: then
    :meth:`save` copies nothing).  A tensor written on a later call is watched from the next one on.
    :meth:`restore` writes through ``.data``: the values come back without moving the version counter,
    so autograd does not take the program's own tensors for modified.  ``graph``: whose ``get_attr`` targets
    to look up on ``gm`` (default: ``gm``'s own graph; a compiler may have rewritten that one in place)."""

    def __init__(self, gm: Any, graph: Any = None):
        self.gm = gm
        self.tensors = attribute_tensors(gm, graph)
        self._written: Optional[set] = None  # None until a call was seen
        self._versions = {k: _version(t) for k, t in self.tensors.items()}

    def _watched(self) -> List[str]:
        return list(self.tensors) if self._written is None else sorted(self._written)

    def save(self) -> Saved:
        """Copies of the watched tensors as they are now (with their version counters)."""
        with torch.no_grad():
            return {k: (self.tensors[k].detach().clone(), _version(self.tensors[k])) for k in self._watched()}

    def changed(self, saved: Saved) -> List[str]:
        """The saved tensors whose values differ from the saved copies now."""
        return [k for k, (c, _) in saved.items() if not same_bits(self.tensors[k].detach(), c)]

    def restore(self, saved: Saved) -> None:
        """The saved values back, where they differ."""
        with torch.no_grad():
            for k in self.changed(saved):
                self.tensors[k].data.copy_(saved[k][0])

    def learn(self, saved: Saved) -> List[str]:
        """After a program's call that started from ``saved``: the tensors it wrote are watched from now on
        (and named on the graph, :func:`mark_written`).  Returns them."""
        written = set(self.changed(saved))
        written.update(k for k, (_, v) in saved.items() if _version(self.tensors[k]) != v)
        written.update(k for k, t in self.tensors.items() if k not in saved and _version(t) != self._versions[k])
        self._versions = {k: _version(t) for k, t in self.tensors.items()}
        self._written = written if self._written is None else self._written | written
        mark_written(self.gm, sorted(self._written))
        return sorted(written)
