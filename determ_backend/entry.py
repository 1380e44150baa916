"""The backends as torch finds them: the ``torch_dynamo_backends`` entry points name this module.

Looking a backend up (``torch.compile(model, backend="determ_inductor")`` does, before anything is
compiled) first reads the determ settings of the environment, so a bad one (``REPRO_LEVEL=9``,
``DETERM_CHECK=bogus``) is our one-line :class:`~determ_backend.errors.ConfigError` raised by
``torch.compile`` itself, not a ``BackendCompilerFailed`` at the first call.  ``options=`` given to
``torch.compile`` are only known when the graph compiles; they are checked then.
"""

from __future__ import annotations

from typing import Any

from determ_backend.errors import ConfigError
from determ_backend.trace.stream import dir_problem

__all__ = ["determ_eager", "determ_aot_eager", "determ_inductor"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from determ_backend.backends import core as backends
        from determ_backend.config import load_config

        cfg = load_config()
        problem = dir_problem(cfg.dir)
        if problem:
            raise ConfigError(f"DETERM_DIR={cfg.dir!r}: {problem}; expected a directory that can be created")
        return getattr(backends, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
