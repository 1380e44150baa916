"""Every access to private torch APIs (``torch._dynamo``, ``torch._inductor``,
``torch._functorch``, ...) goes through this module, so a torch upgrade touches
one file.  Imports are lazy: importing determ does not import inductor.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator

import torch

__all__ = ["torch_version", "set_fallback_random"]


def torch_version() -> tuple:
    """``(major, minor)`` of the running torch, compared as integers."""
    parts = torch.__version__.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def inductor_config():
    import torch._inductor.config as cfg

    return cfg


def dynamo_config():
    import torch._dynamo.config as cfg

    return cfg


def set_fallback_random(value: bool) -> None:
    inductor_config().fallback_random = value


@contextlib.contextmanager
def inductor_config_patch(changes: Dict[str, Any]) -> Iterator[None]:
    """Temporarily set inductor config entries (dotted names, e.g. ``cpp.inject_relu_bug_TESTING_ONLY``)."""
    with inductor_config().patch(changes):
        yield


def lookup_backend(name_or_fn) -> Callable:
    """Resolve a dynamo backend name (``"inductor"``, ``"aot_eager"``, a registered entry point) or callable."""
    from torch._dynamo.backends.registry import lookup_backend as _lookup

    return _lookup(name_or_fn)


def aot_autograd(**kwargs) -> Callable:
    from torch._dynamo.backends.common import aot_autograd as _aot

    return _aot(**kwargs)


def compile_fx(gm, example_inputs, **kwargs):
    from torch._inductor.compile_fx import compile_fx as _cfx

    return _cfx(gm, example_inputs, **kwargs)


def compile_fx_inner(gm, example_inputs, **kwargs):
    from torch._inductor.compile_fx import compile_fx_inner as _inner

    return _inner(gm, example_inputs, **kwargs)


def dynamo_reset() -> None:
    import torch._dynamo

    torch._dynamo.reset()
