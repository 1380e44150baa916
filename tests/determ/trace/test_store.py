"""The one content-addressed tensor store (trace.store): loose files, packs of shards and tensor files are
safetensors, identical tensors are stored once, and the files of earlier releases (``<key>.pt``, raw
``tensors.bin`` packs, observer files naming their tensors) stay readable without unpickling anything else."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import determ_backend as db
from determ_backend import dump
from determ_backend.errors import TraceFormatError
from determ_backend.trace import store as store_mod
from determ_backend.trace.store import (PackWriter, TensorStore, checksum_key, fingerprint_key, load_tensor_file,
                                        save_tensor_file, store_for)
from determ_backend.trace.stream import TraceWriter

_G = torch.Generator().manual_seed(0)
TENSORS = {
    "f32": torch.randn(4, 5, generator=_G),
    "bf16": torch.randn(7, generator=_G).bfloat16(),
    "i64": torch.arange(6).reshape(2, 3),
    "bool": torch.tensor([True, False, True]),
    "c64": torch.randn(3, dtype=torch.complex64, generator=_G),
    "c128": torch.randn(2, 2, dtype=torch.complex128, generator=_G),  # a dtype safetensors has no name for
    "f8": torch.randn(5, generator=_G).to(torch.float8_e4m3fn),
    "scalar": torch.tensor(3.5),
    "empty": torch.zeros(0, 4),
    "transposed": torch.randn(3, 2, generator=_G).t(),
}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits."""
    bits = [x.contiguous().reshape(-1).view(torch.uint8) for x in (a, b)]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(*bits)


def _header(path, start=0):
    raw = path.read_bytes()[start:]
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n])


@pytest.mark.parametrize("name", list(TENSORS))
def test_loose_files_round_trip_every_dtype_and_are_safetensors(tmp_path, name):
    t = TENSORS[name]
    s = TensorStore(tmp_path)
    key = s.put(fingerprint_key(t), t)
    assert [p.name for p in tmp_path.iterdir()] == [f"{key}.safetensors"] and key in s
    assert _same(s.get(key), t)
    if name != "c128":  # the others are plain safetensors tensors, named by their key
        assert _same(load_file(str(s.path(key)))[key], t)


def test_the_same_key_is_stored_once(tmp_path):
    s = TensorStore(tmp_path)
    t = TENSORS["f32"]
    key = fingerprint_key(t)
    s.put(key, t)
    before = s.path(key).stat().st_mtime_ns
    s.put(key, t.clone())
    assert len(list(tmp_path.iterdir())) == 1 and s.path(key).stat().st_mtime_ns == before


def test_pt_files_of_earlier_runs_are_read_with_weights_only(tmp_path):
    s = TensorStore(tmp_path)
    t = TENSORS["f32"]
    torch.save(t, tmp_path / "00112233445566ff.pt")
    assert "00112233445566ff" in s and _same(s.get("00112233445566ff"), t)
    s.put("00112233445566ff", torch.zeros(1))  # stored already (as .pt): not written again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00112233445566ff.pt"]
    torch.save({"a": t}, tmp_path / "0011223344556600.pt")
    with pytest.raises(TraceFormatError, match="payload is not a tensor"):
        s.get("0011223344556600")
    marker = tmp_path / "unpickled"

    class Trap:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (tmp_path / "0011223344556601.pt").write_bytes(pickle.dumps(Trap(), protocol=2))
    with pytest.raises(TraceFormatError, match="corrupt tensor payload"):
        s.get("0011223344556601")
    assert not marker.exists()


@pytest.mark.parametrize("key", ["", "../etc/passwd", "ABCDEF0123456789", "abc", 12])
def test_keys_that_are_not_content_keys_are_refused_before_any_file_is_opened(tmp_path, key):
    s = TensorStore(tmp_path)
    assert key not in s
    with pytest.raises(TraceFormatError, match="not a content key"):
        s.put(key, torch.ones(1))
    with pytest.raises(TraceFormatError, match="not a content key"):
        s.get(key)
    assert not list(tmp_path.iterdir())


