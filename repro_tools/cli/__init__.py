"""``repro-tools``: the command line.  Thin: parsing and dispatch only.

Each subcommand lives in its own module exposing ``register(subparsers)``: the
commands of this package (:mod:`.diff`, :mod:`.minify`, :mod:`.ranks`, :mod:`.compare`,
:mod:`.dump_export`, :mod:`.demo`, :mod:`.report`) and
the command families' packages (:mod:`repro_tools.xdevice`, :mod:`repro_tools.bisect`,
:mod:`repro_tools.minify.analyze`); that function adds the subparser and sets
``func=handler`` where ``handler(args) -> int`` returns the exit code
(0 success / no divergence, 1 divergence or failure reproduced, 2 usage or input error).
What the commands do lives in those modules and their packages; a launcher's ``minify``
subcommand runs :mod:`.minify`'s handler itself (:func:`repro_tools.flows.failure.minify_script`).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import List, Optional

from determ_backend.errors import DetermError

__all__ = ["main", "build_parser", "configure_logging"]

_COMMANDS = (
    "repro_tools.cli.diff",
    "repro_tools.cli.minify",
    "repro_tools.cli.ranks",
    "repro_tools.cli.compare",
    "repro_tools.cli.dump_export",
    "repro_tools.xdevice",
    "repro_tools.bisect",
    "repro_tools.cli.demo",
    "repro_tools.minify.analyze",
    "repro_tools.cli.report",
)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("determ")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="repro-tools", description="Find where a PyTorch model's numbers go wrong.")
    p.add_argument("--version", action="version", version=f"repro-tools (determ) {_version()}")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        importlib.import_module(name).register(sub)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    try:
        rc = _main(argv)
        sys.stdout.flush()  # a reader that left surfaces here, not in the interpreter's final flush
        return rc
    except BrokenPipeError:  # `repro-tools ... | head`: the reader left; the rest of the output has no taker
        _silence_stdout()
        return 128 + 13  # the shell's convention for SIGPIPE
    except KeyboardInterrupt:
        print("repro-tools: interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # the results could not be written (a full disk behind stdout)
        _silence_stdout()
        print(f"repro-tools: error: cannot write the output: {_os_error(e)}", file=sys.stderr)
        return 2


def _os_error(e: OSError) -> str:
    """``strerror: file`` of an OSError, in one line."""
    where = f": {e.filename}" if getattr(e, "filename", None) else ""
    return f"{e.strerror or e}{where}"


def _main(argv: Optional[List[str]]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help/--version exit 0, usage errors exit 2
        return int(e.code or 0)
    configure_logging(args.verbose)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args))
    except DetermError as e:
        print(f"repro-tools {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise
    except OSError as e:  # a file the command reads or writes (an output path under a regular file, a full disk)
        print(f"repro-tools {args.command}: error: {_os_error(e)}", file=sys.stderr)
        return 2


def configure_logging(verbose: bool = False) -> None:
    """The commands' logging: INFO (DEBUG with ``verbose``) on stderr, unless the process configured its own."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a file descriptor: nothing left to flush into a pipe
        pass


if __name__ == "__main__":
    sys.exit(main())
