"""Settings validation (determ_backend/config.py, run.py) and the online reference check
(determ_backend/checks.py): bad values are one ConfigError line quoting the value, a reference is
read strictly when the run is created, never overwritten, and never compared silently with nothing."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from backend_helpers import MLP, compile_run, load
from determ_backend.config import load_config
from determ_backend.errors import ConfigError, TraceFormatError
from determ_backend.backends.run import Run

# ---------------------------------------------------------------------- settings


@pytest.mark.parametrize("options,env,needle", [
    ({"dir": None}, {}, "options['dir']=None: expected a non-empty string"),
    ({}, {"DETERM_DIR": ""}, "DETERM_DIR=''"),
    ({"repro_level": 4.7}, {}, "options['repro_level']=4.7: expected an integer"),
    ({}, {"REPRO_LEVEL": "4.7"}, "REPRO_LEVEL='4.7': expected an integer"),
    ({}, {"REPRO_LEVEL": "7"}, "REPRO_LEVEL='7'; expected 1, 2, 3 or 4"),
    ({}, {"DETERM_RUN_ID": "../../escape"}, "DETERM_RUN_ID='../../escape'; expected a plain directory name"),
    ({"run_id": ".."}, {}, "options['run_id']='..'; expected a plain directory name"),
    ({}, {"DETERM_TRACE": "2"}, "DETERM_TRACE='2': expected a boolean"),
    ({}, {"DETERM_TOL": "-1"}, "DETERM_TOL='-1'; expected a non-negative number"),  # as given, not as converted
    ({}, {"DETERM_FP64_MULTIPLIER": "0"}, "DETERM_FP64_MULTIPLIER='0'; expected a positive number"),
    ({}, {"DETERM_RUN_ID": " "}, "DETERM_RUN_ID=' '; expected a plain directory name"),
    ({"run_id": "\t"}, {}, "options['run_id']='\\t'; expected a plain directory name"),
    ({"check": "speed"}, {}, "options['check']='speed': unknown check(s) speed"),
    # a value out of range names the options key the user gave, not the environment variable (unset)
    ({"repro_level": 7}, {"REPRO_LEVEL": "2"}, "options['repro_level']=7; expected 1, 2, 3 or 4"),
    ({"REPRO_AFTER": "foo"}, {}, "options['REPRO_AFTER']='foo'; expected 'dynamo' or 'aot'"),
    ({"tol": -1}, {}, "options['tol']=-1; expected a non-negative number"),
    ({"tol": 1e-3}, {"REPRO_LEVEL": "0"}, "REPRO_LEVEL='0'; expected 1, 2, 3 or 4"),
])
def test_bad_settings_are_one_line_quoting_the_value(options, env, needle):
    with pytest.raises(ConfigError) as e:
        load_config(options, env=env)
    assert needle in str(e.value) and len(str(e.value).splitlines()) == 1


def test_integral_values_and_given_settings():
    cfg = load_config({"repro_level": 4.0}, env={"DETERM_TOL": "1e-3"})
    assert cfg.repro_level == 4
    assert cfg.given == {"repro_level", "tol"}
    assert load_config(env={}).given == frozenset()
    assert cfg == load_config(env={}).replace(repro_level=4)  # "given" is bookkeeping, not a setting


@pytest.mark.parametrize("sub", ["", "sub"])
def test_determ_dir_that_is_a_file_is_a_config_error(tmp_path, sub):
    f = tmp_path / "afile"
    f.write_text("")
    path = str(f / sub) if sub else str(f)
    with pytest.raises(ConfigError, match="DETERM_DIR=.*afile.*expected a writable directory"):
        Run(load_config({"dir": path, "run_id": "r"}, env={}))
    assert f.read_text() == ""


# ---------------------------------------------------------------------- the reference trace


def _reference(tmp_path, run_id="ref", backend="determ_eager", x=None, calls=1):
    torch.manual_seed(0)
    m = MLP()
    x = torch.randn(4, 8) if x is None else x
    torch._dynamo.reset()
    f = torch.compile(m, backend=backend, options={"dir": str(tmp_path), "run_id": run_id})
    for _ in range(calls):
        f(x)
    from determ_backend.backends import run as run_mod

    run_mod.finish_all()
    return m, x, tmp_path / run_id


def test_reference_of_another_backend_is_a_checker_error_not_a_silent_pass(tmp_path, caplog):
    m, x, ref = _reference(tmp_path, backend="determ_eager")
    with caplog.at_level(logging.WARNING, logger="determ_backend.backends.run"):
        _, run_dir = compile_run(m, (x * 1.001,), "determ_aot_eager", tmp_path, "new", backward=True,
                                 reference=str(ref))
    report = load(run_dir)[1]
    assert report["divergent"] is False
    errors = report["checker_errors"]
    assert len(errors) == 2 and all(str(ref) in e for e in errors)
    assert "stage aot_forward" in errors[0] and "stage aot_backward" in errors[1] and "g0/dynamo" in errors[0]
    logged = [r.getMessage() for r in caplog.records if "reference" in r.getMessage()]
    assert len(logged) == 3 and all(len(msg.splitlines()) == 1 for msg in logged)
    assert "g0/dynamo call 0" in logged[2] and "never made by this run" in logged[2]  # nothing of it was compared


def test_calls_beyond_the_reference_are_reported_once(tmp_path):
    m, x, ref = _reference(tmp_path, calls=1)
    torch._dynamo.reset()
    f = torch.compile(m, backend="determ_eager", options={"dir": str(tmp_path), "run_id": "more",
                                                          "reference": str(ref)})
    for _ in range(3):
        f(x)
    from determ_backend.backends import run as run_mod

    run_mod.finish_all()
    report = load(tmp_path / "more")[1]
    assert report["divergent"] is False
    assert report["checker_errors"] == [f"reference: {ref}: the reference recorded 1 call(s) of graph g0 stage "
                                        f"dynamo; calls from 1 on are not compared"]


@pytest.mark.parametrize("content,needle", [
    (None, "no such trace file"),
    ('{"format": "determ-trace", "version": 1}\n{"graph": "g0", "stage"', "corrupt or truncated"),
    ('{"format": "determ-trace", "version": 1}\n', "truncated trace"),
])
def test_bad_reference_fails_when_the_run_is_created_and_writes_nothing(tmp_path, content, needle):
    ref = tmp_path / "ref.jsonl"
    if content is not None:
        ref.write_text(content)
    out = tmp_path / "out"
    with pytest.raises(TraceFormatError) as e:
        Run(load_config({"dir": str(out), "run_id": "r", "reference": str(ref)}, env={}))
    msg = str(e.value)
    assert msg.startswith("DETERM_REFERENCE: ") and str(ref) in msg and needle in msg
    assert len(msg.splitlines()) == 1 and not out.exists()


def test_bad_reference_fails_the_compile_not_a_later_call(tmp_path):
    torch._dynamo.reset()
    f = torch.compile(MLP(), backend="determ_eager",
                      options={"dir": str(tmp_path), "run_id": "r", "reference": str(tmp_path / "missing")})
    with pytest.raises(Exception, match="DETERM_REFERENCE: .*missing: no such trace file") as e:
        f(torch.randn(2, 8))
    assert "BackendCompilerFailed" in type(e.value).__name__  # raised while compiling
    assert not (tmp_path / "r").exists()


def test_a_run_id_that_exists_gets_a_fresh_directory_and_its_reference_is_kept(tmp_path, caplog):
    _, _, ref = _reference(tmp_path, run_id="same")
    before = (ref / "trace.jsonl").read_bytes()
    run = Run(load_config({"dir": str(tmp_path), "run_id": "same", "reference": str(ref / "trace.jsonl")}, env={}))
    assert run.dir == tmp_path / "same-2" and "writes to" in caplog.text
    run.close()
    assert (ref / "trace.jsonl").read_bytes() == before


class _Cancel(torch.nn.Module):
    """A float32 catastrophic cancellation: fine in float64, ruined in float32."""

    def forward(self, x):
        a = torch.sin(x)
        b = (a + 1e8) - 1e8
        return b * 3 + torch.cos(x)


def test_reference_from_another_dtype_is_compared_within_tolerance(tmp_path):
    x = torch.randn(16, generator=torch.Generator().manual_seed(0))
    compile_run(_Cancel(), (x,), "determ_eager", tmp_path, "f32")
    _, run_dir = compile_run(_Cancel(), (x,), "determ_eager", tmp_path, "f64", device="cpu:float64",
                             reference=str(tmp_path / "f32"))
    report = load(run_dir)[1]
    assert report["divergent"] and report["checker_errors"] == []
    finding = report["findings"][0]
    assert finding["mode"] == "tol=0.001"
    assert [(r["node"], r["op"]) for r in finding["root_causes"]] == [("b", "operator.sub")]
    header = json.loads((run_dir / "trace.jsonl").read_text().splitlines()[0])
    assert header["device"] == "cpu"


@pytest.mark.parametrize("tol,divergent", [(None, True), (1e-3, False)])
def test_given_tolerance_applies_to_a_same_device_reference(tmp_path, tol, divergent):
    m, x, ref = _reference(tmp_path)
    x2 = x.clone()
    x2[0, 0] = torch.nextafter(x2[0, 0], torch.tensor(float("inf")))
    opts = {"reference": str(ref)} if tol is None else {"reference": str(ref), "tol": tol}
    _, run_dir = compile_run(m, (x2,), "determ_eager", tmp_path, "new", **opts)
    report = load(run_dir)[1]
    assert report["divergent"] is divergent and report["checker_errors"] == []


# ---------------------------------------------------------------------- report.json


def test_report_names_a_trace_only_once_one_is_written_and_takes_detail_findings(tmp_path, caplog):
    run = Run(load_config({"dir": str(tmp_path), "run_id": "r"}, env={}))
    assert run.report()["trace"] is None  # nothing traced yet: no trace.jsonl to point at
    with caplog.at_level(logging.WARNING, logger="determ_backend.backends.run"):
        run.add_finding("repro accuracy", {"divergent": True, "detail": "output 0: max_abs=0.01"})
    run.close()
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["divergent"] is True and report["trace"] is None
    assert report["first_divergence"]["check"] == "repro accuracy"
    assert "determ repro accuracy divergence: output 0: max_abs=0.01" in caplog.text
    assert not (tmp_path / "r" / "trace.jsonl").exists()


def test_a_repeated_divergence_that_grows_is_said_again_and_kept_as_the_worst_call(tmp_path, caplog):
    """Repeats of one divergence are counted in its finding; one that grew by orders of magnitude (or turned
    non-finite) was folded in silently, with the first call's small metrics."""
    run = Run(load_config({"dir": str(tmp_path), "run_id": "r", "report": False}, env={}))

    def summary(call, err):
        fd = {"graph": "g0", "stage": "aot_forward", "call": call, "node": "nd", "op": "x", "metrics": {"max_abs": err}}
        return {"divergent": True, "first_divergence": fd, "root_causes": [dict(fd)]}

    with caplog.at_level(logging.WARNING, logger="determ_backend.backends.run"):
        for call, err in enumerate((1e-6, 2e-6, 1e3, 5e3, float("inf"))):
            run.add_finding("determinism", summary(call, err))
    run.close()
    (finding,) = json.loads((tmp_path / "r" / "report.json").read_text())["findings"]
    assert finding["repeats"] == 4 and finding["last_call"] == 4 and finding["worst_call"]["call"] == 4
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and "grew at call 2" in lines[1] and "grew at call 4" in lines[2], lines