def test_missing_and_corrupt_files_are_one_line_errors(tmp_path):
    s = TensorStore(tmp_path)
    with pytest.raises(TraceFormatError, match="missing from the store"):
        s.get("00112233445566ff")
    key = s.put("00112233445566ff", TENSORS["f32"])
    raw = s.path(key).read_bytes()
    s.path(key).write_bytes(raw[:-10])
    with pytest.raises(TraceFormatError, match="truncated tensor store file") as e:
        s.get(key)
    assert str(s.path(key)) in str(e.value) and "\n" not in str(e.value)
    s.path(key).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + raw[-80:])
    with pytest.raises(TraceFormatError, match="corrupt tensor store file"):
        s.get(key)
    flipped = bytearray(raw)
    flipped[-3] ^= 0x55  # same size, a readable header: only the fingerprint written with the data tells
    s.path(key).write_bytes(bytes(flipped))
    with pytest.raises(TraceFormatError, match="does not match the fingerprint .* written with it"):
        s.get(key)


# -- packs: many small tensors, one shard per batch -------------------------------------------------------

def test_packs_store_each_key_once_across_batches_and_reopening(tmp_path):
    s = TensorStore(tmp_path, pack="tensors.bin")
    items = [(fingerprint_key(t), t) for t in TENSORS.values()]
    index = {}
    w = s.open_pack(index=index)
    spans = w.put_many(items[:6] + items[:2])  # duplicates within a batch
    again = w.put_many(items[:3])  # ... and across batches: nothing new written
    assert spans[6:] == spans[:2] and again == spans[:3]
    size = s.pack_path.stat().st_size
    assert w.size == sum(t.numel() * t.element_size() for _, t in items[:6])
    w.close()
    w = s.open_pack(append=True, index=index)  # a dump switched off and on again
    spans = spans[:6] + w.put_many(items)[6:]
    assert w.put_many(items[:1]) == spans[:1] and w.size == sum(t.numel() * t.element_size() for _, t in items)
    w.close()
    assert s.pack_path.stat().st_size > size
    for (key, t), span in zip(items, spans):
        assert _same(s.read_span(span, t.dtype, t.shape), t)
        assert _same(s.get(key), t) and key in s  # by key, through the shards' headers
    first = _header(s.pack_path)  # the first shard is a safetensors header naming the first batch by key
    assert list(first)[:6] == [k for k, _ in items[:6]] and first["__metadata__"]["format"] == "determ-tensors"


def test_a_pack_of_raw_bytes_from_earlier_dumps_reads_by_span(tmp_path):
    a, b = torch.arange(4.0), torch.arange(3, dtype=torch.int64)
    (tmp_path / "tensors.bin").write_bytes(a.numpy().tobytes() + b.numpy().tobytes())
    s = TensorStore(tmp_path, pack="tensors.bin")
    assert _same(s.read_span([0, 16], torch.float32, [4]), a) and _same(s.read_span([16, 24], torch.int64, [3]), b)
    with pytest.raises(TraceFormatError, match=r"truncated payload file: x needs bytes \[16, 48\)"):
        s.read_span([16, 32], torch.int64, [4], name="x")
    assert fingerprint_key(a) not in s


def test_a_failed_shard_write_leaves_only_whole_shards(tmp_path, monkeypatch):
    w = PackWriter(tmp_path / "tensors.bin")
    first = w.put_many([("00000000000000a1", torch.ones(100))])
    size = (tmp_path / "tensors.bin").stat().st_size
    real = store_mod.write_all

    def partial(fd, data):
        os.write(fd, b"x" * 50)  # half a shard lands, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_mod, "write_all", partial)
    with pytest.raises(OSError, match="No space left"):
        w.put_many([("00000000000000a2", torch.zeros(100))])
    assert (tmp_path / "tensors.bin").stat().st_size == size
    monkeypatch.setattr(store_mod, "write_all", real)
    second = w.put_many([("00000000000000a2", torch.zeros(100))])
    w.close()
    s = TensorStore(tmp_path, pack="tensors.bin")
    assert torch.equal(s.read_span(first[0], torch.float32, [100]), torch.ones(100))
    assert torch.equal(s.read_span(second[0], torch.float32, [100]), torch.zeros(100))
    assert "00000000000000a2" in s


def test_a_dump_of_an_earlier_release_reads_its_raw_payloads(tmp_path):
    """Index and tensors.bin as determ wrote them before shards: raw bytes back to back, spans in the index."""
    x = torch.arange(6.0).reshape(2, 3)
    rank = tmp_path / "rank0"
    (rank / "dump").mkdir(parents=True)
    (rank / "dump" / "tensors.bin").write_bytes(x.numpy().tobytes())
    entry = {"name": "Functional_relu_0_forward", "op": "Functional.relu", "seq": 0,
             "inputs": [{"name": "input", "dtype": "torch.float32", "shape": [2, 3], "hash": fingerprint_key(x),
                         "payload": [0, 24]}], "outputs": []}
    (rank / "dump.pkl").write_text(json.dumps({"format": "determ-dump", "version": 1, "rank": 0}) + "\n"
                                   + json.dumps(entry, separators=(",", ":")) + "\n"
                                   + json.dumps({"end": True, "count": 1, "payload_bytes": 24, "complete": True})
                                   + "\n")
    d = dump.read_dump(rank)
    assert torch.equal(d.tensor(d.entries[0]["inputs"][0]), x)


