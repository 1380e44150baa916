"""The compile backends ``determ_eager``, ``determ_aot_eager`` and ``determ_inductor``.

Registered through the ``torch_dynamo_backends`` entry-point group, so
``torch.compile(model, backend="determ_inductor")`` works without importing
determ.  Each wraps the like-named torch backend; with tracing and every check
off the result is the wrapped backend's, unchanged.  Settings come from
:mod:`determ_backend.config` (env vars, then ``options=``).  Repro flows
(``REPRO_AFTER``) are plug-ins looked up by :mod:`.flows`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable, Dict, List, Optional

import torch.fx as fx

from determ_backend import _torch_compat
from determ_backend.backends import retarget
from determ_backend.backends.checks import GraphExec, has_random_ops
from determ_backend.backends.extract import graph_snapshot
from determ_backend.backends.flows import load_flow
from determ_backend.config import DetermConfig, load_config
from determ_backend.errors import ConfigError, first_line
from determ_backend.backends.inductor_instrument import compile_with_origins, instrument_compiled
from determ_backend.backends.instrument import graph_node_infos, instrument_graph, param_names
from determ_backend.backends.recorder import NodeInfo, Recorder
from determ_backend.backends.run import Run, get_run

__all__ = ["determ_eager", "determ_aot_eager", "determ_inductor", "make_backend"]

log = logging.getLogger(__name__)


def _active(cfg: DetermConfig) -> bool:
    return bool(cfg.trace or cfg.check or cfg.reference)


def _recorder(run: Run, cfg: DetermConfig, graph: str, stage: str, infos: List[NodeInfo],
              eager_writes: bool = False) -> Recorder:
    # the nan check reads the NaN/Inf counts of the statistics: it records them whatever DETERM_STATS says (with
    # them off it found nothing and said the run was clean)
    return Recorder(graph, stage, infos, stats=cfg.stats or "nan" in cfg.check, rank=run.rank, run=run.id,
                    memo=run.memo if cfg.reuse_saved else None, eager_writes=eager_writes)


def _fx_exec(gm: fx.GraphModule, run: Run, cfg: DetermConfig, graph: str, stage: str,
             display: Dict[str, str], boxed: bool) -> GraphExec:
    infos, index = graph_node_infos(gm, display)
    rec = _recorder(run, cfg, graph, stage, infos, eager_writes=True)  # the FX graph runs op by op
    inst = instrument_graph(gm, rec, index)
    fn = _torch_compat.boxed_nop(inst, []) if boxed else inst.forward
    return GraphExec(fn, rec, run, cfg, reference_gm=gm, boxed=boxed)


def _eager_impl(gm: fx.GraphModule, example_inputs, cfg: DetermConfig, wrap_compiler=None) -> Callable:
    """``wrap_compiler`` is accepted for a uniform signature; eager has no AOT stage to wrap."""
    if not _active(cfg):
        return gm.forward
    run = get_run(cfg)
    return _fx_exec(gm, run, cfg, run.next_graph_id(), "dynamo", param_names(gm), boxed=False)


def _placeholder_display(gm: fx.GraphModule) -> List[Optional[str]]:
    names = param_names(gm)
    return [names.get(n.name) for n in gm.graph.nodes if n.op == "placeholder"]


class _AotNames:
    """Maps AOT placeholders (``primals_3``, ``arg2_1``) to module paths, by position in the forward."""

    def __init__(self, dynamo_gm: fx.GraphModule):
        self.positional = _placeholder_display(dynamo_gm)
        self.by_name: Dict[str, str] = {}

    def for_graph(self, gm: fx.GraphModule, forward: bool) -> Dict[str, str]:
        phs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        if forward and len(phs) >= len(self.positional):
            for name, disp in zip(phs, self.positional):
                if disp:
                    self.by_name[name] = disp
        return {n: self.by_name[n] for n in phs if n in self.by_name}


def _aot_impl(gm: fx.GraphModule, example_inputs, cfg: DetermConfig, wrap_compiler=None,
              decomp_partition: bool = False) -> Callable:
    aot = _torch_compat.aot_eager_decomp_partition if decomp_partition else _torch_compat.aot_eager
    if not _active(cfg) and wrap_compiler is None:
        return aot(gm, example_inputs)
    run = get_run(cfg) if _active(cfg) else None
    graph = run.next_graph_id() if run else "g"
    names = _AotNames(gm)

    def make(stage: str) -> Callable:
        def compiler(fx_g: fx.GraphModule, inputs):
            if run is None:
                return _torch_compat.boxed_nop(fx_g, inputs)
            disp = names.for_graph(fx_g, forward=stage == "aot_forward")
            return _fx_exec(fx_g, run, cfg, graph, stage, disp, boxed=True)

        return wrap_compiler(compiler, stage) if wrap_compiler else compiler

    return aot(gm, example_inputs, fw_compiler=make("aot_forward"), bw_compiler=make("aot_backward"))


def _repro_wrap(kind: str, cfg: DetermConfig) -> Optional[Callable]:
    if cfg.repro_after != "aot":
        return None
    after_aot = load_flow("aot")
    return lambda compiler, stage: after_aot.wrap_compiler(compiler, cfg, compiler_name=kind)


def _inductor_impl(gm: fx.GraphModule, example_inputs, cfg: DetermConfig, wrap_compiler=None,
                   config_patches: Optional[Dict[str, Any]] = None) -> Callable:
    patches = dict(config_patches or {})
    if "accuracy" in cfg.check:
        patches["fallback_random"] = True  # random ops must match eager for the comparison
    if not _active(cfg) and wrap_compiler is None:
        return _torch_compat.compile_fx(gm, example_inputs, config_patches=patches or None)
    run = get_run(cfg) if _active(cfg) else None
    graph = run.next_graph_id() if run else "g"
    names = _AotNames(gm)

    def inner(fx_g: fx.GraphModule, inputs, **kwargs):
        if run is None:
            return _torch_compat.compile_fx_inner(fx_g, inputs, **kwargs)
        backward = bool(kwargs.get("is_backward"))
        stage = "inductor_backward" if backward else "inductor_forward"
        disp = names.for_graph(fx_g, forward=not backward)
        # the graph as AOT hands it over: inductor's post-grad passes rewrite fx_g in place when it compiles, and
        # not when its cache holds the graph, so names and the eager reference taken from fx_g afterwards depended
        # on the cache (a cold run and a warm one of one program did not even pair)
        handed = graph_snapshot(fx_g)
        compiled, origins = compile_with_origins(fx_g, inputs, **kwargs)
        fx_g = handed
        try:
            rec = instrument_compiled(compiled, fx_g, lambda infos: _recorder(run, cfg, graph, stage, infos), origins,
                                      disp)
        except Exception as e:  # determ's own failure: the graph runs as inductor compiled it, untraced
            log.debug("determ: instrumenting the inductor wrapper failed", exc_info=True)
            run.add_checker_error("trace", f"{graph} {stage} is not traced: instrumenting inductor's wrapper failed: "
                                           f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            return compiled
        if rec is None:
            return compiled
        if "accuracy" in cfg.check and not backward and has_random_ops(fx_g):
            log.warning("determ accuracy: graph %s draws random numbers (dropout in training); it is compiled with "
                        "inductor's fallback_random so that its draws are eager's and can be compared, so the "
                        "program's random numbers are eager's, not those plain inductor draws", graph)
        exec_ = GraphExec(compiled.current_callable, rec, run, cfg, reference_gm=fx_g, boxed=True, compiler="inductor",
                          compile_region=functools.partial(_compile_region, patches=patches))
        _torch_compat.set_compiled_callable(compiled, exec_)
        return compiled

    inner_compile = wrap_compiler(inner, "inductor") if wrap_compiler else inner
    with contextlib.ExitStack() as stack:
        stack.enter_context(_torch_compat.autograd_cache_disabled())
        if "nan" in cfg.check:  # a creation inside a fused kernel is found by replaying the call's inputs
            stack.enter_context(_torch_compat.donated_buffers_disabled())
        return _torch_compat.compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches or None)


def _compile_region(gm: fx.GraphModule, inputs, patches: Dict[str, Any]) -> Callable:
    """Inductor, as configured for the user's graph, on a region of it (narrowing an accuracy root)."""
    return _torch_compat.compile_fx(gm, inputs, config_patches=patches or None)


