"""repro_script: GraphModule + inputs -> standalone repro.py -> (gm, inputs, meta); bad inputs."""

from __future__ import annotations

import logging
import operator
import re

import pytest
import torch
import torch.fx as fx

from determ_backend.errors import ReproError
from repro_tools.repro.script import copy_repro, load_repro, read_meta, write_repro

from repro_helpers import (TESTS, assert_reproduces, capture_graph, forward_source, last_stderr_line, model, run_script,
                           model_inputs, run_code, run_main, run_without_determ)


class WithParams(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("shift", torch.arange(4.0))

    def forward(self, x):
        return (torch.relu(self.lin(x) + self.shift),)


@pytest.fixture
def dynamo_graph():
    return capture_graph(model, *model_inputs(requires_grad=True))


def test_round_trip_keeps_graph_inputs_strides_params_and_meta(tmp_path):
    gm = fx.symbolic_trace(WithParams())
    base = torch.randn(3, 8)
    x = base[:, ::2]
    path = write_repro(gm, [x], tmp_path / "repro.py", meta={"kind": "accuracy", "note": {"a": [1, 2]}})
    gm2, inputs, meta = load_repro(path)
    assert torch.equal(inputs[0], x) and inputs[0].stride() == x.stride()
    assert meta["note"] == {"a": [1, 2]} and meta["kind"] == "accuracy"
    assert meta["torch_version"] == torch.__version__ and meta["device"] == "cpu"
    assert torch.equal(gm2(*inputs)[0], gm(x)[0])
    assert read_meta(path)["note"] == {"a": [1, 2]}


def test_each_distinct_storage_is_stored_once(tmp_path):
    gm = fx.symbolic_trace(lambda a, b, c: (a + b + c,))
    base = torch.randn(16)
    a, b, c = base[:4], base[4:8], torch.randn(4)
    write_repro(gm, [a, b, c], tmp_path / "repro.py")
    assert len(list((tmp_path / "repro_store").glob("*.safetensors"))) == 2
    _, inputs, _ = load_repro(tmp_path / "repro.py")
    assert inputs[0].untyped_storage().data_ptr() == inputs[1].untyped_storage().data_ptr()


def test_forward_is_readable_torch_code_with_source_lines(dynamo_graph, tmp_path):
    path = write_repro(*dynamo_graph, tmp_path / "repro.py")
    src = forward_source(path)
    assert "torch.relu(" in src and "test_repro_script" not in src
    assert "# File: " + str(TESTS / "repro_helpers.py") in path.read_text()  # the user's source line, as a comment
    gm, _, _ = load_repro(path)
    relu = next(n for n in gm.graph.nodes if n.target is torch.relu)
    assert relu.name == "relu" and "repro_helpers.py" in relu.meta["stack_trace"]


@pytest.mark.parametrize("kind, compiler, rc", [
    ("compile_error", "relu_compile_error_TESTING_ONLY", 1),
    ("runtime_error", "relu_runtime_error_TESTING_ONLY", 1),
    ("accuracy", "relu_accuracy_error_TESTING_ONLY", 1),
    ("accuracy", "eager", 0),
    ("nondeterminism", "repro_helpers:noisy_backend", 1),
    ("nondeterminism", "eager", 0),
])
def test_run_reports_by_exit_code(dynamo_graph, tmp_path, capsys, kind, compiler, rc):
    path = write_repro(*dynamo_graph, tmp_path / "repro.py", meta={"kind": kind, "compiler": compiler, "only_fwd": False})
    assert run_main(path, "run") == rc
    assert ("reproduced " + kind if rc else "not reproduced") in capsys.readouterr().out


def test_script_runs_in_a_fresh_process_with_torch_alone(dynamo_graph, tmp_path):
    path = write_repro(*dynamo_graph, tmp_path / "repro.py", meta={"kind": "compile_error",
                                                                   "compiler": "relu_compile_error_TESTING_ONLY"})
    proc = run_without_determ(path, "run", "get-args", "minify")
    assert "exit run 1" in proc.stdout and "reproduced compile_error: ReluCompileError" in proc.stdout, proc.stderr
    assert "exit get-args 0" in proc.stdout and "stored" in proc.stdout
    assert "exit minify 2" in proc.stdout and "needs determ" in proc.stderr


def test_crash_is_checked_in_a_child_process(dynamo_graph, tmp_path):
    path = write_repro(*dynamo_graph, tmp_path / "crash.py", meta={"kind": "any", "compiler": "repro_helpers:relu_abort_backend"})
    proc = assert_reproduces(path, "crash", "torch.relu(")
    assert "SIGABRT" in proc.stdout


def test_fake_or_unsaved_inputs_are_regenerated_with_a_fixed_seed(dynamo_graph, tmp_path, capsys):
    gm, inputs = dynamo_graph
    path = write_repro(gm, inputs, tmp_path / "repro.py", save_data=False)
    assert not (tmp_path / "repro_store").exists()
    _, a, _ = load_repro(path)
    _, b, _ = load_repro(path)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and a[1].requires_grad
    assert run_main(path, "get-args") == 0
    assert capsys.readouterr().out.count("regenerated") == 2
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(x) for x in inputs]
    write_repro(gm, fakes, tmp_path / "fake.py")
    assert read_meta(tmp_path / "fake.py")["regenerated_inputs"] == 2


