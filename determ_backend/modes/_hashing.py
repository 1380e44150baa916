"""Fingerprints of the tensors the eager modes record, captured at once and resolved in batches.

:meth:`PendingHashes.add` does the per-tensor device work immediately (the tensor
may be mutated by the very next op) through the package's one batcher,
:class:`determ_backend.fingerprint.core.FingerprintBatch` (``"exact"`` statistics);
:meth:`PendingHashes.resolve` finishes it with a constant number of ops and one host
transfer per device, and fills ``Record.hash`` / ``Record.stats``.  This module owns
which fingerprint a record gets (its own, its source's, or one derived for a view);
the recording of ops is :mod:`determ_backend.modes._record`'s.

Outputs that hold exactly an input's values (``clone``, ``copy_``, same-dtype
``_to_copy``, ``detach``, a view with the same layout) take that input's
fingerprint, which is their own: the fingerprint depends on dtype, shape and
elements only.  Other views (``t``, ``expand``, ``slice``...) hold no new values,
so their hash is *derived* on the host from the base's hash and the view geometry
instead of re-reading memory: equal bases and geometry give equal hashes, any
change to the base changes it.  Such records carry ``extra["derived_hash"] = True``
(the value is not the fingerprint of the view's elements, so it is comparable only
with another derived hash).

Fingerprinting runs below every dispatch mode (:func:`~determ_backend.modes.ops.unseen`):
an outer mode (nested eager tools) does not record it as the user's ops.
"""

from __future__ import annotations

import functools
import hashlib
from typing import List, Optional

import torch

from determ_backend.fingerprint.core import FingerprintBatch
from determ_backend.modes.ops import unseen
from determ_backend.trace.stream import Record, format_hash

__all__ = ["PendingHashes", "hashable", "derived_hash", "view_geometry"]


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def hashable(t: torch.Tensor) -> Optional[str]:
    """None if ``t`` can be fingerprinted, else why not.  (Called for every recorded tensor: the common case
    is three cheap attribute checks.)"""
    if type(t) in _PLAIN and t.layout is torch.strided and not t.is_meta and not t.is_nested:
        return None
    return "nested" if t.is_nested else f"{t.layout}/{t.device.type}/{type(t).__name__}"


@functools.lru_cache(maxsize=4096)
def _geometry_text(geometry: tuple) -> str:
    """A view geometry's text in the digest (a step repeats its views)."""
    return f"|{geometry}"


def derived_hash(base_hash: Optional[str], geometry: tuple) -> Optional[str]:
    if base_hash is None:
        return None
    digest = hashlib.blake2b(f"view|{base_hash}{_geometry_text(geometry)}".encode(), digest_size=8).digest()
    return format_hash(int.from_bytes(digest, "little"))


def view_geometry(out: torch.Tensor, base: torch.Tensor) -> tuple:
    """Everything that determines a view's elements given its base's elements."""
    return (str(base.dtype), tuple(base.shape), base.stride(), str(out.dtype), tuple(out.shape), out.stride(),
            out.storage_offset() * out.element_size() - base.storage_offset() * base.element_size())


class PendingHashes:
    """Records waiting for their fingerprints."""

    def __init__(self, stats: bool = False):
        self.stats = stats
        self._batch = FingerprintBatch("exact" if stats else None)
        # (Record, position in the batch) | (Record, source Record) | (Record, base Record, view geometry)
        self._items: List[tuple] = []
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def on_host(self) -> bool:
        """True when resolving the pending records waits on no device (see :attr:`FingerprintBatch.on_host`)."""
        return self._batch.on_host

    def add(self, rec: Record, t) -> None:
        """Capture ``t`` (a tensor, or a Python scalar an op returned) for ``rec``."""
        if isinstance(t, torch.Tensor):  # most tensors: read now by the native kernel, no torch op to hide
            i = self._batch.add_now(t)
            if i is not None:
                self._items.append((rec, i))
                self.nbytes += t.nbytes
                return
        with unseen():
            self._add(rec, t)

    def _add(self, rec: Record, t) -> None:
        if not isinstance(t, torch.Tensor):
            t = torch.tensor(t, dtype=torch.float64 if isinstance(t, float) else None)
        self._items.append((rec, self._batch.add(t)))  # the batch detaches what it keeps; the native path reads now
        self.nbytes += t.nbytes

    def add_same(self, rec: Record, src: Record) -> None:
        """``rec`` holds the same logical values (dtype, shape, elements) as ``src``: same fingerprint."""
        self._items.append((rec, src))

    def add_view(self, rec: Record, base: Record, out: torch.Tensor, base_tensor: torch.Tensor) -> None:
        rec.extra = dict(rec.extra or {}, derived_hash=True)
        self._items.append((rec, base, view_geometry(out, base_tensor)))

    def resolve(self) -> None:
        """Fill ``hash`` (and ``stats``) of every pending record, in capture order."""
        with unseen():
            self._resolve()

    def _resolve(self) -> None:
        items, self._items = self._items, []
        self.nbytes = 0
        host = self._batch.resolve()
        for it in items:
            rec = it[0]
            if len(it) == 3:
                rec.hash = derived_hash(it[1].hash, it[2])
            elif isinstance(it[1], Record):
                rec.hash, rec.stats = it[1].hash, it[1].stats
            else:
                h, st = host[it[1]]
                rec.hash = format_hash(h)
                if self.stats:
                    rec.stats = st
