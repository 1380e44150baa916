"""The after-AOT repro flows (``REPRO_AFTER=aot``, ``REPRO_LEVEL=1..4``) for inductor and aot_eager-style compilers.

:func:`wrap_compiler` wraps the compiler AOTAutograd hands each forward and
backward graph to (inductor's ``compile_fx_inner`` via
``compile_fx(gm, inputs, inner_compile=...)``, or the ``fw_compiler`` /
``bw_compiler`` of ``aot_autograd``).  Graphs here are decomposed aten graphs
with parameters lifted to inputs; compile-time inputs are fake tensors, so
compile-time dumps regenerate their inputs from shape/stride/dtype (fixed seed)
while runtime dumps save the real values.  Per level:

1. on a compile or runtime error writes ``repro.py``;
2. on an error writes ``minifier_launcher.py``;
3. writes the launcher *before* compiling, so a compile that kills the process
   still leaves it; on an error minifies in an isolated process;
4. on the first call checks the compiled graph against the eager graph with an
   fp64 reference (any compiler, not only inductor); on a divergence writes the
   launcher, minifies (unless ``DETERM_MINIFY=0``) and raises
   :class:`~determ_backend.errors.AccuracyError`.  Checker errors are reported.
   A graph that draws random numbers (dropout) is checked, dumped and minified
   with its draws as inputs, fed the numbers an eager run drew, and compiled once
   more that way for the check: eager and compiled code never draw the same
   numbers.

The flows keep a :func:`~repro_tools.flows.failure.graph_snapshot` of each graph
(never a deep copy: AOT's fake tensor mode is active while its compiler runs,
and real tensor constants cannot be copied under it).  A failure of the flows'
own machinery is a checker error in ``report.json`` and one line on stderr; the
graph then compiles and runs as the wrapped compiler would.

:func:`inductor_backend` and :func:`aot_backend` build ready-to-use dynamo
backends.  Dumps and minification live in :mod:`repro_tools.flows.failure`.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch.fx as fx

from determ_backend import _torch_compat as tc
from determ_backend.config import DetermConfig, load_config
from determ_backend.errors import AccuracyError
from determ_backend.backends.checks import unrecorded
from determ_backend.backends.extract import lift_random_draws
from repro_tools.minify.accuracy import call_maybe_boxed, same_two_models
from repro_tools.minify.compilers import compile_graph
from repro_tools.flows.failure import GraphDump, InputsBefore, act_on_accuracy, graph_snapshot, report_flow_error
from repro_tools.repro.script import compiler_ref, unimportable_label

__all__ = ["wrap_compiler", "inductor_backend", "aot_backend"]

log = logging.getLogger(__name__)

_SCRIPT_COMPILERS = {"inductor": "inductor_inner", "aot_eager": "eager", "eager": "eager"}
"""How a repro script recompiles an aten graph for the usual compiler names."""


def _label(inner_compile: Callable, compiler_name: Optional[str]) -> tuple:
    if compiler_name in _SCRIPT_COMPILERS:
        return _SCRIPT_COMPILERS[compiler_name], []
    try:
        return compiler_ref(inner_compile)
    except Exception as e:  # a closure: name it anyway, the script will say it cannot resolve it
        label = unimportable_label(inner_compile, e)
        return compiler_name or label, []


def wrap_compiler(inner_compile: Callable, config: Optional[DetermConfig] = None,
                  compiler_name: Optional[str] = None) -> Callable:
    """``inner_compile(gm, example_inputs, **kwargs)`` under the after-AOT repro flows (boxed result).

    ``compiler_name``: ``"inductor"`` (repros recompile with ``compile_fx_inner``), ``"aot_eager"``
    (repros run the graph as is), or any label; default: ``inner_compile``'s ``module:function``.
    """
    label, sys_path = _label(inner_compile, compiler_name)

    def repro_compiler(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
        cfg = config if config is not None else load_config()
        stage = "backward" if kwargs.get("is_backward") else "forward"
        inputs = list(example_inputs)
        try:  # AOT's fake mode is active here: the snapshot shares the graph's real constants, copies none
            dump = GraphDump(cfg, "aot", label, graph_snapshot(gm), {"sys_path": sys_path, "only_fwd": True,
                                                                     "stage": stage})
        except Exception as e:
            report_flow_error(cfg, "aot", f"copying the {stage} graph", e)
            return inner_compile(gm, example_inputs, **kwargs)  # this graph goes on without the flows
        launcher = dump.launcher_before_compile(inputs) if cfg.repro_level == 3 else None
        try:
            compiled = inner_compile(gm, example_inputs, **kwargs)
        except Exception as e:
            dump.on_failure("compile_error", inputs, e, launcher)
            raise
        return _runtime(compiled, cfg, dump, launcher)

    repro_compiler.__name__ = f"repro_{getattr(inner_compile, '__name__', 'compiler')}"
    return repro_compiler


def _runtime(compiled: Callable, cfg: DetermConfig, dump: GraphDump, launcher) -> Callable:
    """The compiled graph's call, checked against eager on its first call at level 4.  A failure (dumped once) is
    raised by that call and every later one, as after dynamo: a program that catches it and goes on must not get
    the wrong values silently from the next step on."""
    state: Dict[str, Any] = {}
    before = InputsBefore(dump.gm)

    def run(args: List[Any]) -> Any:
        saved = list(args)
        kept = before.keep(saved)
        if cfg.repro_level == 4 and not state.get("checked"):
            state["checked"] = True
            try:
                _check_accuracy(compiled, saved, cfg, dump)
            except AccuracyError as e:
                state["error"] = e
        if "error" in state:
            raise state["error"]
        try:
            return call_maybe_boxed(compiled, args)
        except Exception as e:
            dump.on_failure("runtime_error", before.restore(saved, kept, dump), e, launcher)
            raise

    return tc.set_boxed(run)


def _check_accuracy(compiled: Callable, inputs: List[Any], cfg: DetermConfig, dump: GraphDump) -> None:
    stage = dump.extra_meta.get("stage")
    try:
        reference = copy.deepcopy(dump.gm)  # the reference runs get constants of their own, not the shared ones
    except Exception as e:
        report_flow_error(cfg, "aot", f"copying the {stage} graph for the accuracy check", e)
        return
    try:
        lifted = lift_random_draws(reference, inputs)
        if lifted is not None:  # eager and compiled draws never agree: judge the graph that reads eager's draws
            compiled = compile_graph(dump.compiler, copy.deepcopy(lifted.gm), lifted.inputs)
            reference, inputs = lifted.gm, lifted.inputs
            dump = dump.with_graph(lifted.gm, {"random_draws_as_inputs": lifted.draws})
            log.info("determ repro (after aot): the %s graph's %d random draw(s) are inputs for the accuracy check "
                     "(one more compile): %s", stage, len(lifted.draws), ", ".join(lifted.draws))
    except Exception as e:
        report_flow_error(cfg, "aot", f"taking the {stage} graph's random draws as inputs for the accuracy check", e)
        return
    with unrecorded():  # the check's run of the compiled graph is no call of the program's
        result = same_two_models(reference, compiled, inputs, only_fwd=True, tol=cfg.tol,
                                 multiplier=cfg.fp64_multiplier, strict=cfg.strict)
    act_on_accuracy(result, cfg, dump, inputs, "repro accuracy (after aot)", f"compiled {stage} graph ({dump.compiler})")


def inductor_backend(config: Optional[DetermConfig] = None) -> Callable:
    """A dynamo backend: inductor with the after-AOT repro flows around ``compile_fx_inner``.

    Call it: ``torch.compile(m, backend=inductor_backend())``."""

    def backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        inner = wrap_compiler(tc.compile_fx_inner, config, "inductor")
        return tc.compile_fx(gm, list(example_inputs), inner_compile=inner)

    return backend


def aot_backend(fw_compiler: Callable, bw_compiler: Optional[Callable] = None,
                config: Optional[DetermConfig] = None, compiler_name: Optional[str] = None) -> Callable:
    """A dynamo backend: ``aot_autograd`` with the after-AOT repro flows around its forward/backward compilers."""
    return tc.aot_autograd(fw_compiler=wrap_compiler(fw_compiler, config, compiler_name),
                           bw_compiler=wrap_compiler(bw_compiler or fw_compiler, config, compiler_name))
