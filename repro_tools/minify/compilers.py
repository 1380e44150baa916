"""The compiler under test: resolving it, compiling a GraphModule with it, calling the result.

A compiler is named by a string -- ``"eager"``, any dynamo backend name
(``"inductor"``, ``"aot_eager"``, a registered entry point), ``"inductor_inner"``
(inductor's after-aot entry, for graphs that are already decomposed aten), or
``"package.module:attr"`` naming a backend callable ``f(gm, example_inputs)`` --
or is such a callable itself (in-process use only).  Names cross process
boundaries, callables do not: :func:`compiler_name` turns an importable callable
into its name.

Private torch access goes through :mod:`determ_backend._torch_compat`.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable, Dict, Iterator, List, Sequence, Union

import torch
import torch.fx as fx

from determ_backend import _torch_compat as tc
from determ_backend.errors import ConfigError

__all__ = ["Compiler", "compiler_name", "resolve_compiler", "compile_graph", "call_compiled", "config_patch"]

Compiler = Union[str, Callable]


def _eager(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    return gm.forward


def compiler_name(compiler: Compiler) -> str:
    """A name that resolves to ``compiler`` in another process; :class:`ConfigError` when there is none."""
    if isinstance(compiler, str):
        return compiler
    mod, qual = getattr(compiler, "__module__", None), getattr(compiler, "__qualname__", None)
    if mod and qual and "<" not in qual and mod != "__main__":
        name = f"{mod}:{qual}"
        if resolve_compiler(name) is compiler:
            return name
    raise ConfigError(f"compiler {compiler!r} has no importable name; pass 'package.module:function' to run it isolated")


def resolve_compiler(compiler: Compiler) -> Callable:
    """The backend callable ``f(gm, example_inputs) -> callable`` for a name or callable."""
    if callable(compiler):
        return compiler
    if not isinstance(compiler, str) or not compiler:
        raise ConfigError(f"compiler: expected a backend name or callable, got {compiler!r}")
    if compiler == "eager":
        return _eager
    if compiler == "inductor_inner":
        return tc.compile_fx_inner
    if ":" in compiler:
        mod, _, attr = compiler.partition(":")
        try:
            obj: Any = importlib.import_module(mod)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"compiler {compiler!r}: cannot import it ({e})") from e
        return obj
    try:
        return tc.lookup_backend(compiler)
    except Exception as e:  # dynamo raises InvalidBackend (not a public type)
        raise ConfigError(f"compiler {compiler!r}: not a known backend ({e})") from e


def compile_graph(compiler: Compiler, gm: fx.GraphModule, inputs: Sequence[Any]) -> Callable:
    """Compile ``gm`` with ``compiler`` for ``inputs``; returns a callable taking positional inputs.

    Dynamo backends are called with positional arguments (as dynamo does); inductor's
    after-aot entry (``inductor_inner``) returns a boxed callable taking a list.
    """
    if compiler != "inductor_inner" and reads_scalars(gm):
        # a value read back from a tensor (``.item()`` under capture_scalar_outputs) is a symbol only dynamo's shape
        # environment holds: the graph goes through dynamo again, as it did in the user's program
        return torch.compile(_calling(gm), backend=resolve_compiler(compiler), fullgraph=True)
    fn = resolve_compiler(compiler)(gm, list(inputs))
    if compiler == "inductor_inner":
        return lambda *args: fn(list(args))
    return fn


def _calling(gm: fx.GraphModule) -> Callable:
    """A plain function calling ``gm``: dynamo starts from it (the frames of a GraphModule's own call are ones it
    skips) and inlines the graph."""
    def run(*args: Any) -> Any:
        return gm(*args)

    return run


def reads_scalars(gm: fx.GraphModule) -> bool:
    """Whether a Dynamo-level graph reads a value back from a tensor into a symbol (``item()``, ``tolist()``)."""
    return any(n.op == "call_method" and n.target in ("item", "tolist") for n in gm.graph.nodes)


def call_compiled(fn: Callable, inputs: Sequence[Any]) -> Any:
    """Call a graph compiled by :func:`compile_graph`."""
    return fn(*inputs)


@contextlib.contextmanager
def config_patch(config: Dict[str, Any]) -> Iterator[None]:
    """Apply inductor config entries (dotted names) for the duration of the block; restored afterwards."""
    if not config:
        yield
        return
    with tc.inductor_config_patch(dict(config)):
        yield


def flat_tensors(value: Any) -> List[Any]:
    """Leaves of a (nested) output structure, in order."""
    if isinstance(value, (list, tuple)):
        out: List[Any] = []
        for v in value:
            out.extend(flat_tensors(v))
        return out
    return [value]