def test_compile_time_config_is_recorded_and_applied(dynamo_graph, tmp_path):
    import torch._inductor.config as icfg

    with icfg.patch({"cpp.inject_relu_bug_TESTING_ONLY": "accuracy"}):
        path = write_repro(*dynamo_graph, tmp_path / "repro.py")
    assert read_meta(path)["config"]["cpp.inject_relu_bug_TESTING_ONLY"] == "accuracy"
    assert "'cpp.inject_relu_bug_TESTING_ONLY': 'accuracy'" in path.read_text()
    assert icfg.cpp.inject_relu_bug_TESTING_ONLY is None


def test_copy_repro_takes_its_store_along(dynamo_graph, tmp_path):
    src = write_repro(*dynamo_graph, tmp_path / "a" / "repro.py", meta={"kind": "compile_error",
                                                                        "compiler": "relu_compile_error_TESTING_ONLY"})
    dst = copy_repro(src, tmp_path / "b" / "repro.py", {"copied": True})
    (tmp_path / "a" / "repro_store").rename(tmp_path / "gone")
    _, inputs, meta = load_repro(dst)
    assert meta["copied"] and len(inputs) == 2


def _corrupt(store, how):
    f = sorted(store.glob("*.safetensors"))[0]
    if how == "missing":
        f.unlink()
    elif how == "lfs":  # what a clone without `git lfs pull` leaves: a text pointer, whose bytes read as a huge length
        f.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 4096\n")
    elif how == "long":  # a header length past the end of the file
        f.write_bytes(b"\xff" * 7 + b"\x7f" + f.read_bytes()[8:])
    else:
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))


@pytest.mark.parametrize("how, message", [("missing", "missing input file"), ("corrupt", "corrupt content store file"),
                                          ("lfs", "corrupt content store file (a Git LFS pointer"),
                                          ("long", "corrupt content store file")])
def test_bad_content_store_is_one_clear_error(dynamo_graph, tmp_path, capsys, how, message):
    path = write_repro(*dynamo_graph, tmp_path / "repro.py", meta={"kind": "compile_error"})
    _corrupt(tmp_path / "repro_store", how)
    with pytest.raises(ReproError, match=re.escape(message)):
        load_repro(path)
    assert run_main(path, "run") == 2
    err = capsys.readouterr().err
    assert message in err and "repro_store" in err and "Traceback" not in err


def test_repro_from_another_torch_version_warns_and_still_runs(dynamo_graph, tmp_path, caplog, capsys):
    path = write_repro(*dynamo_graph, tmp_path / "repro.py", meta={"kind": "compile_error",
                                                                   "compiler": "relu_compile_error_TESTING_ONLY"})
    path.write_text(re.sub(r"'torch_version': '[^']*'", "'torch_version': '1.13.0'", path.read_text()))
    with caplog.at_level(logging.WARNING):
        load_repro(path)
    assert "written with torch 1.13.0" in caplog.text
    assert run_main(path, "run") == 1
    assert f"written with torch 1.13.0, running torch {torch.__version__}" in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [("x = 1\n", "not a determ repro script"), ("def (:\n", "not a readable")])
def test_not_a_repro_script(tmp_path, content, message):
    (tmp_path / "r.py").write_text(content)
    with pytest.raises(ReproError, match=message):
        load_repro(tmp_path / "r.py")
    with pytest.raises(ReproError, match="no such repro script"):
        load_repro(tmp_path / "missing.py")


@pytest.mark.parametrize("out, message", [("nodir/args.pt", "does not exist"), (".", "is a directory")])
def test_get_args_to_a_bad_out_path_is_one_line_exit_2(dynamo_graph, tmp_path, capsys, out, message):
    path = write_repro(*dynamo_graph, tmp_path / "repro.py")
    assert run_main(path, "get-args", "--out", str(tmp_path / out)) == 2
    err = capsys.readouterr().err
    assert message in err and "--out" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert run_main(path, "get-args", "--out", str(tmp_path / "args.pt")) == 0
    assert len(torch.load(tmp_path / "args.pt", weights_only=True)) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["args.pt", "repro.py", "repro_store"]  # no temp file left


