"""The repro flows as plug-ins: what ``REPRO_AFTER=dynamo|aot`` runs around a backend, and the repro writer.

The flows themselves (dumping a failing graph, minifying it, writing ``repro.py``)
are offline tools and live in :mod:`repro_tools.flows`.  They register under the
``determ_flows`` entry-point group, one entry per ``REPRO_AFTER`` value, each naming
a module: ``dynamo`` provides ``wrap_backend(backend, cfg, name)`` and ``aot``
provides ``wrap_compiler(compiler, cfg, compiler_name)``; ``repro`` provides
``write_repro(gm, inputs, path, meta=...)`` (a check that found a failure writes the
graph as a ``repro.py`` for the minifier); ``report`` provides ``write_run_report(run_dir)``
(a run with a finding writes its ``report.html``).  Looking them up here keeps
:mod:`determ_backend` free of imports of :mod:`repro_tools`.
"""

from __future__ import annotations

import functools
from importlib.metadata import entry_points
from types import ModuleType

from determ_backend.errors import ConfigError

__all__ = ["GROUP", "load_flow", "write_repro", "write_report"]

#: The entry-point group the repro flows register under.
GROUP = "determ_flows"


@functools.lru_cache(maxsize=None)
def load_flow(name: str) -> ModuleType:
    """The module that implements ``REPRO_AFTER=<name>``; a :class:`ConfigError` when none is installed."""
    eps = entry_points()
    if hasattr(eps, "select"):  # Python 3.10+
        found = list(eps.select(group=GROUP, name=name))
    else:  # Python 3.9: a dict of group -> entry points
        found = [e for e in eps.get(GROUP, ()) if e.name == name]
    if not found:
        what = f"REPRO_AFTER={name}: no repro flow of that name" if name in ("dynamo", "aot") else \
            f"no {name!r} plug-in"
        raise ConfigError(f"{what} is installed (entry-point group {GROUP!r}; reinstall determ: pip install -e .)")
    return found[0].load()


def write_repro(gm, inputs, path, meta):
    """``gm`` on ``inputs`` as a standalone ``repro.py`` at ``path`` (the ``repro`` plug-in); returns its path."""
    return load_flow("repro").write_repro(gm, inputs, path, meta=meta)


def write_report(run_dir):
    """The HTML report of the run in ``run_dir``, written there as ``report.html`` (the ``report`` plug-in);
    returns its path."""
    return load_flow("report").write_run_report(run_dir)
