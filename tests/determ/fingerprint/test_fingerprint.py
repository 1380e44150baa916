"""Properties of determ_backend.fingerprint.core (issue 2, deliverable 2).

The reference implementation ``_reference_hash`` below follows the algorithm in
fingerprint.py's docstring with plain Python integers; the library must agree
with it for every size class (empty, one partial row, one full row, many rows,
more than one chunk of rows).  Hash values are never stored as goldens.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import struct
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings, strategies as st

from determ_backend.fingerprint import _native
from determ_backend.fingerprint import core as fp
from determ_backend.errors import DetermError, UnsupportedDtypeError
from determ_backend.fingerprint.core import ROW_WORDS, fingerprint_tensors, hash_tensor, hash_tensors, tensor_stats

pytestmark = [pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental"),
              pytest.mark.filterwarnings("ignore:.*quantize_per_tensor.*deprecated")]

MASK = (1 << 64) - 1
BOUNDED = settings(max_examples=40, deadline=None)
ALL_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
PLAIN_DTYPES = [d for d in ALL_DTYPES if not str(d).startswith(("torch.qint", "torch.quint"))]
FLOAT_DTYPES = [d for d in PLAIN_DTYPES if d.is_floating_point and d.itemsize >= 1 and "float4" not in str(d)]


@pytest.fixture(autouse=True, params=["native", "torch"])
def hash_path(request, monkeypatch):
    """Every property holds on both CPU paths: the one-pass native kernel and the torch ops."""
    if request.param == "native" and not _native.available():
        pytest.skip("no C compiler: the native kernel is not built")
    if request.param == "torch":
        monkeypatch.setattr(_native, "kernel", lambda: None)
    return request.param


# ---------------------------------------------------------------- helpers

def _fmix64(v: int) -> int:
    v &= MASK
    v ^= v >> 33
    v = (v * 0xFF51AFD7ED558CCD) & MASK
    v ^= v >> 33
    v = (v * 0xC4CEB9FE1A85EC53) & MASK
    return v ^ (v >> 33)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A copy of the logical bytes of ``t`` (row-major), for comparing bit patterns (NaNs included)."""
    t = t.detach().resolve_conj().resolve_neg()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size())
    if ints is not None:  # storage-only dtypes cannot be copied, their same-size ints can
        t = t.view(ints)
    return t.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


