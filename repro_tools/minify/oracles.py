"""Oracles: "does this candidate graph, with these inputs, still fail the same way?"

An :class:`OracleSpec` (plain data, JSON round-trip, so it can be sent to the
isolated worker) names the kind of failure and the compiler under test:

* ``compile_error`` / ``runtime_error`` / ``error`` (either stage): the compiler,
  or the compiled graph, raises; once the input graph's failure is known
  (``expected``), a candidate only counts when it fails at the same stage with
  the same exception type and a similar message, so the search cannot drift to
  another bug;
* ``crash`` (the process dies by a signal, e.g. a segfault or ``abort``) and
  ``hang`` (no answer within ``timeout`` seconds): judged by the isolated worker
  in :mod:`repro_tools.minify.isolate`, never in-process;
* ``accuracy``: compiled vs eager with an fp64 reference, the ``same()`` criterion
  of :func:`determ_backend.compare.judge` (``strict``: non-float outputs count too);
* ``nondeterminism``: two executions of one compiled graph differ bitwise;
* ``batch_invariance``: the graph compiled for its inputs and for the first rows of its batched
  inputs (the values the whole graph's run on its first rows cut, :func:`batch_cuts`; without them,
  those whose dimension ``batch_dim`` is ``batch`` or a multiple of it, size arguments equal to
  ``batch`` following) gives outputs whose matching rows differ bitwise
  (:func:`determ_backend.compare.rows_agree`), for the first half or the first row;
* ``nan``: the compiled graph creates a NaN/Inf -- an output holds one while every input is finite
  (the rule of :mod:`determ_backend.compare.nonfinite`);
* ``cross_device``: the graph on ``devices[0]`` vs ``devices[1]`` (specs such as
  ``cuda``, ``cpu:float64``; the graph's parameters, buffers and constants move
  with its inputs) differs beyond ``tol``.

The compiler always gets a copy of the graph: the original stays the eager reference.

:func:`check` judges in this process; :func:`observe` returns the raw outputs
the localizer needs; :func:`check_observed` also returns, for inductor accuracy, the
compiled values of the nodes inductor materialized, from the same compile.  Running
them in a worker lives in :mod:`repro_tools.minify.isolate`.  Every run gets clones of the
inputs (:func:`determ_backend.clones.clone_inputs`).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
import math
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from determ_backend.backends.eager import eager_node_values
from determ_backend.clones import clone_inputs
from determ_backend.compare import DEFAULT_FP64_MULTIPLIER, DEFAULT_TOL, batch_rows, judge, rows_agree, sub_batches
from determ_backend.compare.nonfinite import creates, nonfinite
from determ_backend.devices import parse_device_spec
from determ_backend.errors import ConfigError, ReproError, first_line
from determ_backend.fingerprint.core import hash_tensors
from determ_backend.backends.retarget import converter, moved_graph
from repro_tools.minify.accuracy import same_two_models

from repro_tools.minify.compilers import (Compiler, call_compiled, compile_graph, compiler_name, config_patch, flat_tensors, resolve_compiler)
from repro_tools.minify.inductor_values import SUPPORTED, BufferValues

__all__ = ["KINDS", "OracleSpec", "Signature", "Verdict", "check", "check_observed", "observe", "similar",
           "InProcessRunner", "leaf_differs", "reference_outputs", "sub_batch_inputs", "batch_cuts", "input_cuts",
           "given_cuts", "script_cuts"]

log = logging.getLogger(__name__)

KINDS = ("compile_error", "runtime_error", "error", "crash", "hang", "accuracy", "nondeterminism", "cross_device",
         "batch_invariance", "nan")
ISOLATED_ONLY = ("crash", "hang")
_SEED = 1234


@dataclass(frozen=True)
class Signature:
    """What a failure looked like: ``stage`` (compile, runtime, crash, hang, accuracy, ...), exception type, message."""

    stage: str
    type: str = ""
    message: str = ""

    def short(self) -> str:
        first = self.message.strip().splitlines()[0][:200] if self.message.strip() else ""
        return ": ".join(part for part in (self.stage, self.type, first) if part)


@dataclass(frozen=True)
class Verdict:
    """The answer to one query."""

    fails: bool
    signature: Optional[Signature] = None
    detail: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class OracleSpec:
    kind: str = "accuracy"
    """One of :data:`KINDS`."""
    compiler: Compiler = "inductor"
    """Backend name, ``module:function``, or a callable (in-process only)."""
    config: Tuple[Tuple[str, Any], ...] = ()
    """Inductor config entries applied while compiling, e.g. ``(("cpp.inject_relu_bug_TESTING_ONLY", "accuracy"),)``."""
    tol: float = DEFAULT_TOL
    """Accuracy / cross-device tolerance."""
    multiplier: float = DEFAULT_FP64_MULTIPLIER
    """Accuracy: compiled error vs fp64 may be this multiple of eager's."""
    strict: bool = False
    """Accuracy / cross-device: non-float outputs count too (with ``tol == 0``: everything bitwise)."""
    grads: bool = False
    """Accuracy: judge the gradients too -- of a scalar loss over the outputs, with respect to the inputs that
    require grad and the parameters -- as the after-dynamo check judged a training graph (a compiler whose fault
    is in the backward alone leaves the forward outputs right)."""
    devices: Tuple[str, ...] = ("cpu", "cpu:float64")
    """Cross-device: the two device specs compared."""
    runs: int = 2
    """Nondeterminism: executions compared."""
    timeout: float = 300.0
    """Isolated queries: seconds before a candidate counts as hanging."""
    similarity: float = 0.5
    """Errors: minimum message similarity (0..1) to count as the same failure."""
    expected: Optional[Signature] = None
    """Errors / crashes: the input graph's failure, which candidates must match."""
    batch: Optional[int] = None
    """Batch invariance: the batch size of the repro's inputs."""
    batch_dim: int = 0
    """Batch invariance: the dimension that holds the batch."""
    cuts: Tuple[Tuple[int, Tuple[Tuple[str, Optional[int], int], ...]], ...] = ()
    """Batch invariance: per sub-batch size ``b``, the graph's values that hold the batch, by node name:
    ``(name, dim, rows)`` for a tensor (its first ``rows`` entries along ``dim`` are the first ``b`` rows),
    ``(name, None, value)`` for a size argument, ``(name, -1, 0)`` for a tensor that cannot be cut
    (:func:`batch_cuts`).  A candidate's inputs are cut by their names; empty: by the rule of
    :func:`sub_batch_inputs`."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"oracle kind {self.kind!r}: expected one of {', '.join(KINDS)}")
        if self.kind == "batch_invariance" and (not isinstance(self.batch, int) or self.batch < 2):
            raise ConfigError(f"batch_invariance oracle needs the batch size of the inputs (batch >= 2), got "
                              f"{self.batch!r}")
        if self.kind == "cross_device":
            if len(self.devices) != 2:
                raise ConfigError(f"cross_device oracle needs two device specs, got {list(self.devices)}")
            for d in self.devices:
                parse_device_spec(d)
        if self.runs < 2:
            raise ConfigError(f"oracle runs must be >= 2, got {self.runs}")
        if not 0.0 <= self.similarity <= 1.0:
            raise ConfigError(f"oracle similarity must be within [0, 1], got {self.similarity}")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) \
                or not math.isfinite(self.timeout) or self.timeout <= 0:
            raise ConfigError(f"oracle timeout must be a positive number of seconds, got {self.timeout!r}")
        if isinstance(self.config, dict):
            object.__setattr__(self, "config", tuple(sorted(self.config.items())))
        object.__setattr__(self, "cuts", tuple((int(b), tuple((str(n), None if d is None else int(d), int(r))
                                                              for n, d, r in entries)) for b, entries in self.cuts))

    def replace(self, **changes) -> "OracleSpec":
        return dataclasses.replace(self, **changes)

    def compiler_label(self) -> str:
        """The compiler's importable name, or just its name for an in-process callable."""
        try:
            return compiler_name(self.compiler)
        except ConfigError:
            return getattr(self.compiler, "__name__", repr(self.compiler))

    def to_json(self, portable: bool = True) -> Dict[str, Any]:
        """Plain data; ``portable=False`` labels an unimportable callable compiler instead of failing."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["compiler"] = compiler_name(self.compiler) if portable else self.compiler_label()
        d["config"] = [list(kv) for kv in self.config]
        d["devices"] = list(self.devices)
        d["expected"] = dataclasses.asdict(self.expected) if self.expected else None
        d["cuts"] = [[b, [list(e) for e in entries]] for b, entries in self.cuts]
        return d

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "OracleSpec":
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        kw["config"] = tuple(tuple(kv) for kv in kw.get("config", ()))
        kw["devices"] = tuple(kw.get("devices", ("cpu", "cpu:float64")))
        if kw.get("expected"):
            kw["expected"] = Signature(**kw["expected"])
        return cls(**kw)


# ---------------------------------------------------------------- error matching

_PATH = re.compile(r"(/[\w.+-]+)+")
_HEX = re.compile(r"0x[0-9a-fA-F]+")
_NUM = re.compile(r"\d+")


def _key_tokens(message: str) -> List[str]:
    """Normalized tokens of the informative part of a message (error lines when present)."""
    lines = message.splitlines()
    errs = [ln for ln in lines if "error" in ln.lower()]
    text = "\n".join((errs or lines)[:40])[:4000]
    text = _NUM.sub("N", _HEX.sub("0x", _PATH.sub("<path>", text)))
    return text.split()


def similar(a: Signature, b: Signature, threshold: float) -> bool:
    """Same stage and exception type, and messages at least ``threshold`` alike."""
    if a.stage != b.stage or a.type != b.type:
        return False
    ta, tb = _key_tokens(a.message), _key_tokens(b.message)
    if not ta and not tb:
        return True
    return difflib.SequenceMatcher(None, ta, tb, autojunk=False).ratio() >= threshold


_MESSAGE_LIMIT = 4000  # characters of a failure message kept whole


def condensed(message: str) -> str:
    """A failure message as a signature keeps it: whole up to :data:`_MESSAGE_LIMIT` characters; past that (a C++
    compile error carries the compiler's whole output, thousands of lines of warnings) its first 20 lines, the lines
    that say ``error``, and its last 10, with a line saying how many were left out."""
    if len(message) <= _MESSAGE_LIMIT:
        return message
    lines = message.splitlines()
    keep = set(range(min(20, len(lines)))) | set(range(max(0, len(lines) - 10), len(lines)))
    keep |= set([i for i, ln in enumerate(lines) if "error" in ln.lower()][:40])
    out, last = [], -1
    for i in sorted(keep):
        if i != last + 1:
            out.append(f"... ({i - last - 1} lines left out)")
        out.append(lines[i][:500])
        last = i
    return "\n".join(out)


def _error_signature(stage: str, e: BaseException) -> Signature:
    cause = e.__cause__ or getattr(e, "inner_exception", None)
    typ = type(e).__name__ + (f"/{type(cause).__name__}" if isinstance(cause, BaseException) else "")
    return Signature(stage, typ, condensed(str(e)))


# ---------------------------------------------------------------- running

def _to64(inputs: Sequence[Any]) -> List[Any]:
    return [x.detach().to(torch.float64) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            for x in clone_inputs(inputs)]


def _config(spec: OracleSpec) -> Dict[str, Any]:
    cfg = dict(spec.config)
    if spec.kind == "accuracy" and isinstance(spec.compiler, str) and spec.compiler.startswith("inductor"):
        cfg.setdefault("fallback_random", True)
    return cfg


def _fresh(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy for the compiler: some compilers rewrite the graph they are given in place (PyTorch's
    ``relu_accuracy_error_TESTING_ONLY`` does), and ``gm`` is also the eager reference."""
    return copy.deepcopy(gm)


def _compile_run(spec: OracleSpec, gm: fx.GraphModule, inputs: Sequence[Any], runs: int = 1,
                 compile_fn: Callable = compile_graph) -> List[List[Any]]:
    """Compile (a copy of ``gm``) once, run ``runs`` times (same seed each time); flat outputs per run."""
    with config_patch(_config(spec)):
        fn = compile_fn(spec.compiler, _fresh(gm), clone_inputs(inputs))
        outs = []
        for _ in range(runs):
            torch.manual_seed(_SEED)
            outs.append([x.detach() if isinstance(x, torch.Tensor) else x
                         for x in flat_tensors(call_compiled(fn, clone_inputs(inputs)))])
    return outs


def reference_outputs(gm: fx.GraphModule, inputs: Sequence[Any]) -> Tuple[List[Any], Optional[List[Any]]]:
    """Eager outputs and fp64 outputs (None when the graph cannot run in fp64), without autograd: only
    values are compared, and some ops refuse inputs that require grad (an attention mask built from
    a parameter, in a graph that ran under ``no_grad``)."""
    with torch.no_grad():
        torch.manual_seed(_SEED)
        eager = flat_tensors(gm(*clone_inputs(inputs)))
        try:
            torch.manual_seed(_SEED)
            ref64 = flat_tensors(gm(*_to64(inputs)))
        except Exception:  # some ops have no fp64 kernel: judge without the fp64 reference
            ref64 = None
    return eager, ref64


def _on_device(gm: fx.GraphModule, inputs: Sequence[Any], spec: str) -> Tuple[fx.GraphModule, List[Any]]:
    """``gm`` and ``inputs`` on device spec ``spec``: the graph's own parameters, buffers and tensor
    constants are moved (and cast, for a dtype spec) along with the inputs."""
    conv = converter(spec)
    moved = [conv(x.detach()) if isinstance(x, torch.Tensor) else x for x in inputs]
    return moved_graph(gm, conv), moved


def observe(spec: OracleSpec, gm: fx.GraphModule, inputs: Sequence[Any]) -> List[List[Any]]:
    """Raw outputs the localizer compares: accuracy -> [compiled]; nondeterminism -> one list per run;
    cross_device -> [device A, device B] (on CPU).  Errors propagate."""
    with torch.random.fork_rng(devices=[]):
        return _observe(spec, gm, inputs)


def _observe(spec: OracleSpec, gm: fx.GraphModule, inputs: Sequence[Any]) -> List[List[Any]]:
    if spec.kind == "accuracy":
        return _compile_run(spec, gm, inputs)
    if spec.kind == "nondeterminism":
        return _compile_run(spec, gm, inputs, runs=spec.runs)
    if spec.kind == "cross_device":
        sides = []
        for d in spec.devices:
            out = _compile_run(spec, *_on_device(gm, inputs, d))[0]
            sides.append([x.cpu() if isinstance(x, torch.Tensor) else x for x in out])
        return sides
    raise ConfigError(f"oracle kind {spec.kind!r} has nothing to observe")


def _raised(e: BaseException) -> str:
    """A verdict's detail for a candidate that raised: what it raised (the input graph's refusal shows it)."""
    return f"candidate raised instead of running: {type(e).__name__}: {first_line(e)[:300]}"


def _oracle_accuracy(spec: OracleSpec, gm: fx.GraphModule, inputs: Sequence[Any],
                    compile_fn: Callable = compile_graph) -> Verdict:
    if spec.grads:
        return _oracle_accuracy_grads(spec, gm, inputs, compile_fn)
    try:
        res = _compile_run(spec, gm, inputs, compile_fn=compile_fn)[0]
    except Exception as e:  # a candidate that errors is a different failure, not this one
        return Verdict(False, _error_signature("compile/run", e), _raised(e))
    eager, ref64 = reference_outputs(gm, inputs)
    if len(eager) != len(res):
        return Verdict(True, Signature("accuracy", "", f"{len(res)} outputs vs eager {len(eager)}"))
    for i, (e, r) in enumerate(zip(eager, res)):
        if not isinstance(e, torch.Tensor) or not isinstance(r, torch.Tensor):
            continue
        if leaf_differs(e, r, ref64[i] if ref64 else None, spec):
            return Verdict(True, Signature("accuracy", "", f"output {i} differs from eager beyond tolerance"))
    return Verdict(False, None, "outputs match eager")


def _oracle_accuracy_grads(spec: OracleSpec, gm: fx.GraphModule, inputs: Sequence[Any],
                           compile_fn: Callable = compile_graph) -> Verdict:
    """The accuracy oracle over outputs and gradients: the after-dynamo check's own judgement
    (:func:`~repro_tools.minify.accuracy.same_two_models`), with the compiled copy sharing ``gm``'s parameters
    (their gradients are compared)."""
    shared = {id(t): t for t in list(gm.parameters()) + list(gm.buffers())}
    try:
        with config_patch(_config(spec)):
            fn = compile_fn(spec.compiler, copy.deepcopy(gm, memo=dict(shared)), clone_inputs(inputs))
    except Exception as e:  # a candidate that errors is a different failure, not this one
        return Verdict(False, _error_signature("compile/run", e), _raised(e))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        with config_patch(_config(spec)):
            r = same_two_models(gm, lambda *args: call_compiled(fn, list(args)), inputs, only_fwd=False,
                                tol=spec.tol, multiplier=spec.multiplier, strict=spec.strict)
    if r.status == "diverged":
        return Verdict(True, Signature("accuracy", "", f"{r.detail.split(':')[0]} differs from eager beyond "
                                                       f"tolerance"))
    if r.status == "compiled_error":
        return Verdict(False, _error_signature("compile/run", r.error), _raised(r.error))
    return Verdict(False, None, r.detail or "outputs and gradients match eager")


def leaf_differs(expected: Any, actual: Any, ref64: Any, spec: OracleSpec) -> bool:
    """The compare core's verdict on one value under ``spec`` (accuracy: fp64 criterion; cross-device:
    within ``tol``, two dtypes in the wider one); values it does not compare (non-float without ``strict``)
    do not differ."""
    return judge(expected, actual, ref64, tol=spec.tol, fp64_multiplier=spec.multiplier, strict=spec.strict) is False


def _judge_outputs(spec: OracleSpec, gm: fx.GraphModule, inputs: Sequence[Any]) -> Verdict:
    try:
        sides = observe(spec, gm, inputs)
    except Exception as e:  # a different failure
        return Verdict(False, _error_signature("compile/run", e), _raised(e))
    if spec.kind == "nondeterminism":
        first = hash_tensors([x for x in sides[0] if isinstance(x, torch.Tensor)])
        for r, other in enumerate(sides[1:], 1):
            if hash_tensors([x for x in other if isinstance(x, torch.Tensor)]) != first:
                return Verdict(True, Signature("nondeterminism", "", f"run {r} differs bitwise from run 0"))
        return Verdict(False, None, "runs identical")
    for i, (a, b) in enumerate(zip(*sides)):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and leaf_differs(a, b, None, spec):
            return Verdict(True, Signature("cross_device", "", f"output {i} differs between {' and '.join(spec.devices)}"))
    return Verdict(False, None, "devices agree")


def sub_batch_inputs(inputs: Sequence[Any], batch: int, b: int, dim: int = 0,
                     cuts: Optional[Sequence[Optional[Tuple[Optional[int], int]]]] = None) -> List[Any]:
    """Clones of ``inputs`` cut to their first ``b`` rows.  ``cuts`` (one per input): None leaves it whole,
    ``(dim, rows)`` keeps a tensor's first ``rows`` entries along ``dim``, ``(None, value)`` replaces a size
    argument, ``(-1, 0)`` (a value that cannot be cut) raises ValueError.  Without ``cuts``, a guess: tensors
    whose dimension ``dim`` is ``batch`` (or a multiple of it) keep ``b`` (times that multiple) rows, int sizes
    equal to ``batch`` become ``b`` -- which also cuts a parameter whose first size happens to be a multiple of
    the batch, so repros record their cuts."""
    out: List[Any] = []
    for i, x in enumerate(clone_inputs(inputs)):
        if cuts is not None:
            c = cuts[i]
            if c is None:
                out.append(x)
            elif c[0] is None:
                out.append(c[1])
            elif c[0] < 0 or not isinstance(x, torch.Tensor) or x.dim() <= c[0]:
                raise ValueError(f"input {i} holds the batch in a way that cannot be cut to {b} rows")
            else:
                out.append(x.narrow(c[0], 0, c[1]).clone())
        elif isinstance(x, torch.Tensor) and x.dim() > dim and x.shape[dim] % batch == 0 and x.shape[dim]:
            out.append(x.narrow(dim, 0, x.shape[dim] // batch * b).clone())
        elif isinstance(x, int) and not isinstance(x, bool) and x == batch:
            out.append(b)
        else:
            out.append(x)
    return out


def batch_cuts(gm: fx.GraphModule, inputs: Sequence[Any], full: Dict[str, Any], batch: int, dim: int = 0,
               given: Optional[Dict[int, Sequence[Optional[Tuple[Optional[int], int]]]]] = None) -> tuple:
    """:attr:`OracleSpec.cuts` of ``gm``: which of its values hold the batch, and where.  ``full``: every node's
    eager value on ``inputs`` (by name); ``given``: per sub-batch size, the cuts of ``inputs`` themselves (what the
    check that found the failure knew), else :func:`sub_batch_inputs`' guess.  The graph runs eagerly on the
    sub-batch, and a value whose shape shrank there (one dimension, by the batch's ratio) holds the batch: its
    first rows in that dimension are the sub-batch's.  Candidates of the minifier read their inputs from these
    values, so each is cut as the whole graph's run cut it -- a weight whose size is a multiple of the batch stays
    whole, ``B*T`` rows of a reshape become ``b*T``.  A sub-batch the graph cannot run gives no cuts (the guess
    decides)."""
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    out = []
    for b in sub_batches(batch):
        given_b = (given or {}).get(b)  # one cut per input, or None
        sub = sub_batch_inputs(inputs, batch, b, dim, given_b)
        try:
            part = eager_node_values(gm, sub)
        except Exception as e:  # the guess decides, as for a repro that recorded nothing
            log.warning("batch invariance: the graph does not run eagerly on its first %d rows (%s: %s); "
                        "inputs are cut by their sizes", b, type(e).__name__, e)
            return ()
        entries = []
        for name, v in full.items():
            w = part.get(name)
            if isinstance(v, torch.Tensor) and isinstance(w, torch.Tensor):
                if v.shape == w.shape:
                    continue
                where = batch_rows(list(v.shape), list(w.shape), batch, b)
                entries.append((name,) + (where if where is not None else (-1, 0)))
            elif isinstance(v, int) and not isinstance(v, bool) and isinstance(w, int) and v != w:
                entries.append((name, None, w))
        seen = {e[0] for e in entries}
        for name, cut in zip(names, given_b or ()):  # an input missing from the run's values keeps its given cut
            if cut is not None and name not in seen:
                entries.append((name,) + tuple(cut))
        out.append((b, tuple(entries)))
    return tuple(out)


def given_cuts(recorded: Any, n: int) -> Optional[Dict[int, List[Optional[Tuple[Optional[int], int]]]]]:
    """A repro's ``META["batch_cuts"]`` (per sub-batch size, ``[input index, dim, rows]`` of each input holding
    the batch; ``dim`` None for a size argument) as one cut per input of ``n``; None when it recorded none.
    Raises :class:`ReproError` on a malformed entry."""
    if not recorded:
        return None
    out: Dict[int, List[Optional[Tuple[Optional[int], int]]]] = {}
    try:
        for b, entries in dict(recorded).items():
            cuts: List[Optional[Tuple[Optional[int], int]]] = [None] * n
            for i, d, rows in entries:
                cuts[int(i)] = (None if d is None else int(d), int(rows))
            out[int(b)] = cuts
    except (TypeError, ValueError, IndexError) as e:
        raise ReproError(f"repro metadata: batch_cuts is malformed ({type(e).__name__}: {e}); expected "
                         "{sub-batch size: [[input index, dim or None, rows], ...]}") from None
    return out


def script_cuts(spec: OracleSpec, gm: fx.GraphModule) -> Dict[int, List[list]]:
    """``META["batch_cuts"]`` of a repro of ``gm`` (see :func:`given_cuts`), from the spec's cuts by name."""
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    out = {}
    for b, _ in spec.cuts:
        cuts = input_cuts(spec, names, b) or []
        out[b] = [[i, c[0], c[1]] for i, c in enumerate(cuts) if c is not None]
    return out


def input_cuts(spec: OracleSpec, names: Sequence[str], b: int) -> Optional[List[Optional[Tuple[Optional[int], int]]]]:
    """The cuts of inputs named ``names`` for a sub-batch of ``b`` (:attr:`OracleSpec.cuts`), or None when the
    spec has none (the guess of :func:`sub_batch_inputs` decides)."""
    table = dict(spec.cuts).get(b)
    if table is None:
        return None
    by_name = {n: (d, r) for n, d, r in table}
    return [by_name.get(n) for n in names]


def _judge_batch(spec: OracleSpec, gm: fx.GraphModule, inputs: Sequence[Any]) -> Verdict:
    try:
        full = _compile_run(spec, gm, inputs)[0]
    except Exception as e:  # a different failure
        return Verdict(False, _error_signature("compile/run", e), _raised(e))
    for b in sub_batches(spec.batch):
        try:
            cuts = input_cuts(spec, [n.name for n in gm.graph.nodes if n.op == "placeholder"], b)
            part = _compile_run(spec, gm, sub_batch_inputs(inputs, spec.batch, b, spec.batch_dim, cuts))[0]
        except Exception as e:  # the candidate cannot run on a sub-batch: not this failure
            return Verdict(False, _error_signature("compile/run", e), f"candidate raised on a batch of {b}")
        for i, (x, y) in enumerate(zip(full, part)):
            if rows_agree(x, y, spec.batch, b) is False:
                return Verdict(True, Signature("batch_invariance", "", f"output {i}: rows 0..{b - 1} differ between "
                                                                      f"batch {spec.batch} and batch {b}"))
    return Verdict(False, None, "rows agree")


def _judge_nan(spec: OracleSpec, gm: fx.GraphModule, inputs: Sequence[Any]) -> Verdict:
    try:
        outs = _compile_run(spec, gm, inputs)[0]
    except Exception as e:  # a different failure
        return Verdict(False, _error_signature("compile/run", e), _raised(e))
    bad = [i for i, o in enumerate(outs) if nonfinite([o])]
    if creates(bool(bad), [nonfinite([x]) for x in inputs if isinstance(x, torch.Tensor)]):
        return Verdict(True, Signature("nan", "", f"output {bad[0]} holds NaN/Inf from finite inputs"))
    return Verdict(False, None, "no NaN/Inf created")


def _judge_error(spec: OracleSpec, gm: fx.GraphModule, inputs: Sequence[Any]) -> Verdict:
    sig = None
    with config_patch(_config(spec)):
        try:
            fn = compile_graph(spec.compiler, _fresh(gm), clone_inputs(inputs))
        except Exception as e:  # the failure under study
            sig = _error_signature("compile", e)
        else:
            try:
                call_compiled(fn, clone_inputs(inputs))
            except Exception as e:  # the failure under study
                sig = _error_signature("runtime", e)
    if sig is None:
        return Verdict(False, None, "no error")
    if spec.kind == "compile_error" and sig.stage != "compile" or spec.kind == "runtime_error" and sig.stage != "runtime":
        return Verdict(False, sig, f"fails at {sig.stage}, not the stage asked for")
    if spec.expected is not None and not similar(sig, spec.expected, spec.similarity):
        return Verdict(False, sig, "a different error than the original")
    return Verdict(True, sig, sig.short())


def check(spec: OracleSpec, gm: fx.GraphModule, inputs: Sequence[Any]) -> Verdict:
    """Judge one candidate in this process (``crash``/``hang`` need :mod:`repro_tools.minify.isolate`)."""
    if spec.kind in ISOLATED_ONLY:
        raise ConfigError(f"oracle kind {spec.kind!r} needs an isolated worker (repro_tools.minify.isolate)")
    resolve_compiler(spec.compiler)  # a compiler that does not resolve is bad input, never the failure judged
    if spec.kind == "accuracy":
        return _timed(_oracle_accuracy, spec, gm, inputs)
    if spec.kind in ("nondeterminism", "cross_device"):
        return _timed(_judge_outputs, spec, gm, inputs)
    if spec.kind == "batch_invariance":
        return _timed(_judge_batch, spec, gm, inputs)
    if spec.kind == "nan":
        return _timed(_judge_nan, spec, gm, inputs)
    return _timed(_judge_error, spec, gm, inputs)


def _timed(judge: Callable[..., Verdict], *args: Any, **kwargs: Any) -> Verdict:
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[]):  # the oracle seeds; the caller's RNG state is left alone
        v = judge(*args, **kwargs)
    return dataclasses.replace(v, seconds=time.perf_counter() - t0)


def check_observed(spec: OracleSpec, gm: fx.GraphModule, inputs: Sequence[Any],
                   ref: Dict[str, Any]) -> Tuple[Verdict, Optional[Dict[str, Any]]]:
    """:func:`check`, plus, when the graph fails an accuracy oracle of an inductor compiler, the compiled
    value of every node inductor materialized a buffer for (``{node name: value}``, from the same compile
    and run; see :mod:`repro_tools.minify.inductor_values`); otherwise None.  ``ref``: eager values by node name."""
    if spec.kind != "accuracy" or spec.compiler not in SUPPORTED:
        return check(spec, gm, inputs), None
    capture = BufferValues()
    v = _timed(_oracle_accuracy, spec, gm, inputs, compile_fn=capture.compile)
    return v, (capture.values(ref) if v.fails else None)


@dataclass
class InProcessRunner:
    """Runs queries in this process (fast; no protection against crashes or hangs)."""

    calls: int = 0

    def check(self, spec: OracleSpec, gm: fx.GraphModule, inputs: Sequence[Any]) -> Verdict:
        self.calls += 1
        return check(spec, gm, inputs)

    def check_observed(self, spec: OracleSpec, gm: fx.GraphModule, inputs: Sequence[Any],
                       ref: Dict[str, Any]) -> Tuple[Verdict, Optional[Dict[str, Any]]]:
        self.calls += 1
        return check_observed(spec, gm, inputs, ref)

    def observe(self, spec: OracleSpec, gm: fx.GraphModule, inputs: Sequence[Any]) -> List[List[Any]]:
        self.calls += 1
        return observe(spec, gm, inputs)

    def close(self) -> None:
        pass
