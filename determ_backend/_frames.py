"""Which stack frames are the user's: the one filter behind every "user source" determ reports.

Owns the roots of code that is not the user's -- torch's package directory,
``determ_backend`` itself and (for the eager modes) the standard library and
frozen modules -- and the walk from a frame outwards to the first user frames.
Used by the eager modes and the observer (op records' ``source`` and stacks, in
:mod:`determ_backend.modes`) and by the API dump (an entry's ``source`` and
``stack``, in :mod:`determ_backend.dump.capture.hooks`); the dump keeps
standard-library frames in its ptdbg-style stacks.  Where an FX node's user source
comes from (its recorded stack trace) is :mod:`determ_backend.backends.instrument`'s
business.
"""

from __future__ import annotations

import importlib.util
import os
import sysconfig
from typing import Any, Dict, List, Optional

import torch

__all__ = ["FrameFilter", "user_frames", "called_from_determ", "in_torch", "caller_outside_torch"]

_TORCH_ROOT = os.path.join(os.path.dirname(torch.__file__), "")
_DETERM_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")
_STDLIB_ROOTS = (os.path.join(sysconfig.get_paths()["stdlib"], ""), "<frozen")
_USER_MODELS = (os.path.join(_DETERM_ROOT, "demo_model.py"),)  # user code that ships with determ (the demo model)


_CACHE_LIMIT = 1 << 14  # code objects remembered per filter (generated code makes new ones)


def _wrapper_files() -> tuple:
    """Files of decorator wrappers that stand between the user and torch (``typing_extensions.deprecated``,
    which torch's deprecated APIs carry): never the user's line."""
    try:
        spec = importlib.util.find_spec("typing_extensions")
    except (ImportError, ValueError):
        return ()
    return (spec.origin,) if spec is not None and spec.origin else ()


class FrameFilter:
    """Which frames are user code: not in torch, not in determ, not a decorator wrapper (:func:`_wrapper_files`),
    and (``stdlib=True``) not in the standard library or a frozen module.  The answer is cached per code object."""

    def __init__(self, stdlib: bool = True) -> None:
        self._roots = (_TORCH_ROOT, _DETERM_ROOT) + _wrapper_files() + (_STDLIB_ROOTS if stdlib else ())
        # id(code) -> internal?  By id: hashing a code object hashes its bytecode and constants every time.
        # The codes are kept alive in _codes, so an id is not reused while it is cached.
        self._cache: Dict[int, bool] = {}
        self._codes: List[Any] = []
        self._walk: Any = ...  # the native walk past frames known to be internal; looked up at the first use

    @property
    def cache(self) -> Dict[int, bool]:
        """``id(code) -> internal?`` for the codes classified so far (cleared in place when full): what a walk in C
        reads, asking :meth:`internal` for a code it does not find."""
        return self._cache

    @property
    def roots(self) -> tuple:
        """The path prefixes of code that is not the user's: a frame whose file starts with one is skipped."""
        return self._roots

    def internal(self, code) -> bool:
        """Whether ``code`` is not the user's (cached, as in :meth:`user_frames`)."""
        found = self._cache.get(id(code))
        if found is None:
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
                self._codes.clear()
            self._codes.append(code)
            found = self._cache[id(code)] = code.co_filename.startswith(self._roots)
        return found

    def user_frames(self, frame, depth: int) -> list:
        """The first ``depth`` user frames from ``frame`` outwards (innermost first)."""
        out = []
        cache = self._cache
        walk = self._walk
        if walk is ...:
            from determ_backend.fingerprint._native import frame_walker  # builds the kernel: not at import

            walk = self._walk = frame_walker()
        while frame is not None:
            if walk is not None:  # skips, in one C loop, the frames already known to be internal
                frame = walk(frame, cache)
                if frame is None:
                    break
            code = frame.f_code
            internal = cache.get(id(code))
            if internal is None:
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                    self._codes.clear()
                self._codes.append(code)
                internal = cache[id(code)] = code.co_filename.startswith(self._roots)
            if not internal:
                out.append(frame)
                if len(out) >= depth:
                    break
            frame = frame.f_back
        return out


_USER = FrameFilter()  # user_frames()'s filter, shared so that its cache lasts from call to call


def user_frames(frame, depth: int = 8) -> List[str]:
    """``file:line in function`` of the first ``depth`` frames outside torch, determ and the stdlib."""
    return [f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}" for f in _USER.user_frames(frame, depth)]


def in_torch(path: str) -> bool:
    """Whether source file ``path`` is torch's own."""
    return path.startswith(_TORCH_ROOT)


def called_from_determ(frame) -> bool:
    """Whether the first frame from ``frame`` outwards that is not torch's is determ's own code
    (a backend's recorder hashing a compiled graph's tensors, a check), the demo model excepted."""
    return caller_outside_torch(frame) == "<determ>"


def caller_outside_torch(frame, stdlib: bool = False) -> Optional[str]:
    """The file of the first frame from ``frame`` outwards that is not torch's (nor the standard library's, with
    ``stdlib``: a ``with`` block of torch's own runs through ``contextlib``), ``"<determ>"`` when it is determ's own
    code (the demo model excepted), None when there is none."""
    while frame is not None:
        path = frame.f_code.co_filename
        if not (path.startswith(_TORCH_ROOT) or (stdlib and path.startswith(_STDLIB_ROOTS))):
            return "<determ>" if path.startswith(_DETERM_ROOT) and path not in _USER_MODELS else path
        frame = frame.f_back
    return None
