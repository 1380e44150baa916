"""The one-pass native CPU kernel (determ_backend/_native.py, _native_fp.c): same fingerprints as the
torch path, statistics that agree with torch's, a cached build, and a clean fallback without it."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from determ_backend.fingerprint import _native
from determ_backend.fingerprint import core as fp

pytestmark = pytest.mark.skipif(not _native.available(), reason="no C compiler: the native kernel is not built")

STAT_DTYPES = list(_native.SUPPORTED)
SIZES = [1, 3, 8, 9, 4095, 8192, 8193, 3 * 8192 + 5]


def _torch_path(monkeypatch):
    monkeypatch.setattr(_native, "kernel", lambda: None)


def _sample(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g, dtype=torch.float64) * 3).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2**40)), min(info.max, 2**40)
    return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(dtype)


def _both(t: torch.Tensor, monkeypatch, stats: bool = True):
    nat = fp.fingerprint_now(t, stats)
    with monkeypatch.context() as m:
        _torch_path(m)
        assert fp.fingerprint_now(t, stats) is None
        ref = fp.hash_tensors([t])[0], (fp.tensor_stats(t) if stats else None)
    return nat, ref


@pytest.mark.parametrize("dtype", STAT_DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_hash_equals_torch_path_and_stats_agree(dtype, n, monkeypatch):
    t = _sample(dtype, n, seed=n)
    (h, vec), (ref_h, ref_st) = _both(t, monkeypatch)
    assert h == ref_h
    st = fp.stats_dict(vec)
    assert (st["nan"], st["inf"]) == (ref_st["nan"], ref_st["inf"]) == (0, 0)
    for k in ("min", "max"):
        assert st[k] == ref_st[k]
    for k in ("mean", "l2"):
        assert st[k] == pytest.approx(ref_st[k], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [5, 20_000])
def test_nan_and_inf_are_counted_exactly(dtype, n, monkeypatch):
    t = _sample(dtype, n)
    t[[1, n - 1]] = math.nan
    t[2] = math.inf
    t[3] = -math.inf
    (h, vec), (ref_h, ref_st) = _both(t, monkeypatch)
    st = fp.stats_dict(vec)
    assert h == ref_h
    assert (st["nan"], st["inf"]) == (ref_st["nan"], ref_st["inf"]) == (2, 2)
    assert all(math.isnan(st[k]) and math.isnan(ref_st[k]) for k in ("min", "max", "mean", "l2"))
    t[[1, n - 1]] = 0.0
    st = fp.stats_dict(fp.fingerprint_now(t, True)[1])
    assert (st["min"], st["max"], st["nan"], st["inf"]) == (-math.inf, math.inf, 0, 2)


@pytest.mark.parametrize("view", ["transpose", "offset", "step", "expand"])
def test_views_hash_their_logical_elements(view, monkeypatch):
    base = _sample(torch.float16, 64 * 129).reshape(64, 129)
    t = {"transpose": base.t(), "offset": base[1:, 3:], "step": base[::3, ::2],
         "expand": base[0].expand(5, 129)}[view]
    (h, vec), (ref_h, ref_st) = _both(t, monkeypatch)
    assert h == ref_h == fp.hash_tensor(t.contiguous())
    assert fp.stats_dict(vec)["max"] == ref_st["max"]


def test_misaligned_and_odd_byte_counts(monkeypatch):
    raw = _sample(torch.uint8, 3 * 8192 + 7)
    for t in (raw[1:], raw[3:-2], raw[1:].view(torch.uint8)[:5], raw[2:].view(torch.uint8)):
        (h, _), (ref_h, _) = _both(t, monkeypatch)
        assert h == ref_h


def test_empty_and_zero_dim(monkeypatch):
    for t in (torch.empty(0), torch.empty(3, 0, dtype=torch.int32), torch.tensor(2.5)):
        (h, vec), (ref_h, ref_st) = _both(t, monkeypatch)
        assert h == ref_h
        assert fp.stats_dict(vec) == pytest.approx(ref_st, nan_ok=True)


def test_dtypes_without_statistics_still_hash_natively(monkeypatch):
    t = torch.randn(100, dtype=torch.complex64)
    assert fp.fingerprint_now(t, stats=True) is None  # statistics: torch path
    (h, vec), (ref_h, _) = _both(t, monkeypatch, stats=False)
    assert vec is None and h == ref_h


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, timeout=120)


_PROBE = """
    import torch
    from determ_backend.fingerprint import _native, core as fp
    t = torch.arange(10000, dtype=torch.float32)
    print(_native.available(), fp.hash_tensor(t))
