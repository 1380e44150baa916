"""Checks of the tools' constructor arguments: one line naming the argument and what was expected."""

from __future__ import annotations

import os
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
    if optional and v is None:
        return None
    if not isinstance(v, (str, os.PathLike)) or not str(v):
        raise ConfigError(f"{name}={v!r}: expected a file name (str or path)")
    p = Path(v)
    if os.path.isdir(v):
        raise ConfigError(f"{name}={str(v)!r}: is a directory; expected a file name")
    for parent in p.parents:  # the nearest existing ancestor must be a directory (missing ones are made)
        if os.path.lexists(parent):
            if not os.path.isdir(parent):
                raise ConfigError(f"{name}={str(v)!r}: {str(parent)!r} is not a directory; expected a file name "
                                  f"in a directory")
            break
    return p
