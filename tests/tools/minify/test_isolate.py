"""The persistent oracle worker: reused across queries, survives crashes and hangs; graph code round trip."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from determ_backend.errors import ReproError
from repro_tools.repro.codegen import graph_source
from repro_tools.repro.graph_code import graph_from_source, read_graph_dir, write_graph_dir
from repro_tools.minify.isolate import Worker
from repro_tools.minify.oracles import OracleSpec
from paths import ROOT


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


_PARENT = """
import sys, time
sys.path[:0] = {paths!r}
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from repro_tools.minify.isolate import Worker
from repro_tools.minify.oracles import OracleSpec

w = Worker()
x = torch.randn(4, 3)
gm = make_fx(lambda x: (torch.erf(x) + 1,))(x)
print(w.tmp, flush=True)
w.check(OracleSpec(kind="hang", compiler="minifier_helpers:hang_on_erf", timeout=600), gm, [x])
"""


def _children(pid):
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _exited(pid, seconds=10.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_worker_dies_with_its_killed_parent_and_its_files_are_collected_later(tmp_path):
    root = ROOT
    code = _PARENT.format(paths=[str(root / "tests"), str(root)])
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    tmp = Path(parent.stdout.readline().strip())
    deadline, workers = time.monotonic() + 120, []
    while not workers and time.monotonic() < deadline:
        time.sleep(0.2)
        workers = _children(parent.pid)
    assert workers and tmp.is_dir()
    time.sleep(1.0)
    parent.kill()  # SIGKILL: the parent cannot clean up
    parent.wait()
    assert _exited(workers[0])
    assert tmp.is_dir()  # left behind by the killed parent ...
    Worker().close()  # ... and removed by the next worker
    assert not tmp.exists()
