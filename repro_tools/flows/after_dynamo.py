"""The after-dynamo repro flows (``REPRO_AFTER=dynamo``, ``REPRO_LEVEL=1..4``) for any backend.

:func:`wrap_backend` turns a dynamo backend (a name such as ``"inductor"`` or a
callable ``f(gm, example_inputs)``) into one that, per level:

1. on a compile or runtime error writes ``repro.py``;
2. on an error writes ``minifier_launcher.py`` (running it minifies);
3. writes the launcher *before* compiling (a segfault still leaves it), then
   on an error minifies in an isolated process;
4. checks the compiled graph against eager with an fp64 reference
   (:func:`repro_tools.minify.accuracy.same_two_models`, forward and backward) on the
   example inputs; on a divergence writes the launcher, minifies (unless
   ``DETERM_MINIFY=0``) and raises :class:`~determ_backend.errors.AccuracyError`
   when the graph is called (so it reaches the caller as itself, not wrapped in
   dynamo's ``BackendCompilerFailed``; so does an error of the compiled graph met
   while checking).  An error while checking is reported as a checker error,
   never swallowed.  A graph whose eager run draws random numbers (dropout) is
   not judged (eager and compiled draws differ): a warning and a ``skipped``
   note in ``report.json`` say so; the after-AOT flow checks such graphs.

A failure of the flows' own machinery (copying or dumping the graph, writing the
launcher, minifying) is a checker error in ``report.json`` and one line on
stderr; the graph then compiles and runs as the wrapped backend would.

Errors are re-raised after dumping.  Dumps, minification and the summary live
in :mod:`repro_tools.flows.failure`; the after-aot flows in :mod:`repro_tools.flows.after_aot`.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.fx as fx

from determ_backend import _torch_compat as tc
from determ_backend.config import DetermConfig, load_config
from determ_backend.backends.checks import unrecorded
from determ_backend.clones import AttributeState

from repro_tools.minify.accuracy import same_two_models
from repro_tools.flows.failure import GraphDump, InputsBefore, act_on_accuracy, report_flow_error
from repro_tools.repro.script import compiler_ref, unimportable_label

__all__ = ["wrap_backend"]

log = logging.getLogger(__name__)


def _compiler_label(backend: Union[str, Callable], name: Optional[str]) -> tuple:
    if name is not None:
        return name, []
    try:
        return compiler_ref(backend)
    except Exception as e:  # an unimportable callable: the repro names it, and says it cannot be resolved
        return unimportable_label(backend, e), []


def wrap_backend(backend: Union[str, Callable], config: Optional[DetermConfig] = None, *,
                 name: Optional[str] = None) -> Callable:
    """A dynamo backend running ``backend`` under the after-dynamo repro flows.

    ``config``: a :class:`~determ_backend.config.DetermConfig` (default: from the environment at
    each compile).  ``name``: how repro scripts name the backend (default: its registered name or
    ``module:function``); use it when ``backend`` is a closure.
    """
    label, sys_path = _compiler_label(backend, name)

    def repro_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
        cfg = config if config is not None else load_config()
        inner = tc.lookup_backend(backend) if isinstance(backend, str) else backend
        try:
            # a graph compiled without grad (inference, an optimizer step) only runs without it: dynamo guards on
            # the grad mode, so the repro runs it so too (with grad, its in-place update of a parameter raises)
            dump = GraphDump(cfg, "dynamo", label, copy.deepcopy(gm), {"sys_path": sys_path,
                                                                       "only_fwd": not torch.is_grad_enabled()})
        except Exception as e:
            report_flow_error(cfg, "dynamo", "copying the graph", e)
            return inner(gm, example_inputs, **kwargs)  # this graph goes on without the flows
        return _compile(inner, gm, list(example_inputs), kwargs, cfg, dump)

    repro_backend.__name__ = f"repro_{label}".replace(":", "_").replace(".", "_")
    return repro_backend


def _compile(inner: Callable, gm: fx.GraphModule, inputs: list, kwargs: dict, cfg: DetermConfig,
             dump: GraphDump) -> Callable:
    level = cfg.repro_level
    launcher = dump.launcher_before_compile(inputs) if level == 3 else None
    try:
        compiled = inner(gm, inputs, **kwargs)
    except Exception as e:
        dump.on_failure("compile_error", inputs, e, launcher)
        raise
    if level == 4:
        # a dynamic graph's size arguments come as dynamo's SymInts (``s0``): the check calls the compiled code,
        # which needs the numbers they stand for on this call
        concrete = [tc.symint_hint(x) if isinstance(x, torch.SymInt) else x for x in inputs]
        return _checked_on_first_call(compiled, gm, concrete, cfg, dump)
    return _guard_runtime(compiled, dump, launcher)


def _checked_on_first_call(compiled: Callable, gm: fx.GraphModule, inputs: list, cfg: DetermConfig,
                           dump: GraphDump) -> Callable:
    """``compiled``, checked against eager on the example inputs when it is first called, not while dynamo is
    still compiling: its backward, compiled on first use, cannot be compiled inside dynamo's compile (torch raised
    "Metric(s) {'is_forward'} have already been set" and a healthy training step failed).  A failure (already
    dumped) is raised by this and every later call: raised at compile time, dynamo would wrap it in
    BackendCompilerFailed, and ``except AccuracyError`` would miss it."""
    state: dict = {}

    def run(*args: Any) -> Any:
        if "error" not in state and not state.get("checked"):
            state["checked"] = True
            try:
                _check_accuracy(compiled, gm, inputs, cfg, dump)
            except Exception as e:
                state["error"] = e
        if "error" in state:
            raise state["error"]
        return compiled(*args)

    return run


def _check_accuracy(compiled: Callable, gm: fx.GraphModule, inputs: list, cfg: DetermConfig, dump: GraphDump) -> None:
    """``gm``: the graph ``compiled`` was compiled from; its tensor attributes are the program's."""
    # dynamo calls a backend's result with positional args, whatever ``_boxed_call`` it carries (inductor's
    # compile_fx result inherits a misleading ``_boxed_call`` from the boxed function it wraps)
    unboxed = lambda *args: compiled(*args)  # noqa: E731
    try:
        reference = copy.deepcopy(dump.gm)  # the fp64 reference casts its module
    except Exception as e:
        report_flow_error(cfg, "dynamo", "copying the graph for the accuracy check", e)
        return
    # the compiled graph reads the program's own tensor attributes (a compiled optimizer step's parameters and
    # state): its run for the check is judged by what it writes there, which is then put back, so the program's
    # call finds them as it left them
    try:
        attrs = AttributeState(gm, dump.gm.graph)
    except Exception as e:
        report_flow_error(cfg, "dynamo", "reading the graph's tensor attributes for the accuracy check", e)
        return
    with unrecorded():  # the check's run of the compiled graph is no call of the program's
        result = same_two_models(reference, unboxed, inputs, only_fwd=False, tol=cfg.tol,
                                 multiplier=cfg.fp64_multiplier, strict=cfg.strict, compiled_attributes=attrs)
    if result.status == "not_judged":  # a dynamo graph's draws cannot be cut out; AOT's aten graphs' can
        result.detail += "; REPRO_AFTER=aot checks such graphs, with their draws taken as inputs"
    act_on_accuracy(result, cfg, dump, inputs, "repro accuracy (after dynamo)", f"compiled graph ({dump.compiler})")


def _guard_runtime(compiled: Callable, dump: GraphDump, launcher) -> Callable:
    before = InputsBefore(dump.gm)

    def run(*args: Any) -> Any:
        saved = list(args)
        kept = before.keep(saved)
        try:
            return compiled(*args)
        except Exception as e:
            dump.on_failure("runtime_error", before.restore(saved, kept, dump), e, launcher)
            raise

    return run