def _reference_hash(t: torch.Tensor) -> int:
    """The docstring's algorithm on Python ints (independent of the torch reductions)."""
    raw = bytes(_raw(t).tolist())
    raw += b"\0" * (-len(raw) % 4)
    words = struct.unpack(f"<{len(raw) // 4}i", raw)
    k = fp.row_weights("cpu").tolist()
    acc = 0
    for r in range(0, len(words), ROW_WORDS):
        s = sum(w * c for w, c in zip(words[r: r + ROW_WORDS], k)) & MASK
        acc += _fmix64(s ^ _fmix64((r // ROW_WORDS + 1) * 0x9E3779B97F4A7C15))
    key = fp._tensor_key(t) if t.is_quantized else int.from_bytes(
        hashlib.blake2b(f"{t.dtype}|{tuple(t.shape)}".encode(), digest_size=8).digest(), "little")
    return _fmix64(acc ^ key)


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _of_dtype(dtype: torch.dtype, numel: int, seed: int = 0) -> torch.Tensor:
    """A 1-d tensor of ``dtype`` from random bytes (bool: random 0/1)."""
    if dtype == torch.bool:
        return _bytes(numel, seed) % 2 == 1
    return _bytes(numel * dtype.itemsize, seed).view(dtype)


def _flip_bit(t: torch.Tensor, byte: int, bit: int) -> torch.Tensor:
    b = _raw(t)
    b[byte] ^= 1 << bit
    return b.view(t.dtype).reshape(t.shape)


def _h(t: torch.Tensor) -> int:
    v = hash_tensor(t)
    assert isinstance(v, int) and 0 <= v < 2**64
    return v


def _all_distinct(tensors) -> None:
    hs = hash_tensors(tensors)
    assert len(set(hs)) == len(hs), hs


# ---------------------------------------------------------------- definition, sizes, batch

@pytest.mark.parametrize("words", [0, 1, 7, ROW_WORDS - 1, ROW_WORDS, ROW_WORDS + 1, 3 * ROW_WORDS,
                                   64 * ROW_WORDS, 64 * ROW_WORDS + 5, 150 * ROW_WORDS + 2049])
def test_matches_reference_for_every_size_class(words):
    t = _bytes(words * 4, seed=words).view(torch.float32)
    assert _h(t) == _reference_hash(t) == hash_tensors([t])[0]


@pytest.mark.parametrize("nbytes", [1, 2, 3, 5, 6, 7, 4 * ROW_WORDS + 3, 4 * 65 * ROW_WORDS + 1])
def test_byte_count_not_multiple_of_four(nbytes):
    t = _bytes(nbytes, seed=nbytes)
    assert _h(t) == _reference_hash(t)
    assert _h(t) != _h(_flip_bit(t, nbytes - 1, 7))  # the bytes of the padded last word count


def test_row_weights_are_odd_with_distinct_low_33_bits():
    k = fp.row_weights("cpu").tolist()
    assert len(k) == ROW_WORDS and all(v & 1 for v in k)
    assert len({v & ((1 << 33) - 1) for v in k}) == ROW_WORDS


def test_hash_tensors_equals_per_tensor_hashes_for_a_mixed_batch():
    x = torch.randn(6, 9)
    batch = [x, x.t(), x[1:, ::2], torch.tensor(2.5), torch.zeros(0), torch.zeros(3, 0, dtype=torch.int8),
             _bytes(5), torch.randn(70 * ROW_WORDS + 3), torch.randn(5, dtype=torch.complex64).conj(),
             torch.randn(5).to(torch.bfloat16), torch.tensor([True, False]), x]
    expected = [hash_tensor(t) for t in batch]
    assert hash_tensors(batch) == expected
    assert hash_tensors(batch[::-1]) == expected[::-1]
    assert [r["hash"] for r in fingerprint_tensors(batch)] == expected
    assert [r["hash"] for r in fingerprint_tensors(batch, stats=False)] == expected
    assert hash_tensors([]) == []


def test_hash_batch_equals_hash_tensors_even_after_buffers_change():
    batch = [torch.randn(6, 9), torch.randn(9, 6).t(), torch.tensor(2.5), torch.zeros(0), _bytes(5),
             torch.randn(70 * ROW_WORDS + 3), torch.randn(5).to(torch.bfloat16), torch.randn(2 * ROW_WORDS)]
    expected = hash_tensors(batch)
    hb = fp.HashBatch("cpu")
    for t in batch:
        hb.add(t)
        t.add_(1)  # the buffer is reused after being queued
    assert [v & MASK for v in hb.finish().tolist()] == expected
    assert hash_tensors(batch) != expected


def test_values_cover_the_unsigned_64_bit_range():
    hs = [_h(torch.tensor([float(i)])) for i in range(64)]
    assert any(h >= 2**63 for h in hs) and any(h < 2**63 for h in hs)


# ---------------------------------------------------------------- bit flips

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64, torch.int8])
def test_every_single_bit_flip_gives_a_distinct_hash(dtype):
    t = _of_dtype(dtype, 3, seed=1)
    flips = [_flip_bit(t, byte, bit) for byte in range(t.numel() * dtype.itemsize) for bit in range(8)]
    _all_distinct([t] + flips)


@BOUNDED
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64, torch.uint8, torch.int64,
                              torch.float8_e4m3fn, torch.complex64]),
       numel=st.integers(1, 3 * ROW_WORDS), data=st.data())