def test_copy_repro_keeps_a_different_file_at_the_destination_and_refuses_its_source(dynamo_graph, tmp_path, caplog):
    src = write_repro(*dynamo_graph, tmp_path / "a" / "repro.py", meta={"kind": "compile_error"})
    (tmp_path / "repro.py").write_text("# the user's own edits\n")
    with caplog.at_level(logging.WARNING):
        copy_repro(src, tmp_path / "repro.py")
    assert (tmp_path / "repro.prev-1.py").read_text() == "# the user's own edits\n" and "repro.prev-1.py" in caplog.text
    copy_repro(src, tmp_path / "repro.py")  # the same content again: nothing to keep
    assert not (tmp_path / "repro.prev-2.py").exists()
    with pytest.raises(ReproError, match="refusing to overwrite"):
        copy_repro(src, src)


@pytest.mark.slow
def test_minifying_the_working_directorys_repro_keeps_it(dynamo_graph, tmp_path, monkeypatch, capsys):
    from repro_tools.flows.failure import minify_script

    monkeypatch.chdir(tmp_path)
    path = write_repro(*dynamo_graph, tmp_path / "repro.py",
                       meta={"kind": "compile_error", "compiler": "repro_helpers:aot_relu_compile_error"})
    original = path.read_text()
    assert minify_script(path, ["--in-process", "--no-progress"]) == 1
    assert path.read_text() == original
    assert last_stderr_line(capsys.readouterr().err) == str(tmp_path / "repro.min.py")
    assert " @ " in forward_source(path) and " @ " not in forward_source(tmp_path / "repro.min.py")
    assert_reproduces(tmp_path / "repro.min.py", "compile_error", "torch.relu(")


def test_minifying_a_repro_that_does_not_fail_exits_0_and_leaves_nothing(dynamo_graph, tmp_path, capsys):
    from repro_tools.flows.failure import minify_script

    path = write_repro(*dynamo_graph, tmp_path / "repro.py", meta={"kind": "accuracy", "compiler": "eager"})
    assert minify_script(path) == 0
    assert "does not fail here" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repro.py", "repro_store"]


@pytest.mark.parametrize("key", ["", "../../etc/passwd", "/tmp/x", "ABCDEF0123456789", "0123"])
def test_a_storage_key_that_is_not_a_checksum_is_refused_by_name(dynamo_graph, tmp_path, capsys, key):
    path = write_repro(*dynamo_graph, tmp_path / "repro.py")
    text = path.read_text()
    stored = re.search(r"'storage': '([0-9a-f]+)'", text).group(1)
    path.write_text(text.replace(f"'storage': '{stored}'", f"'storage': {key!r}", 1))
    for cmd in (["get-args"], ["run", "--in-process"]):
        assert run_main(path, *cmd) == 2
        err = capsys.readouterr().err
        assert f"storage key {key!r} is not a content checksum" in err and len(err.strip().splitlines()) == 1


def test_get_args_does_not_replace_a_file_without_force(dynamo_graph, tmp_path, capsys):
    path = write_repro(*dynamo_graph, tmp_path / "repro.py")
    (tmp_path / "args.pt").write_text("mine")
    assert run_main(path, "get-args", "--out", str(tmp_path / "args.pt")) == 2
    assert "exists; pass --force" in capsys.readouterr().err and (tmp_path / "args.pt").read_text() == "mine"
    assert run_main(path, "get-args", "--out", str(tmp_path / "args.pt"), "--force") == 0
    assert len(torch.load(tmp_path / "args.pt", weights_only=True)) == 2


class _OutVariant(torch.nn.Module):
    """An inference graph as inductor writes them: an ``out=`` matmul, fine without grad, refused by autograd."""

    def forward(self, a, b):
        buf = torch.empty(2, 2)
        torch.mm(a, b, out=buf)
        return buf.relu()


def test_a_forward_only_graph_runs_without_grad_as_it_ran(tmp_path, capsys):
    """A graph captured under no_grad is run so: with grad on, its out= op raised an error of the script's own
    making ('functions with out=... arguments don't support automatic differentiation')."""
    gm = fx.symbolic_trace(_OutVariant())
    a, b = torch.randn(2, 3, requires_grad=True), torch.randn(3, 2)
    path = write_repro(gm, [a, b], tmp_path / "repro.py", meta={"kind": "runtime_error", "compiler": "eager",
                                                                 "only_fwd": True})
    assert run_main(path, "run") == 0
    assert "not reproduced" in capsys.readouterr().out


