"""The fingerprint's definition in numbers: word layout, row weights, mixing, key.

Owns what both routes to a fingerprint must agree on bit for bit -- the torch
path in :mod:`determ_backend.fingerprint.core` and the Triton kernel in
:mod:`determ_backend.fingerprint._triton`: ``ROW_WORDS``, the row weights ``K``,
the 64-bit mixing function, the dtype/shape key, how a tensor's logical bytes
become int32 words, and the final combination of row sums into one value per
tensor.  The algorithm itself is described in :mod:`~determ_backend.fingerprint.core`,
which also owns the row sums, the batchers and the statistics.

Private to the fingerprint package: both modules import this one and never each
other at import time.
"""

from __future__ import annotations

import functools
import hashlib
from typing import List

import torch

from determ_backend import _torch_compat as _compat
from determ_backend.errors import UnsupportedDtypeError

__all__ = ["ROW_WORDS", "MASK64", "GOLDEN", "signed", "py_fmix", "fmix", "row_weights", "key", "check_tensor",
           "same_size_int", "words", "finish"]

ROW_WORDS = 4096
"""Words (int32) per row; part of the definition of the hash, never change it."""

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xFF51AFD7ED558CCD
_M2 = 0xC4CEB9FE1A85EC53


def signed(v: int) -> int:
    """``v`` modulo 2**64 as a signed int64 value."""
    v &= MASK64
    return v - (1 << 64) if v >= (1 << 63) else v


def py_fmix(v: int) -> int:
    """The 64-bit finalizer (murmur3's fmix64) on a Python int."""
    v &= MASK64
    v ^= v >> 33
    v = (v * _M1) & MASK64
    v ^= v >> 33
    v = (v * _M2) & MASK64
    v ^= v >> 33
    return v


def _lsr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of an int64 tensor (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def fmix(x: torch.Tensor) -> torch.Tensor:
    """:func:`py_fmix` elementwise on an int64 tensor (wrapping arithmetic)."""
    x = x ^ _lsr(x, 33)
    x = x * signed(_M1)
    x = x ^ _lsr(x, 33)
    x = x * signed(_M2)
    return x ^ _lsr(x, 33)


@functools.lru_cache(maxsize=None)
def _host_weights() -> torch.Tensor:
    low_mask = (1 << 33) - 1
    vals = []
    for c in range(ROW_WORDS):
        high = py_fmix(c + GOLDEN) & ~low_mask
        low = ((2 * c + 1) * (_M1 | 1)) & low_mask  # odd, distinct mod 2**33
        vals.append(signed(high | low))
    with _compat.unobserved():  # cached: never a torch.func wrapper, never an op of the user's
        return torch.tensor(vals, dtype=torch.int64)


@functools.lru_cache(maxsize=16)
def row_weights(device: str) -> torch.Tensor:
    """The ``K`` vector of step 2 on ``device`` (cached per device; made where no user mode sees it and no
    ``torch.func`` transform wraps it)."""
    with _compat.unobserved():
        return _host_weights().to(device)


@functools.lru_cache(maxsize=4096)
def key(dtype: torch.dtype, shape: tuple, extra: str = "") -> int:
    """Step 4's key of a dtype and shape (a tuple or a ``torch.Size``: they hash and compare alike; ``extra``:
    the quantizer of a quantized tensor), signed int64."""
    digest = hashlib.blake2b(f"{dtype}|{tuple(shape)}{extra}".encode(), digest_size=8).digest()
    return signed(int.from_bytes(digest, "little"))


def check_tensor(t, what: str = "hash_tensor") -> None:
    """Raise :class:`UnsupportedDtypeError` unless ``t`` is a tensor with data (not on ``meta``)."""
    if not isinstance(t, torch.Tensor):
        raise UnsupportedDtypeError(f"{what} expects a torch.Tensor, got {type(t).__name__}")
    if t.device.type == "meta":
        raise UnsupportedDtypeError(f"{what}: a tensor on the 'meta' device has no data to fingerprint "
                                    f"(dtype {t.dtype}, shape {tuple(t.shape)})")


def same_size_int(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as the integer dtype of its element size (any strides), or ``t`` if none."""
    size = t.element_size()
    for d in (torch.uint8, torch.int16, torch.int32, torch.int64):
        if d.itemsize == size:
            return t if t.dtype == d else t.view(d)
    return t


def materialized(t: torch.Tensor) -> torch.Tensor:
    """``t``, or for a ZeroTensor (forward-mode AD's stand-in for a missing tangent, no memory behind it: its kernels
    and a read of its null data pointer crash) the zeros it stands for."""
    return torch.zeros(t.shape, dtype=t.dtype, device=t.device) if _compat.is_zero_tensor(t) else t


def _logical_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's logical elements as a flat contiguous uint8 tensor."""
    if t.layout != torch.strided:
        raise UnsupportedDtypeError(f"cannot fingerprint a tensor with layout {t.layout}; expected torch.strided")
    t = materialized(t.detach())
    if t.is_quantized:
        t = t.int_repr()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = same_size_int(t)  # copying ints works for every dtype, storage-only ones included
    flat = t.contiguous().reshape(-1)
    try:
        return flat.view(torch.uint8)
    except RuntimeError:
        try:
            return flat.clone().view(torch.uint8)
        except RuntimeError as e:
            raise UnsupportedDtypeError(f"cannot fingerprint dtype {t.dtype}: {e}") from None


def words(t: torch.Tensor) -> torch.Tensor:
    """The logical bytes as a flat int32 tensor; a partial last word is zero-padded."""
    if (t.layout == torch.strided and t.element_size() in (4, 8, 16) and t.is_contiguous()
            and not (t.is_quantized or t.is_conj() or t.is_neg() or _compat.is_zero_tensor(t))):
        return t.detach().reshape(-1).view(torch.int32)  # common case: already whole aligned words
    b = _logical_bytes(t)
    n = b.numel()
    if b.storage_offset() % 4:
        b = b.clone()
    n4, tail = divmod(n, 4)
    w = b[: n4 * 4].view(torch.int32)
    if tail:
        pad = torch.zeros(4, dtype=torch.uint8, device=b.device)
        pad[:tail] = b[n4 * 4:]
        w = torch.cat([w, pad.view(torch.int32)])
    return w


def finish(sums: torch.Tensor, rowpos: torch.Tensor, seg: torch.Tensor, keys: List[int], device) -> torch.Tensor:
    """Steps 3-4: combine row sums into one int64 fingerprint per tensor (device-side, no sync).

    ``sums[j]`` is row ``rowpos[j]`` of tensor ``seg[j]``; ``keys[i]`` is tensor ``i``'s key."""
    acc = torch.zeros(len(keys), dtype=torch.int64, device=device)
    if sums.numel():
        mixed = fmix(sums ^ fmix((rowpos + 1) * signed(GOLDEN)))
        acc.index_add_(0, seg, mixed)
    return fmix(acc ^ torch.tensor(keys, dtype=torch.int64, device=device))