def test_a_bit_flip_anywhere_changes_the_hash(dtype, numel, data):
    t = _of_dtype(dtype, numel, seed=numel)
    byte = data.draw(st.integers(0, numel * dtype.itemsize - 1))
    bit = data.draw(st.integers(0, 7))
    assert _h(t) != _h(_flip_bit(t, byte, bit))


def test_bit_flips_at_row_and_chunk_boundaries():
    t = torch.randn(66 * ROW_WORDS + 1)
    positions = [0, ROW_WORDS - 1, ROW_WORDS, 64 * ROW_WORDS - 1, 64 * ROW_WORDS, t.numel() - 1]
    _all_distinct([t] + [_flip_bit(t, 4 * p + 3, 7) for p in positions] + [_flip_bit(t, 4 * p, 0) for p in positions])


# ---------------------------------------------------------------- permutations

def _swapped(t: torch.Tensor, i: int, j: int) -> torch.Tensor:
    s = t.clone()
    s[i], s[j] = t[j], t[i]
    return s


@BOUNDED
@given(i=st.integers(0, 3 * ROW_WORDS - 1), j=st.integers(0, 3 * ROW_WORDS - 1))
def test_swapping_two_distinct_elements_changes_the_hash(i, j):
    t = torch.arange(3 * ROW_WORDS, dtype=torch.float32)  # distinct values
    if i != j:
        assert _h(t) != _h(_swapped(t, i, j))


@pytest.mark.parametrize("i,j", [(0, 1), (0, ROW_WORDS - 1), (17, 4000), (ROW_WORDS - 1, ROW_WORDS),
                                 (5, 2 * ROW_WORDS + 5), (1, 65 * ROW_WORDS + 1)])
