"""The ``repro-tools`` entry point: ``--version`` in-process and through the installed console script."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version

import torch
from backend_helpers import compile_run

from repro_tools.cli import main

VERSION = version("determ")


def test_version_in_process(capsys):
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == f"repro-tools (determ) {VERSION}"


def test_version_through_the_console_script():
    script = os.path.join(os.path.dirname(sys.executable), "repro-tools")
    assert os.path.exists(script), f"{script} missing: run scripts/setup (pip install -e '.[test]')"
    out = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"repro-tools (determ) {VERSION}"


def test_usage_errors_exit_2(capsys):
    assert main([]) == 2
    assert main(["--no-such-option"]) == 2
    assert "usage: repro-tools" in capsys.readouterr().err



def _two_runs(tmp_path):
    """Two traced runs that differ, and the console script."""
    torch.manual_seed(0)
    m, x = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), torch.randn(2, 4)
    _, a = compile_run(m, (x,), "determ_eager", tmp_path, "a")
    _, b = compile_run(m, (x + 1,), "determ_eager", tmp_path, "b")
    return a, b, os.path.join(os.path.dirname(sys.executable), "repro-tools")


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path):
    """``repro-tools diff ... | head``: output into a closed pipe ends quietly with the shell's SIGPIPE code."""
    a, b, script = _two_runs(tmp_path)
    proc = subprocess.Popen([script, "diff", str(a), str(b)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the command has written anything (importing torch takes far longer)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_an_output_that_cannot_be_written_is_one_line_not_a_traceback(tmp_path):
    """A full disk behind stdout, and an output directory under a regular file: one line each, exit 2."""
    a, b, script = _two_runs(tmp_path)
    if os.path.exists("/dev/full"):
        with open("/dev/full", "w") as full:
            r = subprocess.run([script, "diff", str(a), str(b)], stdout=full, stderr=subprocess.PIPE, text=True)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("repro-tools"), r.stderr
    (tmp_path / "afile").write_text("x")
    r = subprocess.run([script, "report", str(a), "-o", str(tmp_path / "afile" / "page.html")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
