"""Running a compiled graph under determ: tracing and the online checks.

:class:`GraphExec` wraps a compiled callable.  On every call it runs the graph
(instrumented, so a :class:`~determ_backend.backends.recorder.Recorder` captures each
node), writes the records to the run's trace, and applies the configured checks:

* ``determinism``: the graph is first executed on cloned inputs with the RNG
  state saved, then (RNG restored) on the real inputs; records whose
  fingerprints differ are compared and the root cause reported.
* ``accuracy``: every captured value is compared with an eager execution of the
  same FX graph on the same inputs, judged against an fp64 execution
  (:func:`~determ_backend.compare.judge`).  The root cause is the causal one of
  :mod:`determ_backend.compare.roots`: a finding needs a failing output, and each
  candidate is confirmed by replaying the eager graph with its compiled value
  substituted (a divergence that leaves the outputs within tolerance is masked).
  Inductor buffers that hold no node's value (``extra.holds``) are not judged.
* ``nan``: the first record created non-finite -- NaN/Inf in its value while every input
  is finite (:mod:`determ_backend.compare.nonfinite`, on the nan/inf counts the trace's
  statistics already hold); records that only carry a NaN along are not findings.  When the
  record is an inductor buffer that fused several nodes, the graph is replayed eagerly on the
  call's inputs and the creating node of that region is named (or, when eager computes the
  region finite, the compiled kernel itself is).
* ``batch_invariance``: a graph whose inputs share a dynamic batch dimension (the size
  symbol of ``DETERM_BATCH_DIM``, 0 by default) is run again on a copy of the call's inputs and on
  sub-batches of them (the first half, then the first row) -- the same compiled code, the batch size
  symbol changed -- and the matching rows of every traced node are compared bitwise; the root
  cause is the first node whose input rows agree while its output rows do not (the causal rule of
  :mod:`determ_backend.compare.roots`).  A backward graph is cut by its forward graph's batch
  symbol (saved activations and incoming gradients; parameters stay whole).  Each root cause is
  reported once (with its ``repro.py``).  Graphs with no such dimension (a static batch size) are
  skipped with a note.
* ``reference``: records are compared online with a trace from another run
  (:class:`~determ_backend.backends.run.ReferenceTrace`, read when the run is created):
  bitwise when both were recorded on the same device and dtype, else within
  ``DETERM_TOL`` as ``repro-tools xdevice`` compares traces (also when
  ``DETERM_TOL`` is given).  A graph call with no counterpart in the reference
  is a checker error, never a silent pass.

The eager runs (the reference values, the causal replay) are
:mod:`determ_backend.backends.eager`'s, narrowing a root inside a fused kernel is
:mod:`determ_backend.backends.narrow`'s, and cloning inputs is :mod:`determ_backend.clones`'s.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
import torch.fx as fx

from determ_backend import _torch_compat, devices
from determ_backend.backends import flows, narrow
from determ_backend.backends.extract import node_draws
from determ_backend.compare import (Comparison, Pair, align, batch_rows, compare_traces, dtype_tol, find_roots,
                                    is_float, is_output, judge, rmse, rounds_alike, sub_batches,
                                    tensor_metrics)
from determ_backend.compare.nonfinite import causal_creations, first_created
from determ_backend.config import DetermConfig
from determ_backend.errors import AccuracyError, first_line
from determ_backend.backends.eager import RankLocalReplay, holds_collectives, replay
from determ_backend.backends.instrument import node_source
from determ_backend.backends.recorder import CallResult, Recorder
from determ_backend.backends.run import Run
from determ_backend.backends.retarget import widen_casts, widened
from determ_backend.backends.upstream import Upstream, move_innocent_roots
from determ_backend.clones import AttributeState, Saved, clone_inputs, read_attributes_in
from determ_backend.fingerprint.core import hash_tensors
from determ_backend.trace.stream import Record, format_hash

__all__ = ["GraphExec", "graph_in_dtype", "has_random_ops", "unrecorded"]

log = logging.getLogger(__name__)

_UNRECORDED = threading.local()  # unrecorded() regions open in this thread
_UNRECORDED_ANY = [0]  # ... in any thread: read by threads Python did not start (autograd's device threads)
_UNRECORDED_LOCK = threading.Lock()


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Calls of determ-compiled graphs inside run as compiled, recorded nowhere and checked by nothing: a repro
    flow's own execution of a graph (its accuracy check on the first call's inputs) is no call of the program's,
    and the trace holds the program's calls alone.  It holds for this thread, and for the threads autograd runs a
    backward in for it (threads Python did not start); another thread of the program is traced as ever.  Graphs
    compiled inside are configured as ever: :func:`determ_backend.config.flows_suspended` is the compile-time
    counterpart (the minifier's candidates get no tracing at all)."""
    _UNRECORDED.depth = getattr(_UNRECORDED, "depth", 0) + 1
    with _UNRECORDED_LOCK:
        _UNRECORDED_ANY[0] += 1
    try:
        yield
    finally:
        _UNRECORDED.depth -= 1
        with _UNRECORDED_LOCK:
            _UNRECORDED_ANY[0] -= 1


def _unrecorded_here() -> bool:
    if getattr(_UNRECORDED, "depth", 0):
        return True
    return bool(_UNRECORDED_ANY[0]) and isinstance(threading.current_thread(), threading._DummyThread)