def test_swaps_within_one_row_and_across_rows(i, j):
    t = torch.randn(66 * ROW_WORDS)
    assert _h(t) != _h(_swapped(t, i, j))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("i,j", [(0, 1), (0, 2000), (ROW_WORDS // 2 - 1, ROW_WORDS // 2), (3, ROW_WORDS + 3)])
def test_swapping_zeros_that_differ_only_in_sign(dtype, i, j):
    t = torch.zeros(2 * ROW_WORDS + 8, dtype=dtype)
    t[j] = -0.0
    assert _h(t) != _h(_swapped(t, i, j))


def test_permutations_of_rows_and_rolls():
    t = torch.randn(4, ROW_WORDS)
    _all_distinct([t, t[[1, 0, 2, 3]], t.roll(1), t.roll(1, 0), t.flip(0), t[torch.randperm(4)].roll(7)])
    small = torch.tensor([1.0, 2.0, 3.0])
    _all_distinct([small, small.flip(0), small.roll(1), small[[0, 2, 1]]])


# ---------------------------------------------------------------- sign of zero, NaN payloads

def _zero_bytes(value: float, dtype: torch.dtype) -> list:
    return torch.tensor([value]).to(dtype).view(torch.uint8).tolist()


SIGNED_ZERO = [d for d in FLOAT_DTYPES if _zero_bytes(-0.0, d) != _zero_bytes(0.0, d)]  # fnuz/e8m0: no -0


def test_signed_zero_dtype_list_is_complete():
    names = {str(d) for d in SIGNED_ZERO}
    assert {"torch.float16", "torch.bfloat16", "torch.float32", "torch.float64",
            "torch.float8_e4m3fn", "torch.float8_e5m2"} <= names


@pytest.mark.parametrize("dtype", SIGNED_ZERO, ids=str)
def test_sign_of_zero(dtype):
    pos, neg = torch.tensor(0.0).to(dtype), torch.tensor(-0.0).to(dtype)
    assert _h(pos) != _h(neg)
    zeros = torch.zeros(9)
    assert _h(zeros.to(dtype)) != _h((-zeros).to(dtype))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_sign_of_zero_in_complex_parts(dtype):
    _all_distinct([torch.tensor([complex(a, b)], dtype=dtype) for a in (0.0, -0.0) for b in (0.0, -0.0)])


@pytest.mark.parametrize("dtype,itype,patterns", [
    (torch.float32, torch.int32, [0x7FC00000, 0x7FC00001, 0x7F800001, -0x00400000, 0x7FFFFFFF]),
    (torch.float64, torch.int64, [0x7FF8000000000000, 0x7FF8000000000001, 0x7FF0000000000001, -0x0008000000000000]),
    (torch.float16, torch.int16, [0x7E00, 0x7E01, 0x7C01, -0x0200]),
    (torch.bfloat16, torch.int16, [0x7FC0, 0x7FC1, 0x7F81, -0x0040]),
])
def test_distinct_nan_payloads(dtype, itype, patterns):
    nans = [torch.tensor([1.0, 0.0], dtype=dtype) for _ in patterns]
    for t, p in zip(nans, patterns):
        t.view(itype)[1] = p
        assert torch.isnan(t[1])
    _all_distinct(nans)


# ---------------------------------------------------------------- dtype and shape keys

def test_same_bytes_different_dtype_differ():
    raw = _bytes(64, seed=3)
    by_size = {1: [torch.uint8, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2, torch.bits8],
               2: [torch.int16, torch.uint16, torch.float16, torch.bfloat16],
               4: [torch.int32, torch.uint32, torch.float32, torch.complex32],
               8: [torch.int64, torch.uint64, torch.float64, torch.complex64]}
    for dtypes in by_size.values():
        _all_distinct([raw.view(d) for d in dtypes])
    bits = torch.tensor([0, 1, 1, 0], dtype=torch.uint8)
    _all_distinct([bits, bits.view(torch.int8), bits.view(torch.bool)])


def test_shape_is_part_of_the_key():
    x = torch.arange(6.0)
    _all_distinct([x, x.reshape(2, 3), x.reshape(3, 2), x.reshape(1, 6), x.reshape(6, 1), x.reshape(1, 2, 3)])
    _all_distinct([torch.tensor(1.0), torch.tensor([1.0]), torch.tensor([[1.0]])])
    _all_distinct([torch.zeros(0), torch.zeros(0, 3), torch.zeros(3, 0), torch.zeros(1, 0)])
    assert _h(torch.tensor([1, 2, 3], dtype=torch.int8)) != _h(torch.tensor([1, 2, 3, 0], dtype=torch.int8))


# ---------------------------------------------------------------- strides, views, storage offsets

def _same_logical_values(view: torch.Tensor, fresh: torch.Tensor) -> None:
    assert view.dtype == fresh.dtype and view.shape == fresh.shape and torch.equal(_raw(view), _raw(fresh))
    assert _h(view) == _h(fresh) == _reference_hash(fresh)


def test_transposed_and_contiguous_copy_hash_the_same():
    x = torch.randn(37, 53)
    _same_logical_values(x.t(), x.t().contiguous())
    _same_logical_values(x.t(), torch.tensor(x.t().tolist()))
    img = torch.randn(2, 3, 5, 7)
    _same_logical_values(img.to(memory_format=torch.channels_last), img)
    row = torch.randn(1, 5)
    _same_logical_values(row.expand(4, 5), row.repeat(4, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8, torch.bool, torch.complex128])
@pytest.mark.parametrize("offset", [1, 2, 3])
def test_storage_offset_views_hash_their_own_elements(dtype, offset):
    base = _of_dtype(dtype, 2 * ROW_WORDS + 11, seed=offset)
    view = base[offset:]
    assert view.storage_offset() == offset
    _same_logical_values(view, view.clone())
    _same_logical_values(base[offset: offset + 7], base[offset: offset + 7].clone())


def test_non_contiguous_views_hash_only_their_logical_elements():
    x = torch.randn(8, 10)
    for view in (x[::2], x[:, 3], x[1:7:3, 2:9:2], x.t()[2:5], x.unsqueeze(0)[:, :, ::3]):
        _same_logical_values(view, view.clone(memory_format=torch.contiguous_format))
    col = x[:, 3]
    before = _h(col)
    x[:, 4] += 1.0  # outside the view
    assert _h(col) == before
    x[5, 3] += 1.0  # inside the view
    assert _h(col) != before


def test_conj_and_neg_views_hash_their_logical_values():
    z = torch.randn(7, dtype=torch.complex64)
    _same_logical_values(z.conj(), z.conj().resolve_conj())
    assert _h(z.conj()) != _h(z)
    neg = z.conj().imag
    assert neg.is_neg()
    _same_logical_values(neg, -z.imag)


def test_storage_only_dtype_views():
    raw = _bytes(64, seed=5)
    for d in (torch.uint4, torch.bits8, torch.float4_e2m1fn_x2):
        assert _h(raw.view(d)[::3]) == _h(raw[::3].view(d))


# ---------------------------------------------------------------- every dtype

@pytest.mark.parametrize("dtype", PLAIN_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (5,), (3, 7)])
def test_every_dtype_and_shape(dtype, shape):
    numel = math.prod(shape)
    t = _of_dtype(dtype, numel, seed=numel).reshape(shape)
    assert _h(t) == _h(t) == hash_tensors([t])[0] == _reference_hash(t)
    if numel:
        changed = _flip_bit(t, 0, 0)
        assert _h(changed) != _h(t)


def test_every_dtype_list_is_complete():
    names = {str(d) for d in PLAIN_DTYPES}
    for n in ("bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
              "float8_e5m2fnuz", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
              "bool", "complex32", "complex64", "complex128"):
        assert f"torch.{n}" in names


@pytest.mark.parametrize("qdtype", [torch.qint8, torch.quint8, torch.qint32])
def test_quantized_tensors_hash_their_integers_and_quantizer(qdtype):
    x = torch.linspace(-1, 1, 9)
    q = torch.quantize_per_tensor(x, 0.1, 3 if qdtype == torch.quint8 else 0, qdtype)
    q_scaled = torch.quantize_per_tensor(2 * x, 0.2, 3 if qdtype == torch.quint8 else 0, qdtype)
    assert torch.equal(q.int_repr(), q_scaled.int_repr())
    assert _h(q) != _h(q_scaled)  # same integers, different values
    assert _h(q) == _h(torch.quantize_per_tensor(x, 0.1, 3 if qdtype == torch.quint8 else 0, qdtype))
    assert _h(q) != _h(q.int_repr())
    pc = torch.quantize_per_channel(x.reshape(3, 3), torch.tensor([0.1, 0.2, 0.3]), torch.zeros(3, dtype=torch.long), 0, qdtype)
    pc2 = torch.quantize_per_channel(x.reshape(3, 3), torch.tensor([0.1, 0.2, 0.4]), torch.zeros(3, dtype=torch.long), 0, qdtype)
    assert _h(pc) != _h(pc2)


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("fn", [hash_tensor, lambda t: hash_tensors([t]), tensor_stats,
                                lambda t: fingerprint_tensors([t])])
def test_meta_tensors_are_rejected_with_a_clear_error(fn):
    """A meta tensor has a dtype and shape but no data: we refuse rather than invent a value."""
    with pytest.raises(UnsupportedDtypeError, match="'meta' device has no data"):
        fn(torch.empty(3, 4, device="meta"))


def test_sparse_and_non_tensors_are_rejected():
    with pytest.raises(UnsupportedDtypeError, match="layout"):
        hash_tensor(torch.eye(3).to_sparse())
    with pytest.raises(DetermError, match="expects a torch.Tensor"):
        hash_tensors([torch.ones(1), [1.0]])


# ---------------------------------------------------------------- cross-process stability

_CHILD = textwrap.dedent("""
    import json, torch
    from determ_backend.fingerprint.core import ROW_WORDS, hash_tensors
    torch.set_num_threads(1)
    {source}
    print(json.dumps(hash_tensors(_stable_tensors())))
""")


def _stable_tensors():  # its source also runs in the child process
    base = torch.arange(-500, 70 * ROW_WORDS, dtype=torch.float64) * 0.37
    return [base.float(), base[:999].to(torch.bfloat16), base[:33].to(torch.float8_e4m3fn), base.long(),
            base[:10].half().reshape(2, 5).t(), (base[:21] > 3).reshape(3, 7), base[:8].to(torch.complex64),
            base[:5].to(torch.uint16), torch.tensor(-0.0), torch.zeros(0, 2)]


def test_same_value_in_a_fresh_process():
    """Another interpreter, one intra-op thread, a fixed str-hash seed (ours is random): same values."""
    env = dict(os.environ, PYTHONHASHSEED="12345")
    child = _CHILD.replace("{source}", inspect.getsource(_stable_tensors))
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, timeout=120, check=True)
    assert json.loads(out.stdout) == hash_tensors(_stable_tensors())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_same_value_on_cuda():
    ts = _stable_tensors()
    assert hash_tensors([t.cuda() for t in ts]) == hash_tensors(ts)
    assert [hash_tensor(t.cuda()) for t in ts] == [hash_tensor(t) for t in ts]


# ---------------------------------------------------------------- statistics

def _stats_case(values, dtype):
    return tensor_stats(torch.tensor(values, dtype=dtype))


@pytest.mark.parametrize("values,dtype,expected", [
    ([1.0, -2.0, 3.0], torch.float32, dict(min=-2.0, max=3.0, mean=2 / 3, l2=math.sqrt(14), nan=0, inf=0)),
    ([1, -2, 3], torch.int32, dict(min=-2.0, max=3.0, mean=2 / 3, l2=math.sqrt(14), nan=0, inf=0)),
    ([2**62, -(2**62)], torch.int64, dict(min=-(2.0**62), max=2.0**62, mean=0.0, l2=math.sqrt(2) * 2.0**62, nan=0, inf=0)),
    ([255, 0], torch.uint8, dict(min=0.0, max=255.0, mean=127.5, l2=255.0, nan=0, inf=0)),
    ([True, False, True, True], torch.bool, dict(min=0.0, max=1.0, mean=0.75, l2=math.sqrt(3), nan=0, inf=0)),
    ([-math.inf, 1.0, math.inf], torch.float64, dict(min=-math.inf, max=math.inf, nan=0, inf=2)),
    ([3 + 4j, 0j], torch.complex64, dict(min=0.0, max=5.0, mean=2.5, l2=5.0, nan=0, inf=0)),
])
def test_tensor_stats_values(values, dtype, expected):
    got = _stats_case(values, dtype)
    assert set(got) == {"min", "max", "mean", "l2", "nan", "inf"}
    for key, want in expected.items():
        assert got[key] == pytest.approx(want, rel=1e-12), key


def test_tensor_stats_nan_empty_half_and_storage_only():
    got = tensor_stats(torch.tensor([1.0, math.nan, math.inf, 2.0]))
    assert (got["nan"], got["inf"]) == (1, 1) and math.isnan(got["mean"])
    assert tensor_stats(torch.zeros(0, 3)) == dict(min=None, max=None, mean=None, l2=0.0, nan=0, inf=0)
    big = tensor_stats(torch.full((10000,), 60000.0, dtype=torch.float16))  # float64 accumulation
    assert big["mean"] == 60000.0 and big["l2"] == pytest.approx(6e6)
    assert tensor_stats(_bytes(8).view(torch.bits8)) == dict(min=None, max=None, mean=None, l2=None, nan=0, inf=0)
    q = torch.quantize_per_tensor(torch.tensor([-1.0, 0.5]), 0.5, 0, torch.qint8)
    assert tensor_stats(q)["min"] == -1.0
    rec = fingerprint_tensors([torch.tensor([1.0, -1.0])])[0]
    assert rec["l2"] == pytest.approx(math.sqrt(2)) and rec["hash"] == hash_tensor(torch.tensor([1.0, -1.0]))