def test_a_repro_records_the_thread_count_and_runs_with_it(tmp_path):
    """A kernel's C++ error thrown inside an OpenMP region aborts the process: a repro of a program that ran with one
    thread runs with one thread (with the default count the runtime error became a SIGABRT 'crash')."""
    import subprocess
    import sys

    gm = fx.symbolic_trace(_OutVariant())
    prior = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        path = write_repro(gm, [torch.randn(2, 3), torch.randn(3, 2)], tmp_path / "repro.py",
                           meta={"kind": "any", "compiler": "eager", "only_fwd": True})
    finally:
        torch.set_num_threads(prior)
    assert read_meta(path)["threads"] == 1
    probe = tmp_path / "probe.py"
    probe.write_text(f"import runpy, sys, torch\nsys.argv = [{str(path)!r}, 'get-args']\n"
                     f"try:\n    runpy.run_path({str(path)!r}, run_name='__main__')\nexcept SystemExit:\n    pass\n"
                     "print('threads', torch.get_num_threads())\n")
    r = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, timeout=300)
    assert "threads 1" in r.stdout, r.stdout + r.stderr


def test_a_long_compile_error_keeps_its_error_lines():
    from repro_tools.flows.failure import _error_text

    text = "cc1plus: error: 'compile' was not declared\n" + "warning: overflow in conversion\n" * 500
    kept = _error_text(text)
    assert len(kept) <= 4100 and "'compile' was not declared" in kept and kept.endswith("conversion\n")


def test_a_graph_with_inductors_prims_loads_in_a_fresh_process(tmp_path):
    """``prims.inductor_seeds`` & co. exist once torch's inductor registered them: a dropout graph's repro after
    AOT could not be traced back (and so not minified) in a process that had not compiled anything.  So does
    ``prims.fma``, in a compiled AdamW step's dynamo graph: its repro failed to load, a compile error."""
    import torch._inductor.inductor_prims  # noqa: F401  (here, to build the graph)

    prims = torch.ops.prims
    g = fx.Graph()
    x = g.placeholder("x")
    seed = g.call_function(prims.inductor_lookup_seed.default,
                           (g.call_function(prims.inductor_seeds.default, (1, torch.device("cpu"))), 0))
    rand = g.call_function(prims.inductor_random.default, ([3], seed, "rand"))
    g.output((g.call_function(torch.ops.aten.mul.Tensor, (x, g.call_function(torch.ops.aten.gt.Scalar, (rand, 0.5)))),))
    g2 = fx.Graph()  # the fma alone: no prims.inductor_* op in the graph to bring the module in
    y = g2.placeholder("y")
    g2.output((g2.call_function(prims.fma.default, (y, y, y)),))
    for name, graph, op in (("dropout", g, "prims.inductor_random.default"), ("fma", g2, "prims.fma.default")):
        path = write_repro(fx.GraphModule(torch.nn.Module(), graph), [torch.randn(3)], tmp_path / f"{name}.py",
                           meta={"kind": "runtime_error", "compiler": "eager"})
        code = ("import sys, torch\nfrom repro_tools.repro.script import load_repro\n"
                f"gm, inputs, _ = load_repro({str(path)!r})\n"
                "print('targets', sorted({str(n.target) for n in gm.graph.nodes if n.op == 'call_function'}))\n")
        proc = run_code(code, tmp_path)
        assert proc.returncode == 0 and op in proc.stdout, proc.stderr[-2000:]


