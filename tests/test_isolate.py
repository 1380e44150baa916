"""The persistent oracle worker: reused across queries, survives crashes and hangs; graph code round trip."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from determ_backend.errors import ReproError
from repro_tools.graph_code import graph_from_source, graph_source, read_graph_dir, write_graph_dir
from repro_tools.isolate import Worker
from repro_tools.oracles import OracleSpec


def _graphs():
    x = torch.randn(4, 3)
    erf = make_fx(lambda x: (torch.erf(x) + 1,))(x)
    plain = make_fx(lambda x: (torch.relu(x) + 1,))(x)
    return erf, plain, [x]


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.close()


def test_worker_is_reused_across_queries(worker):
    erf, plain, inputs = _graphs()
    spec = OracleSpec(kind="accuracy", compiler="minifier_helpers:wrong_erf")
    assert worker.check(spec, erf, inputs).fails
    assert not worker.check(spec, plain, inputs).fails
    assert worker.starts == 1
    sides = worker.observe(spec, erf, inputs)
    assert torch.allclose(sides[0][0], torch.erf(inputs[0] * 1.05) + 1)


@pytest.mark.slow
@pytest.mark.parametrize("compiler,kind,what", [
    ("minifier_helpers:abort_on_erf", "crash", "SIGABRT"),
    ("minifier_helpers:segfault_on_erf", "crash", "SIGSEGV"),
    ("minifier_helpers:hang_on_erf", "hang", "timeout"),
])
def test_worker_survives_crashing_and_hanging_candidates(worker, compiler, kind, what):
    erf, plain, inputs = _graphs()
    spec = OracleSpec(kind=kind, compiler=compiler, timeout=20.0 if kind == "crash" else 3.0)
    v = worker.check(spec, erf, inputs)
    assert v.fails and v.signature.type == what
    starts = worker.starts
    v2 = worker.check(spec, plain, inputs)  # the next query gets a fresh worker and an answer
    assert not v2.fails and "did not happen" in v2.detail
    assert worker.starts == starts + 1
    # a crash is not an accuracy failure: the accuracy oracle says "does not fail" and carries on
    acc = worker.check(OracleSpec(kind="accuracy", compiler=compiler, timeout=3.0), erf, inputs)
    assert not acc.fails and acc.signature.stage in ("crash", "hang")


def test_graph_code_round_trip(tmp_path):
    erf, _, inputs = _graphs()
    src = graph_source(erf)
    gm = graph_from_source(src)
    assert torch.equal(gm(*inputs)[0], erf(*inputs)[0])
    write_graph_dir(erf, inputs, tmp_path, {"kind": "accuracy"})
    gm2, ins2, meta = read_graph_dir(tmp_path / "graph.py")
    assert meta == {"kind": "accuracy"} and torch.equal(ins2[0], inputs[0])


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_graph_dir_bad_inputs_are_clear(tmp_path, damage):
    erf, _, inputs = _graphs()
    write_graph_dir(erf, inputs, tmp_path)
    if damage == "missing":
        (tmp_path / "inputs.pt").unlink()
    else:
        (tmp_path / "inputs.pt").write_bytes(b"not a tensor file")
    with pytest.raises(ReproError, match="inputs.pt"):
        read_graph_dir(tmp_path)
