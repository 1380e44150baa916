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

This module owns the hash API, the row sums (step 2), the batchers and the
statistics: :class:`HashBatch` streams one device's tensors into one finish, and
:class:`FingerprintBatch` -- the one batcher of hashes *and* statistics, used by
the compile backends' recorder, the eager modes, the API dump and
:func:`fingerprint_tensors` -- resolves many tensors on any devices with one host
transfer per device.  The numbers that define the hash (word layout, row weights,
mixing, key) live in :mod:`determ_backend.fingerprint._words`, shared with the
Triton row-sum kernel (:mod:`determ_backend.fingerprint._triton`); the one-pass
CPU kernel is :mod:`determ_backend.fingerprint._native`.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from determ_backend import _torch_compat as _compat
from determ_backend.fingerprint import _native
from determ_backend.fingerprint._words import (GOLDEN, MASK64, ROW_WORDS, check_tensor, finish, key, materialized,
                                               py_fmix,
                                               row_weights, same_size_int, signed, words)

__all__ = ["hash_tensor", "hash_tensors", "tensor_stats", "fingerprint_tensors", "fingerprint_now", "HashBatch",
           "FingerprintBatch", "STATS_KINDS", "row_weights", "ROW_WORDS"]

_STRIDED = torch.strided
_is_zero = _compat.is_zero_tensor
_BLOCK_ROWS = 64  # rows reduced per kernel call on the torch path (cache-sized)


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
    return key(t.dtype, t.shape, _quantizer(t)) if t.is_quantized else key(t.dtype, t.shape)


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
        from determ_backend.fingerprint import _triton as _fingerprint_triton  # imports triton: only when needed

        if _fingerprint_triton.available():
            _fingerprint_triton.row_sums(rows, k, out)
            return
    _row_sums_torch(rows, k, out)


def _segment_sums(word_lists: List[torch.Tensor], k: torch.Tensor) -> torch.Tensor:
    """Row sum of each short (<= ROW_WORDS) word vector, batched into a constant number of ops."""
    dev = k.device
    lengths = torch.tensor([w.numel() for w in word_lists], device=dev)
    flat = torch.cat(word_lists)
    starts = torch.cumsum(lengths, 0) - lengths
    seg = torch.repeat_interleave(torch.arange(len(word_lists), device=dev), lengths)
    pos = torch.arange(flat.numel(), device=dev) - starts[seg]
    out = torch.zeros(len(word_lists), dtype=torch.int64, device=dev)
    return out.index_add_(0, seg, flat * k[pos])


def fingerprint_now(t: torch.Tensor, stats: bool = False, kernel: Optional[_native.Kernel] = None,
                    copy: bool = True) -> Optional[Tuple[int, Optional[Sequence[float]]]]:
    """CPU fast path: ``(hash, stats vector | None)`` of ``t`` computed right now in one pass by the
    native kernel (:mod:`determ_backend.fingerprint._native`), or None when it does not apply (not a plain CPU
    tensor, kernel not built, or statistics asked for a dtype it has none for) -- then use the
    torch path, which gives the same hash.  The stats vector is ``[min, max, mean, l2, nan, inf,
    numel]`` as :func:`tensor_stats` reports it.  ``kernel``: the kernel as
    :func:`~determ_backend.fingerprint._native.kernel` gave it, when the caller looked it up already.
    ``copy=False``: None for a non-contiguous tensor instead of reading a contiguous copy (then no torch op
    runs here at all).  Called once per traced tensor: every check here is one cheap attribute."""
    if not t.is_cpu or t.layout is not _STRIDED or t.is_quantized or t.is_conj() or t.is_neg() or _is_zero(t):
        return None
    dtype = t.dtype
    kind = _native.SUPPORTED.get(dtype, 0)
    if stats and not kind:
        return None
    if kernel is None:
        kernel = _native.kernel()
        if kernel is None:
            return None
    n = t.numel()
    x = t
    if not x.is_contiguous():  # statistics need the dtype; the hash only the bytes (any dtype copies as ints)
        if not copy:
            return None
        x = x.detach().contiguous() if stats else same_size_int(x.detach()).contiguous()
    return kernel.call(x.data_ptr() if n else 0, x.nbytes, kind, n, key(dtype, t.shape), kernel.threads,
                       stats)


def _cat(xs: List[torch.Tensor]) -> torch.Tensor:
    return torch.cat(xs) if len(xs) > 1 else xs[0]


