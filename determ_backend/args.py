"""Checks of the tools' constructor arguments: one line naming the argument and what was expected."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Optional

from determ_backend.errors import ConfigError

__all__ = ["check_bool", "check_count", "check_path"]


def check_bool(**flags) -> None:
    for name, v in flags.items():
        if not isinstance(v, bool):
            raise ConfigError(f"{name}={v!r}: expected True or False")


def check_count(name: str, v, minimum: int, optional: bool = False) -> None:
    if optional and v is None:
        return
    if type(v) is not int or v < minimum:
        expected = "a positive integer" if minimum > 0 else "a non-negative integer"
        raise ConfigError(f"{name}={v!r}: expected {expected}{' or None' if optional else ''}")


def check_path(name: str, v, optional: bool = False) -> Optional[Path]:
    """``v`` as a :class:`~pathlib.Path` naming a file that can be made: not a directory, and its nearest existing
    ancestor a directory (missing ones are made when it is written).  One ``stat`` for a file that exists (a trace
    written again each step), two for a new file in an existing directory."""
    if optional and v is None:
        return None
    if not isinstance(v, (str, os.PathLike)) or not str(v):
        raise ConfigError(f"{name}={v!r}: expected a file name (str or path)")
    if "\0" in str(v):
        raise ConfigError(f"{name}={str(v)!r}: holds a NUL character; expected a file name")
    p = Path(v)
    found = _stat(p)
    if found is not None:
        if stat.S_ISDIR(found.st_mode):
            raise ConfigError(f"{name}={str(v)!r}: is a directory; expected a file name")
        return p  # a file that exists sits in a directory
    parent = p.parent
    while True:
        found = _stat(parent)
        if found is not None or os.path.lexists(parent):  # a link to nothing exists, and is no directory
            if found is None or not stat.S_ISDIR(found.st_mode):
                raise ConfigError(f"{name}={str(v)!r}: {str(parent)!r} is not a directory; expected a file name "
                                  f"in a directory")
            return p
        if parent == parent.parent:
            return p
        parent = parent.parent


def _stat(p: Path) -> Optional[os.stat_result]:
    try:
        return os.stat(p)
    except OSError:  # missing, or not readable
        return None
