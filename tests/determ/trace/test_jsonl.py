"""The one JSON Lines stream (trace.jsonl): traces and dump indexes written and read by the same rules --
files of earlier releases, partial reads (no footer, a cut last line, a footer cut on a full disk), appends."""

from __future__ import annotations

import os
import errno
import json
import logging
import pickle

import pytest
import torch

from determ_backend import dump
from determ_backend.dump.capture.writer import DUMP_STREAM, DumpWriteError, IndexWriter
from determ_backend.errors import TraceFormatError
from determ_backend.trace import jsonl
from determ_backend.trace.jsonl import StreamWriter, StreamWriteError, read_header, read_stream
from determ_backend.trace.stream import TRACE_FORMAT, Record, TraceWriter, read_trace_file

_OLD_TRACE = (
    '{"format": "determ-trace", "version": 1, "run": "r1", "torch": "2.5.0", "producer": "HashMode"}\n'
    '{"graph":"eager","stage":"eager","node":"mul#0","op":"aten.mul.Tensor","kind":"node","call":0,"seq":0,'
    '"dtype":"float32","shape":[2],"hash":"00112233445566ff","rank":0}\n'
    '{"graph":"eager","stage":"eager","node":"sum#1","op":"aten.sum.default","kind":"node","call":0,"seq":1,'
    '"dtype":"float32","shape":[],"hash":"0a1b2c3d4e5f6071","inputs":["mul#0"],"rank":0}\n'
    '{"end": true, "count": 2}\n')

_OLD_DUMP = (
    '{"format": "determ-dump", "version": 1, "rank": 0, "world_size": 1, "mode": "all", "task": "tensor"}\n'
    '{"name":"Functional_relu_0_forward","op":"Functional.relu","seq":0,"inputs":[{"name":"input",'
    '"dtype":"torch.float32","shape":[2],"hash":"00112233445566ff","payload":[0,8]}],"outputs":[]}\n'
    '{"name":"Functional_relu_0_backward","op":"Functional.relu","seq":1,"inputs":[],"outputs":[]}\n')


def _dump_footer(count, **kw):
    return json.dumps({"end": True, "count": count, **kw}) + "\n"


def test_trace_files_of_earlier_releases_read_and_new_ones_keep_their_bytes(tmp_path):
    old = tmp_path / "old.jsonl"
    old.write_text(_OLD_TRACE)
    tf = read_trace_file(old)
    assert tf.complete and [r.node for r in tf.records] == ["mul#0", "sum#1"] and tf.header["run"] == "r1"
    new = tmp_path / "new.jsonl"
    with TraceWriter(new, run="r1", meta={"producer": "HashMode"}) as w:
        w.write(tf.records)
    lines = new.read_text().splitlines(keepends=True)
    header = json.loads(lines[0])
    assert header == {**json.loads(_OLD_TRACE.splitlines()[0]), "torch": torch.__version__}
    assert lines[0] == json.dumps(header) + "\n"  # the header's spelling is the one earlier releases wrote
    assert lines[1:] == _OLD_TRACE.splitlines(keepends=True)[1:]


def test_dump_indexes_of_earlier_releases_read_including_cut_ones(tmp_path, caplog):
    whole = tmp_path / "whole" / "dump.pkl"
    whole.parent.mkdir()
    whole.write_text(_OLD_DUMP + _dump_footer(2, payload_bytes=8, complete=True))
    d = dump.read_dump(whole)
    assert [e["name"] for e in d.entries] == ["Functional_relu_0_forward", "Functional_relu_0_backward"]
    assert not d.cut and d.header["task"] == "tensor" and dump.read_dump(whole.parent).path == whole
    cut = tmp_path / "cut" / "dump.pkl"
    cut.parent.mkdir()
    cut.write_text(_OLD_DUMP.splitlines(keepends=True)[0] + _OLD_DUMP.splitlines(keepends=True)[1]
                   + _dump_footer(1, complete=False, cut="No space left on device"))
    with caplog.at_level(logging.WARNING):
        d = dump.read_dump(cut)
    assert d.cut and len(d.entries) == 1
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "was cut (No space left on device) after 1 entries" in warned[0]
    caplog.clear()
    payloads = tmp_path / "failed" / "dump.pkl"  # the index is whole, writing payloads failed
    payloads.parent.mkdir()
    payloads.write_text(_OLD_DUMP + _dump_footer(2, payload_bytes=0, complete=False))
    with caplog.at_level(logging.WARNING):
        assert dump.read_dump(payloads).cut
    assert len(caplog.records) == 1 and "tensor payloads failed" in caplog.records[0].getMessage()