class HashBatch:
    """Fingerprints of one device's tensors, streamed in one at a time and finished together.

    :meth:`add` does the per-tensor work right away (so a buffer may be reused or
    mutated afterwards): small tensors are copied as words, large ones reduced to
    their row sums.  :meth:`finish` then combines everything with a constant
    number of device ops for the whole batch, and returns one int64 device value
    per added tensor (no host sync).  Values equal :func:`hash_tensor`.
    """

    def __init__(self, device, kernel: Any = ...) -> None:
        """``kernel``: the native kernel as :func:`~determ_backend.fingerprint._native.kernel` gave it (None: not
        used), when the caller looked it up already; looked up here by default."""
        self.device = torch.device(device)
        self._cpu = self.device.type == "cpu"
        self._k = row_weights(str(self.device))
        self._keys: List[int] = []
        self._small: List[torch.Tensor] = []
        self._small_ix: List[int] = []
        self._sums: List[torch.Tensor] = []
        self._sums_ix: List[int] = []
        self._native: Dict[int, int] = {}
        if not self._cpu:
            kernel = None
        self._kernel: Optional[_native.Kernel] = _native.kernel() if kernel is ... else kernel  # once per batch

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, t: torch.Tensor, copy: bool = True) -> int:
        """Queue ``t``; returns its index in :meth:`finish`'s result.  ``copy=False``: ``t`` stays unchanged
        until :meth:`finish` (a small tensor's words are then not copied)."""
        check_tensor(t)
        return self._add(t, copy)

    def _add(self, t: torch.Tensor, copy: bool, native: bool = True) -> int:
        """:meth:`add` of a tensor already checked; ``native=False``: the native kernel was tried already."""
        i = len(self._keys)
        known = None
        if native and self._kernel is not None:
            nat = fingerprint_now(t, False, self._kernel)
            known = None if nat is None else nat[0]
        if known is not None:
            self._keys.append(0)  # never used: the native value replaces the finished one
            self._native[i] = known
            return i
        self._keys.append(_tensor_key(t))
        w = words(t)
        n = w.numel()
        if n == 0:
            return i
        if n <= ROW_WORDS:
            self._small.append(w.clone() if copy and w.data_ptr() == t.data_ptr() else w)
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
        if self._native and len(self._native) == len(self._keys):  # all done in native passes
            return torch.tensor([signed(v) for v in self._native.values()], dtype=torch.int64)
        dev = self.device
        s_parts, p_parts, g_parts = [], [], []
        if self._small:
            s_parts.append(_segment_sums(self._small, self._k))
            p_parts.append(torch.zeros(len(self._small_ix), dtype=torch.int64, device=dev))
            g_parts.append(torch.tensor(self._small_ix, dtype=torch.int64, device=dev))
        if self._sums:
            lengths = torch.tensor([s.numel() for s in self._sums], device=dev)
            starts = torch.cumsum(lengths, 0) - lengths
            s_parts.append(_cat(self._sums))
            seg_local = torch.repeat_interleave(torch.arange(len(self._sums), device=dev), lengths)
            p_parts.append(torch.arange(s_parts[-1].numel(), device=dev) - starts[seg_local])
            g_parts.append(torch.tensor(self._sums_ix, dtype=torch.int64, device=dev)[seg_local])
        if not s_parts:
            empty = torch.empty(0, dtype=torch.int64, device=dev)
            return self._with_native(finish(empty, empty, empty, self._keys, dev))
        return self._with_native(finish(_cat(s_parts), _cat(p_parts), _cat(g_parts), self._keys, dev))

    def _with_native(self, res: torch.Tensor) -> torch.Tensor:
        """``res`` with the fingerprints the native kernel already computed written in."""
        if self._native:
            res[torch.tensor(list(self._native), dtype=torch.int64)] = torch.tensor(
                [signed(v) for v in self._native.values()], dtype=torch.int64)
        return res


def hash_tensors(tensors: Iterable[torch.Tensor]) -> List[int]:
    """Fingerprints of many tensors, with one host sync per device at the end."""
    tensors = list(tensors)
    by_dev: Dict[torch.device, List[int]] = {}
    for i, t in enumerate(tensors):
        check_tensor(t)
        by_dev.setdefault(t.device, []).append(i)
    out = [0] * len(tensors)
    for dev, idx in by_dev.items():
        batch = HashBatch(dev)
        for i in idx:
            batch._add(tensors[i], False)  # checked above
        for i, v in zip(idx, batch.finish().cpu().tolist()):
            out[i] = v & MASK64
    return out


