"""Overflow check: the first API whose output holds nan/inf while its inputs are finite
(the creation rule of :mod:`determ_backend.compare.nonfinite`, shared with ``DETERM_CHECK=nan``).

Works on any device: finiteness is :func:`determ_backend.compare.nonfinite.nonfinite`
(``aminmax``, one host transfer per device).  After
``overflow_nums`` overflows the check raises :class:`DumpOverflowError`, which
stops training as ptdbg does (``overflow_nums=-1``: never stop).

Recording of the overflowing call lives in :mod:`.hooks`.
"""

from __future__ import annotations

from typing import Optional, Tuple

from determ_backend.errors import ConfigError, DetermError

__all__ = ["DumpOverflowError", "OverflowCounter"]


class DumpOverflowError(DetermError, ValueError):
    """The overflow check found ``overflow_nums`` overflowing APIs and stops the run."""


def check_overflow_nums(value, what: str = "register_hook: overflow_nums") -> int:
    """``value`` when it is a valid ``overflow_nums`` (an int >= 1, or -1: never stop), else a one-line ConfigError
    naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        raise ConfigError(f"{what}={value!r}; expected an int >= 1 (overflowing APIs before the run stops) or -1 "
                          f"(never stop)")
    return value


class OverflowCounter:
    """Counts overflows and tells when to stop."""

    def __init__(self, overflow_nums: int):
        self.limit = check_overflow_nums(overflow_nums)
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
