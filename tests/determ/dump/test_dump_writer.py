"""The dump's payload pack and index: dedup, ring buffer wrap-around, disk full, on/off phases."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from determ_backend import dump
from determ_backend.dump.capture.pipeline import DumpPipeline
from determ_backend.dump.capture.writer import IndexWriter
from determ_backend.errors import TraceFormatError
from determ_backend.fingerprint.core import hash_tensor
from determ_backend.trace.stream import format_hash
from dump_helpers import dump_run, make_net, train_step
from paths import TESTS


@pytest.fixture(autouse=True)
def _clean():
    yield
    dump.remove_hooks()


def _dump_tensors(tmp_path, tensors, ring_bytes, mutate=None):
    """Each tensor as one entry through a real pipeline; ``mutate`` runs after submission, before close."""
    index = IndexWriter(tmp_path / "dump.pkl", {"rank": 0})
    pipe = DumpPipeline(index, tmp_path / "dump" / "tensors.bin", ring_bytes=ring_bytes)
    try:
        for i, t in enumerate(tensors):
            pipe.submit({"name": f"e{i}", "outputs": [{"name": "output", "dtype": str(t.dtype),
                                                      "shape": list(t.shape), "_fp": pipe.tensor(t)}]})
        if mutate:
            mutate()
    finally:
        try:
            pipe.close()
        finally:
            index.close(payload_bytes=pipe.size, complete=True)
    d = dump.read_dump(tmp_path / "dump.pkl")
    return d, [e["outputs"][0] for e in d.entries], pipe


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64])
def test_payloads_round_trip_and_identical_tensors_are_stored_once(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(64, 33, generator=g) * 10).to(dtype)
    tensors = [base, base.clone(), base.t(), base[3], torch.zeros((), dtype=dtype), base[:0]]
    d, outs, pipe = _dump_tensors(tmp_path, tensors, 1 << 16)
    assert outs[0]["payload"] == outs[1]["payload"]  # same bytes, same place
    assert pipe.size == sum(t.numel() * t.element_size() for t in tensors) - base.numel() * base.element_size()
    for t, e in zip(tensors, outs):
        assert e["hash"] == format_hash(hash_tensor(t))
        assert torch.equal(d.tensor(e), t)


def test_ring_buffer_wraps_and_large_tensors_bypass_it(tmp_path):
    tensors = [torch.full((97 + i,), float(i)) for i in range(200)] + [torch.arange(5000.0)]  # last > ring/4
    d, outs, _ = _dump_tensors(tmp_path, tensors, 4096)
    for t, e in zip(tensors, outs):
        assert torch.equal(d.tensor(e), t) and e["stats"]["max"] == float(t.max())


def test_later_inplace_changes_do_not_tear_snapshots(tmp_path):
    t = torch.arange(1000.0)
    d, outs, _ = _dump_tensors(tmp_path, [t], 1 << 20, mutate=lambda: t.mul_(-1))
    assert torch.equal(d.tensor(outs[0]), torch.arange(1000.0))
    assert outs[0]["hash"] == format_hash(hash_tensor(torch.arange(1000.0)))


def test_disk_full_is_a_clear_error(tmp_path):
    (tmp_path / "dump").mkdir()
    os.symlink("/dev/full", tmp_path / "dump" / "tensors.bin")
    with pytest.raises(dump.DumpWriteError, match=r"tensors.bin: cannot write tensor payloads \(No space left on device\)"):
        _dump_tensors(tmp_path, [torch.full((1000,), float(i)) for i in range(100)], 1 << 16)


def test_disk_full_during_a_dump_is_raised_when_switching_off(tmp_path):
    data = tmp_path / "t" / "rank0" / "dump"
    data.mkdir(parents=True)
    os.symlink("/dev/full", data / "tensors.bin")
    with pytest.raises(dump.DumpWriteError, match="the disk may be full"):
        dump_run(tmp_path, "t", make_net())
    assert dump.read_dump(tmp_path / "t" / "rank0" / "dump.pkl").cut  # the index itself is whole


def test_file_size_limit_in_a_subprocess_is_a_clear_error(tmp_path):
    code = textwrap.dedent(f"""
        import resource, signal, sys, torch
        sys.path.insert(0, {str(TESTS)!r})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))
        from determ_backend import dump
        from dump_helpers import dump_run, make_net
        try:
            dump_run({str(tmp_path)!r}, "t", make_net())
        except dump.DumpWriteError as e:
            print("ERR", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ERR" in out.stdout and "File too large" in out.stdout, out.stderr[-2000:]


def test_an_index_that_fills_its_file_is_cut_at_its_last_whole_entry_and_stays_readable(tmp_path, caplog):
    """Statistics mode writes only the index: a file size limit (as a full disk would) stops it mid-dump."""
    code = textwrap.dedent(f"""
        import resource, signal, sys, torch
        sys.path.insert(0, {str(TESTS)!r})
        from determ_backend import dump
        from dump_helpers import dump_run, make_net
        full = dump_run({str(tmp_path)!r}, "full", make_net(), summary_only=True)  # the reference, unlimited
        limit = full.stat().st_size // 2
        print("LIMIT", limit)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        try:
            dump_run({str(tmp_path)!r}, "t", make_net(), summary_only=True)
        except dump.DumpWriteError as e:
            print("ERR", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    line = next((x for x in out.stdout.splitlines() if x.startswith("ERR")), "")
    assert "dump.pkl: cannot write the dump index (File too large); it keeps the" in line, out.stderr[-2000:]
    limit = int(next(x for x in out.stdout.splitlines() if x.startswith("LIMIT")).split()[1])
    index = tmp_path / "t" / "rank0" / "dump.pkl"
    with caplog.at_level("WARNING"):
        d = dump.read_dump(index)
    assert d.cut and d.footer["cut"] == "File too large" and d.entries and index.stat().st_size <= limit
    assert f"index was cut (File too large) after {len(d.entries)} entries" in caplog.text
    cmp = dump.compare({"npu_pkl_path": str(index), "bench_pkl_path": str(tmp_path / "full" / "rank0" / "dump.pkl")},
                       tmp_path / "out")
    assert cmp.csv_path.is_file() and not cmp.root_causes  # what was kept agrees with the full dump


def test_index_reopen_appends_after_removing_the_footer(tmp_path):
    w = IndexWriter(tmp_path / "dump.pkl", {"rank": 0})
    w.write({"name": "a"})
    w.close(payload_bytes=0)
    w.reopen()
    w.write({"name": "b"})
    w.close(payload_bytes=0)
    d = dump.read_dump(tmp_path / "dump.pkl")
    assert [e["name"] for e in d.entries] == ["a", "b"] and d.footer["count"] == 2


def test_switching_off_and_on_keeps_one_index_and_counters(tmp_path):
    net = make_net()
    dump.set_dump_path(tmp_path, dump_tag="t")
    dump.register_hook(net, dump.acc_cmp_dump)
    for _ in range(2):
        dump.set_dump_switch("ON", dump_mode=["forward"])
        train_step(net)
        dump.set_dump_switch("OFF")
    names = [e["name"] for e in dump.read_dump(tmp_path / "t" / "rank0" / "dump.pkl").entries]
    assert "Functional_linear_0_forward" in names and "Functional_linear_2_forward" in names
    d = dump.read_dump(tmp_path / "t" / "rank0" / "dump.pkl")
    conv = [e for e in d.entries if e["op"] == "Functional.conv2d"]
    assert conv[0]["inputs"][1]["payload"] == conv[1]["inputs"][1]["payload"]  # same weight: stored once


def test_a_pickle_index_is_refused(tmp_path):
    import pickle

    p = tmp_path / "dump.pkl"
    p.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(TraceFormatError, match="never unpickles"):
        dump.read_dump(p)