_ROW0 = py_fmix(GOLDEN)  # step 3's position term of row 0: fmix((0 + 1) * GOLDEN)


def hash_tensor(t: torch.Tensor) -> int:
    """64-bit fingerprint in ``[0, 2**64)`` of ``t``'s dtype, shape and logical bits.

    Equal to ``hash_tensors([t])[0]``.  A tensor on the ``meta`` device (no data)
    raises :class:`UnsupportedDtypeError`.
    """
    check_tensor(t)
    nat = fingerprint_now(t)
    if nat is not None:
        return nat[0]
    if t.numel() * t.element_size() > 4 * ROW_WORDS:
        return hash_tensors([t])[0]
    w = words(t)
    n = w.numel()
    # One row at most: the same arithmetic as HashBatch/finish, with steps 3-4 on the host.
    acc = 0
    if n:
        acc = py_fmix(int((w * row_weights(str(w.device))[:n]).sum().item()) ^ _ROW0)
    return py_fmix(acc ^ _tensor_key(t))


# ---------------------------------------------------------------- statistics

_NO_ARITHMETIC = frozenset(getattr(torch, name) for name in (
    "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16", "float4_e2m1fn_x2",
    *(f"int{b}" for b in range(1, 8)), *(f"uint{b}" for b in range(1, 8)),
) if isinstance(getattr(torch, name, None), torch.dtype))
"""Storage-only dtypes (bit containers, packed fp4, sub-byte int shells): hashable, but no statistics."""

_HALF = (torch.float16, torch.bfloat16)
_TRACE_SMALL = 1 << 16  # bytes: under "trace" statistics, tensors up to this size are reduced per batch

STATS_KINDS = ("exact", "fast", "trace")
"""The statistics a :class:`FingerprintBatch` computes (all report ``{min, max, mean, l2, nan, inf}``):

- ``"exact"``: float64 accumulation, NaN/inf counted (:func:`tensor_stats`); the eager modes;
- ``"fast"``: accumulation in float32 for 16-bit floats, in the tensor's own dtype otherwise (float64
  for integers); NaN/inf counted, in a second pass over the batch, only in tensors where min, max, mean
  or l2 is not finite; complex tensors by magnitude.  The tensors are read again at
  :meth:`FingerprintBatch.resolve` and not copied, so they must stay unchanged until then; the API dump;
- ``"trace"``: tensors up to 64 KiB with float64 sums and NaN/inf counted, reduced together per batch
  (from a copy unless the batch is stable); larger ones as ``"fast"`` in three passes (float32
  accumulation below float64) with NaN/inf not counted: 0 when the L2 norm proves there are none, else
  None (unknown; min/max/l2 show which kind is present); complex and quantized tensors as ``"exact"``;
  the compile backends' recorder.
"""


def _stats_vector(t: torch.Tensor) -> torch.Tensor:
    """Float64 device vector [min, max, mean, l2, nan, inf, numel] ("exact" statistics)."""
    check_tensor(t, "tensor_stats")
    t = materialized(t.detach())
    if t.is_quantized:
        t = t.dequantize()
    n = t.numel()
    dev = t.device
    if n == 0 or t.dtype in _NO_ARITHMETIC:  # numel slot 0 or -1: stats_dict reports None
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


def _fast_vector(t: torch.Tensor) -> torch.Tensor:
    """Float64 device vector [min, max, mean, l2] of a non-empty tensor with arithmetic ("fast" statistics)."""
    if t.is_quantized:
        t = t.dequantize()
    if t.is_complex():
        t = t.abs()
    if not t.is_floating_point():
        t = t.to(torch.float64)
    elif t.element_size() == 1:  # float8 types have few kernels
        t = t.float()
    flat = t.reshape(-1)
    acc = torch.float32 if flat.dtype in _HALF else None
    mn, mx = torch.aminmax(flat)
    v = torch.stack([mn, mx, flat.sum(dtype=acc), torch.linalg.vector_norm(flat, dtype=acc)]).double()  # exact widenings
    v[2:3].div_(flat.numel())  # the mean, divided in float64
    return v


