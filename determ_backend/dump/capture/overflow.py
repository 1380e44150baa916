"""Overflow check: the first API whose output holds nan/inf while its inputs are finite
(the creation rule of :mod:`determ_backend.compare.nonfinite`, shared with ``DETERM_CHECK=nan``).

Works on any device: finiteness is read from ``aminmax`` (nan and +-inf show up
in the minimum or maximum), one host transfer per batch.  After
``overflow_nums`` overflows the check raises :class:`DumpOverflowError`, which
stops training as ptdbg does (``overflow_nums=-1``: never stop).

Recording of the overflowing call lives in :mod:`.hooks`.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch

from determ_backend.errors import ConfigError, DetermError

__all__ = ["DumpOverflowError", "nonfinite", "OverflowCounter"]


class DumpOverflowError(DetermError, ValueError):
    """The overflow check found ``overflow_nums`` overflowing APIs and stops the run."""


def _float_tensors(ts: Sequence[object]) -> List[torch.Tensor]:
    return [t for t in ts if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
            and t.numel() and t.layout == torch.strided and t.device.type != "meta"]


def nonfinite(tensors: Sequence[object]) -> bool:
    """True when any floating tensor in ``tensors`` holds a nan or inf."""
    ts = _float_tensors(tensors)
    if not ts:
        return False
    rows = []
    for t in ts:
        x = t.detach()
        if x.is_complex():
            x = torch.view_as_real(x)
        if x.element_size() == 1:
            x = x.float()
        mn, mx = torch.aminmax(x.reshape(-1))
        rows.append(torch.stack([mn.double(), mx.double()]))
    by_dev = {}
    for r in rows:
        by_dev.setdefault(r.device, []).append(r)
    for rs in by_dev.values():
        if not all(math.isfinite(v) for v in torch.stack(rs).reshape(-1).cpu().tolist()):
            return True
    return False


class OverflowCounter:
    """Counts overflows and tells when to stop."""

    def __init__(self, overflow_nums: int):
        if isinstance(overflow_nums, bool) or not isinstance(overflow_nums, int) or (overflow_nums < 1 and overflow_nums != -1):
            raise ConfigError(f"register_hook: overflow_nums must be a positive int or -1 (never stop), got {overflow_nums!r}")
        self.limit = overflow_nums
        self.count = 0
        self.enabled = True
        self.first: Optional[Tuple[str, str]] = None
        """``(name, source)`` of the first overflowing call."""

    def hit(self, name: str, source: Optional[str]) -> bool:
        """Count the overflow of call ``name``; True when the run should stop now."""
        self.count += 1
        if self.first is None:
            self.first = (name, source or "?")
        return self.limit != -1 and self.count >= self.limit

    def stop_error(self, name: str, source: Optional[str], index_path: object) -> DumpOverflowError:
        """The error that stops the run at the overflow of ``name`` (the last one counted)."""
        first, first_src = self.first or (name, source or "?")
        msg = f"[overflow {self.count} times]: first overflowing API {first} at {first_src}"
        if self.count > 1:
            msg += f"; overflow_nums={self.limit} reached at {name} at {source or '?'}"
        return DumpOverflowError(f"{msg}; dump file is saved in '{index_path}'")