_IMPLS = {"eager": _eager_impl, "aot_eager": _aot_impl, "inductor": _inductor_impl,
          "aot_eager_decomp_partition": functools.partial(_aot_impl, decomp_partition=True)}


def make_backend(kind: str, options: Optional[Dict[str, Any]] = None) -> Callable:
    """A dynamo backend callable for ``kind`` (``eager``/``aot_eager``/``inductor``) with fixed options."""

    def backend(gm: fx.GraphModule, example_inputs, **kwargs):
        opts = dict(options or {})
        mode = kwargs.pop("mode", None)  # torch.compile(..., mode=): what it stands for, as inductor applies it
        if mode not in (None, "default"):
            if kind == "inductor":
                try:
                    opts.update(_torch_compat.inductor_mode_options(mode))
                except Exception as e:
                    raise ConfigError(f"torch.compile(mode={mode!r}): {first_line(e)}") from None
            else:
                log.warning("determ_%s: torch.compile(mode=%r) sets inductor options; %s ignores it, as torch's "
                            "%s backend does", kind, mode, f"determ_{kind}", kind)
        opts.update(kwargs.pop("options", None) or {})  # explicit options win over the mode's
        opts, inductor_opts = split_options(opts, kind)
        cfg = load_config(opts)
        return _dispatch(kind, gm, example_inputs, cfg, opts, inductor_opts)

    backend.__name__ = f"determ_{kind}"
    return backend


