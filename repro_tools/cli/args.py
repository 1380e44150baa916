"""Argument types the ``repro-tools`` commands share (argparse turns their errors into one usage line, exit 2)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Union

from determ_backend.errors import ConfigError
from determ_backend.trace.stream import dir_problem

__all__ = ["tol_arg", "seconds_arg", "check_writable_dir"]


def tol_arg(text: str) -> float:
    """``--tol``: a finite number >= 0 (a NaN tolerance would pass nothing, a negative one everything)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return v


def seconds_arg(text: str) -> float:
    """``--timeout``: a finite number of seconds > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return v


def check_writable_dir(out: Union[str, Path], what: str) -> None:
    """``out`` is, or can become, a directory (:func:`~determ_backend.trace.stream.dir_problem`), else a one-line
    :class:`ConfigError` naming the flag ``what``: checked before any work, so that a bad directory is not found
    when the first result is written."""
    problem = dir_problem(out)
    if problem is not None:
        raise ConfigError(f"{what} {out}: {problem}; expected a directory (new or existing)")
