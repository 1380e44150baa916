"""Eager dispatch modes: ``HashMode``, ``HashDebugTrace`` and ``BitwiseEquivalenceMode``.

The modes themselves are :mod:`.core`; per-op records (:mod:`._record`), batched
fingerprints (:mod:`._hashing`), the bitwise re-run (:mod:`._bitwise`), op and
caller facts shared with the observer (:mod:`.ops`) and the human-readable log
(:mod:`.log`) are its parts.
"""

from determ_backend.modes.core import (BitwiseEquivalenceMode, HashDebugTrace, HashMode, read_hash_log,
                                       read_hash_log_file)

__all__ = ["HashMode", "HashDebugTrace", "BitwiseEquivalenceMode", "read_hash_log", "read_hash_log_file"]
