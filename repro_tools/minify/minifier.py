"""The minifier: localize first, then shrink; checkpoints, ``--resume``, progress, summary.

:func:`minify` checks that the input graph fails the oracle, runs
:func:`~repro_tools.minify.passes.localize_from_buffers` (in-process inductor accuracy: the
input check's own compile already yields the materialized buffers' values) or
:func:`~repro_tools.minify.passes.localize_culprit` (one instrumented run and a verified
cut: a handful of queries for a single culprit), falls back to the general passes
when localization does not apply or does not verify, and finishes with
single-node removal so the result is 1-minimal.  The final result's failing
verdict must come from a query made in this run; flaky kinds (nondeterminism,
hang) and results restored by ``--resume`` are asked once more.  After every improvement a checkpoint repro and a JSON state
file are written to ``out_dir``, so a killed run continues with ``resume=True``.  :func:`minify_repro` does
the same for a repro file (its graph, inputs and the oracle its metadata describes): what
``repro-tools minify`` (:mod:`repro_tools.cli.minify`) and a launcher's ``minify`` subcommand run.

Reading/writing repro files lives in :mod:`repro_tools.minify.repro_files`; candidates in
:mod:`repro_tools.minify.subgraph`; the search loop in :mod:`repro_tools.minify.reducer`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
import torch.fx as fx
from tqdm import tqdm

from determ_backend import devices
from determ_backend.config import flows_suspended
from determ_backend.errors import ConfigError, DetermError, OracleError, ReproError
from determ_backend.trace.stream import atomic_write_text

from repro_tools.minify import passes
from repro_tools.minify.compilers import resolve_compiler
from repro_tools.minify.oracles import ISOLATED_ONLY, InProcessRunner, OracleSpec, Signature, Verdict
from repro_tools.minify.oracles import batch_cuts as batch_cuts_of, given_cuts, script_cuts
from repro_tools.minify.reducer import BudgetExhausted, Reducer
from repro_tools.minify.repro_files import (inherited_meta, load_repro_any, regenerated_note, spec_from_meta,
                                          write_repro_any)
from repro_tools.minify.subgraph import Candidate, GraphView, source_line
from repro_tools.repro.script import add_sys_path

__all__ = ["minify", "minify_repro", "MinifyResult", "STATE_FILE", "SUMMARY_FILE"]

log = logging.getLogger(__name__)
STATE_FILE = "minify_state.json"
SUMMARY_FILE = "summary.json"
"""The finished minification's summary (before/after, queries, culprit), next to the state."""
_STATE_FORMAT = "determ-minify-state"
_ERROR_KINDS = ("compile_error", "runtime_error", "error", "crash", "hang")
_FLAKY_KINDS = ("nondeterminism", "hang")  # their final result is always asked again
_EAGER_KINDS = ("accuracy", "cross_device")  # judged against the graph's eager values


@dataclass
class MinifyResult:
    gm: fx.GraphModule
    inputs: List[Any]
    summary: Dict[str, Any] = field(default_factory=dict)