def test_standalone_accuracy_check_judges_what_a_graph_writes_and_leaves_the_state_as_found():
    """A repro's own check (torch alone) judges a graph's in-place updates of its buffers like its outputs, and
    runs eager, compiled and float64 each from the state it found: a compiled optimizer step whose update is off
    returns nothing wrong."""
    from repro_tools.repro import _harness

    class Repro(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("avg", torch.ones(4))

        def forward(self, x):
            self.avg.mul_(0.9).add_(x, alpha=0.1)
            return (x * 2,)

    mod, x = Repro(), torch.randn(4)

    def right(args):
        return mod(*args)

    def wrong(args):
        out = mod(*args)
        mod.avg.data.mul_(1.5)
        return out

    assert _harness.check_accuracy(mod, right, [x], 1e-3, False) is None
    assert torch.equal(mod.avg, torch.ones(4))
    msg = _harness.check_accuracy(mod, wrong, [x], 1e-3, False)
    assert msg is not None and msg.startswith("avg as the graph left it"), msg
    assert torch.equal(mod.avg, torch.ones(4))


def test_the_standalone_check_numbers_outputs_as_the_flows_do():
    """A graph that returns a size before the tensor that fails: the flow says "output 2" (its place in what the
    graph returns) and so does the repro's own check, which counted tensors only ("output 1")."""
    from repro_tools.repro import _harness

    class Repro(torch.nn.Module):
        def forward(self, x):
            return x.sum(), x.shape[0] * 2, torch.relu(x)

    mod, x = Repro(), torch.randn(4)

    def wrong(args):
        s, n, r = mod(*args)
        return s, n, r + 1

    msg = _harness.check_accuracy(mod, wrong, [x], 1e-3, False)
    assert msg is not None and msg.startswith("output 2"), msg


def test_storages_that_hold_equal_bytes_stay_distinct_and_views_stay_views(tmp_path):
    """Store files are named by their bytes: an optimizer's zero-filled moments (one per parameter) loaded as one
    tensor, and each in-place update of one moved them all."""
    a, b = torch.zeros(3), torch.zeros(3)
    g = fx.Graph()
    xs = [g.placeholder(n) for n in ("a", "b", "c")]
    g.output((g.call_function(torch.ops.aten.add.Tensor, (xs[0], xs[1])),))
    path = write_repro(fx.GraphModule(torch.nn.Module(), g), [a, b, a[1:]], tmp_path / "repro.py",
                       meta={"kind": "runtime_error", "compiler": "eager"})
    _, (la, lb, lc), _ = load_repro(path)
    la.add_(1)
    assert torch.equal(lb, torch.zeros(3)) and torch.equal(lc, torch.ones(2))


def test_a_buffer_updated_in_place_is_traced_back_as_an_update(tmp_path):
    """Traced back with torch.fx, a buffer was read as a constant: ``step += 1`` ran once while tracing and
    was folded away, and ``1 - 0.9 ** step`` with it; the repro of a compiled optimizer step computed NaN."""
    root = torch.nn.Module()
    root.register_buffer("step", torch.zeros(()))
    g = fx.Graph()
    x = g.placeholder("x")
    step = g.call_function(operator.iadd, (g.get_attr("step"), 1))
    g.output((g.call_function(torch.mul, (x, g.call_function(operator.sub, (1, g.call_function(
        operator.pow, (0.9, step)))))),))
    path = write_repro(fx.GraphModule(root, g), [torch.ones(2)], tmp_path / "repro.py",
                       meta={"kind": "runtime_error", "compiler": "eager"})
    gm, inputs, _ = load_repro(path)
    assert gm.step.item() == 0  # tracing ran nothing
    for k in (1, 2):
        (out,) = gm(*inputs)
        assert gm.step.item() == k and torch.allclose(out, torch.full((2,), 1 - 0.9 ** k))


class _BuildsAModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(8, 8)

    def forward(self, x):
        act = torch.nn.ReLU()  # dynamo keeps torch._C._log_api_usage_once(...) for it: a call that makes no node
        h = self.l1(x) * 2.0
        with torch.no_grad():  # _set_grad_enabled(False), (True): calls on constants too
            s = h.sum()
        return act(h) + s


def test_a_script_traced_back_names_each_node_after_the_call_it_was(tmp_path):
    """Calls on constants alone run while the script is traced back and make no node: every later node took the
    name and source line of the node before it (a repro blamed the mul's line for the relu)."""
    gm, inputs = capture_graph(_BuildsAModule(), torch.randn(4, 8))
    targets = {n.target for n in gm.graph.nodes}
    assert torch._C._log_api_usage_once in targets and torch._C._set_grad_enabled in targets
    gm2, _, _ = load_repro(write_repro(gm, inputs, tmp_path / "repro.py"))
    before = {n.name: n.target for n in gm.graph.nodes if n.op == "call_function"}
    after = {n.name: n for n in gm2.graph.nodes if n.op == "call_function"}
    assert after and all(before.get(name) is n.target for name, n in after.items())  # each name on its own call
    relu = next(n for n in after.values() if n.target is torch.nn.functional.relu)
    assert f"test_repro_script.py\", line {_line_of('return act(h) + s')}" in relu.meta["stack_trace"]


def _line_of(text: str) -> int:
    with open(__file__, encoding="utf-8") as f:
        return next(i for i, ln in enumerate(f, 1) if text in ln and "_line_of" not in ln)


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return torch.relu(g) * 2


def _with_subgraphs(x):
    h = _Twice.apply(torch.tanh(x))
    return torch.utils.checkpoint.checkpoint(lambda t: torch.sin(t) * 3, h, use_reentrant=False).sum()


def test_a_graph_with_subgraphs_loads_and_runs(tmp_path, capsys):
    """A dynamo graph holding a custom autograd.Function and a checkpoint passes its bodies to higher-order ops as
    modules; written as plain classes, neither the script ('Repro_fwd_body_0' object has no attribute 'graph',
    reported as a reproduced compile_error) nor determ's loader (so the minifier stopped) could run them."""
    gm, inputs = capture_graph(_with_subgraphs, torch.randn(4, 8, requires_grad=True))
    assert any(n.op == "get_attr" for n in gm.graph.nodes)  # the subgraph bodies
    path = write_repro(gm, inputs, tmp_path / "repro.py", meta={"kind": "compile_error", "compiler": "eager"})
    loaded, args, _ = load_repro(path)
    torch.testing.assert_close(loaded(*args)[0], gm(*inputs)[0])
    assert run_main(path, "run") == 0
    assert "not reproduced" in capsys.readouterr().out


def test_a_compiler_defined_in_the_running_script_is_named_as_such(caplog):
    """A user's compiler defined in the script (``__main__``) is module-level, yet another process cannot import it;
    the warning said 'has no importable name (... has no importable name; ...)', once per graph."""
    from repro_tools.repro.script import compiler_ref, unimportable_label

    def my_fw_compiler(gm, example_inputs):
        return gm

    my_fw_compiler.__module__, my_fw_compiler.__qualname__ = "__main__", "my_fw_compiler"
    with pytest.raises(ReproError, match=r"'my_fw_compiler' is defined in the script being run \(__main__\)") as e:
        compiler_ref(my_fw_compiler)
    with caplog.at_level(logging.WARNING, logger="repro_tools.repro.script"):
        assert unimportable_label(my_fw_compiler, e.value) == unimportable_label(my_fw_compiler, e.value) == "my_fw_compiler"
    assert len([r for r in caplog.records if "defined in the script" in r.message]) == 1


def test_a_clean_answer_on_regenerated_inputs_says_they_are_not_the_programs(tmp_path, capsys):
    """A launcher written before compiling holds fake inputs, so its script regenerates them: a value-dependent
    failure then does not show, and run / analyze / minify / xdevice must not let "it passes" pass for the program's
    answer."""
    from determ_backend.errors import OracleError
    from repro_tools.cli import main
    from repro_tools.minify.analyze import analyze_repro
    from repro_tools.minify.minifier import minify_repro

    gm = fx.symbolic_trace(WithParams())
    x = torch.randn(3, 4)
    meta = {"kind": "accuracy", "compiler": "eager"}
    saved = write_repro(gm, [x], tmp_path / "saved" / "repro.py", meta=meta)
    regen = write_repro(gm, [x], tmp_path / "regen" / "repro.py", meta=meta, save_data=False)
    note = "4 tensors were regenerated from a fixed seed, not the values the program ran with"  # the input and weights
    assert run_main(saved, "run") == 0
    out = capsys.readouterr().out
    assert "not reproduced" in out and "regenerated" not in out
    assert run_main(regen, "run") == 0
    assert note in capsys.readouterr().out
    assert "inputs_note" not in analyze_repro(saved, ("accuracy",))
    assert note in analyze_repro(regen, ("accuracy",))["inputs_note"]
    with pytest.raises(OracleError, match="input graph does not fail.*" + note):
        minify_repro(regen, tmp_path / "min")
    capsys.readouterr()
    assert main(["xdevice", str(regen), "--devices", "cpu,cpu:float64"]) == 0
    assert f"note: {note}" in capsys.readouterr().out
    assert main(["xdevice", str(saved), "--devices", "cpu,cpu:float64"]) == 0
    assert "regenerated" not in capsys.readouterr().out


def test_submodules_whose_names_are_no_identifiers_are_written_as_modules(tmp_path):
    """An fx-traced ``nn.Sequential`` calls submodules named ``0``, ``layers.1``: the script read ``self.0 = ...``
    and did not even parse."""
    class Nested(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
            self.head = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.layers(x))

    x = torch.randn(2, 4)
    for k, m in enumerate([torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), Nested()]):
        path = write_repro(fx.symbolic_trace(m), [x], tmp_path / f"r{k}" / "repro.py",
                           meta={"kind": "accuracy", "compiler": "eager"})
        gm, inputs, _ = load_repro(path)
        assert torch.equal(gm(*inputs), m(x))
        assert run_main(path, "run") == 0


