"""Tensor fingerprints: a 64-bit, order-aware, bitwise hash plus cheap statistics.

The fingerprint is a function of (dtype, shape, logical bits) only: strides,
storage offset and device do not enter it, so the same values hash the same in
another process or on another device.  It is computed on the tensor's own device
with torch ops (no copy of the data to the host); :func:`hash_tensors` does one
host sync per device for a whole batch.

Algorithm (every step exact integer arithmetic, so any reduction order and any
backend -- torch CPU, torch on an accelerator, the Triton kernel in
:mod:`determ_backend.fingerprint._triton` -- gives the same bits):

1. the logical bytes, zero-padded to whole 32-bit words, are laid out as rows of
   ``ROW_WORDS`` int32 words;
2. each row is reduced to ``S_r = sum_c word[r, c] * K[c]  (mod 2**64)`` where
   ``K[c]`` are odd 64-bit constants whose low 33 bits are pairwise distinct.
   A change confined to one row (any bit flip, any swap of two words) therefore
   always changes ``S_r``;
3. rows are combined non-linearly: ``H = sum_r fmix64(S_r ^ P_r)`` with a
   position constant ``P_r``, so moving data between rows changes ``H``;
4. the result is ``fmix64(H ^ key(dtype, shape))``; a quantized tensor is hashed
   through its integer representation and its key also holds its quantizer
   (scheme, scale(s), zero point(s)), which is part of its value.

The dtype/shape key is hashed on the host (it is metadata, not data).
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from determ_backend.fingerprint import _native
from determ_backend.errors import UnsupportedDtypeError

__all__ = ["hash_tensor", "hash_tensors", "tensor_stats", "fingerprint_tensors", "fingerprint_now", "ROW_WORDS"]

ROW_WORDS = 4096
"""Words (int32) per row; part of the definition of the hash, never change it."""

_BLOCK_ROWS = 64  # rows reduced per kernel call on the torch path (cache-sized)
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xFF51AFD7ED558CCD
_M2 = 0xC4CEB9FE1A85EC53


def _signed(v: int) -> int:
    v &= _MASK64
    return v - (1 << 64) if v >= (1 << 63) else v


def _py_fmix(v: int) -> int:
    v &= _MASK64
    v ^= v >> 33
    v = (v * _M1) & _MASK64
    v ^= v >> 33
    v = (v * _M2) & _MASK64
    v ^= v >> 33
    return v


def _lsr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of an int64 tensor (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _fmix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _lsr(x, 33)
    x = x * _signed(_M1)
    x = x ^ _lsr(x, 33)
    x = x * _signed(_M2)
    return x ^ _lsr(x, 33)


@functools.lru_cache(maxsize=None)
def _host_weights() -> torch.Tensor:
    low_mask = (1 << 33) - 1
    vals = []
    for c in range(ROW_WORDS):
        high = _py_fmix(c + _GOLDEN) & ~low_mask
        low = ((2 * c + 1) * (_M1 | 1)) & low_mask  # odd, distinct mod 2**33
        vals.append(_signed(high | low))
    return torch.tensor(vals, dtype=torch.int64)


@functools.lru_cache(maxsize=16)
def row_weights(device: str) -> torch.Tensor:
    """The ``K`` vector of step 2 on ``device`` (cached per device)."""
    return _host_weights().to(device)


@functools.lru_cache(maxsize=4096)
def _key(dtype: torch.dtype, shape: tuple, extra: str = "") -> int:
    digest = hashlib.blake2b(f"{dtype}|{shape}{extra}".encode(), digest_size=8).digest()
    return _signed(int.from_bytes(digest, "little"))


def _quantizer(t: torch.Tensor) -> str:
    """A quantized tensor's value depends on its quantizer, so that enters the key ("" otherwise)."""
    if not t.is_quantized:
        return ""
    scheme = t.qscheme()
    if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        return f"|{scheme}|{t.q_scale()!r}|{t.q_zero_point()}"
    return (f"|{scheme}|{t.q_per_channel_axis()}|{t.q_per_channel_scales().tolist()!r}"
            f"|{t.q_per_channel_zero_points().tolist()!r}")


