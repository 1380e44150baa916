"""The HTML report: one self-contained page of any result determ writes.

* :mod:`.sources`: :func:`build` reads a run directory, a trace, two traces, an ``xdevice``
  output, two API dumps, a compare output or a minify output into a :class:`~.model.Report`;
* :mod:`.model`: the report and its node rows (verdicts from the compare core);
* :mod:`.render`: the page (jinja2, autoescaped; styles and script inlined);
* :mod:`.screenshot`: a PNG of a page, by headless Chromium.

:func:`write_run_report` is the ``report`` plug-in of the ``determ_flows`` entry-point group: a run with
a finding writes ``report.html`` next to its ``report.json`` through it.  The command is
``repro-tools report`` (:mod:`repro_tools.cli.report`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence, Union

from determ_backend.backends.run import REPORT_HTML

from repro_tools.report.model import Report
from repro_tools.report.render import render, write_html
from repro_tools.report.sources import build, detect

__all__ = ["Report", "build", "detect", "render", "write", "write_run_report", "REPORT_NAME"]

REPORT_NAME = REPORT_HTML  # the run's own page is named by the run


def write(paths: Sequence[Union[str, Path]], out: Optional[Union[str, Path]] = None) -> Path:
    """The report of ``paths`` written to ``out`` (default ``report.html`` in the current directory)."""
    return write_html(build([str(p) for p in paths]), out or REPORT_NAME)


def write_run_report(run_dir: Union[str, Path]) -> Path:
    """``<run_dir>/report.html`` from the run's ``report.json``, pairs files and trace."""
    return write([run_dir], Path(run_dir) / REPORT_NAME)