def test_a_dynamo_graph_that_assigns_into_a_tensor_loads_and_runs(tmp_path, capsys):
    """``y[:, 1:] = x[:, :-1]`` (BART's and T5's shift_tokens_right) is an ``operator.setitem`` node: the script's
    tracer had no item assignment, so the repro could not be loaded, minified or analyzed, and ``run`` called its
    own tracing error the compile_error it reproduced."""
    def shift(x, w):
        y = x.new_zeros(x.shape)
        y[:, 1:] = x[:, :-1]
        y[:, 0] = 2.0
        return torch.relu(y @ w)

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    gm, inputs = capture_graph(shift, x, w)
    assert any(n.target is operator.setitem for n in gm.graph.nodes)
    path = write_repro(gm, inputs, tmp_path / "repro.py", meta={"kind": "accuracy", "compiler": "eager"})
    gm2, ins, _ = load_repro(path)
    got = gm2(*ins)
    assert torch.equal(got[0] if isinstance(got, (tuple, list)) else got, shift(x, w))
    assert run_main(path, "run") == 0 and "not reproduced" in capsys.readouterr().out
    # a script whose graph cannot be traced back is the script's fault: exit 2, never "reproduced compile_error"
    broken = tmp_path / "broken.py"
    text = path.read_text()
    broken.write_text(text.replace("    def forward(self", "    def forward(self, *_a, **_k):\n        raise "
                                   "torch.fx.proxy.TraceError('untraceable')\n\n    def _unused(self", 1))
    assert run_main(broken, "run") == 2
    captured = capsys.readouterr()
    assert "reproduced" not in captured.out and "cannot be traced back" in captured.err


