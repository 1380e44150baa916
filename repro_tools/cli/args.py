"""Argument types the ``repro-tools`` commands share (argparse turns their errors into one usage line, exit 2)."""

from __future__ import annotations

import argparse
import math

__all__ = ["tol_arg", "seconds_arg"]


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