"""


def test_build_is_cached_and_missing_compiler_falls_back(tmp_path):
    cache = str(tmp_path / "cache")
    first = _run(_PROBE, DETERM_CACHE_DIR=cache)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split()[0] == "True"
    built = list((tmp_path / "cache" / "native").glob("determ_fp_*.so"))
    assert len(built) == 1 and not list((tmp_path / "cache" / "native").glob("*.tmp"))
    # a later process loads the cached library and needs no compiler
    again = _run(_PROBE, DETERM_CACHE_DIR=cache, CC="/nonexistent/cc", PATH="/nonexistent")
    assert again.stdout.split() == first.stdout.split(), again.stderr
    # no compiler and no cached build: the torch path, same fingerprint
    bare = _run(_PROBE, DETERM_CACHE_DIR=str(tmp_path / "empty"), CC="/nonexistent/cc", PATH="/nonexistent")
    assert bare.returncode == 0, bare.stderr
    assert bare.stdout.split() == ["False", first.stdout.split()[1]]
    off = _run(_PROBE, DETERM_CACHE_DIR=cache, DETERM_NATIVE="0")
    assert off.stdout.split() == ["False", first.stdout.split()[1]]


def test_failed_build_logs_one_warning_and_falls_back(tmp_path):
    bad_cc = tmp_path / "cc"
    bad_cc.write_text("#!/bin/sh\necho 'cc: internal error' >&2\nexit 3\n")
    bad_cc.chmod(0o755)
    res = _run(_PROBE, DETERM_CACHE_DIR=str(tmp_path / "c"), CC=str(bad_cc))
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[0] == "False"
    assert "native fingerprint kernel unavailable" in res.stderr and "internal error" in res.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_results_do_not_depend_on_the_thread_count(dtype, monkeypatch):
    t = _sample(dtype, 8192 * 300 + 11, seed=3)  # 300+ rows: split over several threads
    if dtype.is_floating_point:
        t[12345] = math.inf  # a row on the exact-recount path
    results = []
    for n in ("1", "2", "3", "8"):
        monkeypatch.setenv("DETERM_NATIVE_THREADS", n)
        results.append(fp.fingerprint_now(t, True))
    assert all(r == results[0] for r in results), results
    assert results[0][0] == fp.hash_tensors([t[:]])[0]


def test_backend_traces_agree_with_and_without_the_kernel(tmp_path, monkeypatch):
    """A trace recorded where no compiler exists compares bitwise with one recorded with the kernel."""
    from backend_helpers import MLP, compile_run, load

    def trace(run_id):
        torch.manual_seed(0)
        _, run_dir = compile_run(MLP(), (torch.randn(64, 8),), "determ_aot_eager", tmp_path, run_id, backward=True)
        return load(run_dir)[0]

    native = trace("native")
    with monkeypatch.context() as m:
        _torch_path(m)
        plain = trace("torch")
    assert len(native) == len(plain) > 10
    for a, b in zip(native, plain):
        assert (a.stage, a.node, a.hash) == (b.stage, b.node, b.hash)
        if a.stats and a.stats.get("min") is not None:
            assert a.stats["max"] == b.stats["max"] and a.stats["mean"] == pytest.approx(b.stats["mean"], abs=1e-6)


def test_corrupt_cached_build_is_rebuilt_once(tmp_path):
    cache = str(tmp_path / "cache")
    first = _run(_PROBE, DETERM_CACHE_DIR=cache)
    assert first.stdout.split()[0] == "True", first.stderr
    (lib,) = (tmp_path / "cache" / "native").glob("determ_fp_*.so")
    size = lib.stat().st_size
    lib.write_bytes(lib.read_bytes()[:100])  # truncated
    again = _run(_PROBE, DETERM_CACHE_DIR=cache)
    assert again.stdout.split() == first.stdout.split(), again.stderr
    assert "unavailable" not in again.stderr and lib.stat().st_size == size
    assert not list((tmp_path / "cache" / "native").glob("*.tmp"))
    # corrupt and no compiler to rebuild with: one warning, the torch path, same fingerprint
    lib.write_bytes(b"\0" * 100)
    bare = _run(_PROBE, DETERM_CACHE_DIR=cache, CC="/nonexistent/cc", PATH="/nonexistent")
    assert bare.stdout.split() == ["False", first.stdout.split()[1]], bare.stderr
    assert bare.stderr.count("native fingerprint kernel unavailable") == 1


@pytest.mark.parametrize("var,value,needle", [
    ("DETERM_NATIVE", "2", "DETERM_NATIVE='2': expected a boolean"),
    ("DETERM_NATIVE_THREADS", "abc", "DETERM_NATIVE_THREADS='abc': expected a positive integer"),
    ("DETERM_NATIVE_THREADS", "0", "DETERM_NATIVE_THREADS='0': expected a positive integer"),
])
def test_bad_native_settings_are_config_errors(monkeypatch, var, value, needle):
    from determ_backend.errors import ConfigError

    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=needle):
        fp.fingerprint_now(torch.ones(10), True)


@pytest.mark.parametrize("value,on", [("off", False), ("False", False), ("yes", True), ("1", True)])
def test_native_switch_accepts_the_boolean_spellings(monkeypatch, value, on):
    monkeypatch.setenv("DETERM_NATIVE", value)
    assert _native.available() is on


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scale", [1e30, 1e-25])
def test_sums_out_of_float32_square_range_are_redone_in_float64(dtype, scale, monkeypatch):
    """Statistics lanes add short blocks in float32: squares of 1e30 overflow there and those of 1e-25
    underflow, not in float64."""
    t = torch.full((5000,), scale, dtype=dtype)
    t[7] = -3 * scale
    (h, vec), (ref_h, ref_st) = _both(t, monkeypatch)
    st = fp.stats_dict(vec)
    assert h == ref_h and (st["nan"], st["inf"]) == (0, 0)
    assert math.isfinite(st["l2"]) and st["l2"] == pytest.approx(ref_st["l2"], rel=1e-6)
    assert st["mean"] == pytest.approx(ref_st["mean"], rel=1e-6)


def test_subnormal_halves_and_signed_zeros(monkeypatch):
    t = torch.tensor([6e-8, -6e-8, 1e-5, -0.0, 0.0, 65504.0] * 700, dtype=torch.float16)
    (h, vec), (ref_h, ref_st) = _both(t, monkeypatch)
    st = fp.stats_dict(vec)
    assert h == ref_h and (st["min"], st["max"]) == (ref_st["min"], ref_st["max"])
    assert st["l2"] == pytest.approx(ref_st["l2"], rel=1e-6)


def test_the_ctypes_route_gives_what_the_extension_gives():
    """Where Python's headers are missing the same library is called through ctypes: same results."""
    import ctypes

    path = _native._library_path()
    if _native.kernel() is None or not path.exists():
        pytest.skip("kernel not built here")
    via_ctypes = _native._ctypes_call(ctypes.CDLL(str(path)))
    k = _native.kernel()
    for dtype in (torch.float32, torch.float16, torch.int64):
        for n in (0, 1, 4097, 70_000):
            t = _sample(dtype, n, seed=n)
            args = (t.data_ptr() if n else 0, n * t.element_size(), _native.SUPPORTED[dtype], n, 12345, 1)
            for stats in (False, True):
                a, b = k.call(*args, stats), via_ctypes(*args, stats)
                assert a[0] == b[0]
                if stats:
                    assert a[1] == pytest.approx(b[1], nan_ok=True)


@pytest.mark.parametrize("stats", [None, "exact"])
def test_add_now_reads_contiguous_cpu_tensors_and_leaves_the_rest_to_add(stats):
    """``FingerprintBatch.add_now`` takes a contiguous CPU tensor at once, giving what ``add`` gives, and
    returns None (nothing added) for what it would have to copy or cannot read natively: ``add`` takes those."""
    plain = torch.randn(64, 48)
    cases = [(plain, True), (plain.t(), False),  # a transposed view: read through a contiguous copy by add
             (torch.randn(5, dtype=torch.complex64), stats is None)]  # hashed natively, but no statistics
    for t, native in cases:
        now, ref = fp.FingerprintBatch(stats), fp.FingerprintBatch(stats)
        i = now.add_now(t)
        assert i == 0 if native else (i is None and len(now) == 0)
        if i is None:
            now.add(t)
        ref.add(t)
        assert now.resolve() == ref.resolve()
