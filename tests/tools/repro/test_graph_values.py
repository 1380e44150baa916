"""Tensor files of the one store where the repro tools keep values: the minifier's ``inputs.pt`` (safetensors
under its documented name; the torch.save lists of earlier releases still read, weights only) and repro stores
written before their files named the tensor by its key."""

from __future__ import annotations

import json
import math
import pickle
import struct

import pytest
import torch
import torch.fx as fx

from determ_backend.errors import ReproError
from repro_tools.repro.graph_code import load_tensors, read_graph_dir, save_tensors, write_graph_dir
from repro_tools.repro.script import load_repro, write_repro


def test_value_lists_round_trip_as_safetensors(tmp_path):
    x = torch.randn(3, 4)
    values = [x, x.clone(), x.t(), 3, 2.5, math.inf, None, True, "s", torch.float16, torch.device("cpu"),
              [x[0], (1, torch.zeros(2, dtype=torch.int64))], torch.Size([2, 3])]
    p = tmp_path / "inputs.pt"
    save_tensors(values, p)
    raw = p.read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    assert header["__metadata__"]["format"] == "determ-graph-values"
    assert len([k for k in header if k != "__metadata__"]) == 4  # x stored once; x.t(), x[0], zeros
    out = load_tensors(p)
    assert torch.equal(out[0], x) and torch.equal(out[1], x) and out[2].stride() == x.t().stride()
    assert out[3:11] == [3, 2.5, math.inf, None, True, "s", torch.float16, torch.device("cpu")]
    assert isinstance(out[11], list) and isinstance(out[11][1], tuple) and torch.equal(out[11][0], x[0])
    assert type(out[12]) is torch.Size and out[12] == torch.Size([2, 3])
    with pytest.raises(ReproError, match="a dict cannot be saved"):
        save_tensors([{"a": 1}], tmp_path / "bad.pt")


def test_inputs_of_earlier_releases_are_read_weights_only(tmp_path):
    gm = fx.symbolic_trace(lambda a: (a * 2,))
    x = torch.randn(4)
    write_graph_dir(gm, [x], tmp_path)
    torch.save([x, 3], tmp_path / "inputs.pt")  # what write_graph_dir wrote before
    _, inputs, _ = read_graph_dir(tmp_path)
    assert torch.equal(inputs[0], x) and inputs[1] == 3
    marker = tmp_path / "unpickled"

    class Trap:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (tmp_path / "inputs.pt").write_bytes(pickle.dumps([Trap()], protocol=2))
    with pytest.raises(ReproError, match="inputs.pt: cannot load tensors"):
        read_graph_dir(tmp_path)
    assert not marker.exists()


def test_repro_stores_written_before_tensors_were_named_by_key_still_load(tmp_path):
    gm = fx.symbolic_trace(lambda a: (a + 1,))
    x = torch.randn(5)
    path = write_repro(gm, [x], tmp_path / "repro.py")
    (f,) = (tmp_path / "repro_store").glob("*.safetensors")
    data = x.numpy().tobytes()
    header = json.dumps({"data": {"dtype": "U8", "shape": [len(data)], "data_offsets": [0, len(data)]},
                         "__metadata__": {"sha256_prefix": f.stem}}).encode()
    header += b" " * (-len(header) % 8)
    f.write_bytes(struct.pack("<Q", len(header)) + header + data)  # the layout of earlier releases
    _, inputs, _ = load_repro(path)
    assert torch.equal(inputs[0], x)