def graph_in_dtype(gm: fx.GraphModule, dtype: torch.dtype) -> fx.GraphModule:
    """``gm`` with every narrower floating dtype its nodes name widened to ``dtype``
    (:func:`~determ_backend.backends.retarget.widen_casts`): the graph's own float32 buffers would otherwise
    meet float64 inputs (an ``index_put`` into a ``full(..., dtype=float32)``), a ``.float()`` of a Dynamo graph
    a float64 weight.  The copy shares ``gm``'s parameters and constants; an eager run reads the float ones as
    copies in ``dtype``."""
    g = fx.Graph()
    g.output(g.graph_copy(gm.graph, {}))
    widen_casts(g, dtype)
    out = fx.GraphModule(gm, g)
    read_attributes_in(out, dtype)  # float state (a compiled optimizer's) meets inputs in the new dtype
    return out


def _to64(args: Sequence[Any]) -> List[Any]:
    """The float64 reference's inputs: floating tensors in float64, complex ones in complex128."""
    return [a.detach().to(widened(a.dtype, torch.float64)) if isinstance(a, torch.Tensor) and
            (a.is_floating_point() or a.is_complex()) else a for a in args]


def _device_of(args: Sequence[Any]) -> Optional[str]:
    """The device type of the first tensor argument (where a graph computes)."""
    return next((a.device.type for a in args if isinstance(a, torch.Tensor)), None)


def _ref_name(rec: Record) -> Optional[str]:
    """The reference value a record is judged against: its FX node (or ``output.K``), None when the
    record holds no node's value (an inductor buffer labelled ``holds``, a second buffer ``node#k``)."""
    extra = rec.extra or {}
    if extra.get("holds"):
        return None
    if extra.get("placeholder"):
        return extra["placeholder"]
    if rec.kind == "output":
        return rec.node
    return rec.node if "#" not in rec.node else None


def _argument_records(result: CallResult) -> List[Record]:
    """The records of the call's tensor arguments, in order: its ``input``/``param`` records less the constants the
    graph holds (``get_attr``: every Hugging Face decoder has some), which are no argument of the call."""
    return [r for r in result.records if r.kind in ("input", "param") and r.op != "get_attr"]


def _inputs_intact(result: CallResult, args: List[Any]) -> bool:
    """Whether the call's tensor inputs still hold what the trace recorded at its start (a compiled backward
    may reuse its inputs' memory): their fingerprints against the input records', in order."""
    recs = _argument_records(result)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if len(recs) != len(tensors) or any(r.hash is None for r in recs):
        return False
    return [format_hash(h) for h in hash_tensors(tensors)] == [r.hash for r in recs]


def _row_pairs(full: CallResult, part: CallResult, batch: int, b: int) -> List[Pair]:
    """The records of the two runs paired by node, judged on their matching rows: the fingerprint of the first
    rows of each full-batch value (kept by this call) against the sub-batch record's own fingerprint.  Inputs
    agree by construction.  A value with no batch dimension is judged whole (the two fingerprints) where rows are
    made of it (a batch-carrying value consumes it, directly or through other such values): a reduction over the
    batch that feeds every row (``h + h.mean(0)``) is where rows start to depend on the batch.  Elsewhere (a loss,
    a weight's gradient: outputs that sum over the batch by design) it is not judged."""
    by_node = {r.node: r for r in part.records}
    pairs, slices, judged = [], [], []
    whole: List[Pair] = []  # no batch dimension: judged whole if rows are made of it
    for r in full.records:
        q = by_node.get(r.node)
        p = Pair(r, q)
        pairs.append(p)
        if q is None:
            continue
        if r.kind in ("input", "param"):
            p.equal = True
            continue
        v = full.values.get(r.node)
        where = batch_rows(list(v.shape), q.shape, batch, b) \
            if isinstance(v, torch.Tensor) and q.hash is not None and q.dtype == r.dtype else None
        if where is not None:
            slices.append(v.narrow(where[0], 0, where[1]))
            judged.append(p)
        elif isinstance(v, torch.Tensor) and r.hash is not None and q.hash is not None and q.dtype == r.dtype \
                and list(v.shape) == list(q.shape):
            whole.append(p)
    for p, h in zip(judged, hash_tensors(slices) if slices else ()):
        p.equal = format_hash(h) == p.b.hash
    feeds = _feeds_rows({p.a.node for p in judged}, full.records)
    for p in whole:
        if p.a.node in feeds:
            p.equal = p.a.hash == p.b.hash
    return pairs


def _feeds_rows(rows: set, records) -> set:
    """The nodes from which a value with rows (``rows``) is made, directly or through values without rows."""
    users: Dict[str, List[str]] = {}
    for r in records:
        for n in r.inputs:
            users.setdefault(n, []).append(r.node)
    out: set = set()
    for r in reversed(records):  # consumers come after their inputs: one pass from the end sees every path
        if any(u in rows or u in out for u in users.get(r.node, ())):
            out.add(r.node)
    return out


def _mentions(expr: Any, sym: Any) -> bool:
    """Whether a size expression (None for a plain int) involves the symbol ``sym``."""
    return expr is not None and (expr == sym or sym in getattr(expr, "free_symbols", ()))


def has_random_ops(gm: fx.GraphModule) -> bool:
    """Whether the graph draws random numbers (then a replay needs the call's RNG state)."""
    return any(node_draws(n) for n in gm.graph.nodes)


_ONE_OP_KERNELS = ("extern_kernels.", "torch.ops.")


def _kernel_of(node: str, records) -> Optional[str]:
    """The kernel that wrote ``node``'s value, or a partial value of it; None when no buffer holds either."""
    for r in records:
        ex = r.extra or {}
        if ex.get("kernel") and (r.node == node or ex.get("of") == node):
            return ex["kernel"]
    return None


_MAX_NARROW = 4
"""Fused kernels narrowed into per graph call (one compile per root in them).  A backward graph recomputes a
forward op in each kernel that needs it (a relu per expert of a mixture): every such kernel's root is one."""