def _tensor_key(t: torch.Tensor) -> int:
    """Step 4's key: dtype and shape (and the quantizer of a quantized tensor)."""
    return _key(t.dtype, tuple(t.shape), _quantizer(t))


def _check_tensor(t, what: str = "hash_tensor") -> None:
    if not isinstance(t, torch.Tensor):
        raise UnsupportedDtypeError(f"{what} expects a torch.Tensor, got {type(t).__name__}")
    if t.device.type == "meta":
        raise UnsupportedDtypeError(f"{what}: a tensor on the 'meta' device has no data to fingerprint "
                                    f"(dtype {t.dtype}, shape {tuple(t.shape)})")


def _same_size_int(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as the integer dtype of its element size (any strides), or ``t`` if none."""
    size = t.element_size()
    for d in (torch.uint8, torch.int16, torch.int32, torch.int64):
        if d.itemsize == size:
            return t if t.dtype == d else t.view(d)
    return t


def _logical_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's logical elements as a flat contiguous uint8 tensor."""
    if t.layout != torch.strided:
        raise UnsupportedDtypeError(f"cannot fingerprint a tensor with layout {t.layout}; expected torch.strided")
    t = t.detach()
    if t.is_quantized:
        t = t.int_repr()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = _same_size_int(t)  # copying ints works for every dtype, storage-only ones included
    flat = t.contiguous().reshape(-1)
    try:
        return flat.view(torch.uint8)
    except RuntimeError:
        try:
            return flat.clone().view(torch.uint8)
        except RuntimeError as e:
            raise UnsupportedDtypeError(f"cannot fingerprint dtype {t.dtype}: {e}") from None


def _words(t: torch.Tensor) -> torch.Tensor:
    """The logical bytes as a flat int32 tensor; a partial last word is zero-padded."""
    if (t.layout == torch.strided and t.element_size() in (4, 8, 16) and t.is_contiguous()
            and not (t.is_quantized or t.is_conj() or t.is_neg())):
        return t.detach().reshape(-1).view(torch.int32)  # common case: already whole aligned words
    b = _logical_bytes(t)
    n = b.numel()
    if b.storage_offset() % 4:
        b = b.clone()
    n4, tail = divmod(n, 4)
    words = b[: n4 * 4].view(torch.int32)
    if tail:
        pad = torch.zeros(4, dtype=torch.uint8, device=b.device)
        pad[:tail] = b[n4 * 4:]
        words = torch.cat([words, pad.view(torch.int32)])
    return words


def _row_sums_torch(rows: torch.Tensor, k: torch.Tensor, out: torch.Tensor) -> None:
    r = rows.shape[0]
    scratch = torch.empty(min(r, _BLOCK_ROWS), ROW_WORDS, dtype=torch.int64, device=rows.device)
    for r0 in range(0, r, _BLOCK_ROWS):
        blk = rows[r0: r0 + _BLOCK_ROWS]
        s = scratch[: blk.shape[0]]
        s.copy_(blk)  # widen first: int32 * int64 with type promotion is ~10x slower on CPU
        if s.device.type == "cpu":  # one fused pass (wrapping int64 dot products, as mul_ + sum)
            torch.mv(s, k, out=out[r0: r0 + blk.shape[0]])
        else:
            s.mul_(k)
            torch.sum(s, 1, out=out[r0: r0 + blk.shape[0]])


def _row_sums(rows: torch.Tensor, k: torch.Tensor, out: torch.Tensor) -> None:
    """``out[r] = sum_c rows[r, c] * k[c]`` (wrapping int64) for an (R, ROW_WORDS) int32 tensor."""
    if rows.device.type == "cuda" and rows.shape[0] > _BLOCK_ROWS:
        from determ_backend.fingerprint import _triton as _fingerprint_triton

        if _fingerprint_triton.available():
            _fingerprint_triton.row_sums(rows, k, out)
            return
    _row_sums_torch(rows, k, out)


def _segment_sums(words: List[torch.Tensor], k: torch.Tensor) -> torch.Tensor:
    """Row sum of each short (<= ROW_WORDS) word vector, batched into a constant number of ops."""
    dev = k.device
    lengths = torch.tensor([w.numel() for w in words], device=dev)
    flat = torch.cat(words)
    starts = torch.cumsum(lengths, 0) - lengths
    seg = torch.repeat_interleave(torch.arange(len(words), device=dev), lengths)
    pos = torch.arange(flat.numel(), device=dev) - starts[seg]
    out = torch.zeros(len(words), dtype=torch.int64, device=dev)
    return out.index_add_(0, seg, flat * k[pos])


def _finish(sums: torch.Tensor, rowpos: torch.Tensor, seg: torch.Tensor, keys: List[int], device) -> torch.Tensor:
    """Combine row sums into one int64 fingerprint per tensor (device-side, no sync)."""
    acc = torch.zeros(len(keys), dtype=torch.int64, device=device)
    if sums.numel():
        mixed = _fmix(sums ^ _fmix((rowpos + 1) * _signed(_GOLDEN)))
        acc.index_add_(0, seg, mixed)
    return _fmix(acc ^ torch.tensor(keys, dtype=torch.int64, device=device))


def fingerprint_now(t: torch.Tensor, stats: bool = False) -> Optional[Tuple[int, Optional[List[float]]]]:
    """CPU fast path: ``(hash, stats vector | None)`` of ``t`` computed right now in one pass by the
    native kernel (:mod:`determ_backend.fingerprint._native`), or None when it does not apply (not a plain CPU
    tensor, kernel not built, or statistics asked for a dtype it has none for) -- then use the
    torch path, which gives the same hash.  The stats vector is ``[min, max, mean, l2, nan, inf,
    numel]`` as :func:`tensor_stats` reports it (sums accumulated in float64)."""
    if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized or t.is_conj() or t.is_neg():
        return None
    if stats and t.dtype not in _native.SUPPORTED:
        return None
    x = t.detach()
    if not x.is_contiguous():  # statistics need the dtype; the hash only the bytes (any dtype copies as ints)
        x = x.contiguous() if stats else _same_size_int(x).contiguous()
    res = _native.fingerprint(x, row_weights("cpu"), _tensor_key(t), stats)
    if res is None or not stats:
        return res
    h, (mn, mx, total, sq, nan, inf) = res
    n = x.numel()
    if n == 0:
        return h, [math.nan, math.nan, math.nan, 0.0, 0.0, 0.0, 0.0]
    return h, [mn, mx, total / n, math.nan if nan else math.sqrt(sq), nan, inf, float(n)]


def _hash_one_device(tensors: Sequence[torch.Tensor], device) -> torch.Tensor:
    k = row_weights(str(device))
    small_words, small_ix = [], []
    parts_s, parts_p, parts_g = [], [], []
    native: Dict[int, int] = {}
    for i, t in enumerate(tensors):
        nat = fingerprint_now(t) if device.type == "cpu" else None
        if nat is not None:
            native[i] = nat[0]
            continue
        w = _words(t)
        n = w.numel()
        if n == 0:
            continue
        if n <= ROW_WORDS:
            small_words.append(w)
            small_ix.append(i)
            continue
        full_rows = n // ROW_WORDS
        rem = n - full_rows * ROW_WORDS
        sums = torch.empty(full_rows + (rem > 0), dtype=torch.int64, device=device)
        _row_sums(w[: full_rows * ROW_WORDS].view(full_rows, ROW_WORDS), k, sums[:full_rows])
        if rem:
            torch.sum(w[full_rows * ROW_WORDS:] * k[:rem], 0, out=sums[full_rows])
        parts_s.append(sums)
        parts_p.append(torch.arange(sums.numel(), device=device))
        parts_g.append(torch.full((sums.numel(),), i, dtype=torch.int64, device=device))
    if small_words:
        parts_s.append(_segment_sums(small_words, k))
        parts_p.append(torch.zeros(len(small_ix), dtype=torch.int64, device=device))
        parts_g.append(torch.tensor(small_ix, dtype=torch.int64, device=device))
    if len(native) == len(tensors):  # all done in native passes: nothing left to combine
        return torch.tensor([_signed(v) for v in native.values()], dtype=torch.int64)
    keys = [_tensor_key(t) for t in tensors]
    if not parts_s:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return _with_native(_finish(empty, empty, empty, keys, device), native)
    cat = (lambda xs: torch.cat(xs) if len(xs) > 1 else xs[0])
    return _with_native(_finish(cat(parts_s), cat(parts_p), cat(parts_g), keys, device), native)


def _with_native(res: torch.Tensor, native: Dict[int, int]) -> torch.Tensor:
    """``res`` with the fingerprints the native kernel already computed written in."""
    if native:
        res[torch.tensor(list(native), dtype=torch.int64)] = torch.tensor([_signed(v) for v in native.values()],
                                                                          dtype=torch.int64)
    return res


def _hash_groups(tensors: Sequence[torch.Tensor]) -> List[Tuple[List[int], torch.Tensor]]:
    """``[(indices, int64 device vector of their fingerprints)]``, one entry per device (no host sync)."""
    by_dev: Dict[torch.device, List[int]] = {}
    for i, t in enumerate(tensors):
        _check_tensor(t)
        by_dev.setdefault(t.device, []).append(i)
    return [(idx, _hash_one_device([tensors[i] for i in idx], dev)) for dev, idx in by_dev.items()]


def _hash_device_values(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """One int64 device scalar per tensor (no host sync)."""
    result: List[Optional[torch.Tensor]] = [None] * len(tensors)
    for idx, vals in _hash_groups(tensors):
        for j, i in enumerate(idx):
            result[i] = vals[j]
    return result  # type: ignore[return-value]


def hash_tensors(tensors: Iterable[torch.Tensor]) -> List[int]:
    """Fingerprints of many tensors, with one host sync per device at the end."""
    tensors = list(tensors)
    out = [0] * len(tensors)
    for idx, vals in _hash_groups(tensors):
        for i, v in zip(idx, vals.cpu().tolist()):
            out[i] = v & _MASK64
    return out


_ROW0 = _py_fmix(_GOLDEN)  # step 3's position term of row 0: fmix((0 + 1) * GOLDEN)


def hash_tensor(t: torch.Tensor) -> int:
    """64-bit fingerprint in ``[0, 2**64)`` of ``t``'s dtype, shape and logical bits.

    Equal to ``hash_tensors([t])[0]``.  A tensor on the ``meta`` device (no data)
    raises :class:`UnsupportedDtypeError`.
    """
    _check_tensor(t)
    nat = fingerprint_now(t)
    if nat is not None:
        return nat[0]
    if t.numel() * t.element_size() > 4 * ROW_WORDS:
        return hash_tensors([t])[0]
    words = _words(t)
    n = words.numel()
    # One row at most: the same arithmetic as _hash_one_device/_finish, with steps 3-4 on the host.
    acc = 0
    if n:
        acc = _py_fmix(int((words * row_weights(str(words.device))[:n]).sum().item()) ^ _ROW0)
    return _py_fmix(acc ^ _tensor_key(t))


_STAT_KEYS = ("min", "max", "mean", "l2", "nan", "inf")
_NO_ARITHMETIC = frozenset(getattr(torch, name) for name in (
    "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16", "float4_e2m1fn_x2",
    *(f"int{b}" for b in range(1, 8)), *(f"uint{b}" for b in range(1, 8)),
) if isinstance(getattr(torch, name, None), torch.dtype))
"""Storage-only dtypes (bit containers, packed fp4, sub-byte int shells): hashable, but no statistics."""


def _stats_vector(t: torch.Tensor) -> torch.Tensor:
    """Float64 device vector [min, max, mean, l2, nan, inf, numel]."""
    _check_tensor(t, "tensor_stats")
    t = t.detach()
    if t.is_quantized:
        t = t.dequantize()
    n = t.numel()
    dev = t.device
    if n == 0 or t.dtype in _NO_ARITHMETIC:  # numel slot 0 or -1: _stats_dict reports None
        return torch.tensor([math.nan, math.nan, math.nan, 0.0 if n == 0 else math.nan, 0.0, 0.0,
                             0.0 if n == 0 else -1.0], dtype=torch.float64, device=dev)
    if t.is_complex():
        nan = torch.isnan(t).sum()
        inf = torch.isinf(t).sum()
        t = t.abs()
    elif t.is_floating_point():
        if t.element_size() == 1:  # float8 types have few kernels
            t = t.float()
        nan = torch.isnan(t).sum()
        inf = torch.isinf(t).sum()
    else:
        t = t.to(torch.float64) if t.dtype == torch.bool or t.dtype.itemsize < 8 or not t.dtype.is_signed else t
        nan = inf = torch.zeros((), dtype=torch.int64, device=dev)
    mn, mx = torch.aminmax(t.reshape(-1))
    mean = t.sum(dtype=torch.float64) / n
    l2 = torch.linalg.vector_norm(t.to(torch.float64) if not t.is_floating_point() else t, dtype=torch.float64)
    parts = [mn, mx, mean, l2, nan, inf]
    return torch.stack([p.to(torch.float64) for p in parts] + [torch.tensor(float(n), dtype=torch.float64, device=dev)])


def _stats_dict(v: List[float]) -> dict:
    d = dict(zip(_STAT_KEYS, v[:6]))
    d["nan"] = int(d["nan"])
    d["inf"] = int(d["inf"])
    if v[6] <= 0:  # empty (0) or a storage-only dtype (-1)
        d["min"] = d["max"] = d["mean"] = None
    if v[6] < 0:
        d["l2"] = None
    return d


def fingerprint_tensors(tensors: Iterable[torch.Tensor], stats: bool = True) -> List[dict]:
    """``[{"hash": int, **stats}]`` for each tensor; one host sync per device."""
    tensors = list(tensors)
    if not tensors:
        return []
    out: List[dict] = [{} for _ in tensors]
    rest = []
    for i, t in enumerate(tensors):
        _check_tensor(t, "fingerprint_tensors")
        nat = fingerprint_now(t, stats)
        if nat is None:
            rest.append(i)
            continue
        out[i] = {"hash": nat[0], **(_stats_dict(nat[1]) if stats else {})}
    if rest:
        for i, rec in zip(rest, _fingerprint_torch([tensors[i] for i in rest], stats)):
            out[i] = rec
    return out


def _fingerprint_torch(tensors: List[torch.Tensor], stats: bool) -> List[dict]:
    hashes = _hash_device_values(tensors)
    rows: List[torch.Tensor] = []
    for t, h in zip(tensors, hashes):
        parts = [h.to(torch.float64)]  # placeholder slot: the hash travels separately below
        if stats:
            parts.append(_stats_vector(t))
        rows.append(torch.cat([p.reshape(-1) for p in parts]))
    by_dev: Dict[torch.device, List[int]] = {}
    for i, t in enumerate(tensors):
        by_dev.setdefault(t.device, []).append(i)
    out: List[dict] = [{} for _ in tensors]
    for idx in by_dev.values():
        host_h = torch.stack([hashes[i] for i in idx]).cpu().tolist()
        host_s = torch.stack([rows[i] for i in idx]).cpu().tolist() if stats else None
        for j, i in enumerate(idx):
            rec = {"hash": host_h[j] & _MASK64}
            if stats:
                rec.update(_stats_dict(host_s[j][1:]))
            out[i] = rec
    return out


def tensor_stats(t: torch.Tensor) -> dict:
    """``{min, max, mean, l2, nan, inf}`` of ``t`` with float64 accumulation.

    NaNs propagate into min/max/mean/l2 as torch does (their count is in ``nan``);
    complex tensors report statistics of their magnitudes; an empty tensor has
    ``None`` for min/max/mean and 0 for the rest; a storage-only dtype (``bits8``,
    ``float4_e2m1fn_x2``, ``uint4``, ...) has ``None`` for min/max/mean/l2.
    A tensor on the ``meta`` device raises :class:`UnsupportedDtypeError`.
    """
    _check_tensor(t, "tensor_stats")
    nat = fingerprint_now(t, stats=True)
    return _stats_dict(nat[1] if nat is not None else _stats_vector(t).cpu().tolist())


class HashBatch:
    """Fingerprints streamed in one at a time and finished together, for tracers.

    :meth:`add` does the per-tensor work right away (so a buffer may be reused or
    mutated afterwards): small tensors are copied as words, large ones reduced to
    their row sums.  :meth:`finish` then combines everything with a constant
    number of device ops for the whole batch, and returns one int64 device value
    per added tensor (no host sync).  Values equal :func:`hash_tensors`.
    """

    def __init__(self, device) -> None:
        self.device = torch.device(device)
        self._k = row_weights(str(self.device))
        self._keys: List[int] = []
        self._small: List[torch.Tensor] = []
        self._small_ix: List[int] = []
        self._sums: List[torch.Tensor] = []
        self._sums_ix: List[int] = []
        self._native: Dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, t: torch.Tensor, known: Optional[int] = None) -> int:
        """Queue ``t``; returns its index in :meth:`finish`'s result.  ``known``: its fingerprint,
        already computed (by :func:`fingerprint_now`)."""
        _check_tensor(t)
        i = len(self._keys)
        self._keys.append(_tensor_key(t))
        if known is None and self.device.type == "cpu":
            nat = fingerprint_now(t)
            known = None if nat is None else nat[0]
        if known is not None:
            self._native[i] = known
            return i
        w = _words(t)
        n = w.numel()
        if n == 0:
            return i
        if n <= ROW_WORDS:
            self._small.append(w.clone() if w.data_ptr() == t.data_ptr() else w)
            self._small_ix.append(i)
            return i
        full_rows = n // ROW_WORDS
        rem = n - full_rows * ROW_WORDS
        sums = torch.empty(full_rows + (rem > 0), dtype=torch.int64, device=self.device)
        _row_sums(w[: full_rows * ROW_WORDS].view(full_rows, ROW_WORDS), self._k, sums[:full_rows])
        if rem:
            torch.sum(w[full_rows * ROW_WORDS:].to(torch.int64) * self._k[:rem], 0, out=sums[full_rows])
        self._sums.append(sums)
        self._sums_ix.append(i)
        return i

    def finish(self) -> torch.Tensor:
        dev = self.device
        s_parts, p_parts, g_parts = [], [], []
        if self._small:
            s_parts.append(_segment_sums(self._small, self._k))
            p_parts.append(torch.zeros(len(self._small_ix), dtype=torch.int64, device=dev))
            g_parts.append(torch.tensor(self._small_ix, dtype=torch.int64, device=dev))
        if self._sums:
            lengths = torch.tensor([s.numel() for s in self._sums], device=dev)
            starts = torch.cumsum(lengths, 0) - lengths
            s_parts.append(torch.cat(self._sums) if len(self._sums) > 1 else self._sums[0])
            seg_local = torch.repeat_interleave(torch.arange(len(self._sums), device=dev), lengths)
            p_parts.append(torch.arange(s_parts[-1].numel(), device=dev) - starts[seg_local])
            g_parts.append(torch.tensor(self._sums_ix, dtype=torch.int64, device=dev)[seg_local])
        if not s_parts:
            empty = torch.empty(0, dtype=torch.int64, device=dev)
            return _with_native(_finish(empty, empty, empty, self._keys, dev), self._native)
        cat = (lambda xs: torch.cat(xs) if len(xs) > 1 else xs[0])
        return _with_native(_finish(cat(s_parts), cat(p_parts), cat(g_parts), self._keys, dev), self._native)