def checkpointed_model(x, w):
    block = lambda h: torch.relu(h @ w)  # noqa: E731
    return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).sum(0)


def test_the_nodes_of_a_checkpoints_body_keep_their_names_and_user_lines(tmp_path):
    """After dynamo a checkpoint's body is a subgraph the script writes as a class: loaded back, its nodes had no
    source, so a culprit found there (the minifier inlines the body) was reported at ``<unknown source>``."""
    gm, inputs = capture_graph(checkpointed_model, *model_inputs(requires_grad=True))
    path = write_repro(gm, inputs, tmp_path / "repro.py", meta={"compiler": "eager", "after": "dynamo"})
    gm2, _, _ = load_repro(path)  # traced back, the body is inlined where the checkpoint was
    (relu,) = [n for n in gm2.graph.nodes if n.target is torch.relu]
    line = checkpointed_model.__code__.co_firstlineno + 1
    assert relu.name == "relu" and f'"{__file__}", line {line}' in relu.meta.get("stack_trace", ""), relu.meta
    assert "SUBGRAPH_NODES" in path.read_text()
    load_repro(write_repro(fx.symbolic_trace(WithParams()), [torch.randn(3, 4)], tmp_path / "plain.py"))
    assert "SUBGRAPH_NODES" not in (tmp_path / "plain.py").read_text()  # scripts without subgraphs are as before


def _twice_op(namespace: str) -> str:
    """Source defining custom op ``<namespace>::twice`` (the module of a user's custom op)."""
    return (f"import torch\n@torch.library.custom_op('{namespace}::twice', mutates_args=())\n"
            "def twice(x: torch.Tensor) -> torch.Tensor:\n    return x * 2\n"
            "@twice.register_fake\ndef _(x):\n    return torch.empty_like(x)\n")


_USER_OPS = _twice_op("determ_user_ops")


def test_a_repro_calling_a_users_custom_op_imports_it_from_anywhere_and_says_so_when_it_cannot(tmp_path, monkeypatch):
    """The module defining a custom op was imported at the script's top before its recorded sys_path was applied:
    run from another directory, the script died with ModuleNotFoundError and exit 1 ("reproduced"); and a repro cut
    from it, calling no custom op any more, still imported the module."""
    import importlib

    home = tmp_path / "home"
    home.mkdir()
    (home / "determ_user_ops_mod.py").write_text(_USER_OPS)
    monkeypatch.syspath_prepend(str(home))
    importlib.import_module("determ_user_ops_mod")
    gm, inputs = capture_graph(lambda x: torch.ops.determ_user_ops.twice(torch.relu(x)) + 1, torch.randn(4))
    path = write_repro(gm, inputs, tmp_path / "repro.py", meta={"compiler": "eager", "after": "dynamo"})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ok = run_script(path, "run", cwd=elsewhere)
    assert ok.returncode == 0 and "not reproduced" in ok.stdout, ok.stderr[-1500:]
    (home / "determ_user_ops_mod.py").rename(home / "moved.py")
    gone = run_script(path, "run", cwd=elsewhere)
    assert gone.returncode == 2 and "cannot import determ_user_ops_mod" in gone.stderr
    assert len(gone.stderr.strip().splitlines()) == 1, gone.stderr
    cut = write_repro(fx.symbolic_trace(lambda x: torch.relu(x)), inputs, tmp_path / "cut.py", meta=read_meta(path))
    assert "determ_user_ops_mod" not in cut.read_text().split("META =")[0]  # no import of it above the graph
    assert run_script(cut, "run", cwd=elsewhere).returncode == 0


_MAIN_OP_PROGRAM = _twice_op("determ_main_ops") + '''
import sys
sys.path.insert(0, sys.argv[2])
from repro_helpers import capture_graph
from repro_tools.repro.script import write_repro
gm, inputs = capture_graph(lambda x: torch.relu(twice(x)), torch.randn(4))
write_repro(gm, inputs, sys.argv[1], meta={"compiler": "eager", "after": "dynamo"})
'''