def _segment_vectors(tensors: List[torch.Tensor], dev: torch.device) -> torch.Tensor:
    """(m, 7) float64 [min, max, mean, l2, nan, inf, numel] of small tensors, in a constant number of ops."""
    lengths = torch.tensor([t.numel() for t in tensors], device=dev)
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
    m = len(tensors)
    seg = torch.repeat_interleave(torch.arange(m, device=dev), lengths)
    f64 = dict(dtype=torch.float64, device=dev)
    mn = torch.full((m,), math.inf, **f64).scatter_reduce_(0, seg, flat, "amin")
    mx = torch.full((m,), -math.inf, **f64).scatter_reduce_(0, seg, flat, "amax")
    total = torch.zeros(m, **f64).index_add_(0, seg, flat)
    l2 = torch.zeros(m, **f64).index_add_(0, seg, flat * flat).sqrt()
    nan = torch.zeros(m, **f64).index_add_(0, seg, torch.isnan(flat).to(torch.float64))
    inf = torch.zeros(m, **f64).index_add_(0, seg, torch.isinf(flat).to(torch.float64))
    n = lengths.to(torch.float64)
    empty = n == 0
    mn, mx = mn.masked_fill(empty, math.nan), mx.masked_fill(empty, math.nan)
    return torch.stack([mn, mx, total / n.clamp(min=1), l2, nan, inf, n], 1)


def stats_dict(v: Sequence[float], max_first: bool = False) -> dict:
    """The statistics of a ``[min, max, mean, l2, nan, inf, numel]`` vector (numel 0: empty, -1: no arithmetic)."""
    if v[6] <= 0:  # empty (0) or a storage-only dtype (-1)
        return _fast_dict((None, None, None, v[3] if v[6] == 0 else None), int(v[4]), int(v[5]), max_first)
    if max_first:
        return {"max": v[1], "min": v[0], "mean": v[2], "l2": v[3], "nan": int(v[4]), "inf": int(v[5])}
    return {"min": v[0], "max": v[1], "mean": v[2], "l2": v[3], "nan": int(v[4]), "inf": int(v[5])}


def _fast_dict(v: Sequence[Optional[float]], nan: Optional[int], inf: Optional[int],
               max_first: bool = False) -> dict:
    """``{min, max, mean, l2, nan, inf}`` from ``[min, max, mean, l2]`` and the counts (``max_first``: in the
    order of ptdbg-style dump entries)."""
    if max_first:
        return {"max": v[1], "min": v[0], "mean": v[2], "l2": v[3], "nan": nan, "inf": inf}
    return {"min": v[0], "max": v[1], "mean": v[2], "l2": v[3], "nan": nan, "inf": inf}


def _derived_counts(v: Sequence[float]) -> Tuple[Optional[int], Optional[int]]:
    """NaN/inf counts a ``[min, max, mean, l2]`` vector proves: 0 when it shows there are none, else None."""
    mn, mx, _, l2 = v
    has_inf = math.isinf(mn) or math.isinf(mx)
    return (None if math.isnan(l2) else 0), (None if math.isnan(l2) or (math.isinf(l2) and has_inf) else 0)


# How an added tensor's statistics wait for the host transfer (second element of a pending entry):
_NONE, _VECTOR, _SEGMENT, _FAST, _FAST_COUNT, _DERIVED = range(6)