def test_the_warning_says_when_the_node_it_names_is_no_root_cause(tmp_path, caplog):
    """A first divergence whose inputs were not shown to agree is reported, never marked a root cause; the console
    line read exactly like a root cause's."""
    run = Run(load_config({"dir": str(tmp_path), "run_id": "r"}, env={}))
    fd = {"graph": "g0", "stage": "inductor_forward", "node": "log1p", "op": "aten.log1p.default", "source": "m.py:3"}
    with caplog.at_level(logging.WARNING, logger="determ_backend.backends.run"):
        run.add_finding("accuracy", {"divergent": True, "first_divergence": dict(fd, root_cause=False)})
        run.add_finding("accuracy", {"divergent": True, "first_divergence": dict(fd, node="relu", root_cause=True)})
    run.close()
    lines = [r.message for r in caplog.records]
    assert "first divergence (no root cause" in lines[0] and "node=log1p" in lines[0]
    assert "first divergence" not in lines[1] and "node=relu" in lines[1]


def test_bisect_dir_and_run_id_override_the_scripts_options():
    env = {"DETERM_BISECT_DIR": "/b/out", "DETERM_RUN_ID": "bisect-1-003", "DETERM_DIR": "/b/out"}
    cfg = load_config({"dir": "my_out", "run_id": "mine"}, env=env)
    assert (cfg.dir, cfg.run_id) == ("/b/out", "bisect-1-003")
    assert load_config({"dir": "my_out"}, env={"DETERM_DIR": "/b/out"}).dir == "my_out"  # options win otherwise