class _Session:
    """One minification: the reducer plus its checkpoints, state file and progress bar."""

    def __init__(self, view: GraphView, spec: OracleSpec, runner: Any, out_dir: Optional[Path],
                 budget: int, progress: bool, meta: Dict[str, Any]):
        self.view, self.spec, self.runner, self.out_dir = view, spec, runner, out_dir
        self.meta = meta
        self.t0 = time.perf_counter()
        self.seconds_before = 0.0
        self.checkpoints = 0
        self.localize_done = False
        self.bar = tqdm(total=budget, desc="minify", unit="query", file=sys.stderr, disable=not progress,
                        dynamic_ncols=True)
        self.r: Optional[Reducer] = None

    def seconds(self) -> float:
        return self.seconds_before + time.perf_counter() - self.t0

    def on_query(self, r: Reducer) -> None:
        self.bar.n = r.queries
        self.bar.set_postfix(ops=len(r.current.keep), refresh=True)

    def on_improve(self, r: Reducer) -> None:
        self.bar.set_postfix(ops=len(r.current.keep), refresh=True)
        if self.out_dir is None:
            return
        self.checkpoints += 1
        gm, inputs = self.view.materialize(r.current)
        write_repro_any(gm, inputs, self.out_dir / "checkpoints" / f"{self.checkpoints:03d}", self._meta(r, gm))
        self.save_state(r)

    def _meta(self, r: Reducer, gm: fx.GraphModule) -> Dict[str, Any]:
        """The caller's ``meta`` (e.g. what the source repro's flow recorded), then the oracle's settings for the
        repro of ``gm`` (a batch-invariance repro: which of its inputs hold the batch)."""
        sp = self.spec
        m = dict(self.meta)
        m.update(oracle=sp.kind, compiler=sp.compiler_label(), config=dict(sp.config), tol=sp.tol,
                 multiplier=sp.multiplier, strict=sp.strict, oracle_spec=sp.to_json(portable=False), culprit=r.culprit)
        if sp.kind == "cross_device":
            m["devices"] = list(sp.devices)
        if sp.kind == "nondeterminism":
            m["runs"] = sp.runs
        if sp.kind == "batch_invariance":
            m["batch"], m["batch_dim"] = sp.batch, sp.batch_dim
            if sp.cuts:
                m["batch_cuts"] = script_cuts(sp, gm)
        if sp.kind == "hang":
            m["timeout"] = sp.timeout
        return m

    # ------------------------------------------------------------ state
    def save_state(self, r: Reducer) -> None:
        c = r.current
        for name in {c.values} - {"ref"}:
            torch.save(self.view.value_maps[name], self.out_dir / f"values_{name}.pt")
        state = {"format": _STATE_FORMAT, "version": 1, "start_key": self.meta.get("start_key"),
                 "spec": self.spec.to_json(portable=False), "queries": r.queries, "seconds": self.seconds(),
                 "current": {"keep": sorted(c.keep, key=self.view.order.__getitem__),
                             "outputs": list(c.outputs) if c.outputs is not None else None,
                             "values": c.values, "merge_inputs": c.merge_inputs},
                 "culprit": r.culprit, "localized": r.localized, "localize_done": self.localize_done,
                 "checkpoints": self.checkpoints, "cache": r.cache}
        atomic_write_text(self.out_dir / STATE_FILE, json.dumps(state))

    def load_state(self, start_key: str) -> Optional[Dict[str, Any]]:
        path = self.out_dir / STATE_FILE if self.out_dir is not None else None
        if path is None or not path.is_file():
            log.warning("--resume: no %s in %s; starting from the beginning", STATE_FILE, self.out_dir)
            return None
        try:
            state = json.loads(path.read_text())
        except ValueError as e:
            raise ReproError(f"{path}: corrupt minifier state ({e}); delete it to start over") from e
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise ReproError(f"{path}: not a minifier state file (expected a JSON object with "
                             f"format {_STATE_FORMAT!r}); use another --out or delete it")
        if state.get("start_key") != start_key:
            raise ReproError(f"{path}: state belongs to a different graph; use another --out or delete it")
        _check_state(path, state)
        for name in {state["current"]["values"]} - {"ref"}:
            f = self.out_dir / f"values_{name}.pt"
            try:
                self.view.value_maps[name] = torch.load(f, weights_only=True)
            except Exception as e:  # torch raises several unrelated types for a corrupt file (UnpicklingError too)
                raise ReproError(f"{f}: cannot load recorded values ({e})") from e
        self.seconds_before = float(state.get("seconds", 0.0))
        self.checkpoints = int(state.get("checkpoints", 0))
        self.localize_done = bool(state.get("localize_done"))
        return state


def _check_state(path: Path, state: Dict[str, Any]) -> None:
    """The fields :func:`_resume` reads, with their types; one line naming the file otherwise."""
    cur = state.get("current")
    ok = (isinstance(cur, dict) and isinstance(cur.get("keep"), list) and isinstance(cur.get("values"), str)
          and "merge_inputs" in cur
          and isinstance(cur.get("outputs"), (list, type(None))) and isinstance(state.get("spec"), dict)
          and isinstance(state.get("cache"), dict) and isinstance(state.get("queries"), int))
    if not ok:
        raise ReproError(f"{path}: minifier state is incomplete or malformed (expected keys current.keep, "
                         "current.values, current.outputs, current.merge_inputs, spec, cache, queries); delete it to start over")


