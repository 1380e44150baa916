"""Fingerprints of the tensors the eager modes record, captured at once and resolved in batches.

:meth:`PendingHashes.add` does the per-tensor device work immediately (the tensor
may be mutated by the very next op) through :class:`determ_backend.fingerprint.core.HashBatch`;
:meth:`PendingHashes.resolve` finishes every batch with a constant number of ops and
one host transfer per device, and fills ``Record.hash`` / ``Record.stats``.

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

import hashlib
from typing import Dict, List, Optional

import torch

from determ_backend.fingerprint import core as _fp
from determ_backend.modes.ops import unseen
from determ_backend.trace.stream import Record, format_hash

__all__ = ["PendingHashes", "hashable", "derived_hash"]


def hashable(t: torch.Tensor) -> Optional[str]:
    """None if ``t`` can be fingerprinted, else why not."""
    if t.layout != torch.strided or t.device.type == "meta" or type(t) not in (torch.Tensor, torch.nn.Parameter):
        return f"{t.layout}/{t.device.type}/{type(t).__name__}"
    return None


def derived_hash(base_hash: Optional[str], geometry: tuple) -> Optional[str]:
    if base_hash is None:
        return None
    digest = hashlib.blake2b(f"view|{base_hash}|{geometry}".encode(), digest_size=8).digest()
    return format_hash(int.from_bytes(digest, "little"))


def view_geometry(out: torch.Tensor, base: torch.Tensor) -> tuple:
    """Everything that determines a view's elements given its base's elements."""
    return (str(base.dtype), tuple(base.shape), base.stride(), str(out.dtype), tuple(out.shape), out.stride(),
            out.storage_offset() * out.element_size() - base.storage_offset() * base.element_size())


class PendingHashes:
    """Records waiting for their fingerprints."""

    def __init__(self, stats: bool = False):
        self.stats = stats
        self._batches: Dict[torch.device, "_fp.HashBatch"] = {}
        # (Record, device, index, stats vector) | (Record, source Record) | (Record, base Record, view geometry)
        self._items: List[tuple] = []
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def add(self, rec: Record, t) -> None:
        """Capture ``t`` (a tensor, or a Python scalar an op returned) for ``rec``."""
        with unseen():
            self._add(rec, t)

    def _add(self, rec: Record, t) -> None:
        if not isinstance(t, torch.Tensor):
            t = torch.tensor(t, dtype=torch.float64 if isinstance(t, float) else None)
        t = t.detach()
        batch = self._batches.get(t.device)
        if batch is None:
            batch = self._batches[t.device] = _fp.HashBatch(t.device)
        nat = _fp.fingerprint_now(t, self.stats) if t.device.type == "cpu" else None  # one pass, now
        idx = batch.add(t, known=None if nat is None else nat[0])
        if not self.stats:
            s = None
        elif nat is not None:
            s = torch.tensor(nat[1], dtype=torch.float64)
        else:
            s = _fp._stats_vector(t)
        self._items.append((rec, t.device, idx, s))
        self.nbytes += t.numel() * t.element_size()

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
        batches, self._batches = self._batches, {}
        items, self._items = self._items, []
        self.nbytes = 0
        host: Dict[torch.device, tuple] = {}
        for dev, batch in batches.items():
            idx = [k for k, it in enumerate(items) if len(it) == 4 and it[1] == dev]
            hs = batch.finish().cpu().tolist()
            ss = torch.stack([items[k][3] for k in idx]).cpu().tolist() if self.stats and idx else None
            host[dev] = (hs, {k: j for j, k in enumerate(idx)}, ss)
        for k, it in enumerate(items):
            rec = it[0]
            if len(it) == 2:
                rec.hash, rec.stats = it[1].hash, it[1].stats
                continue
            if len(it) == 3:
                rec.hash = derived_hash(it[1].hash, it[2])
                continue
            hs, pos, ss = host[it[1]]
            rec.hash = format_hash(hs[it[2]])
            if ss is not None:
                rec.stats = _fp._stats_dict(ss[pos[k]])
