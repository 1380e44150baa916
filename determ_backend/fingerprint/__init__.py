"""Tensor fingerprints: one 64-bit, order-aware, bitwise hash plus cheap statistics.

Owns the hash, the statistics and the one batcher every producer uses (the compile
backends' recorder, the eager modes, the API dump): :class:`FingerprintBatch`, in
:mod:`.core`.  The numbers that define the hash: :mod:`._words`; the kernels behind
it: :mod:`._native` (the one-pass CPU kernel) and :mod:`._triton` (GPU).
Comparing fingerprints is :mod:`determ_backend.compare`'s job.
"""

from determ_backend.fingerprint.core import (ROW_WORDS, STATS_KINDS, FingerprintBatch, HashBatch, fingerprint_now,
                                             fingerprint_tensors, hash_tensor, hash_tensors, tensor_stats)

__all__ = ["hash_tensor", "hash_tensors", "tensor_stats", "fingerprint_tensors", "fingerprint_now", "FingerprintBatch",
           "HashBatch", "STATS_KINDS", "ROW_WORDS"]