def _accuracy_metrics(got: torch.Tensor, exp: torch.Tensor, e64: Optional[torch.Tensor]) -> Dict[str, Any]:
    """:func:`tensor_metrics` of a compiled value against eager, the fp64 errors named by side."""
    m = tensor_metrics(got, exp, e64)
    if "err_a_vs_fp64" in m:
        m["err_compiled_vs_fp64"] = m.pop("err_a_vs_fp64")
        m["err_eager_vs_fp64"] = m.pop("err_b_vs_fp64")
    return m


def _static_batch(graph: str, size: int, dim: int, name: str) -> str:
    """Why the batch check skips a graph whose batch size is a constant: what the user can change."""
    head = f"graph {graph}: its batch size {size} (dimension {dim} of input {name}) is static"
    if size in (0, 1):  # torch.compile specializes sizes 0 and 1 even under dynamic=True
        return f"{head} -- torch.compile makes a size of {size} a constant even with dynamic=True: use a batch of 2 or more"
    return (f"{head} -- compile with dynamic=True or torch._dynamo.mark_dynamic(x, {dim}); if you did, the model made "
            "it a constant (code that branches on, or asserts, the batch size)")


class _Confirmation:
    """Causal confirmation of accuracy root-cause candidates: the eager graph is replayed with one
    candidate's compiled value substituted; if every output stays within tolerance, the candidate's
    divergence is absorbed downstream (masked)."""

    def __init__(self, ex: "GraphExec", args: List[Any], rng_state, result: CallResult,
                 ref: Dict[str, torch.Tensor], ref64: Dict[str, torch.Tensor]):
        self.ex, self.args, self.rng, self.result, self.ref, self.ref64 = ex, args, rng_state, result, ref, ref64

    def confirm(self, candidates: List[Pair]) -> List[Optional[bool]]:
        return [self._one(p) for p in candidates]

    @functools.cached_property
    def upstream(self) -> Upstream:
        """The innocence test of a root (:mod:`determ_backend.backends.upstream`): the eager graph replayed with
        the compiled values of a node's inputs."""
        return Upstream(self.ex.reference_gm, self.args, self.rng, self.result.values, self.ref, self.ex.config.tol,
                        holds=self._holds)

    def move_innocent_roots(self, cmp: Comparison) -> None:
        """A root whose node computes its compiled value from its compiled inputs is innocent: its error came in
        through inputs that passed the absolute tolerance because they are small (``relu(x) * 1e-4`` feeding a
        matmul); the root moves to them (:func:`~determ_backend.backends.upstream.move_innocent_roots`)."""
        def node_of(p: Pair) -> Optional[str]:
            return _ref_name(p.rec) if p.rec.kind == "node" else None

        def remeasure(name: str) -> Dict[str, Any]:
            return _accuracy_metrics(self.result.values.get(name), self.ref[name], self.ref64.get(name))

        move_innocent_roots(cmp, self.upstream, node_of, remeasure)

    def _holds(self, name: str) -> bool:
        """Whether the compiled value recorded as ``name`` is that node's whole value."""
        rec = self._records.get(name)
        return rec is not None and _ref_name(rec) == name

    @functools.cached_property
    def _records(self) -> Dict[str, Record]:
        return {r.node: r for r in self.result.records}

    @functools.cached_property
    def _written_back(self) -> set:
        """The nodes whose values the graph writes back into its inputs: symptoms, as its outputs are."""
        return {name for r in self.result.records if (r.extra or {}).get("writes_input")
                for name in [_ref_name(r)] if name is not None}

    def _one(self, p: Pair) -> Optional[bool]:
        rec = p.rec
        name = _ref_name(rec)
        value = self.result.values.get(rec.node)
        exp = self.ref.get(name) if name is not None else None
        if rec.kind == "output" or value is None or not isinstance(exp, torch.Tensor) or value.shape != exp.shape:
            return None
        try:
            replayed = replay(self.ex.reference_gm, self.args, self.rng, inject={name: value}, rank_local=True)
        except Exception as e:  # a substituted value the graph cannot run with: cannot tell
            log.info("determ accuracy: replay with %s substituted failed (%s)", name, e)
            return None
        strict = self.ex.config.strict
        written = self._written_back
        for key, exp in self.ref.items():
            if not (key.startswith("output.") or key in written) or key not in replayed:
                continue
            if not strict and not is_float(exp):
                continue
            if self.ex._judge(exp, replayed[key], self.ref64.get(key), key) is False:
                return True
        return False


