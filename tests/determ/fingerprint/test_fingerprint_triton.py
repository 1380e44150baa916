"""The Triton row-sum kernel gives bit-identical results to the torch path.

The kernel runs on CPU tensors under Triton's interpreter, which must be switched
on (``TRITON_INTERPRET=1``) before Triton is imported.  So unless this process
was started that way, ``test_kernel_under_the_interpreter`` runs this file again
in a fresh process with the variable set, where the ``interpreter`` tests run.
The interpreter is slow: tensors stay small (a few rows).  On a machine with
CUDA the ``gpu`` test runs the compiled kernel through ``hash_tensor`` itself.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from determ_backend.fingerprint import core as fp
from determ_backend.errors import DetermError

pytest.importorskip("triton")
from determ_backend.fingerprint import _triton as ft  # noqa: E402  (needs triton)

ROW = fp.ROW_WORDS
INTERPRETED = ft.interpreting()


@pytest.fixture
def interpreter():
    if not INTERPRETED:
        pytest.skip("runs in the TRITON_INTERPRET=1 child of test_kernel_under_the_interpreter")
    assert ft.available()


@pytest.mark.skipif(INTERPRETED, reason="this process is the interpreter run")
def test_kernel_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider",
                          "-k", "not gpu and not test_kernel_under_the_interpreter"],
                         capture_output=True, text=True, env=env, timeout=300)
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "passed" in summary and "skipped" not in summary, out.stdout[-4000:]  # the kernel tests really ran


def _rows(n_rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(-2**31, 2**31 - 1, (n_rows, ROW), dtype=torch.int32, generator=g)
    rows[0, :8] = torch.tensor([-2**31, 2**31 - 1, -1, 0, 1, -2**31, -2**31, 2**31 - 1], dtype=torch.int32)
    return rows


def _both_ways(rows: torch.Tensor):
    k = fp.row_weights("cpu")
    got = torch.full((rows.shape[0],), 7, dtype=torch.int64)
    want = torch.empty(rows.shape[0], dtype=torch.int64)
    ft.row_sums(rows, k, got)
    fp._row_sums_torch(rows, k, want)
    return got, want


@pytest.mark.parametrize("n_rows,seed", [(1, 0), (3, 1)])
def test_row_sums_match_torch_bit_for_bit(interpreter, n_rows, seed):
    got, want = _both_ways(_rows(n_rows, seed))
    assert torch.equal(got, want)


def test_row_sums_wrap_like_int64(interpreter):
    rows = torch.full((2, ROW), -2**31, dtype=torch.int32)  # every product and the sums overflow
    rows[1] = 2**31 - 1
    got, want = _both_ways(rows)
    assert torch.equal(got, want)
    k = fp.row_weights("cpu").tolist()
    expected = (sum(-2**31 * c for c in k) + 2**63) % 2**64 - 2**63
    assert got[0].item() == expected


def test_row_sums_on_a_strided_row_view(interpreter):
    wide = _rows(2, 5).repeat(1, 2)  # rows of 2*ROW words; take the second half of each
    view = wide[:, ROW:]
    assert not view.is_contiguous()
    got, want = _both_ways(view)
    assert torch.equal(got, want)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(10),
    lambda: torch.randn(2 * ROW + 3),
    lambda: torch.randn(33).to(torch.bfloat16),
    lambda: torch.arange(7, dtype=torch.int8),
    lambda: torch.randn(6, 5).t(),
    lambda: torch.zeros(0),
    lambda: torch.tensor(-0.0),
], ids=["f32", "f32-3rows", "bf16", "int8-tail", "transposed", "empty", "0d"])
def test_full_hash_via_kernel_equals_hash_tensor(interpreter, make):
    t = make()
    assert ft.hash_tensor_via_kernel(t) == fp.hash_tensor(t)


def test_bad_shapes_are_rejected(interpreter):
    k = fp.row_weights("cpu")
    with pytest.raises(DetermError, match="int32"):
        ft.row_sums(torch.zeros(1, ROW, dtype=torch.int64), k, torch.empty(1, dtype=torch.int64))
    with pytest.raises(DetermError, match="multiple of"):
        ft.row_sums(torch.zeros(1, 100, dtype=torch.int32), k[:100], torch.empty(1, dtype=torch.int64))


def test_unavailable_without_interpreter_or_cuda(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert ft.available() == torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_hash_uses_the_kernel_and_matches_cpu():
    t = torch.randn(100 * ROW + 17)  # > 64 rows: fingerprint._row_sums takes the Triton path
    assert fp.hash_tensor(t.cuda()) == fp.hash_tensor(t)
    rows = _rows(80, 9).cuda()
    k = fp.row_weights(str(rows.device))
    got = torch.empty(80, dtype=torch.int64, device=rows.device)
    want = torch.empty_like(got)
    ft.row_sums(rows, k, got)
    fp._row_sums_torch(rows, k, want)
    assert torch.equal(got, want)
