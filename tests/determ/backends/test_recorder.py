"""The recorder: hashes equal the public fingerprint, statistics for small and large tensors, nan/inf."""

from __future__ import annotations

import math

import pytest
import torch

from determ_backend.fingerprint import _native
from determ_backend.fingerprint.core import hash_tensors
from determ_backend.backends.recorder import NodeInfo, Recorder, ValueMemo


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


def _forward_backward(memo, returned, taken, stats=True):
    """A forward recorder returning ``returned``, then a backward recorder taking ``taken`` as inputs."""
    fw = Recorder("g", "aot_forward", [NodeInfo(f"output.{i}", "output", kind="output") for i in range(len(returned))],
                  stats=stats, memo=memo)
    fw.begin_call()
    for i, t in enumerate(returned):
        fw.capture(i, t)
    fw_recs = fw.end_call().records
    bw = Recorder("g", "aot_backward", [NodeInfo(f"in{i}", "input", kind="input") for i in range(len(taken))],
                  stats=stats, memo=memo)
    return fw_recs, bw


def test_a_backward_input_the_forward_returned_takes_its_fingerprint_unless_anything_wrote_it(monkeypatch):
    from determ_backend.fingerprint import core
    memo = ValueMemo()
    saved, viewed, changed = torch.randn(1000), torch.randn(1000), torch.randn(1000)
    fw_recs, bw = _forward_backward(memo, [saved, viewed, changed], [saved, viewed, changed, saved.view(10, 100)])
    viewed[:10].mul_(2)  # a write through a view bumps the base's version
    changed.add_(1)
    read = []  # every tensor the recorder reads goes through its batch's add (add_known: a fingerprint it has)
    real = core.FingerprintBatch.add
    monkeypatch.setattr(core.FingerprintBatch, "add", lambda self, t: read.append(t) or real(self, t))
    bw.begin_call()
    for i, t in enumerate([saved, viewed, changed, saved.view(10, 100)]):
        bw.capture(i, t)
    recs = bw.end_call().records
    seen = list(read)
    expected = hash_tensors([saved, viewed, changed, saved.view(10, 100)])
    assert [int(r.hash, 16) for r in recs] == expected  # every hash is the value's as it is now
    assert recs[0].hash == fw_recs[0].hash and recs[0].stats == fw_recs[0].stats
    assert recs[1].hash != fw_recs[1].hash and recs[2].hash != fw_recs[2].hash
    assert len(seen) == 3 and seen[0] is viewed and seen[1] is changed  # the unchanged saved tensor was not read
    assert recs[0].stats is not fw_recs[0].stats  # a copy: a record's statistics are its own


def test_the_memo_needs_statistics_when_the_backward_records_them_and_forgets_dead_tensors():
    memo = ValueMemo()
    t = torch.randn(50)
    _, bw = _forward_backward(memo, [t], [t], stats=False)
    assert memo.get(t, stats=False) is not None and memo.get(t, stats=True) is None
    ref_id = id(t)
    del t
    assert all(v[0]() is not None for k, v in memo._entries.items() if k != ref_id)
    u = torch.randn(50)
    assert memo.get(u, stats=False) is None  # a new tensor (possibly at the dead one's id) is never taken


def test_a_source_file_whose_name_holds_a_quote_keeps_its_line():
    """``node_source`` read the stack trace up to the first quote: a script named ``q"uote.py`` lost its source."""
    import torch.fx as fx

    from determ_backend.backends.instrument import node_source

    g = fx.Graph()
    n = g.placeholder("x")
    n.meta["stack_trace"] = ('  File "/srv/run.py", line 3, in main\n    f(x)\n'
                             '  File "/tmp/a b/q"uote.py", line 7, in forward\n    return x.relu()\n')
    assert node_source(n) == '/tmp/a b/q"uote.py:7 (forward)'