_LOOKUP_SCRIPT = """
import torch
f = torch.compile(torch.nn.Linear(4, 4), backend="determ_inductor")
print("torch.compile returned")
f(torch.randn(2, 4))
"""


@pytest.mark.parametrize("var, value, message", [
    ("REPRO_LEVEL", "9", "ConfigError: REPRO_LEVEL='9'; expected 1, 2, 3 or 4"),
    ("DETERM_CHECK", "bogus", "ConfigError: DETERM_CHECK='bogus': unknown check(s) bogus"),
    ("DETERM_RUN_ID", "../../x", "ConfigError: DETERM_RUN_ID='../../x'; expected a plain directory name"),
    ("DETERM_DIR", "{tmp}/afile/out", "afile is a file, not a directory; expected a directory that can be created"),
    # a file system that refuses new directories whatever the permission bits say (root's access() says yes)
    pytest.param("DETERM_DIR", "/proc/determ_out", "cannot create it in /proc",
                 marks=pytest.mark.skipif(not os.path.isdir("/proc"), reason="no /proc")),
])
def test_a_bad_setting_in_the_environment_stops_torch_compile_itself_with_our_line_last(tmp_path, var, value, message):
    import os
    import subprocess
    import sys

    (tmp_path / "afile").write_text("")
    (tmp_path / "s.py").write_text(_LOOKUP_SCRIPT)
    env = dict(os.environ, **{var: value.format(tmp=tmp_path)})
    r = subprocess.run([sys.executable, str(tmp_path / "s.py")], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "torch.compile returned" not in r.stdout
    last = r.stderr.strip().splitlines()[-1]
    assert message in last and "BackendCompilerFailed" not in r.stderr, r.stderr[-2000:]


def test_the_minifiers_compiles_are_neither_traced_nor_checked():
    """The level-4 flow minifies in the program's process: with DETERM_CHECK set, every candidate a determ backend
    compiled was traced and checked as a graph of the program (a one-graph model reported four graphs and findings
    about candidates)."""
    from determ_backend.config import flows_suspended

    env = {"DETERM_CHECK": "accuracy", "REPRO_AFTER": "dynamo", "REPRO_LEVEL": "4", "DETERM_REFERENCE": "/x"}
    with flows_suspended(untraced=True):
        cfg = load_config({"check": "determinism"}, env=env)
        assert (cfg.trace, cfg.check, cfg.reference, cfg.repro_after) == (False, (), None, None)
    with flows_suspended():  # a repro script checks the backend it runs: its checks stay
        assert load_config(env=env).check == ("accuracy",)
    assert load_config(env=env).check == ("accuracy",) and load_config(env=env).trace


def test_a_file_name_argument_is_checked_in_one_line(tmp_path):
    from determ_backend.args import check_path

    afile = tmp_path / "afile"
    afile.write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    assert check_path("log_path", str(afile)) == afile  # exists: written again
    assert check_path("log_path", tmp_path / "new" / "deeper" / "run.log") == tmp_path / "new" / "deeper" / "run.log"
    assert check_path("log_path", "relative.log") == Path("relative.log")
    assert check_path("trace_path", None, optional=True) is None
    bad = [(tmp_path, "is a directory; expected a file name"),
           (afile / "run.log", f"{str(afile)!r} is not a directory"),
           (afile / "sub" / "run.log", f"{str(afile)!r} is not a directory"),
           (tmp_path / "dangling" / "run.log", "dangling' is not a directory"),
           ("", "expected a file name"), (3, "expected a file name"), ("a\0b.log", "holds a NUL character")]
    for value, needle in bad:
        with pytest.raises(ConfigError) as e:
            check_path("log_path", value)
        assert str(e.value).startswith("log_path=") and needle in str(e.value) and "\n" not in str(e.value), e.value


def test_the_error_line_of_a_failed_program_names_its_exception():
    from determ_backend.errors import exception_line

    dynamo = ("Traceback (most recent call last):\n  File \"x.py\", line 3, in <module>\n"
              "torch._dynamo.exc.BackendCompilerFailed: backend='determ_aot_eager' raised:\n"
              "RuntimeError: Expected query, key, and value to have the same dtype\n\n"
              "Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace (please do this especially if you're reporting "
              "a bug to PyTorch). For even more developer context, set TORCH_LOGS=\"+dynamo\"\n")
    assert exception_line(dynamo) == "RuntimeError: Expected query, key, and value to have the same dtype"
    assert exception_line("Traceback ...\n  raise ValueError('boom')\nValueError: boom\n") == "ValueError: boom"
    assert exception_line("Traceback ...\nKeyboardInterrupt\n") == "KeyboardInterrupt"
    unsupported = ("torch._dynamo.exc.Unsupported: Data-dependent branching\n  Explanation: Detected data-dependent "
                   "branching\n\nfrom user code:\n   File \"u.py\", line 4\n\nSet TORCHDYNAMO_VERBOSE=1 for the "
                   "internal stack trace\n")
    assert exception_line(unsupported) == "torch._dynamo.exc.Unsupported: Data-dependent branching"
    assert exception_line("killed: out of memory\n\n") == "killed: out of memory"  # no exception: the last line
    assert exception_line("") == ""
