"""The recorder: hashes equal the public fingerprint, statistics for small and large tensors, nan/inf."""

from __future__ import annotations

import math

import pytest
import torch

from determ_backend.fingerprint import _native
from determ_backend.fingerprint.core import hash_tensors
from determ_backend.backends.recorder import NodeInfo, Recorder


def _record(tensors):
    r = Recorder("g0", "test", [NodeInfo(f"n{i}", "op") for i in range(len(tensors))])
    r.begin_call()
    for i, t in enumerate(tensors):
        r.capture(i, t)
    return r.end_call().records


@pytest.mark.parametrize("n", [7, 100_000])  # batched small path and per-tensor large path
def test_hashes_and_stats_match_the_public_functions(n):
    ts = [torch.randn(n), torch.arange(n), torch.randn(n).bfloat16(), torch.randn(n, dtype=torch.float64)]
    recs = _record(ts)
    assert [int(r.hash, 16) for r in recs] == hash_tensors(ts)
    for r, t in zip(recs, ts):
        x = t.double()
        assert r.stats["min"] == pytest.approx(x.min().item())
        assert r.stats["max"] == pytest.approx(x.max().item())
        assert r.stats["mean"] == pytest.approx(x.mean().item(), abs=1e-4 * max(1.0, abs(x).max().item()))
        assert r.stats["l2"] == pytest.approx(x.norm().item(), rel=1e-3)
        assert r.stats["nan"] == 0 and r.stats["inf"] == 0


def test_buffer_mutated_after_capture_keeps_its_captured_hash():
    t = torch.randn(100_000)
    expected = hash_tensors([t])[0]
    r = Recorder("g0", "test", [NodeInfo("a", "op")])
    r.begin_call()
    r.capture(0, t)
    t.add_(1.0)  # inductor reuses buffers in place after the kernel that wrote them
    assert int(r.end_call().records[0].hash, 16) == expected


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch-path"])
@pytest.mark.parametrize("n", [5, 100_000])
def test_nan_and_inf_are_reported(n, native, monkeypatch):
    if native and not _native.available():
        pytest.skip("no C compiler: the native kernel is not built")
    if not native:
        monkeypatch.setattr(_native, "kernel", lambda: None)
    base = torch.randn(n)
    with_nan, with_inf = base.clone(), base.clone()
    with_nan[1] = math.nan
    with_inf[2] = math.inf
    nan_rec, inf_rec, clean = _record([with_nan, with_inf, base])
    assert clean.stats["nan"] == 0 and clean.stats["inf"] == 0
    if native or n < 1000:  # the native kernel and the batched small-tensor path: exact counts
        assert (nan_rec.stats["nan"], inf_rec.stats["inf"], inf_rec.stats["nan"]) == (1, 1, 0)
    else:  # large tensors: presence is known, the count is not (None)
        assert nan_rec.stats["nan"] is None and inf_rec.stats["inf"] is None and inf_rec.stats["nan"] == 0
        assert math.isinf(inf_rec.stats["max"])


def test_an_output_proved_unchanged_reuses_its_capture_and_anything_else_is_read():
    rec = Recorder("g", "inductor_forward", [NodeInfo("a", "op"), NodeInfo("output.0", "output", kind="output"),
                                             NodeInfo("output.1", "output", kind="output")])
    a, other = torch.randn(300), torch.randn(300)
    rec.reused = frozenset({0})
    rec.begin_call()
    rec.capture(0, a)
    rec.capture_same(1, 0, a)
    rec.capture_same(2, 0, other)  # not the memory captured at 0: read, not reused
    recs = {r.node: r for r in rec.end_call().records}
    ha, hb = hash_tensors([a, other])
    assert int(recs["a"].hash, 16) == int(recs["output.0"].hash, 16) == ha
    assert recs["output.0"].stats == recs["a"].stats
    assert int(recs["output.1"].hash, 16) == hb