def _check_start(spec: OracleSpec, view: GraphView, out: Optional[Path], resume: bool) -> None:
    """What is wrong before any query: a compiler that does not resolve, a graph that cannot run eagerly
    (for oracles judging against eager), an ``out_dir`` holding an earlier minification."""
    resolve_compiler(spec.compiler)
    if spec.kind in _EAGER_KINDS and view.eager_error:
        raise ReproError(f"the input graph cannot run eagerly ({view.eager_error}); the {spec.kind} oracle "
                         "compares against its eager run")
    if out is not None and not resume and (out / STATE_FILE).exists():
        raise ConfigError(f"out_dir {out}: holds an earlier minification ({STATE_FILE}); resume it or use "
                          "another directory")


def _make_runner(spec: OracleSpec, isolate: bool):
    if isolate or spec.kind in ISOLATED_ONLY:
        from repro_tools.minify.isolate import Worker

        return Worker()
    return InProcessRunner()


def _culprit_info(view: GraphView, r: Reducer) -> Optional[Dict[str, Any]]:
    """The node the minification blames: the one it localized, or the one op left; None when several are left and
    none was localized (a budget that ran out, or a failure that needs them together): the last node kept is no
    culprit (a LayerNorm's residual add was named while the relu that went wrong was still in the graph)."""
    keep = r.current.keep
    name = r.culprit if r.culprit in keep else next(iter(keep)) if len(keep) == 1 else None
    if name is None:
        return None
    node = view.by_name[name]
    return {"node": name, "op": view.op_name(name), "source": source_line(node), "code": node.format_node()}


def _search(s: _Session, r: Reducer, localize: bool) -> bool:
    """All passes; returns True when the budget ran out first."""
    try:
        if localize and not s.localize_done:
            if not passes.localize_from_buffers(r):
                passes.localize_culprit(r)
            r.observed = None
            s.localize_done = True
            if s.out_dir is not None:
                s.save_state(r)
        if not r.localized:
            for p in passes.FALLBACK:
                p(r)
        while passes.remove_single_nodes(r) | passes.prune_outputs(r):
            pass
    except BudgetExhausted as e:
        log.warning("%s; returning the smallest failing graph found so far", e)
        return True
    return False


def minify(gm: fx.GraphModule, inputs: Sequence[Any], spec: OracleSpec, *, runner: Any = None,
           isolate: bool = False, budget: int = 500, localize: bool = True,
           out_dir: Optional[Union[str, Path]] = None, resume: bool = False, progress: bool = True,
           meta: Optional[Dict[str, Any]] = None, batch_cuts: Optional[Dict[Any, Any]] = None) -> MinifyResult:
    """Shrink ``gm`` to a small graph that still fails ``spec``'s oracle.

    ``runner``: an object with ``check``/``observe`` (default: in-process, or a
    persistent :class:`~repro_tools.minify.isolate.Worker` with ``isolate=True`` or for
    crash/hang oracles).  ``out_dir``: checkpoints, state and the final repro.  ``batch_cuts``: for a
    batch-invariance oracle, the cuts of ``inputs`` a repro recorded (``META["batch_cuts"]``: per sub-batch
    size, ``[input index, dim, rows]`` of each input holding the batch); the oracle then cuts every candidate's
    inputs as a run of the whole graph on those rows cuts them (:func:`~repro_tools.minify.oracles.batch_cuts`).
    Raises :class:`OracleError` when the input graph does not fail, :class:`ConfigError` when the
    compiler does not resolve or ``out_dir`` holds an earlier minification and ``resume`` is false.
    """
    view = GraphView(gm, inputs, grads=spec.grads)
    if spec.kind == "batch_invariance" and not spec.cuts:
        spec = spec.replace(cuts=batch_cuts_of(gm, inputs, view.ref, spec.batch, spec.batch_dim,
                                               given_cuts(batch_cuts, len(inputs))))
    out = Path(out_dir) if out_dir is not None else None
    _check_start(spec, view, out, resume)
    own_runner = runner is None
    runner = runner if runner is not None else _make_runner(spec, isolate)
    try:
        return _minify(view, spec, runner, out, budget, localize, resume, progress, dict(meta or {}))
    finally:
        if own_runner:
            runner.close()