def test_a_repro_calling_a_custom_op_of_the_main_script_says_so_in_one_line(tmp_path):
    """An op defined in the program's main script cannot be imported by any script: ``run``, ``minify`` and
    ``analyze`` said "the Repro module cannot be traced back into a graph ... a fault of the script"."""
    import subprocess
    import sys

    path = tmp_path / "repro.py"
    made = subprocess.run([sys.executable, "-c", _MAIN_OP_PROGRAM, str(path), str(TESTS)], capture_output=True,
                          text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-1500:]
    r = run_script(path, "run")
    assert r.returncode == 2 and "custom op determ_main_ops::twice" in r.stderr and "main program" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    with pytest.raises(ReproError, match="custom op determ_main_ops::twice"):
        load_repro(path)


def test_a_misspelled_kind_in_a_hand_edited_repro_is_bad_input_not_a_clean_result(tmp_path):
    """META ``'kind': 'acuracy'`` checked nothing and printed "not reproduced: ... passed the acuracy check", exit 0."""
    path = write_repro(fx.symbolic_trace(WithParams()), [torch.randn(3, 4)], tmp_path / "repro.py",
                       meta={"kind": "accuracy"})
    path.write_text(path.read_text().replace("'kind': 'accuracy'", "'kind': 'acuracy'"))
    r = run_script(path, "run")
    assert r.returncode == 2 and "META kind 'acuracy': expected one of" in r.stderr, (r.stdout, r.stderr)
    from repro_tools.repro import _harness
    from repro_tools.repro.script import FAILURE_KINDS
    assert _harness._KINDS == FAILURE_KINDS  # the twins agree


def test_a_graph_that_fails_without_the_compiler_is_bad_input_for_run_and_minify(tmp_path):
    """A hand-edited size that no longer fits the inputs: ``run`` said "reproduced compile_error" for the graph's own
    shape error, and ``minify`` that the graph "returns no tensor computed in it"."""
    from repro_tools.cli import main as cli_main

    gm = fx.symbolic_trace(lambda x: (torch.relu(x).view(12, 16),))
    path = write_repro(gm, [torch.randn(10, 16)], tmp_path / "repro.py",
                       meta={"kind": "runtime_error", "compiler": "eager", "after": "aot"})
    r = run_script(path, "run", "--in-process")
    assert r.returncode == 2 and "fails without the compiler too" in r.stderr and "reproduced" not in r.stdout
    with pytest.raises(ReproError, match=r"cannot run eagerly \(RuntimeError: shape '\[12, 16\]' is invalid"):
        from repro_tools.minify import minify
        from repro_tools.minify.oracles import OracleSpec
        minify(*load_repro(path)[:2], OracleSpec(kind="runtime_error", compiler="eager"), progress=False)
    assert cli_main(["minify", str(path)]) == 2


def test_a_repro_cut_from_one_with_several_op_modules_imports_none_of_them(tmp_path):
    """The inherited op modules were subtracted from the imports against an emptied list after the first one: a cut
    graph calling no custom op still imported the second module."""
    meta = {"imports": ["determ_missing_ops_a", "determ_missing_ops_b"],
            "op_imports": ["determ_missing_ops_a", "determ_missing_ops_b"]}
    path = write_repro(fx.symbolic_trace(WithParams()), [torch.randn(3, 4)], tmp_path / "cut.py", meta=meta)
    got = read_meta(path)
    assert "imports" not in got and "op_imports" not in got, got


def test_a_symbolically_traced_call_to_a_wrapped_function_loads(tmp_path, monkeypatch):
    """fx wraps ``math.sqrt`` of a shape, and a user's ``@torch.fx.wrap`` function (data-dependent inside), and the
    traced code calls ``wrap("...")`` first, which fx refuses anywhere but at a module's top level: written inside the
    repro's class, the repro did not import; left out, the repro's own trace of its class went into the function."""
    import importlib
    import math

    (tmp_path / "wrapped_user_mod.py").write_text(
        "import torch, torch.fx\n"
        "@torch.fx.wrap\n"
        "def scale(x):\n"
        "    return x * 2 if x.sum() > -1e9 else x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("wrapped_user_mod")

    def f(x):
        return mod.scale(x) * math.sqrt(x.shape[-1])

    x = torch.randn(2, 4)
    path = write_repro(fx.symbolic_trace(f), [x], tmp_path / "repro.py", meta={"kind": "accuracy", "compiler": "eager"})
    gm, inputs, _ = load_repro(path)
    assert torch.equal(gm(*inputs), f(x))