def split_options(opts: Dict[str, Any], kind: str) -> tuple:
    """``(determ options, inductor config options)``: keys that are not determ settings are inductor
    config entries (as ``torch.compile(..., options=)`` takes them for inductor)."""
    from determ_backend.config import option_names

    known = option_names()
    determ = {k: v for k, v in opts.items() if k in known}
    other = {k: v for k, v in opts.items() if k not in known}
    if other and kind not in ("inductor",):
        raise ConfigError(f"unknown determ option(s) {', '.join(sorted(other))} for determ_{kind}; "
                          f"expected {', '.join(sorted(known))}")
    if other and not _torch_compat.is_inductor_config(other):
        bad = sorted(k for k in other if not _torch_compat.is_inductor_config({k: None}))
        raise ConfigError(f"unknown option(s) {', '.join(bad)}: neither determ settings nor inductor config entries")
    return determ, other


def _dispatch(kind: str, gm, example_inputs, cfg: DetermConfig, opts: Dict[str, Any], inductor_opts: Dict[str, Any]):
    if cfg.device is not None:  # DETERM_DEVICE: this graph on another device/dtype (repro-tools xdevice)
        return retarget.on_device(cfg.device, make_backend(kind, {**opts, **inductor_opts, "device": None}), gm,
                                  example_inputs)
    if cfg.repro_after == "dynamo":
        after_dynamo = load_flow("dynamo")
        inner = lambda g, i: _run_impl(kind, g, i, cfg.replace(repro_after=None), inductor_opts)
        # the repros name the wrapped backend, torch's own: they run with torch alone, and a repro run or a level-3
        # minifier's child writes no determ run of its own; the options' inductor config is in force while the flows
        # take the compile-time config the repros set
        patched = _torch_compat.inductor_config_patch(inductor_opts) if inductor_opts else contextlib.nullcontext()
        with patched:
            return after_dynamo.wrap_backend(inner, cfg, name=kind)(gm, example_inputs)
    return _run_impl(kind, gm, example_inputs, cfg, inductor_opts)


def _run_impl(kind: str, gm, example_inputs, cfg: DetermConfig, inductor_opts: Optional[Dict[str, Any]] = None):
    kind = cfg.bisect_stage or kind  # DETERM_BISECT_STAGE (repro-tools bisect): this stage of the stack
    wrap = _repro_wrap(kind, cfg) if kind != "eager" else None
    extra = {"config_patches": inductor_opts} if kind == "inductor" and inductor_opts else {}
    if cfg.bisect_stage and kind != "eager":  # torch's bisector hooks scoped to the stage, backward included
        with retarget.stage_scope(kind):
            return _IMPLS[kind](gm, example_inputs, cfg, wrap_compiler=retarget.scoped_wrap(kind, wrap), **extra)
    return _IMPLS[kind](gm, example_inputs, cfg, wrap_compiler=wrap, **extra)


determ_eager = make_backend("eager")
determ_aot_eager = make_backend("aot_eager")
determ_inductor = make_backend("inductor")
