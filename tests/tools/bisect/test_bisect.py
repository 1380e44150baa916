"""repro-tools bisect: the guilty stage and knob of real failures, through real subprocess runs.

Each bisect run starts the user's script in a fresh process (5-60 s on this
machine), so the end-to-end cases are few and marked slow.  DETERM_BISECT_STAGE
inside the backends is checked in-process.
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from determ_backend.backends import run as run_mod
from determ_backend.trace.stream import read_trace
from repro_tools.bisect import core as bisect_mod
from repro_tools.cli import main

# An injected inductor lowering bug (relu computes x + 1), caught by the determ accuracy check.
INDUCTOR_BUG = """
    import torch
    torch._inductor.config.cpp.inject_relu_bug_TESTING_ONLY = "accuracy"

    def f(x):
        return (x * 2.0 + 1.0).relu().sin()

    torch.compile(f, backend="determ_inductor", options={"check": "accuracy"})(torch.randn(8, 8))
"""

# An AOT-level problem: the op's decomposition seen while AOT traces (Python dispatcher) is not
# its eager kernel.  Plain torch backend, failure by exit status.
AOT_BUG = """
    import sys
    import torch

    lib = torch.library.Library("determ_bisect_test", "DEF")
    lib.define("scale(Tensor x) -> Tensor")
    lib.impl("scale", lambda x: x * 2.0, "CompositeImplicitAutograd")
    torch.ops.determ_bisect_test.scale.default.py_impl(torch._C.DispatchKey.CompositeImplicitAutograd)(
        lambda x: x * 3.0)

    def f(x):
        return torch.ops.determ_bisect_test.scale(x).sin()

    x = torch.randn(8)
    sys.exit(0 if torch.allclose(torch.compile(f, backend="aot_eager")(x), f(x)) else 1)
"""

HEALTHY = """
    import sys
    import torch

    def f(x):
        return x.sin() * 2.0 + 1.0

    x = torch.randn(16)
    sys.exit(0 if torch.allclose(torch.compile(f)(x), f(x)) else 1)
"""


def bisect(tmp_path: Path, capsys, source: str):
    """``repro-tools bisect --json -- python script.py``: (exit code, verdict)."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    code = main(["bisect", "--json", "--no-progress", "--workdir", str(tmp_path / "work"), "--",
                 sys.executable, str(script)])
    out = capsys.readouterr().out
    verdict = json.loads(out)
    print(f"bisect measured: stage={verdict['stage']} knob={verdict['knob']} runs={verdict['runs']} "
          f"seconds={verdict['seconds']}", file=sys.stderr)
    return code, verdict


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_inductor_lowering_bug_names_inductor_and_the_lowering(tmp_path, capsys):
    code, v = bisect(tmp_path, capsys, INDUCTOR_BUG)
    assert code == 1
    assert (v["stage"], v["knob"]) == ("inductor", "lowerings") and "relu" in v["detail"]
    assert v["failure"].startswith("determ accuracy divergence")
    assert [h["failed"] for h in v["history"][:4]] == [False, False, False, True]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_aot_level_problem_names_aot_eager(tmp_path, capsys):
    code, v = bisect(tmp_path, capsys, AOT_BUG)
    assert code == 1
    assert v["stage"] == "aot_eager" and v["knob"] is None and v["failure"] == "exit status 1"
    assert v["runs"] == 2


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_healthy_command(tmp_path, capsys):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(HEALTHY))
    assert main(["bisect", "--no-progress", "--", sys.executable, str(script)]) == 0
    out = capsys.readouterr().out
    assert "healthy: the command passes under every stage" in out and out.startswith("bisect: 4 runs, ")
    print(f"bisect measured: healthy {out.splitlines()[0]}", file=sys.stderr)


