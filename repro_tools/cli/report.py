"""``repro-tools report PATH... [-o report.html]``: one self-contained HTML page of a result.

PATH is a run directory, a trace, two traces or run directories, an ``xdevice`` output, two API
dumps, a compare output directory or CSV, or a minify output (:mod:`repro_tools.report.sources`).
The page's path goes to stdout (with ``--screenshot PNG``, the picture's path after it).  Exit 0: written, nothing diverges; 1: written, the result
diverges; 2: bad input.
"""

from __future__ import annotations

import argparse
import logging

from determ_backend.errors import ConfigError

from repro_tools.cli.args import tol_arg
from repro_tools.report import build, write_html
from repro_tools.report.screenshot import screenshot

__all__ = ["register", "run_report"]

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="write a self-contained HTML page of a result (plot, root cause, node table)",
                       description="Render any determ result as one HTML page that opens from file:// with no "
                                   "network: the verdict and root cause with its source lines, the error along the "
                                   "graph, the root cause's producers and consumers, and a filterable node table. "
                                   "Exit 0: nothing diverges; 1: the result diverges; 2: bad input.")
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="a run directory (report.json), a trace, two traces or run directories, an xdevice output, "
                        "two API dumps, a compare output (directory or CSV), or a minify output directory")
    p.add_argument("-o", "--output", default="report.html", metavar="OUT",
                   help="the page to write (default ./report.html)")
    p.add_argument("--tol", type=tol_arg, default=None,
                   help="two traces: judge within TOL instead of bitwise; an xdevice output: the tolerance its "
                        "devices are judged with (default: xdevice's own, 1e-3)")
    p.add_argument("--screenshot", metavar="PNG",
                   help="also render the page in headless Chromium and save a PNG of its top (needs chromium)")
    p.add_argument("--size", default="1100x1180", metavar="WxH",
                   help="the screenshot's window size in pixels (default 1100x1180)")
    p.set_defaults(func=run_report)


def _size(text: str):
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--size {text!r}: expected WIDTHxHEIGHT in pixels, e.g. 1100x1180") from None
    if w <= 0 or h <= 0:  # refused before the page is written, not after
        raise ConfigError(f"--size {text!r}: expected two positive integers, e.g. 1100x1180")
    return w, h


def run_report(args: argparse.Namespace) -> int:
    size = _size(args.size) if args.screenshot else None
    rep = build(args.paths, tol=args.tol)
    try:
        out = write_html(rep, args.output)
    except OSError as e:
        raise ConfigError(f"-o {args.output}: cannot write the page ({e.strerror or e}); expected a writable "
                          "file path") from None
    log.info("%s report: %s", rep.kind, rep.verdict)
    print(out)
    if args.screenshot:
        print(screenshot(out, args.screenshot, *size))
    return 1 if rep.divergent or rep.shown_alike is False else 0