# -- tensor files: observer references, the minifier's exchange ------------------------------------------

def test_tensor_files_store_identical_tensors_once_and_keep_strides(tmp_path):
    t = TENSORS["f32"]
    named = {"a": t, "b": t.clone(), "c": TENSORS["transposed"], "d": TENSORS["c128"]}
    p = tmp_path / "x.safetensors"
    save_tensor_file(p, named, {"format": "mine"})
    header = _header(p)
    assert header["__metadata__"]["format"] == "mine"
    assert sorted(k for k in header if k != "__metadata__") == sorted({fingerprint_key(v) for v in named.values()})
    out, meta = load_tensor_file(p)
    assert meta["format"] == "mine" and set(out) == set(named)
    for k, v in named.items():
        assert _same(out[k], v)
    assert out["c"].stride() == TENSORS["transposed"].stride()
    with safe_open(str(p), framework="pt") as f:  # a safetensors file any reader opens
        assert set(f.keys()) == {k for k in header if k != "__metadata__"}


def test_observer_files_of_earlier_releases_read_by_name(tmp_path):
    x = torch.randn(4, generator=_G)
    with db.ObserverContext(tmp_path, "ref"):
        db.observe_non_deterministic("v", x)
    tensors, meta = load_tensor_file(tmp_path / "ref.safetensors")
    assert meta["format"] == "determ-observer-tensors" and list(tensors) == ["v#0.0"]
    save_file(tensors, str(tmp_path / "ref.safetensors"),  # as earlier releases wrote it: tensors under their names
              metadata={"format": "determ-observer-tensors", "run": "ref"})
    with db.ObserverContext(tmp_path, "run2", reference_hash_file=tmp_path / "ref.jsonl"):
        y = db.observe_non_deterministic("v", torch.zeros(4))
    assert torch.equal(y, x)


def test_checksum_keys_and_store_for(tmp_path):
    data = torch.arange(10, dtype=torch.uint8)
    assert checksum_key(data) == hashlib.sha256(bytes(range(10))).hexdigest()[:40]
    run = tmp_path / "run"
    run.mkdir()
    with TraceWriter(run / "trace.jsonl") as w:
        w.write([])
    assert store_for(run) is None and store_for(tmp_path / "missing") is None
    (run / "tensors").mkdir()
    assert store_for(run).root == run / "tensors" and store_for(run / "trace.jsonl").root == run / "tensors"


def test_names_of_equal_content_load_as_tensors_of_their_own(tmp_path):
    save_tensor_file(tmp_path / "t.safetensors", {"a": torch.zeros(3), "b": torch.zeros(3)})
    got, _ = load_tensor_file(tmp_path / "t.safetensors")
    got["a"].add_(1)
    assert torch.equal(got["b"], torch.zeros(3))


def test_atomically_written_files_get_the_mode_a_plain_open_gives(tmp_path):
    from determ_backend.trace.stream import atomic_write_text

    atomic_write_text(tmp_path / "atomic.txt", "x")
    (tmp_path / "plain.txt").write_text("x")
    assert os.stat(tmp_path / "atomic.txt").st_mode == os.stat(tmp_path / "plain.txt").st_mode


@pytest.mark.parametrize("span, dtype, shape, needle", [
    ([0, 12], torch.float32, [4], "holds 12 bytes, its dtype and shape need 16"),
    ([0, 8], torch.int64, [2], "holds 8 bytes, its dtype and shape need 16"),
    ([0, 16], torch.float32, [-4], "bad shape"),
])
def test_a_span_that_cannot_hold_its_dtype_and_shape_is_a_format_error(tmp_path, span, dtype, shape, needle):
    (tmp_path / "tensors.bin").write_bytes(torch.arange(8.0).numpy().tobytes())
    with pytest.raises(TraceFormatError, match=needle):
        TensorStore(tmp_path, pack="tensors.bin").read_span(span, dtype, shape, name="x")
