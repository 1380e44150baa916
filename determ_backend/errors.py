"""determ's exception hierarchy.

Every error determ raises on purpose derives from :class:`DetermError`, so callers
(and the ``repro-tools`` CLI, which turns them into one line on stderr and exit
code 2) can tell our diagnostics apart from bugs.
"""

from __future__ import annotations

import re as _re

__all__ = [
    "DetermError",
    "ConfigError",
    "UnsupportedDtypeError",
    "DeviceUnavailableError",
    "TraceFormatError",
    "ReproError",
    "AccuracyError",
    "OracleError",
    "NondeterminismError",
    "first_line",
    "exception_line",
]

# the last line of a Python traceback: ``[module.]Name: message`` of an exception class (``RuntimeError: ...``,
# ``torch._dynamo.exc.Unsupported: ...``), or an exception's name alone (``KeyboardInterrupt``)
_EXCEPTION_LINE = _re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Z]\w*:\s.*$"
                              r"|^(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Failed|Failure|Interrupt|Exit)$")


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (a checker error is one line), or "" when it has none."""
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def exception_line(stderr: str) -> str:
    """The line of a failed Python program's ``stderr`` that says what went wrong: the last line naming an exception
    (``RuntimeError: ...``; torch's compile errors end with advice to set ``TORCHDYNAMO_VERBOSE``, and a chained one
    with the error that ended the program), else the last non-empty line, else ""."""
    lines = [line.rstrip() for line in stderr.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if _EXCEPTION_LINE.match(line):
            return line
    return lines[-1] if lines else ""


class DetermError(Exception):
    """Root of every error determ raises deliberately."""


class ConfigError(DetermError, ValueError):
    """A setting (argument, ``DETERM_*``/``REPRO_*`` env var or compile option) has a bad value."""


class UnsupportedDtypeError(DetermError, TypeError):
    """A tensor's dtype or layout cannot be fingerprinted (e.g. a sparse tensor)."""


class DeviceUnavailableError(DetermError, RuntimeError):
    """A device (``cuda``, ``npu``, ``xpu``) was asked for but is not present here."""


class TraceFormatError(DetermError, ValueError):
    """A trace, dump or content-store file is missing, truncated, corrupt or of the wrong kind."""


class ReproError(DetermError, RuntimeError):
    """A repro script, launcher or content store cannot be used as given."""


class AccuracyError(DetermError, AssertionError):
    """Compiled results diverge from the eager/fp64 reference beyond tolerance."""


class OracleError(DetermError, RuntimeError):
    """An oracle cannot judge a candidate (e.g. the input graph does not fail at all)."""


class NondeterminismError(DetermError, RuntimeError):
    """Two executions that should be bitwise identical are not (an op run twice, or a run vs its reference)."""