# -- the partial-read rules: one set for traces and dump indexes ---------------------------------------

def _trace_text():
    return _OLD_TRACE


def _dump_text():
    return _OLD_DUMP + _dump_footer(2, payload_bytes=8, complete=True)


FORMATS = [pytest.param(TRACE_FORMAT, _trace_text, id="trace"), pytest.param(DUMP_STREAM, _dump_text, id="dump")]


def _write(tmp_path, text):
    p = tmp_path / "s.jsonl"
    p.write_text(text)
    return p


@pytest.mark.parametrize("fmt,text", FORMATS)
def test_a_missing_footer_is_an_error_unless_partial_reads_are_allowed(tmp_path, fmt, text):
    lines = text().splitlines(keepends=True)
    p = _write(tmp_path, "".join(lines[:-1]))
    with pytest.raises(TraceFormatError, match=f"truncated {fmt.what} \\(no end line"):
        read_stream(p, fmt)
    s = read_stream(p, fmt, allow_partial=True)
    assert len(s.records) == 2 and not s.complete and s.footer == {}


@pytest.mark.parametrize("fmt,text", FORMATS)
def test_only_a_cut_last_line_is_dropped(tmp_path, fmt, text):
    lines = text().splitlines(keepends=True)
    p = _write(tmp_path, "".join(lines[:2]) + lines[2][: len(lines[2]) // 2])
    with pytest.raises(TraceFormatError, match=r"s.jsonl:3: corrupt or truncated JSON line"):
        read_stream(p, fmt)
    assert len(read_stream(p, fmt, allow_partial=True).records) == 1
    mid = _write(tmp_path, "".join(lines[:2]) + "{garbage\n" + "".join(lines[2:]))
    for partial in (False, True):
        with pytest.raises(TraceFormatError, match=r"s.jsonl:3: corrupt"):
            read_stream(mid, fmt, allow_partial=partial)


@pytest.mark.parametrize("fmt,text", FORMATS)
@pytest.mark.parametrize("mutate,needle", [
    (lambda ls: ls + ['{"graph": "late"}\n'], "data after the end line"),
    (lambda ls: ls[:1] + ls[2:], "end line says 2"),
    (lambda ls: ls[:2] + ["[1, 2]\n"] + ls[2:], "expected a JSON object"),
    (lambda ls: [ls[0], "\n", ls[1], "  \n"] + ls[2:], None),  # blank lines are skipped
])
def test_malformed_streams_are_one_line_errors(tmp_path, fmt, text, mutate, needle):
    p = _write(tmp_path, "".join(mutate(text().splitlines(keepends=True))))
    if needle is None:
        assert len(read_stream(p, fmt).records) == 2
        return
    with pytest.raises(TraceFormatError, match=needle) as e:
        read_stream(p, fmt, allow_partial=True)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("fmt,text", FORMATS)
def test_headers_are_checked_and_pickles_never_unpickled(tmp_path, fmt, text):
    lines = text().splitlines(keepends=True)
    header = json.loads(lines[0])
    for version, needle in [(2, "newer than this determ reads"), ("1", f"bad {fmt.what} format version")]:
        p = _write(tmp_path, json.dumps({**header, "version": version}) + "\n" + "".join(lines[1:]))
        with pytest.raises(TraceFormatError, match=needle):
            read_stream(p, fmt)
    p = _write(tmp_path, json.dumps({**header, "format": "other"}) + "\n")
    with pytest.raises(TraceFormatError, match=f"not a determ {fmt.what}"):
        read_header(p, fmt)
    marker = tmp_path / "unpickled"

    class Trap:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    p.write_bytes(pickle.dumps(Trap()))
    with pytest.raises(TraceFormatError, match="never unpickles"):
        read_stream(p, fmt)
    assert not marker.exists()
    assert read_header(_write(tmp_path, text()), fmt) == header


# -- writing: whole lines, a cut footer on a full disk, appends ----------------------------------------

def _failing_writes(monkeypatch, fail_calls):
    """jsonl.write_all raising ENOSPC at the given call numbers (1-based)."""
    real, calls = jsonl.write_all, []

    def fake(fd, data):
        calls.append(1)
        if len(calls) in fail_calls:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(jsonl, "write_all", fake)


def _records(n):
    return [Record("g0", "eager", f"n{i}", "aten.add.Tensor", seq=i) for i in range(n)]


def test_a_full_disk_cuts_a_trace_to_its_whole_lines_with_a_footer_saying_so(tmp_path, monkeypatch, caplog):
    p = tmp_path / "t.jsonl"
    w = TraceWriter(p, run="r")
    w.write(_records(3))
    _failing_writes(monkeypatch, {1})
    with pytest.raises(StreamWriteError, match=r"t.jsonl: cannot write the trace \(No space left on device\); it "
                                               r"keeps the 3 records written before and is marked cut"):
        w.write(_records(2))
    w.close()  # a no-op: the writer is closed
    with caplog.at_level(logging.WARNING):
        tf = read_trace_file(p)
    assert len(tf.records) == 3 and not tf.complete
    assert "incomplete trace: the trace was cut (No space left on device) after 3 records" in caplog.text
    assert json.loads(p.read_text().splitlines()[-1]) == {"end": True, "count": 3, "complete": False,
                                                           "cut": "No space left on device"}


def test_a_footer_that_does_not_fit_takes_the_last_records_place(tmp_path, monkeypatch):
    p = tmp_path / "dump.pkl"
    w = IndexWriter(p, {"rank": 0})
    for i in range(3):
        w.write({"name": f"e{i}"})
    _failing_writes(monkeypatch, {1, 2})  # the entry, then the first try of the footer
    with pytest.raises(DumpWriteError, match="keeps the 2 entries written before"):
        w.write({"name": "e3"})
    d = dump.read_dump(p)
    assert [e["name"] for e in d.entries] == ["e0", "e1"] and d.cut
    with pytest.raises(DumpWriteError, match="was cut and cannot be appended to"):
        w.reopen()


def test_streams_reopen_to_append_and_refuse_writes_once_closed(tmp_path):
    p = tmp_path / "s.jsonl"
    w = StreamWriter(p, TRACE_FORMAT, {"run": "r"})
    w.write_lines([r.to_json() for r in _records(2)])
    w.close(extra=1)
    assert read_stream(p, TRACE_FORMAT).footer == {"end": True, "count": 2, "extra": 1}
    w.reopen()
    w.write(json.loads(_records(3)[2].to_json()))
    w.close()
    tf = read_trace_file(p)
    assert [r.node for r in tf.records] == ["n0", "n1", "n2"] and tf.complete and w.closed
    with pytest.raises(StreamWriteError, match="the trace is closed"):
        w.write({"graph": "g0"})


_AWKWARD = [
    {"a": 1.5, "b": [1, 2], "c": "é\n\"x\"", "d": True, "e": {"f": None}},
    {"min": float("nan"), "max": float("inf"), "mean": -float("inf"), "l2": 1e-320, "nan": 1, "inf": 2},
    {"big": 2 ** 70, "neg": -(2 ** 63), "zero": -0.0, "t": (1, 2)},
    {1: "int key"},
    {"s": "nullable"},
]


@pytest.mark.parametrize("obj", _AWKWARD, ids=range(len(_AWKWARD)))
@pytest.mark.parametrize("fast", [True, False], ids=["orjson", "stdlib"])
def test_the_one_encoder_reads_back_as_the_standard_library_writes(obj, fast, monkeypatch):
    """orjson writes NaN and infinities as null and refuses some values: every such line goes to the
    standard library, so what is read back never depends on which library wrote it."""
    if fast and jsonl._orjson is None:
        pytest.skip("orjson not installed")
    if not fast:
        monkeypatch.setattr(jsonl, "_orjson", None)
    line = jsonl.encode(obj)
    want = json.loads(json.dumps(obj, allow_nan=True))
    got = json.loads(line.decode("utf-8"))
    assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)  # NaN-safe equality


def test_record_templates_write_what_records_write():
    """The backends write lines from per-capture templates; they must be the records' own lines."""
    from determ_backend.trace.stream import RecordTemplate

    stats = {"min": -1.0, "max": float("inf"), "mean": float("nan"), "l2": None, "nan": 1, "inf": 1}
    for kw in (dict(source='m.py:3 ("f")', inputs=["a", "b.1"], run="r", extra={"buffer": "buf1", "kernel": "k"}),
               dict(), dict(kind="output", inputs=[], rank=None, run=None)):
        tpl = RecordTemplate("g0", "aot_forward", "n.1", "aten.mm.default", **kw)
        for args in ((3, 4, "float32", [2, 3], 2 ** 64 - 5, stats), (0, 0, None, None, None, None),
                     (1, 2, "bool", [], 7, {"min": 0.0, "max": 1.0, "mean": 0.5, "l2": 1.0, "nan": 0, "inf": 0})):
            rec = tpl.record(*args)
            assert tpl.line(*args) == rec.to_line()
            assert json.loads(tpl.line(*args))["node"] == "n.1"


def _edge_floats():
    import random
    import struct
    rng = random.Random(0)
    vals = [0.0, -0.0, 1.0, 2.0, -2.5, 0.1, 1e-5, 1.5e-5, 9.99e-6, 1e-6, 1e-4, 1e15, 1e16, 9.999999999999998e15,
            1234567890123456.8, 12345678901234567.0, 1e22, 1.7976931348623157e308, 5e-324, 2.2250738585072014e-308,
            123456789.123, 0.00012345, -0.00001, 1e-7, 1e100, 3.0e16]
    vals += [struct.unpack("<d", struct.pack("<Q", rng.getrandbits(64)))[0] for _ in range(3000)]
    vals += [rng.uniform(-1, 1) * 10.0 ** rng.randint(-30, 30) for _ in range(3000)]
    vals += [float(rng.randint(-10 ** 17, 10 ** 17)) for _ in range(500)]
    return vals


def test_native_trace_lines_are_the_templates_lines_byte_for_byte():
    """The backends encode a call's lines in C: the same bytes as RecordTemplate.line for any float (orjson
    writes the statistics in both), and the template's own line for anything the C loop does not write."""
    from determ_backend.fingerprint import _native
    from determ_backend.trace.stream import RecordTemplate

    native = _native.line_encoder()
    if native is None or jsonl.fast_dumps() is None:
        pytest.skip("the native extension is not built, or orjson is not installed")
    tpls = [RecordTemplate("g0", "aot_forward", "n.1", "aten.mm.default", source='m.py:3 ("f")', inputs=["a"],
                           run="r", extra={"buffer": "buf1"}),
            RecordTemplate("g1", "inductor_backward", "output.0", "output", kind="output", rank=None, run=None)]
    floats = [f for f in _edge_floats() if f == f]
    rows = []
    for i in range(0, len(floats) - 4, 4):
        a, b, c, d = floats[i:i + 4]
        rows.append((tpls[i % 2], "float32", [i, 3, 0], i * 7919 % 2 ** 64,
                     {"min": a, "max": b, "mean": c, "l2": d, "nan": 0, "inf": i}))
    weird = {"min": float("nan"), "max": float("inf"), "mean": -float("inf"), "l2": None, "nan": 3, "inf": None}
    rows += [(tpls[0], None, None, None, None), (tpls[1], "bool", [], 0, {}), (tpls[0], "float16", [2], 2 ** 64 - 1, weird),
             (tpls[1], "float32", [1], 5, {"min": 1.0, "max": 1e-5, "mean": None, "l2": 2.0, "nan": 0, "inf": 0}),
             (tpls[0], 'd"type', [1], 5, None),
             (tpls[0], "float32", [1], 5, {"min": True, "x\n": 1.0}), (tpls[1], "é", [1], None, {"k": 2 ** 80})]
    fallback = []
    real = RecordTemplate.line
    RecordTemplate.line = lambda self, *a: fallback.append(a[1]) or real(self, *a)
    try:
        got = native(17, rows, jsonl.fast_dumps())
    finally:
        RecordTemplate.line = real
    want = [tpl.line(17, seq, *row) for seq, (tpl, *row) in enumerate(rows)]
    assert got == want
    n = len(rows)  # C hands over only statistics orjson writes with a null (NaN, infinity, None) and odd strings
    assert fallback == [n - 5, n - 4, n - 3, n - 1]
    assert all(json.loads(line)["call"] == 17 for line in got)


def test_reading_some_calls_scans_the_others_without_decoding_them(tmp_path):
    """``read_trace_file(calls=...)`` keeps exactly those calls (1 is not 10 or 11), still checks the footer's count,
    and decodes a line written in another form (spaces) to judge it."""
    w = TraceWriter(tmp_path / "trace.jsonl", run="r")
    w.write([Record(graph="g0", stage="aot_forward", node=f"n{i}", op="aten.add.Tensor", call=c, seq=i)
             for c in (0, 1, 10, 11) for i in range(3)])
    w.close()
    tf = read_trace_file(tmp_path, calls=[1])
    assert [(r.call, r.node) for r in tf.records] == [(1, "n0"), (1, "n1"), (1, "n2")] and tf.complete
    assert {r.call for r in read_trace_file(tmp_path, calls=[0, 11]).records} == {0, 11}
    lines = (tmp_path / "trace.jsonl").read_text().splitlines()
    spaced = json.dumps(dict(json.loads(lines[1]), call=1))  # '"call": 1' with a space: decoded, kept
    (tmp_path / "trace.jsonl").write_text("\n".join([lines[0], spaced] + lines[2:]) + "\n")
    assert [r.node for r in read_trace_file(tmp_path, calls=[1]).records] == ["n0", "n0", "n1", "n2"]
    (tmp_path / "trace.jsonl").write_text("\n".join(lines[:-2] + [lines[-1]]) + "\n")  # a record short
    with pytest.raises(TraceFormatError, match="end line says 12 records, found 11"):
        read_trace_file(tmp_path, calls=[1])


def test_open_fresh_replaces_a_file_and_writes_through_a_link(tmp_path):
    from determ_backend.trace.jsonl import open_fresh

    p = tmp_path / "t.jsonl"
    p.write_text("old contents\n")
    os.link(p, tmp_path / "hard.jsonl")
    fd = open_fresh(p)
    os.write(fd, b"new\n")
    os.close(fd)
    assert p.read_text() == "new\n"
    assert (tmp_path / "hard.jsonl").read_text() == "old contents\n"  # a new file, not the old one truncated

    target = tmp_path / "target.jsonl"
    target.write_text("old\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    fd = open_fresh(link)
    os.write(fd, b"x\n")
    os.close(fd)
    assert link.is_symlink() and target.read_text() == "x\n"  # written through, as O_TRUNC does

    fd = open_fresh(tmp_path / "missing.jsonl", os.O_APPEND)
    os.write(fd, b"y\n")
    os.close(fd)
    assert (tmp_path / "missing.jsonl").read_text() == "y\n"


def test_open_fresh_truncates_where_the_file_cannot_be_unlinked(tmp_path, monkeypatch):
    """A writable file in a directory the user may not change (unlink refused) is truncated in place."""
    from determ_backend.trace import jsonl

    p = tmp_path / "t.log"
    p.write_text("old contents\n")

    def refuse(path, *a, **k):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(jsonl.os, "unlink", refuse)
    fd = jsonl.open_fresh(p)
    os.write(fd, b"new\n")
    os.close(fd)
    assert p.read_text() == "new\n"


def test_open_fresh_makes_missing_parents_only_when_asked(tmp_path):
    """``parents=True`` creates the missing directories (found missing by the open itself, so a file written
    again where it was costs no directory check); without it, a missing directory stays an error."""
    from determ_backend.trace.jsonl import open_fresh

    nested = tmp_path / "a" / "b" / "t.jsonl"
    with pytest.raises(FileNotFoundError):
        open_fresh(nested)
    assert not (tmp_path / "a").exists()
    for contents in (b"first\n", b"second\n"):  # made, then replaced where it is
        fd = open_fresh(nested, parents=True)
        os.write(fd, contents)
        os.close(fd)
        assert nested.read_bytes() == contents
    dangling = tmp_path / "dangling.jsonl"
    dangling.symlink_to(tmp_path / "nowhere" / "t.jsonl")  # its directory exists: the link's target's does not
    with pytest.raises(FileNotFoundError):
        open_fresh(dangling, parents=True)
