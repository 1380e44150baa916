"""The ``repro-tools`` entry point: ``--version`` in-process and through the installed console script."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version

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