def minify_repro(src: Union[str, Path], out_dir: Optional[Union[str, Path]] = None, *,
                 overrides: Optional[Dict[str, Any]] = None, config: Optional[Dict[str, Any]] = None,
                 **options: Any) -> MinifyResult:
    """:func:`minify` of a repro file: a script or a graph directory (``graph.py`` + ``inputs.pt``).

    The oracle is the one the repro's metadata describes (:func:`~repro_tools.minify.repro_files.spec_from_meta`)
    with the non-None ``overrides`` (``kind``, ``compiler``, ``tol``, ``strict``, ``timeout``, ``similarity``,
    ``devices``: the command line's options, which the messages name) and ``config`` entries added to the
    recorded compile config; what the minifier writes inherits the repro's metadata; ``options`` go to
    :func:`minify`.  A graph that cannot even run eagerly is a :class:`ReproError`, a compiler that does not
    resolve a :class:`ConfigError`, both before any query.  ``repro-tools minify`` and a launcher's
    ``minify`` subcommand (:func:`repro_tools.flows.failure.minify_script`) run this."""
    src = Path(src)
    try:
        gm, inputs, meta = load_repro_any(src)
    except DetermError:
        raise
    except Exception as e:  # the repro's own code runs while tracing: any error means it cannot run eagerly
        raise ReproError(f"{src}: the input graph cannot run eagerly ({type(e).__name__}: {e})") from e
    add_sys_path(meta, src)
    overrides = dict(overrides or {})
    if config:
        recorded = meta.get("config") if isinstance(meta.get("config"), dict) else {}
        overrides["config"] = {**recorded, **config}
    spec = spec_from_meta(meta, **overrides)
    for d in spec.devices if spec.kind == "cross_device" else ():  # an absent device is bad input, not the candidate's
        devices.require(devices.parse_device_spec(d)[0])
    try:
        resolve_compiler(spec.compiler)  # a name that does not resolve is bad input, never the failure under study
    except ConfigError as e:
        raise ConfigError(f"--compiler: {e}" if overrides.get("compiler") else f"{src}: the recorded {e}") from e
    with flows_suspended(untraced=True):  # candidates are compiled to check the compiler, never to dump and
        # minify again, nor traced and checked as graphs of the program that may be running this
        try:
            return minify(gm, inputs, spec, out_dir=out_dir,
                          meta={**inherited_meta(meta), "source": str(src.resolve())},
                          batch_cuts=meta.get("batch_cuts"), **options)
        except OracleError as e:
            note = regenerated_note(meta) if spec.kind not in _ERROR_KINDS else None
            if note is None or not str(e).startswith("input graph does not fail"):
                raise
            raise OracleError(f"{e} ({note})") from e


_ORACLE_OPTIONS = ("kind", "tol", "multiplier", "strict", "devices", "runs", "similarity", "batch", "batch_dim",
                   "config")


def _resume(s: _Session, state: Dict[str, Any], spec: OracleSpec, budget: int) -> Reducer:
    saved, now = state["spec"], spec.to_json(portable=False)
    changed = [k for k in _ORACLE_OPTIONS if k in saved and saved[k] != now.get(k)]
    if changed:  # the saved progress was judged by another oracle: resuming would mix two answers
        raise ConfigError("--resume: the run was started with " + ", ".join(f"{k}={saved[k]!r}" for k in changed) +
                          " and is resumed with " + ", ".join(f"{k}={now.get(k)!r}" for k in changed) +
                          "; resume with the same options, or start afresh without --resume")
    exp = saved.get("expected")
    s.spec = spec.replace(expected=Signature(**exp) if exp else None)
    c = state["current"]
    cur = Candidate(frozenset(c["keep"]), tuple(c["outputs"]) if c["outputs"] is not None else None,
                    c["values"], c["merge_inputs"])
    r = Reducer(s.view, s.spec, s.runner, cur, budget=budget, cache=state["cache"], queries=state["queries"],
                on_improve=s.on_improve, on_query=s.on_query)
    r.culprit, r.localized = state.get("culprit"), bool(state.get("localized"))
    log.info("resuming: %d nodes, %d queries spent", len(cur.keep), r.queries)
    return r


