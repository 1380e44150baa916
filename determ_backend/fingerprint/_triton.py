"""The Triton kernel behind the fingerprint's row sums (step 2 of the algorithm in
:mod:`determ_backend.fingerprint.core`), used for CUDA tensors.

One program per row reads the row's ``ROW_WORDS`` int32 words exactly once,
widens them to int64, multiplies by the column weights and sums with wrapping
int64 arithmetic, so the result is bit-identical to the torch row sums of
:mod:`determ_backend.fingerprint.core` whatever the reduction order.  The rest of
the fingerprint (row mixing, dtype/shape key, word layout) is defined in
:mod:`determ_backend.fingerprint._words`, which both modules import; ``core``
imports this module only when it hashes a CUDA tensor, and this module never
imports ``core``.

Under ``TRITON_INTERPRET=1`` Triton runs kernels on CPU tensors; tests use that
to check the kernel against the torch path without a GPU
(:func:`hash_tensor_via_kernel` computes a whole fingerprint with it).
Importing this module imports Triton when it is installed and changes nothing.
"""

from __future__ import annotations

import functools
import os

import torch

from determ_backend.errors import DeviceUnavailableError, UnsupportedDtypeError
from determ_backend.fingerprint._words import MASK64, ROW_WORDS, finish, key, row_weights, words

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional (the ``triton`` extra)
    triton = None
    tl = None

__all__ = ["available", "interpreting", "row_sums", "hash_tensor_via_kernel"]

_BLOCK = 1024  # columns per step of a program's loop; divides ROW_WORDS


def _interpret_flag() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (on CPU tensors).

    That needs ``TRITON_INTERPRET=1`` in the environment *before* Triton is first
    imported: Triton builds its own library functions (``tl.sum``...) in one mode
    at import time, so setting the variable later does not work.
    """
    if triton is None or not _interpret_flag():
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


def available() -> bool:
    """True when Triton is importable and has a backend here: a CUDA device, or the interpreter."""
    if triton is None:
        return False
    return interpreting() or torch.cuda.is_available()


def _row_sums_kernel(rows_ptr, k_ptr, out_ptr, row_stride, COLS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = rows_ptr + row * row_stride
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    for c0 in range(0, COLS, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        words = tl.load(base + cols).to(tl.int64)
        acc += words * tl.load(k_ptr + cols)
    tl.store(out_ptr + row, tl.sum(acc, axis=0))


@functools.lru_cache(maxsize=2)
def _jitted(interpret: bool):
    """The jitted kernel; ``triton.jit`` picks compiled or interpreted mode when it runs, hence the key."""
    return triton.jit(_row_sums_kernel)


def row_sums(rows: torch.Tensor, k: torch.Tensor, out: torch.Tensor) -> None:
    """``out[r] = sum_c int64(rows[r, c]) * k[c]`` with wrapping int64 arithmetic, one pass over ``rows``.

    ``rows``: (R, C) int32 with unit column stride; ``k``: (C,) int64; ``out``: (R,) int64.
    C must be a multiple of 1024 (the fingerprint uses ``ROW_WORDS``).
    """
    if not available():
        raise DeviceUnavailableError("the Triton fingerprint kernel needs triton and a CUDA device (or TRITON_INTERPRET=1)")
    if rows.dim() != 2 or rows.dtype != torch.int32 or (rows.shape[0] and rows.stride(1) != 1):
        raise UnsupportedDtypeError(f"row_sums: rows must be a 2-d int32 tensor with unit column stride, got "
                                    f"{rows.dtype} shape {tuple(rows.shape)} stride {rows.stride()}")
    n_rows, cols = rows.shape
    if cols % _BLOCK or k.shape != (cols,) or k.dtype != torch.int64 or out.shape != (n_rows,) or out.dtype != torch.int64:
        raise UnsupportedDtypeError(f"row_sums: expected k int64 ({cols},) and out int64 ({n_rows},) with {cols} a "
                                    f"multiple of {_BLOCK}; got k {k.dtype} {tuple(k.shape)}, out {out.dtype} {tuple(out.shape)}")
    if n_rows == 0:
        return
    k = k.contiguous()
    dst = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    _jitted(interpreting())[(n_rows,)](rows, k, dst, rows.stride(0), COLS=cols, BLOCK=_BLOCK)
    if dst is not out:
        out.copy_(dst)


def hash_tensor_via_kernel(t: torch.Tensor) -> int:
    """``fingerprint.hash_tensor(t)`` computed with this kernel for every row, the partial last row included.

    An independent route to the same value (the last row is zero-padded to a full
    row, which adds nothing to its sum); tests compare it with the torch path.
    """
    w = words(t)
    n = w.numel()
    n_rows = -(-n // ROW_WORDS)
    padded = torch.zeros(n_rows * ROW_WORDS, dtype=torch.int32, device=w.device)
    padded[:n] = w
    sums = torch.empty(n_rows, dtype=torch.int64, device=w.device)
    row_sums(padded.view(n_rows, ROW_WORDS), row_weights(str(w.device)), sums)
    pos = torch.arange(n_rows, device=w.device)
    owner = torch.zeros(n_rows, dtype=torch.int64, device=w.device)
    value = finish(sums, pos, owner, [key(t.dtype, tuple(t.shape))], w.device)
    return int(value[0].item()) & MASK64