class FingerprintBatch:
    """Fingerprints and statistics of many tensors, on any devices, with one host transfer per device.

    The one batcher of the package: the compile backends' recorder, the eager modes, the API dump and
    :func:`fingerprint_tensors` use it.  ``stats``: one of :data:`STATS_KINDS`, or None for fingerprints
    only.  :meth:`add` does each tensor's device work right away (the native one-pass kernel for a plain
    CPU tensor, else a :class:`HashBatch` entry and the statistics reductions), so the tensor may be
    reused or mutated afterwards.  With ``stable=True`` the caller keeps the tensors unchanged until
    :meth:`resolve` instead: nothing is copied and the statistics are computed there, all together
    (``"fast"`` statistics always are).  :meth:`resolve` finishes every device's batch with a constant
    number of ops, moves hashes and statistics to the host in one transfer per device, and returns
    ``(hash, stats dict or None)`` per added tensor, in order; hashes are in ``[0, 2**64)`` and equal
    :func:`hash_tensor`; ``max_first``: the dicts list ``max`` before ``min``, as ptdbg-style dump
    entries do.
    """

    def __init__(self, stats: Optional[str] = None, stable: bool = False, max_first: bool = False) -> None:
        if stats is not None and stats not in STATS_KINDS:
            raise ValueError(f"FingerprintBatch: stats must be None or one of {STATS_KINDS}, got {stats!r}")
        self.stats = stats
        self._want = stats is not None
        self._stable = stable or stats == "fast"
        self._max_first = max_first
        self._reset()

    def _reset(self) -> None:
        self._kernel: Optional[_native.Kernel] = None  # the native kernel, looked up at the first CPU tensor
        self._looked_up = False
        self._hashes: Dict[torch.device, HashBatch] = {}
        self._out: List[Optional[Tuple[int, Optional[dict]]]] = []  # per added tensor; None until resolved
        # per tensor left for resolve: (position, device, tensor) when its statistics are computed there
        # (stable), else (position, device, how its statistics wait, device vector or small copy, the tensor
        # when nan/inf may need counting)
        self._pending: List[tuple] = []

    def __len__(self) -> int:
        return len(self._out)

    @property
    def on_host(self) -> bool:
        """True when every tensor added so far is already fingerprinted on the host (the native kernel read it,
        or the caller gave its values): :meth:`resolve` then waits on no device and costs no transfer."""
        return not self._pending

    def add(self, t: torch.Tensor) -> int:
        """Capture ``t``; returns its position in :meth:`resolve`'s result."""
        try:
            cpu = t.is_cpu
        except AttributeError:  # not a tensor
            check_tensor(t)  # raises
            raise
        i = len(self._out)
        want = self._want
        if cpu:
            if self._now(t, True) is not None:
                return i
        elif t.is_meta:
            check_tensor(t)  # raises
        dev = t.device
        t = t.detach()
        batch = self._hashes.get(dev)
        if batch is None:
            batch = self._hashes[dev] = HashBatch(dev, self._kernel)  # looked up above for a CPU tensor
        # checked above; the native kernel is tried again for the hash alone if it had no statistics for t
        batch._add(t, not self._stable, native=bool(want and self._kernel is not None))
        self._out.append(None)
        if not want:
            self._pending.append((i, dev, _NONE, None, None))
        else:
            self._pending.append((i, dev, t) if self._stable else (i, dev, *self._capture_stats(t)))
        return i

    def add_now(self, t: torch.Tensor) -> Optional[int]:
        """:meth:`add` for a contiguous CPU tensor the native kernel reads right now, without running any torch
        op (so without a dispatch mode to step around): its position, or None when that does not apply (then
        call :meth:`add`)."""
        return self._now(t, False)  # fingerprint_now answers None for a tensor that is not on the CPU

    def _now(self, t: torch.Tensor, copy: bool) -> Optional[int]:
        """The native one-pass kernel on CPU tensor ``t``, right now: its position, or None (kernel off or
        not built, a layout or dtype it does not read, or ``copy=False`` and ``t`` not contiguous)."""
        if not self._looked_up:  # once per batch: the settings may change between runs
            self._kernel, self._looked_up = _native.kernel(), True
        if self._kernel is None:
            return None
        want = self._want
        nat = fingerprint_now(t, want, self._kernel, copy)
        if nat is None:
            return None
        self._out.append((nat[0], stats_dict(nat[1], self._max_first) if want else None))  # hash and statistics
        return len(self._out) - 1

    def add_known(self, hash: int, stats: Optional[dict] = None) -> int:
        """A tensor whose fingerprint (and statistics, of this batch's kind) the caller already has: it is
        returned as given, in its place.  Returns its position in :meth:`resolve`'s result."""
        self._out.append((hash, stats if self._want else None))
        return len(self._out) - 1

    def _capture_stats(self, t: torch.Tensor) -> tuple:
        """``(how, device vector or small tensor, tensor whose nan/inf may need counting)`` for ``t``."""
        kind = self.stats
        n = t.numel()
        if kind == "exact" or n == 0 or t.dtype in _NO_ARITHMETIC:
            return _VECTOR, _stats_vector(t), None
        if kind == "fast":
            counted = t.is_floating_point() or t.is_complex()
            return (_FAST_COUNT, _fast_vector(t), t) if counted else (_FAST, _fast_vector(t), None)
        if t.is_complex() or t.is_quantized:  # "trace"
            return _VECTOR, _stats_vector(t), None
        if n * t.element_size() <= _TRACE_SMALL:
            return _SEGMENT, t if self._stable else t.clone(), None
        return _DERIVED, _fast_vector(t), None

    def resolve(self) -> List[Tuple[int, Optional[dict]]]:
        """``[(hash, stats dict or None)]`` of every added tensor, in order; the batch is then empty."""
        out, pending, hashes = self._out, self._pending, self._hashes
        self._reset()
        if self._stable:  # statistics of the tensors kept unchanged: computed now, after all the hashing
            pending = [(p[0], p[1], *self._capture_stats(p[2])) if len(p) == 3 else p for p in pending]
        recount: List[tuple] = []
        for dev, batch in hashes.items():
            self._resolve_device(dev, batch, [p for p in pending if p[1] == dev], out, recount)
        if recount:  # "fast": count NaN/inf where a statistic is not finite (one more transfer per device)
            for dev in dict.fromkeys(p[1] for p in recount):
                these = [p for p in recount if p[1] == dev]
                counts = torch.stack([torch.stack([torch.isnan(p[4]).sum(), torch.isinf(p[4]).sum()])
                                      for p in these]).cpu().tolist()
                for p, (nan, inf) in zip(these, counts):
                    out[p[0]][1]["nan"], out[p[0]][1]["inf"] = nan, inf
        return out  # type: ignore[return-value]

    def _resolve_device(self, dev: torch.device, batch: HashBatch, pending: List[tuple], out: list,
                        recount: List[tuple]) -> None:
        """Hashes and statistics of one device's entries in one transfer: int64 hashes viewed as float64,
        then the statistics vectors, concatenated."""
        parts = [batch.finish().view(torch.float64)]
        small = [p[3] for p in pending if p[2] == _SEGMENT]
        if small:
            parts.append(_segment_vectors(small, dev).reshape(-1))
        parts.extend(p[3] for p in pending if p[2] in (_VECTOR, _FAST, _FAST_COUNT, _DERIVED))
        host = _cat(parts).cpu()
        m = len(pending)
        hs = host[:m].view(torch.int64).tolist()
        vals = host[m:].tolist()
        seg_pos, pos = 0, 7 * len(small)
        for h, p in zip(hs, pending):
            how = p[2]
            if how == _NONE:
                st = None
            elif how == _SEGMENT:
                st = stats_dict(vals[seg_pos: seg_pos + 7], self._max_first)
                seg_pos += 7
            elif how == _VECTOR:
                st = stats_dict(vals[pos: pos + 7], self._max_first)
                pos += 7
            else:
                v = vals[pos: pos + 4]
                pos += 4
                if how == _DERIVED:
                    st = _fast_dict(v, *_derived_counts(v), self._max_first)
                else:
                    st = _fast_dict(v, 0, 0, self._max_first)
                    if how == _FAST_COUNT and not math.isfinite(v[0] + v[1] + v[2] + v[3]):  # some value is not
                        recount.append(p)  # (or the sum overflows: counted, and found 0)
            out[p[0]] = (h & MASK64, st)


def fingerprint_tensors(tensors: Iterable[torch.Tensor], stats: bool = True) -> List[dict]:
    """``[{"hash": int, **stats}]`` for each tensor ("exact" statistics); one host sync per device."""
    batch = FingerprintBatch("exact" if stats else None)
    for t in tensors:
        check_tensor(t, "fingerprint_tensors")
        batch.add(t)
    return [{"hash": h, **(st or {})} for h, st in batch.resolve()]


def tensor_stats(t: torch.Tensor) -> dict:
    """``{min, max, mean, l2, nan, inf}`` of ``t`` with float64 accumulation.

    NaNs propagate into min/max/mean/l2 as torch does (their count is in ``nan``);
    complex tensors report statistics of their magnitudes; an empty tensor has
    ``None`` for min/max/mean and 0 for the rest; a storage-only dtype (``bits8``,
    ``float4_e2m1fn_x2``, ``uint4``, ...) has ``None`` for min/max/mean/l2.
    A tensor on the ``meta`` device raises :class:`UnsupportedDtypeError`.
    """
    check_tensor(t, "tensor_stats")
    nat = fingerprint_now(t, stats=True)
    return stats_dict(nat[1] if nat is not None else _stats_vector(t).cpu().tolist())