class GraphExec:
    """A compiled graph plus determ's recording and checks.  ``boxed`` follows AOT's calling convention."""

    def __init__(self, fn: Callable, recorder: Recorder, run: Run, config: DetermConfig,
                 reference_gm: Optional[fx.GraphModule] = None, boxed: bool = False,
                 compile_region: Optional[Callable[[fx.GraphModule, List[Any]], Callable]] = None,
                 compiler: str = "eager"):
        self.fn, self.recorder, self.run, self.config = fn, recorder, run, config
        self.compiler = compiler  # how a repro of this graph recompiles it: "eager" (FX as is) or "inductor"
        self.compile_region = compile_region  # the graph's compiler, to narrow a root inside a fused kernel
        self.reference_gm, self.boxed = reference_gm, boxed
        self._gm64: Optional[fx.GraphModule] = None
        self._no_ref64: Optional[str] = None  # why the last call's float64 reference could not run
        _torch_compat.set_boxed(self, boxed)
        self._unmatched: set = set()  # (graph, stage) already reported as missing from the reference
        self._created: set = set()  # what the nan and batch_invariance checks already reported for this graph
        self._random = reference_gm is not None and has_random_ops(reference_gm)
        self._batch_plan: Any = None  # batch_invariance: None until the first call, False for a skipped graph
        self._state: Optional[AttributeState] = None  # the tensor attributes calls write (first checked call on)
        self._checks_start: Optional[Saved] = None  # while checks run: the attributes' values the call started from
        recorder.keep_values = "accuracy" in config.check or config.save_tensors

    def _invoke(self, args: List[Any]) -> Any:
        return self.fn(args) if self.boxed else self.fn(*args)

    def __call__(self, *call_args: Any) -> Any:
        if self.boxed:
            (args,) = call_args
            args_list = list(args)
            args.clear()
        else:
            args_list = list(call_args)
        if _UNRECORDED_ANY[0] and _unrecorded_here():
            try:
                return self._invoke(args_list)
            finally:
                self.recorder.end_call(count=False)  # its captures dropped, the program's next call keeps its index
        if self.run.device is None:
            self.run.device = _device_of(args_list)
        checks = self.config.check
        twin: Optional[CallResult] = None
        eager_args = self._guard("accuracy", clone_inputs, args_list) \
            if "accuracy" in checks and self.reference_gm is not None else None
        state_before = self._guard("state", self._state_before_checks, bool(checks) and (
            eager_args is not None or "determinism" in checks or "nan" in checks or "batch_invariance" in checks))
        if "determinism" in checks:
            rng = devices.get_rng_state()
            try:
                twin = self._guard("determinism", self._twin, args_list)
            finally:
                devices.set_rng_state(rng)
                if state_before is not None:  # the twin's writes into the graph's attributes undone
                    self._guard("state", self._state.restore, state_before)
        batch_args = self._guard("batch_invariance", clone_inputs, args_list) \
            if "batch_invariance" in checks and self._batch_plan is not False else None
        # the nan check keeps references only: the inputs are replayed when a creation hides in a fused kernel
        nan_args = list(args_list) if "nan" in checks else None
        rng_before = devices.get_rng_state() \
            if eager_args is not None or batch_args is not None or (nan_args and self._random) else None
        keep = self.recorder.keep_values
        if batch_args is not None:  # the batch check's full-batch values: this very call's
            self.recorder.keep_values = True
        try:
            out = self._invoke(args_list)
        finally:
            result = self.recorder.end_call()
            self.recorder.keep_values = keep
        if self.config.save_tensors:
            self.run.store_payloads(result)
        self.run.write_call(result)
        after = None
        if state_before is not None:  # the checks below start from what this call started from
            after = self._guard("state", self._states_around_call, state_before,
                                eager_args is not None or nan_args is not None or batch_args is not None)
        self._checks_start = state_before if after is not None else None
        try:
            if twin is not None:
                self._guard("determinism", self._check_determinism, twin, result)
                self.run.judged.add("determinism")
            if eager_args is not None:
                self._guard("accuracy", self._check_accuracy, eager_args, result, rng_before)
                self.run.judged.add("accuracy")
            if nan_args is not None:
                self.run.judged.add("nan")  # the call's records were looked at for a creation
                if result.nonfinite():
                    self._guard("nan", self._check_nan, result, nan_args, rng_before)
            if batch_args is not None:
                self._guard("batch_invariance", self._check_batch, result, batch_args, rng_before)
            if self.config.reference:
                self._guard("reference", self._check_reference, result)
        finally:
            self._checks_start = None
            if after is not None:  # and the program goes on from what its call left
                self._state.restore(after)
        return out

    def _state_before_checks(self, checks_run: bool) -> Optional[Saved]:
        """The graph's tensor attributes as this call finds them, when a check will run the graph again (the
        first call saves every one; later calls those the program's calls write, often none)."""
        if not checks_run:
            return None
        if self._state is None:
            self._state = AttributeState(self.reference_gm if self.reference_gm is not None else self.fn)
        return self._state.save() if self._state.tensors else None

    def _states_around_call(self, before: Saved, replays: bool) -> Optional[Saved]:
        """After the program's call: learn what it wrote; when checks replay the graph, put back what the call
        started from and return what it left (put back once the checks are done)."""
        written = self._state.learn(before)
        if not replays or not written:
            return None
        left = self._state.save()
        self._state.restore(before)
        return left

    def _twin(self, args_list: List[Any]) -> CallResult:
        """The determinism check's first execution, on clones of the inputs."""
        try:
            self._invoke(clone_inputs(args_list))
        finally:
            twin = self.recorder.end_call(count=False)
        return twin

    def _guard(self, check: str, fn: Callable, *args: Any) -> Any:
        """Run a piece of ``check``'s machinery; a failure becomes a checker error and the model goes on.
        A divergence raised on purpose (``DETERM_RAISE``) passes through."""
        try:
            return fn(*args)
        except AccuracyError:
            raise
        except Exception as e:
            self.run.add_checker_error(check, f"{type(e).__name__}: {first_line(e)} (in {getattr(fn, '__name__', 'check')})")
            return None

    def _check_determinism(self, twin: CallResult, result: CallResult) -> None:
        cmp = compare_traces(twin.records, result.records)
        if cmp.divergent:
            self.run.add_finding("determinism", cmp.summary(["determinism"]), cmp.pairs)
        elif cmp.masked:
            self.run.add_note("determinism", cmp.summary(["determinism"]))

    def _check_accuracy(self, eager_args: List[Any], result: CallResult, rng_state) -> None:
        try:
            ref = replay(self.reference_gm, eager_args, rng_state)
        except Exception as e:
            log.debug("determ accuracy: eager reference run failed", exc_info=True)
            self.run.add_checker_error("accuracy", f"eager reference run failed: {type(e).__name__}: {first_line(e)}")
            return
        try:
            ref64 = replay(self._reference_gm64(), _to64(eager_args), rng_state)
            self._no_ref64 = None
        except Exception as e:  # an op without a float64 kernel: judge against eager at the dtypes' precision
            why = f"{type(e).__name__}: {first_line(e)}"
            if self._no_ref64 is None:
                log.warning("determ accuracy: the float64 reference of graph %s could not run (%s); compiled values "
                            "are judged against eager alone, within a few units in the last place of their dtype",
                            f"{self.recorder.graph} ({self.recorder.stage})", why)
            self._no_ref64, ref64 = why, {}
        pairs = self._accuracy_pairs(result, ref, ref64)
        confirmation = _Confirmation(self, eager_args, rng_state, result, ref, ref64)
        mode = (f"fp64 tol={self.config.tol:g}" if self._no_ref64 is None else
                f"tol={self.config.tol:g} widened to the dtypes' precision (no fp64 reference: {self._no_ref64})")
        cmp = find_roots(pairs, mode=mode, strict=self.config.strict, confirm=confirmation.confirm)
        if cmp.root_causes:
            confirmation.move_innocent_roots(cmp)
        if cmp.divergent and self.compile_region is not None:
            self._narrow(cmp, ref, ref64)
        if cmp.divergent:
            self.run.add_finding("accuracy", cmp.summary(["accuracy"]), cmp.pairs)
        elif cmp.masked:
            self.run.add_note("accuracy", cmp.summary(["accuracy"]))

    def _check_nan(self, result: CallResult, args: List[Any], rng_state) -> None:
        """The first record of this call created non-finite, once per node (later calls repeat it)."""
        found, masked, sources = causal_creations(result.records, is_output)
        if masked and not found:
            m = masked[0].record
            key = ("masked", m.graph, m.stage, m.node)
            if key not in self._created:
                self._created.add(key)
                self.run.add_note("nan", {"masked": [{"graph": m.graph, "stage": m.stage, "node": m.node, "op": m.op,
                                                      "source": m.source, "note": "NaN/Inf created here reaches no "
                                                      "output of the graph"}]})
        if not found:
            self._note_sources(sources)
            return
        c = found[0]
        rec = c.record
        key = (rec.graph, rec.stage, rec.node)
        if key in self._created:
            return
        self._created.add(key)
        where = {"graph": rec.graph, "stage": rec.stage, "call": rec.call, "node": rec.node, "op": rec.op,
                 "kind": rec.kind, "source": rec.source, "dtype": rec.dtype, "shape": rec.shape,
                 "metrics": {"nan": c.nan, "inf": c.inf}, "inputs": c.inputs, "root_cause": True}
        intact = self.reference_gm is not None and _inputs_intact(result, args)  # the replay and the repro read them
        kernel = (rec.extra or {}).get("kernel")
        if kernel and self.reference_gm is not None:
            inside = self._created_inside(rec, result, args, rng_state, intact)
            if inside is not None:
                where["inside"] = dict(inside, kernel=kernel)
        summary = {"checks": ["nan"], "divergent": True, "first_divergence": where, "root_causes": [where],
                   "creations": len(found) + len(masked)}
        if intact:
            summary["repro"] = self._write_repro("nan", args)
        elif self.reference_gm is not None:  # said, not left out silently: the finding stands without it
            summary["repro_skipped"] = ("the call's inputs no longer hold what it read (a compiled backward reuses "
                                        "their memory): no repro of this call")
        self.run.add_finding("nan", summary)

    def _note_sources(self, sources: List[Record]) -> None:
        """No node of the graph created the NaN at its output: it came in with an input or a parameter (a weight
        holding an Inf).  Said once per input, in a note and a warning: the check finds nothing to blame here.
        Not said once a node was named: a graph fed what an earlier graph created is explained by it."""
        if any(f.get("check") == "nan" for f in self.run.findings):
            return
        for r in sources:
            key = ("source", r.graph, r.stage, r.node)
            if key in self._created:
                continue
            self._created.add(key)
            st = r.stats or {}
            nan, inf = int(st.get("nan") or 0), int(st.get("inf") or 0)
            notice = (f"a NaN at an output of graph={r.graph} stage={r.stage} comes from {r.kind} {r.node}, which "
                      f"holds {nan} NaN and {inf} Inf when the graph is called: no node of the graph created it "
                      f"(look where that value was made)")
            self.run.add_notice("nan", notice, graph=r.graph, stage=r.stage, node=r.node, kind=r.kind,
                                metrics={"nan": nan, "inf": inf})
            log.warning("determ nan: %s", notice)

    def _created_inside(self, rec: Record, result: CallResult, args: List[Any], rng_state,
                        intact: bool) -> Optional[Dict[str, Any]]:
        """The node of ``rec``'s fused region that creates the NaN/Inf in an eager replay of the graph on this
        call's inputs (``intact``: they still hold what the call read); ``{"node": None}`` when eager computes the
        region finite (the compiled kernel is the creator) or the inputs changed; None when the region is a single
        node."""
        name = _ref_name(rec) or (rec.extra or {}).get("of")
        judged = {n for n in (_ref_name(r) for r in result.records) if n}
        region = narrow.region_of(self.reference_gm, name, judged - {name}) if name else []
        if len(region) < 2:
            return None
        names = [n.name for n in region]
        if not intact:
            return {"node": None, "region": names,
                    "note": "not narrowed: the compiled graph reused its inputs' memory (a cached compile from "
                            "before DETERM_CHECK=nan; clear TORCHINDUCTOR_CACHE_DIR to narrow)"}
        try:
            values = replay(self.reference_gm, args, rng_state if rng_state is not None else devices.get_rng_state(),
                            rank_local=True)
        except RankLocalReplay as e:
            return {"node": None, "region": names, "note": f"{e} (this rank alone found the NaN/Inf)"}
        node = first_created(self.reference_gm, values, names)
        if node is None:
            return {"node": None, "region": names,
                    "note": "eager computes this fused region finite: the compiled kernel creates the NaN/Inf"}
        return {"node": node.name, "op": str(node.target), "source": node_source(node), "region": names}

    # -- batch invariance ----------------------------------------------------------------------------
    def _plan_batch(self, result: CallResult, args: List[Any]) -> Any:
        """``(B, tensor indices, size-argument indices)`` of the batch, or the reason the graph is skipped.

        The batch is a size symbol: in a forward graph, that of dimension ``DETERM_BATCH_DIM`` of its first
        (non-parameter) input; a backward graph uses its forward graph's.  Tensors with that symbol in that
        dimension are cut to their first rows, size arguments equal to it follow; parameters and other
        tensors (static sizes, or other symbols) are left whole."""
        r0 = result.records[0] if result.records else None
        if r0 is None or self.reference_gm is None:
            return "a graph with no traced records or no FX graph"
        if self._random:  # the first rows' draws are the batch's only up to the first random op: after it the
            # generator stands elsewhere (it drew for fewer rows), and dropout would be blamed for the batch
            return (f"graph {r0.graph} {r0.stage}: it draws random numbers (dropout in training), and a sub-batch "
                    "draws other numbers for its rows than the batch did")
        if devices.world_size() > 1 and holds_collectives(self.reference_gm):
            # the sub-batch runs stop at the first divergent one, which differs from rank to rank: their collectives
            # would pair with other ranks' next ones
            return (f"graph {r0.graph} {r0.stage}: it holds collectives, which the sub-batch runs of this rank alone "
                    "would issue")
        placeholders = [n for n in self.reference_gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(args):
            return f"graph {r0.graph} {r0.stage}: its placeholders do not match its arguments"
        dim = self.config.batch_dim
        vals = [_torch_compat.example_value(n) for n in placeholders]
        backward = "backward" in r0.stage
        batch_sym = self.run.batch_symbols.get(r0.graph) if backward else None
        if backward and batch_sym is None:
            return f"graph {r0.graph} {r0.stage}: its forward graph was not checked for batch invariance"
        if not backward:
            kinds = iter([r.kind for r in _argument_records(result)])
            for n, a, val in zip(placeholders, args, vals):
                kind = next(kinds, None) if isinstance(a, torch.Tensor) else None
                if kind == "input" and a.dim() > dim and isinstance(val, torch.Tensor):
                    batch_sym = _torch_compat.sym_expr(val.shape[dim])
                    if batch_sym is None:
                        return _static_batch(r0.graph, a.shape[dim], dim, n.name)
                    break
            if batch_sym is None:
                return f"graph {r0.graph}: no input with a dimension {dim} (DETERM_BATCH_DIM)"
        for n, val in zip(placeholders, vals):  # duck sizing: another dimension got the batch's symbol
            if isinstance(val, torch.Tensor) and any(
                    e != dim and _mentions(_torch_compat.sym_expr(size), batch_sym) for e, size in enumerate(val.shape)):
                return (f"graph {r0.graph} {r0.stage}: the batch size is also the size of another dimension (input "
                        f"{n.name} {list(val.shape)}); give the batch a size no other dimension has")
        rows = [i for i, (a, val) in enumerate(zip(args, vals)) if isinstance(a, torch.Tensor) and a.dim() > dim
                and isinstance(val, torch.Tensor) and _torch_compat.sym_expr(val.shape[dim]) == batch_sym]
        sizes = [i for i, (a, val) in enumerate(zip(args, vals))
                 if not isinstance(a, torch.Tensor) and _torch_compat.sym_expr(val) == batch_sym]
        if not rows:
            return f"graph {r0.graph} {r0.stage}: no input holds the batch in dimension {dim}"
        batch = args[rows[0]].shape[dim]
        if batch < 2:
            return f"graph {r0.graph} {r0.stage}: batch size {batch}"
        if not backward:
            self.run.batch_symbols[r0.graph] = batch_sym
        return batch, rows, sizes

    def _run_extra(self, args: List[Any], rng_state) -> CallResult:
        """One extra execution of the compiled graph on ``args`` (traced: its records carry fingerprints)."""
        current = devices.get_rng_state()
        start = self._checks_start
        try:
            if rng_state is not None:
                devices.set_rng_state(rng_state)
            try:
                self._invoke(args)
            finally:
                res = self.recorder.end_call(count=False)
        finally:
            devices.set_rng_state(current)
            if start is not None:  # the next run starts where the program's call started too
                self._state.restore(start)
        return res

    def _check_batch(self, result: CallResult, args: List[Any], rng_state) -> None:
        if self._batch_plan is None:
            plan = self._plan_batch(result, args)
            if isinstance(plan, str):
                self._batch_plan = False
                self.run.add_skip("batch_invariance", plan)
                return
            self._batch_plan = plan
        self.run.judged.add("batch_invariance")
        batch, rows, sizes = self._batch_plan
        dim = self.config.batch_dim
        for b in sub_batches(batch):
            # ``args`` is already a copy taken before the call: the other inputs are shared, not copied again
            sub = [a.narrow(dim, 0, b).clone() if i in rows else b if i in sizes else a
                   for i, a in enumerate(args)]
            part = self._run_extra(sub, rng_state)
            cmp = find_roots(_row_pairs(result, part, batch, b), mode=f"batch_invariance rows 0..{b - 1} of {batch}",
                             strict=True)
            if cmp.divergent:
                key = ("batch_invariance",) + tuple(p.rec.node for p in cmp.root_causes)
                if key in self._created:  # reported for an earlier call
                    return
                self._created.add(key)
                summary = cmp.summary(["batch_invariance"])
                summary.update(batch=batch, sub_batch=b)
                # which inputs hold the batch, as this check cut them: a repro's own guess by sizes would also
                # cut a weight whose first size is a multiple of the batch
                cuts = {s: [[i, dim, s] for i in rows] + [[i, None, s] for i in sizes] for s in sub_batches(batch)}
                summary["repro"] = self._write_repro("batch_invariance", args, batch=batch,
                                                     batch_dim=self.config.batch_dim, batch_cuts=cuts)
                self.run.add_finding("batch_invariance", summary, cmp.pairs)
                return

    def _write_repro(self, kind: str, args: List[Any], **meta: Any) -> Optional[str]:
        """``<run dir>/<kind>_<graph>_<stage>/repro.py``: this graph on the call's inputs, for ``python repro.py``
        and ``repro-tools minify`` (None, with a checker error, when it cannot be written)."""
        r0 = self.recorder
        path = self.run.dir / f"{kind}_{r0.graph}_{r0.stage}" / "repro.py"
        try:
            return str(flows.write_repro(self.reference_gm, args, path, dict(meta, kind=kind, compiler=self.compiler)))
        except Exception as e:  # the finding stands without its repro
            self.run.add_checker_error(kind, f"writing {path} failed: {type(e).__name__}: {first_line(e)}")
            return None

    def _reference_gm64(self) -> fx.GraphModule:
        """The reference graph with its own float dtypes in float64 (built once, on the first check)."""
        if self._gm64 is None:
            self._gm64 = graph_in_dtype(self.reference_gm, torch.float64)
        return self._gm64

    def _narrow(self, cmp: Comparison, ref: Dict[str, Any], ref64: Dict[str, Any]) -> None:
        """Roots written by a kernel that fused several nodes are narrowed to the node that diverges when
        the kernel's region is compiled alone (:mod:`determ_backend.backends.narrow`)."""
        judged = {n for n in (_ref_name(q.rec) for q in cmp.pairs if q.equal is not None) if n}
        by_node = {q.rec.node: q.rec for q in cmp.pairs}
        kernels: set = set()  # the kernels narrowed into so far (at most _MAX_NARROW of them)
        for p in cmp.root_causes:
            rec = p.rec
            kernel = (rec.extra or {}).get("kernel")
            name = _ref_name(rec)
            if rec.kind == "output":  # a graph output written by a fused kernel: narrow the node it returns
                kernel, name = self._output_kernel(rec, by_node)
            if not kernel or name is None or rec.kind not in ("node", "output"):
                continue
            if kernel not in kernels and len(kernels) >= _MAX_NARROW:
                continue
            kernels.add(kernel)
            try:
                found = narrow.narrow_root(self.reference_gm, name, judged, ref, ref64, self.compile_region,
                                           self._judge, rounds_alike)
            except Exception as e:  # the region could not be compiled or run alone: the buffer stays the answer
                self.run.add_checker_error("accuracy", f"narrowing {rec.node} inside {kernel} failed: "
                                                       f"{type(e).__name__}: {first_line(e)}")
                continue
            if found is None:
                continue
            p.inside = dict(found.describe(), kernel=kernel)
            if found.node is not None and found.node.name != name and kernel.startswith(_ONE_OP_KERNELS):
                # an extern or fallback kernel computes its own node only: the culprit came from upstream
                p.inside.update(kernel=_kernel_of(found.node.name, by_node.values()), upstream=True)
            if found.node is not None:
                p.inside["metrics"] = _accuracy_metrics(found.value, ref[found.node.name],
                                                        ref64.get(found.node.name))
        culprits = {(p.inside or {}).get("node") or _ref_name(p.rec) for p in cmp.root_causes if p.rec.kind == "node"}
        seen, keep = set(), []
        for p in cmp.root_causes:  # two roots narrowed to one node (a buffer and an output it feeds) are one
            key = (p.inside or {}).get("node") or p.rec.node
            if key in seen or (p.rec.kind == "output" and not p.inside
                               and culprits & self._unjudged_upstream(p.rec, judged)):
                p.root_cause = False  # an output fed, through values nobody judged, by a culprit already named
                continue
            seen.add(key)
            keep.append(p)
        cmp.root_causes[:] = keep

    def _unjudged_upstream(self, rec: Record, judged: set) -> set:
        """FX nodes behind a graph output through values that were not judged (fused, partial, views)."""
        start = self._returned_node(rec)
        found, stack = set(), [start] if start is not None else []
        while stack and len(found) < 512:
            n = stack.pop()
            if n.name in found:
                continue
            found.add(n.name)
            if n is start or n.name not in judged:
                stack.extend(n.all_input_nodes)
        return found

    def _output_kernel(self, rec: Record, by_node: Dict[str, Record]) -> tuple:
        """``(kernel, FX node name)`` of a graph output record: the kernel that wrote the buffer it returns, and
        the node the graph returns at that position; ``(None, None)`` when either is unknown."""
        src = by_node.get(rec.inputs[0]) if len(rec.inputs) == 1 else None
        kernel = (src.extra or {}).get("kernel") if src is not None else None
        node = self._returned_node(rec)
        return (kernel, node.name) if kernel and node is not None else (None, None)

    def _returned_node(self, rec: Record) -> Optional[fx.Node]:
        """The FX node the reference graph returns at the position of output record ``output.K``; None when there
        is no such position or it returns no node."""
        try:
            k = int(rec.node.rsplit(".", 1)[1])
            out = next(n for n in self.reference_gm.graph.nodes if n.op == "output").args[0]
            node = out[k] if isinstance(out, (tuple, list)) else out
        except (ValueError, IndexError, StopIteration, TypeError):
            return None
        return node if isinstance(node, fx.Node) else None

    def _judge(self, exp: Any, got: Any, e64: Any, name: Optional[str] = None) -> Optional[bool]:
        """Accuracy verdict on one value (node ``name`` of the reference graph, or ``output.K``): the configured
        criterion, non-floating values exactly (whether they count as a symptom at an output is the root-cause
        rule's business).  Without a float64 reference a value computed from bfloat16 or float16 values is held to
        a few units in the last place of the narrowest of them, not to ``tol``: eager rounds them in other places
        than a fused kernel does (a float32 RMSNorm scale of a bf16 residual that inductor keeps in float32), and
        only the reference could say which is closer."""
        tol = self.config.tol
        if not isinstance(e64, torch.Tensor) and isinstance(exp, torch.Tensor) and isinstance(got, torch.Tensor):
            narrowest = self._computed_from.get(name) if name is not None else None
            tol = dtype_tol(tol, exp.dtype, got.dtype, *([narrowest] if narrowest is not None else []))
        return judge(exp, got, e64, tol=tol, fp64_multiplier=self.config.fp64_multiplier, strict=True)

    @functools.cached_property
    def _computed_from(self) -> Dict[str, torch.dtype]:
        """Node name (and ``output.K``) -> the narrowest floating dtype among the values it is computed from, itself
        included (by the reference graph's traced values)."""
        out: Dict[str, torch.dtype] = {}
        if self.reference_gm is None:
            return out
        for n in self.reference_gm.graph.nodes:
            if n.op == "output":
                rets = n.args[0] if isinstance(n.args[0], (tuple, list)) else [n.args[0]]
                for k, r in enumerate(rets):
                    if isinstance(r, fx.Node) and r.name in out:
                        out[f"output.{k}"] = out[r.name]
                continue
            found = [out[a.name] for a in n.all_input_nodes if a.name in out]
            v = _torch_compat.example_value(n)
            for x in (v if isinstance(v, (tuple, list)) else [v]):
                if isinstance(x, torch.Tensor) and x.is_floating_point():
                    found.append(x.dtype)
            if found:
                out[n.name] = max(found, key=lambda d: torch.finfo(d).eps)
        return out

    def _accuracy_pairs(self, result: CallResult, ref: Dict[str, torch.Tensor], ref64: Dict[str, torch.Tensor]) -> List[Pair]:
        pairs: List[Pair] = []
        for rec in result.records:
            name = _ref_name(rec)
            got = result.values.get(rec.node)
            exp = ref.get(name) if name is not None else None
            p = Pair(rec, rec)
            pairs.append(p)
            if rec.kind in ("input", "param"):
                p.equal = True
                continue
            if got is None or not isinstance(exp, torch.Tensor):
                continue  # not a node's value (a partial buffer, a view): judged through its neighbours
            e64 = ref64.get(name)
            if got.shape != exp.shape:
                if got.numel() != exp.numel():
                    continue
                exp = exp.reshape(got.shape)
                e64 = e64.reshape(got.shape) if e64 is not None else None
            p.equal = self._judge(exp, got, e64, name)
            if p.equal is False:
                p.metrics = _accuracy_metrics(got, exp, e64)
            if got.is_floating_point() and exp.is_floating_point():  # every node's error, for the report's error plot
                p.metrics["rmse"] = rmse(got, exp)
                if isinstance(e64, torch.Tensor) and "err_eager_vs_fp64" not in p.metrics:  # a divergent one has it
                    p.metrics["err_eager_vs_fp64"] = rmse(exp, e64)
        return pairs

    def _check_reference(self, result: CallResult) -> None:
        if not result.records:
            return
        ref = self.run.reference
        r0 = result.records[0]
        group = ref.groups.get((r0.graph, r0.stage, r0.call))
        if group is None:
            self._report_unmatched(r0)
            return
        self.run.reference_compared.add((r0.graph, r0.stage, r0.call))
        self.run.judged.add("reference")
        pairs = align(group, result.records)
        other_dtype = any(p.a.dtype != p.b.dtype for p in pairs if p.a is not None and p.b is not None
                          and p.a.dtype and p.b.dtype)
        other_device = bool(ref.device and self.run.device and ref.device != self.run.device)
        tol = self.config.tol if other_dtype or other_device or "tol" in self.config.given else None
        store = self.run.tensors if self.config.save_tensors else None
        cmp = compare_traces(group, result.records, tol=tol, store_a=ref.store, store_b=store, pairs=pairs)
        if cmp.divergent:
            self.run.add_finding("reference", cmp.summary(["reference"]), cmp.pairs)
        elif cmp.masked:
            self.run.add_note("reference", cmp.summary(["reference"]))

    def _report_unmatched(self, r0: Record) -> None:
        """One checker error per graph and stage that the reference cannot be compared with."""
        if (r0.graph, r0.stage) in self._unmatched:
            return
        self._unmatched.add((r0.graph, r0.stage))
        ref = self.run.reference
        calls = ref.calls(r0.graph, r0.stage)
        if calls:
            why = (f"the reference recorded {calls} call(s) of graph {r0.graph} stage {r0.stage}; "
                   f"calls from {r0.call} on are not compared")
        else:
            why = (f"no records of graph {r0.graph} stage {r0.stage} to compare with (the reference has "
                   f"{', '.join(ref.graph_stages()) or 'no records'}; record it with the same backend and model)")
        self.run.add_checker_error("reference", f"{ref.name}: {why}")