def _start(s: _Session, start: Candidate, gm0: fx.GraphModule, in0: List[Any], budget: int,
           localize: bool) -> Reducer:
    """Check the input graph (it must fail), remember its failure, and set up the reducer.  When
    localizing with a runner that can, the same compile also yields per-node values (inductor buffers)."""
    observed = None
    if localize and hasattr(s.runner, "check_observed"):
        v, observed = s.runner.check_observed(s.spec, gm0, in0, s.view.ref)
    else:
        v = s.runner.check(s.spec, gm0, in0)
    if not v.fails:
        accuracy = s.spec.kind == "accuracy" and not (v.detail or "").startswith("candidate raised")
        forward_only = accuracy and not s.spec.grads and s.meta.get("after") != "aot"
        hint = ("; the accuracy oracle compares forward outputs: a divergence only in gradients is minified on the "
                "backward graph after AOT (REPRO_AFTER=aot)") if forward_only else ""
        within = f", tol={s.spec.tol:g}" if accuracy else ""  # the tolerance the outputs were found to match within
        raise OracleError(f"input graph does not fail the {s.spec.kind} oracle ({v.detail or 'no failure'}{within}); "
                          f"nothing to minify{hint}")
    if s.spec.kind in _ERROR_KINDS and v.signature is not None:
        s.spec = s.spec.replace(expected=v.signature)
    r = Reducer(s.view, s.spec, s.runner, start, budget=budget, queries=1, on_improve=s.on_improve,
                on_query=s.on_query)
    r.observed = observed
    r.cache[s.meta["start_key"]] = True
    r.verified[s.meta["start_key"]] = v
    return r


def _final_check(s: _Session, r: Reducer, gm: fx.GraphModule, inputs: List[Any]) -> Verdict:
    """The oracle's verdict on the result: asked again for flaky kinds or when the answer came from a saved cache."""
    v = r.verified.get(s.view.key(gm, inputs))
    if v is not None and s.spec.kind not in _FLAKY_KINDS:
        return v
    v = s.runner.check(s.spec, gm, inputs)
    r.queries += 1
    s.on_query(r)
    if not v.fails:
        raise OracleError(f"the minified graph ({len(r.current.keep)} nodes) no longer fails on a re-check "
                          f"({v.detail}); the oracle looks flaky; last checkpoint in {s.out_dir}")
    return v


def _minify(view, spec, runner, out, budget, localize, resume, progress, meta) -> MinifyResult:
    start = view.normalize(view.full())
    if start is None and view.eager_error:  # no value is known: the graph fails without the compiler
        raise ReproError(f"the input graph cannot run eagerly ({view.eager_error}): its inputs or the script are "
                         "wrong, not the compiler")
    if start is None:  # candidates are cut by the values they return: a graph that returns none has no cut
        raise ReproError("the graph returns no tensor computed in it (it only updates tensors in place, as a "
                         "compiled optimizer step does), so it cannot be shrunk by its outputs; the repro itself "
                         "runs and reproduces the failure")
    gm0, in0 = view.materialize(start)
    meta["start_key"] = view.key(gm0, in0)
    s = _Session(view, spec, runner, out, budget, progress, meta)
    state = s.load_state(meta["start_key"]) if resume else None
    try:
        r = _resume(s, state, spec, budget) if state is not None else _start(s, start, gm0, in0, budget, localize)
        if out is not None:
            s.save_state(r)
        exhausted = _search(s, r, localize)
        gm_f, in_f = view.materialize(r.current)
        final = _final_check(s, r, gm_f, in_f)
    finally:
        s.bar.close()
    repro_path = None
    if out is not None:
        s.save_state(r)
        repro_path = str(write_repro_any(gm_f, in_f, out / "minimal", s._meta(r, gm_f)))
    summary = {"kind": s.spec.kind, "compiler": s.spec.compiler_label(),
               "nodes_before": len(gm0.graph.nodes), "nodes_after": len(gm_f.graph.nodes),
               "ops_before": len(start.keep), "ops_after": len(r.current.keep), "queries": r.queries,
               "cache_hits": r.cache_hits, "seconds": round(s.seconds(), 3), "localized": r.localized,
               "budget_exhausted": exhausted, "culprit": _culprit_info(view, r),
               "failure": final.signature.short() if final.signature else final.detail, "repro_path": repro_path}
    if out is not None:  # what the HTML report of this directory shows
        atomic_write_text(out / SUMMARY_FILE, json.dumps(summary, indent=2, default=str))
    return MinifyResult(gm_f, in_f, summary)
