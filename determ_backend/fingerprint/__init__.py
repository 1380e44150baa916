"""Tensor fingerprints: one 64-bit, order-aware, bitwise hash plus cheap statistics.

Owns the hash, the statistics and the one batcher every producer uses (the compile
backends' recorder, the eager modes, the API dump): :mod:`.core`.  The kernels
behind it: :mod:`._native` (the one-pass CPU kernel) and :mod:`._triton` (GPU).
Comparing fingerprints is :mod:`determ_backend.compare`'s job.
"""

from determ_backend.fingerprint.core import (ROW_WORDS, fingerprint_now, fingerprint_tensors, hash_tensor, hash_tensors,
                                             tensor_stats)

__all__ = ["hash_tensor", "hash_tensors", "tensor_stats", "fingerprint_tensors", "fingerprint_now", "ROW_WORDS"]