@pytest.mark.parametrize("argv, needle", [
    ([], "no command given"),
    (["--"], "no command given"),
    (["--", "determ-no-such-command"], "'determ-no-such-command' not found"),
    (["--timeout", "0", "--", sys.executable], "--timeout must be a positive number"),
    (["{script}"], "a Python script runs as: repro-tools bisect -- python {script}"),
    (["--workdir", "{script}", "--", sys.executable], "--workdir {script}: {script} is a file, not a directory"),
])
def test_usage_errors_exit_2(capsys, argv, needle, tmp_path):
    script = tmp_path / "repro.py"
    script.write_text("")
    argv, needle = [a.format(script=script) for a in argv], needle.format(script=script)
    assert main(["bisect", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_knobs_cover_the_numerics_settings():
    names = [k for k, _ in bisect_mod.config_knobs("inductor")]
    for k in ("fallback_random", "emulate_precision_casts", "cpp.vec_isa_ok", "split_reductions"):
        assert k in names
    assert "lowerings" in bisect_mod.counted_subsystems("inductor")
    assert "decomposition" in bisect_mod.counted_subsystems("aot_eager_decomp_partition")


# ------------------------------------------------------------------ DETERM_BISECT_STAGE inside the backends

def _hardswish_log_softmax(x):
    return torch.nn.functional.hardswish(x).log_softmax(-1)


@pytest.mark.parametrize("stage, trace_stage, decomposed", [
    ("eager", "dynamo", False),
    ("aot_eager", "aot_forward", False),
    ("aot_eager_decomp_partition", "aot_forward", True),
])
def test_bisect_stage_caps_the_stack_and_keeps_tracing(tmp_path, stage, trace_stage, decomposed):
    torch._dynamo.reset()
    x = torch.randn(4, 8)
    opts = {"dir": str(tmp_path), "run_id": stage, "bisect_stage": stage}
    out = torch.compile(_hardswish_log_softmax, backend="determ_inductor", options=opts)(x)
    run_mod.finish_all()
    torch.testing.assert_close(out, _hardswish_log_softmax(x))
    records = read_trace(tmp_path / stage)
    assert {r.stage for r in records} == {trace_stage}
    ops = {r.op for r in records}
    assert ("aten.hardswish.default" not in ops and "aten.clamp_min.default" in ops) == decomposed


# ------------------------------------------------------------------ where runs write, what they leave behind

# A nondeterministic op (fresh noise each call) seen by the determ determinism check: no exit status, only
# the report says divergent, written where the script's own options put it, relative to the directory the
# command changes into.
NOISY_OWN_DIR = """
    import random
    import torch

    @torch.library.custom_op("determ_bisect_test::noisy", mutates_args=())
    def noisy(x: torch.Tensor) -> torch.Tensor:
        return x + random.SystemRandom().random() * 1e-3

    @noisy.register_fake
    def _(x):
        return torch.empty_like(x)

    def f(x):
        return torch.ops.determ_bisect_test.noisy(x.sin()).cos()

    opts = {"check": "determinism", "dir": "my_out", "raise_on_divergence": False}
    torch.compile(f, backend="determ_aot_eager", options=opts)(torch.randn(8))
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_report_is_found_when_the_script_changes_directory_and_names_its_own_dir(tmp_path, capsys, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "script.py").write_text(textwrap.dedent(NOISY_OWN_DIR))
    monkeypatch.chdir(tmp_path)
    code = main(["bisect", "--json", "--no-progress", "--workdir", "rel_logs", "--", "bash", "-c",
                 f"cd sub && {sys.executable} ../script.py"])
    v = json.loads(capsys.readouterr().out)
    assert code == 1 and v["stage"] == "eager" and v["runs"] == 2, v  # passes without torch.compile
    assert v["failure"].startswith("determ determinism divergence at noisy")
    assert (tmp_path / "rel_logs" / "runs" / "000").is_dir() and not (tmp_path / "sub" / "rel_logs").exists()
    # under bisect, the run's report goes to bisect's own directory, whatever the script's options say
    assert list((tmp_path / "rel_logs" / "runs").glob("*/determ_out/bisect-*/report.json"))
    assert not (tmp_path / "sub" / "my_out").exists()


def test_command_failing_without_compiling_is_not_a_compiler_failure(tmp_path, capsys):
    code = main(["bisect", "--no-progress", "--workdir", str(tmp_path), "--", sys.executable, "-c",
                 "import sys; sys.exit(3)"])
    out = capsys.readouterr().out
    assert code == 2 and "not a compiler failure" in out and "exit status 3" in out and "guilty" not in out


def test_a_command_that_compiles_nothing_is_nothing_to_bisect(tmp_path, capsys):
    """It passes every stage without compiling a graph: not 'healthy' (it was), there was nothing to bisect."""
    code = main(["bisect", "--no-progress", "--json", "--workdir", str(tmp_path), "--", sys.executable, "-c",
                 "import torch; print(torch.ones(2).sum())"])
    v = json.loads(capsys.readouterr().out)
    assert code == 2 and v["compiled"] is False and v["healthy"] is False and v["stage"] is None
    code = main(["bisect", "--no-progress", "--workdir", str(tmp_path / "again"), "--", sys.executable, "-c", "0"])
    assert code == 2 and "nothing to bisect: the command compiled no graph" in capsys.readouterr().out


_SPAWNER = "import subprocess, sys; p = subprocess.Popen(['sleep', '60']); " \
           "open(sys.argv[1], 'a').write(f'{p.pid}\\n'); p.wait()"


def test_timeout_kills_the_commands_grandchildren(tmp_path, capsys):
    pids = tmp_path / "pids"
    code = main(["bisect", "--no-progress", "--timeout", "2", "--workdir", str(tmp_path / "w"), "--",
                 sys.executable, "-c", _SPAWNER, str(pids)])
    capsys.readouterr()
    assert code == 2  # timed out with torch.compile disabled too
    spawned = [int(p) for p in pids.read_text().split()]
    assert len(spawned) == 2
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in spawned) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in spawned)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_an_after_aot_repro_failing_uncompiled_is_explained_not_called_no_compiler_failure(tmp_path, capsys):
    """A repro written after AOT compiles its graph with inductor itself: disabling torch.compile changes nothing,
    and bisect called an inductor bug 'not a compiler failure'."""
    import torch.fx as fx

    from repro_tools.bisect.core import Verdict, _print_text
    from repro_tools.repro.script import write_repro

    gm = fx.symbolic_trace(torch.nn.ReLU())
    path = write_repro(gm, [torch.randn(3)], tmp_path / "repro.py", meta={"kind": "accuracy", "after": "aot",
                                                                          "compiler": "inductor_inner"})
    _print_text(Verdict(fails_uncompiled=True, reason="exit status 1"), ["python", str(path)])
    out = capsys.readouterr().out
    assert "written after AOT" in out and "not a compiler failure" not in out
    _print_text(Verdict(fails_uncompiled=True, reason="exit status 1"), ["python", "train.py"])
    assert "not a compiler failure" in capsys.readouterr().out
