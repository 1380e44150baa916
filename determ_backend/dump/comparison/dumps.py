"""Comparing two dumps: ptdbg's ``compare`` / ``compare_distributed`` and the root cause.

Calls of the two dumps are paired by sequence alignment of their signatures
(API + direction + output shapes, not dtypes) with
:func:`determ_backend.compare.align`, so an extra or missing op, or counters
shifted by one, do not break the pairing (names with call counters are never
used to pair).  Tensors of a pair are matched by argument name.

Root cause (our column): the compare core's rule
(:func:`determ_backend.compare.find_roots`) on calls that hold their own
arguments: a call whose output diverges while all its inputs match --
parameters excepted (a call that consumes a changed weight *is* where the
divergence starts); for a backward record the inputs are the incoming
gradients and the forward call's inputs.  "Match" is the core's verdict:
bitwise when both dumps come from the same device type and ran the same dtypes
(no paired tensor differs in dtype), otherwise :func:`~determ_backend.compare.judge`
within :func:`~determ_backend.compare.dtype_tol` of the two dtypes (``tol``, 1e-3 by
default, or a few units in the last place of bf16/fp16; e.g. CPU vs NPU, bf16 vs fp32 -- also
for the ops after a ``.float()``, whose inputs carry the other dtype's
rounding), on the payloads or, in a statistics dump, on the statistics.
ptdbg's ``Accuracy Reached or Not`` column is filled as ptdbg defines it.

The FX-node entries of compiled regions are paired inside each pair of region
entries and judged by the same rule (:mod:`.compiled_compare`): the culprit
inside a ``torch.compile``d model is a node of its graph, not the region.

Metrics live in :mod:`.metrics`; reading dumps in :mod:`.parse`.
"""

from __future__ import annotations

import csv
import io
import logging
import math
import numbers
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from determ_backend.compare import (DEFAULT_TOL, Pair, align, close_to_scale, dtype_tol, find_roots, is_float, judge,
                                    judge_records, largest_magnitude)
from determ_backend.errors import ConfigError, TraceFormatError
from determ_backend.trace.stream import Record, atomic_write_text
from determ_backend.dump.comparison import compiled as cc
from determ_backend.dump.comparison.metrics import accuracy_reached, payload_metrics, stats_metrics, tensor_record
from determ_backend.dump.comparison.parse import (Dump, check_path, check_rank_folders, data_dir_of, find_index,
                                                  open_dump, rank_dirs, read_header)
from determ_backend.dump.capture.writer import PAYLOAD_FILE

__all__ = ["compare", "compare_dumps", "InputsRule", "compare_distributed", "auto_analyze", "analyze", "analysis", "DumpComparison",
           "CSV_COLUMNS"]

log = logging.getLogger(__name__)

CSV_COLUMNS = [
    "NPU Name", "Bench Name", "NPU Tensor Dtype", "Bench Tensor Dtype", "NPU Tensor Shape", "Bench Tensor Shape",
    "Cosine", "MaxAbsErr", "MaxRelativeErr", "One Thousandth Err Ratio", "Five Thousandths Err Ratio",
    "Max diff", "Min diff", "Mean diff", "L2norm diff",
    "NPU max", "NPU min", "NPU mean", "NPU l2norm", "Bench max", "Bench min", "Bench mean", "Bench l2norm",
    "NPU Hash", "Bench Hash", "Bitwise Equal", "Accuracy Reached or Not", "Root Cause", "Err_message",
]
_STACK_COLUMN = "NPU_Stack_Info"


@dataclass
class ApiPair:
    """Two aligned calls and the verdicts of their tensors."""

    a: Optional[Dict[str, Any]]
    b: Optional[Dict[str, Any]]
    rows: List[Dict[str, Any]] = field(default_factory=list)
    inputs_match: Optional[bool] = None
    output_diverges: bool = False
    root_cause: bool = False
    nodes: List["ApiPair"] = field(default_factory=list)
    """For a compiled region: the pairs of its FX-node entries (they precede it in ``DumpComparison.pairs``)."""
    errors: Dict[str, List[float]] = field(default_factory=dict)
    """Relative errors (:func:`_relative_error`) of its computed ``inputs`` and of its diverging ``outputs``."""
    explained: Optional[str] = None
    """Why a call whose inputs agree within the tolerance is no root cause although its output diverges: the
    precision its inputs carry, or a discrete result they may flip."""
    handed_by: Optional[Dict[str, Any]] = None
    """For a parameter read-out holding the very output of a call one dump alone has (the same fingerprint: a
    gradient hook's ``g * 1.01``, an edit of the gradient), that call: the analysis names it with its line."""
    negligible: bool = False
    """Explained as a gradient zero in exact arithmetic (:func:`_zero_at_precision`): no divergence of the runs on
    its own account."""

    @property
    def name(self) -> str:
        return (self.a or self.b)["name"]


@dataclass
class DumpComparison:
    pairs: List[ApiPair]
    exact: bool
    csv_path: Optional[Path] = None
    advisor_path: Optional[Path] = None
    analysis: Optional[str] = None
    """The root-cause text :func:`compare` wrote to ``advisor_path`` (None without ``auto_analyze``)."""
    rank: Optional[int] = None
    """The rank :func:`compare_distributed` compared here (None for a single comparison)."""
    partial: bool = False
    """A dump was cut short (its writer killed, or out of room): what it never wrote is not compared."""
    judged: bool = True
    """Some paired call had an output value to judge (a stack-mode dump holds none; two dumps may pair no call)."""

    @property
    def rows(self) -> List[Dict[str, Any]]:
        return [r for p in self.pairs for r in p.rows]

    @property
    def root_causes(self) -> List[ApiPair]:
        return [p for p in self.pairs if p.root_cause]

    @property
    def first_divergence(self) -> Optional[ApiPair]:
        return next((p for p in self.pairs if p.output_diverges), None)

    @property
    def divergent(self) -> bool:
        """Some paired call's output diverges, other than a ``negligible`` one (a gradient zero in exact arithmetic,
        the two runs apart only in its rounding noise: BERT's attention key bias).  A call that takes such a value in
        and diverges from it is a divergence like any other."""
        return any(p.output_diverges and not p.negligible for p in self.pairs)

    @property
    def unpaired(self) -> int:
        """Calls present in one dump only."""
        return sum(1 for p in self.pairs if p.a is None or p.b is None)

    @property
    def paired(self) -> int:
        """Calls present in both dumps."""
        return sum(1 for p in self.pairs if p.a is not None and p.b is not None)

    @property
    def shown_to_agree(self) -> bool:
        """No divergence, some value judged, and no dump cut short with calls left unpaired: the runs agree as far
        as dumps can say."""
        return not self.divergent and self.judged and not (self.partial and self.unpaired)


def _to_record(e: Dict[str, Any], side: str, i: int) -> Record:
    # the signature the calls align by holds the tensor arguments' shapes too: an extra ``x + 1e-3`` must not pair
    # with the residual ``x + y`` next to it.  Not the other arguments, which filter_switch="OFF" dumps: a call
    # given a keyword the other run's leaves to its default (``gelu(x, approximate="tanh")``, ``gelu(x)``) is
    # the same call, told apart by that argument's value once paired
    # by tensor name: autograd hands a Linear's gradients over in another order under autocast
    ins, outs = (sorted(e.get(io, []), key=lambda t: str(t.get("name"))) for io in ("inputs", "outputs"))
    shapes = [[t["shape"] for t in ins if "shape" in t], [t["shape"] for t in outs if "shape" in t]]
    return Record(graph=side, stage="api", node=e["name"], op=f"{e.get('op')}.{e.get('dir')}", kind=e.get("dir", "node"),
                  shape=shapes, extra={"i": i})


def _fmt(v: Any) -> Any:
    return "N/A" if v is None else v


def _tensor_row(name_a: Optional[str], name_b: Optional[str], ta, tb, da: Dump, db: Dump, exact: bool,
                tol: float = DEFAULT_TOL):
    """A CSV row, the metrics (None when a side is missing) and the verdict of one tensor pair: the core's
    :func:`~determ_backend.compare.judge` (bitwise when ``exact``, else within ``tol`` widened to the dtypes'
    :func:`~determ_backend.compare.dtype_tol`) on the payloads, or :func:`~determ_backend.compare.judge_records`
    on the statistics."""
    row: Dict[str, Any] = {c: "N/A" for c in CSV_COLUMNS}
    row.update({"NPU Name": name_a or "N/A", "Bench Name": name_b or "N/A", "Root Cause": "No", "Err_message": ""})
    for side, t in (("NPU", ta), ("Bench", tb)):
        if t is None or "dtype" not in t:
            continue
        row[f"{side} Tensor Dtype"], row[f"{side} Tensor Shape"] = t["dtype"], t["shape"]
        st = t.get("stats") or {}
        for k, col in (("max", "max"), ("min", "min"), ("mean", "mean"), ("l2", "l2norm")):
            row[f"{side} {col}"] = _fmt(st.get(k))
        row[f"{side} Hash"] = t.get("hash", "N/A")
    if ta is None or tb is None:
        row["Err_message"] = "no counterpart in the other dump (extra or missing op or argument)"
        return row, None, None
    if ta.get("unresolved") or tb.get("unresolved"):
        row["Err_message"] = "input of a compiled node that the backend's trace does not attribute"
        return row, None, None
    if "dtype" not in ta or "dtype" not in tb:
        same = ta.get("value") == tb.get("value") and ta.get("type") == tb.get("type")
        row["Bitwise Equal"] = row["Accuracy Reached or Not"] = "Yes" if same else "No"
        return row, {"bitwise": same, "same_dtype": True}, same
    m: Dict[str, Any] = {"same_dtype": ta["dtype"] == tb["dtype"]}
    if "hash" in ta and "hash" in tb:
        m["bitwise"] = ta["hash"] == tb["hash"] and m["same_dtype"]
    if ta.get("stats") and tb.get("stats"):
        m.update(stats_metrics(ta["stats"], tb["stats"]))
    tol_ = None if exact else dtype_tol(tol, ta["dtype"], tb["dtype"])
    verdict: Optional[bool]
    pair = _payloads(ta, tb, da, db)
    if pair is not None:
        va, vb = pair
        m.update(payload_metrics(va, vb))
        close = None if exact else close_to_scale(vb, va, tol_ or 0.0)  # relative to the value's size
        if close is False and isinstance(m.get("rel_l2"), float) and m["rel_l2"] <= (tol_ or 0.0):
            # apart at a few elements only, the whole within the tolerance (relu's gradient mask flips where the
            # forward value is near 0 and rounds otherwise in bf16): a fault that shifts the value shifts its norm
            close = True
        if close is False:
            m["far"] = _far_share(va, vb, tol_ or 0.0)
        verdict = close if close is not None else judge(vb, va, tol=tol_ or 0.0, strict=True, bitwise=exact)
    else:
        if "hash" in ta and "hash" in tb:
            row["Err_message"] = "statistics only"
        verdict = (judge_records(tensor_record(ta), tensor_record(tb), tol_, scaled=True)[0]
                   if (ta.get("hash") or ta.get("stats")) else None)
    for key, col in (("cosine", "Cosine"), ("max_abs", "MaxAbsErr"), ("max_rel", "MaxRelativeErr"),
                     ("one", "One Thousandth Err Ratio"), ("five", "Five Thousandths Err Ratio"),
                     ("max_diff", "Max diff"), ("min_diff", "Min diff"), ("mean_diff", "Mean diff"),
                     ("l2_diff", "L2norm diff")):
        if key in m:
            row[col] = m[key]
    if "error" in m:
        row["Err_message"] = m["error"]
        verdict = False
    if "bitwise" in m:
        row["Bitwise Equal"] = "Yes" if m["bitwise"] else "No"
    row["Accuracy Reached or Not"] = accuracy_reached(m)
    return row, m, verdict


def _payloads(ta: Dict[str, Any], tb: Dict[str, Any], da: Dump, db: Dump):
    """Both stored tensors, or None: statistics only, or a payload past the end of a dump that was cut
    (disk full) or whose writer was killed -- a damaged payload file of a complete dump is an error."""
    if not ("payload" in ta and "payload" in tb and da.has_payloads and db.has_payloads):
        return None
    try:
        return da.tensor(ta), db.tensor(tb)
    except TraceFormatError:
        if da.cut or db.cut or da.partial or db.partial:
            return None
        raise


def is_given(t: Dict[str, Any]) -> bool:
    """Whether a call's argument entry is one the calling code hands it rather than one an earlier call computed:
    a weight, or a non-tensor value (an entry with a ``type`` and no ``dtype``).  A tensor whose producer is not
    known (a compiled node's unattributed input) is not: it counts as a computed input not shown to agree."""
    return bool(t.get("param")) or ("type" in t and "dtype" not in t)


class InputsRule:
    """Whether a paired call's inputs agree, judged in call order: one rule for :func:`compare_dumps` and the online
    baseline (:mod:`determ_backend.dump.capture.online`).  A call whose inputs agree and whose output does not is a
    root cause.

    * The computed inputs must each be shown to agree (a verdict of None, not judged, is no agreement).
    * A weight or a non-tensor argument that differs where nothing diverged before is where the runs part (a
      perturbed weight blames its first consumer, gelu's ``approximate='tanh'`` the gelu); after a divergence it
      may be its consequence (an optimizer step updated the weight from a differing gradient, an argument came from
      a differing ``.item()``): then it is an input that differs like any other.
    * A parameter or gradient read-out (``Parameter.*``) depends on everything before it.
    * A backward call's inputs do not agree when its forward's did not, weights and arguments included.
    * A module boundary whose ``first`` inner call (by ``seq``) came before the last call whose output diverged from
      agreeing inputs is explained by it (entries without ``seq`` leave this rule out); so is a module's backward
      entry, whose ``first`` is the first entry written once its outputs' gradients arrived.

    ``remembered``: how many forward calls' verdicts are kept for their backward (None: all)."""

    def __init__(self, remembered: Optional[int] = None):
        self.diverged_before = False
        self._last_diverged: Optional[int] = None  # ``seq`` of the last call whose output diverged
        self._forward: Dict[str, bool] = {}
        self._remembered = remembered
        self._ins = False  # the verdict :meth:`inputs_agree` gave last (the call :meth:`output_judged` judges next)

    def inputs_agree(self, entry: Dict[str, Any], computed: Sequence[Optional[bool]],
                     given: Sequence[Optional[bool]]) -> bool:
        """The verdict for ``entry`` (judged before its output) from its ``computed`` and ``given`` inputs' verdicts."""
        ins = all(x is True for x in computed) and not (self.diverged_before and any(x is False for x in given))
        name = str(entry.get("name", ""))
        if str(entry.get("op", "")).startswith("Parameter."):
            return not self.diverged_before
        first = entry.get("first")
        if isinstance(first, int) and self._last_diverged is not None and self._last_diverged >= first:
            ins = False
        if entry.get("dir") == "backward":
            ins = ins and self._forward.get(name[: -len("backward")] + "forward", True)
            self._ins = ins
            return ins
        # its backward computes from what the forward was given too (the weight it multiplies the gradient by): a
        # weight that differs blames the forward call, and its backward inherits the difference
        self._forward[name] = ins and not any(x is False for x in given)
        if self._remembered is not None and len(self._forward) > self._remembered:
            for k in list(self._forward)[: self._remembered // 2]:
                del self._forward[k]
        self._ins = ins
        return ins

    def unpaired(self, seq: Optional[int]) -> None:
        """A call ran in one dump only (a hook's extra op) at ``seq`` of the judged dump's numbering (for a call of
        the other dump, that of the last call before it): a module around it is explained by it, as by a call that
        diverged, instead of being a root cause itself."""
        if isinstance(seq, int):
            self._last_diverged = max(self._last_diverged if self._last_diverged is not None else seq, seq)

    def output_judged(self, entry: Dict[str, Any], diverges: bool) -> None:
        """``entry``'s output verdict: later calls are judged knowing whether anything diverged before.  Only a
        divergence that starts at ``entry`` (its inputs agreed) explains a module around it: one it inherited came
        from the module's own code before it (a silu the module calls, at level L0), and the module is the root."""
        if diverges:
            self.diverged_before = True
            if isinstance(entry.get("seq"), int) and self._ins:
                self._last_diverged = entry["seq"]


def _pair_tensors(pa: ApiPair, da: Dump, db: Dump, exact: bool, tol: float) -> Dict[str, List[Optional[bool]]]:
    """Fill ``pa.rows``; returns the match verdicts of the computed ``inputs``, of the ``given`` ones (weights and
    non-tensor arguments: what the calling code hands the call, not what an earlier call computed) and of the
    ``outputs``.

    Bitwise verdicts only when ``exact`` and every paired tensor of the call has the same dtype on both sides:
    a call fed a bf16 tensor on one side and fp32 on the other is judged by tolerance, outputs included."""
    found = []
    for io_ in ("inputs", "outputs"):
        la = (pa.a or {}).get(io_, [])
        lb = (pa.b or {}).get(io_, [])
        by_a, by_b = {t.get("name"): t for t in la}, {t.get("name"): t for t in lb}
        order = [t.get("name") for t in la] + [n for n in by_b if n not in by_a]
        for n in order:
            ta, tb = by_a.get(n), by_b.get(n)
            t = ta or tb or {}
            found.append((io_, n, ta, tb, is_given(t)))
    api_exact = exact and all(ta is None or tb is None or ta.get("dtype") == tb.get("dtype")
                              for _, _, ta, tb, _ in found)
    verdicts: Dict[str, List[Optional[bool]]] = {"inputs": [], "given": [], "outputs": []}
    pa.errors = {f"{io_}{kind}": [] for io_ in ("inputs", "outputs")
                 for kind in ("", "_abs", "_size", "_numel", "_smaller")}
    for io_, n, ta, tb, given in found:
        row, m, v = _tensor_row(f"{pa.a['name']}_{n}" if ta is not None else None,
                                f"{pa.b['name']}_{n}" if tb is not None else None, ta, tb, da, db, api_exact, tol)
        row["_io"], row["_match"] = io_, v
        row["_far"] = (m or {}).get("far")
        pa.rows.append(row)
        kind = "given" if io_ == "inputs" and given else io_
        verdicts[kind].append(v)
        if kind == "inputs" or (kind == "outputs" and v is False):  # what a call was given, and what it got wrong
            shape = (tb or ta or {}).get("shape")
            numel = math.prod(shape) if isinstance(shape, list) and all(isinstance(d, int) for d in shape) else None
            for suffix, value in (("", _relative_error(m, ta, tb)), ("_abs", _absolute_error(m)),
                                  ("_size", _largest_magnitude(ta, tb)), ("_numel", numel),
                                  ("_smaller", _smaller_side(ta, tb))):
                if value is not None:
                    pa.errors[f"{kind}{suffix}"].append(value)
    return verdicts


# A call whose output error is less than this many times its computed inputs' (relative to their sizes) carries the
# error it was given, it does not make it: judged within a tolerance, a small gradient passes an absolute tolerance
# at 10% error, and the call that scales it up was blamed (a bf16 run against an fp32 one blamed innocent backwards)
_GROWTH = 4.0


def _relative_error(m: Optional[Dict[str, Any]], ta, tb) -> Optional[float]:
    """A tensor pair's error relative to the benchmark's size: the L2 norm of the difference over the benchmark's
    (stored tensors), else the difference of the two L2 norms over the benchmark's (statistics, a lower bound)."""
    if not m:
        return None
    if isinstance(m.get("rel_l2"), float):
        return m["rel_l2"]
    la, lb = ((ta or {}).get("stats") or {}).get("l2"), ((tb or {}).get("stats") or {}).get("l2")
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (la, lb)):
        return None
    return abs(la - lb) / lb if lb else (0.0 if la == lb else math.inf)


def _far_share(a: torch.Tensor, b: torch.Tensor, tol: float) -> float:
    """The share of elements of ``a`` farther from ``b`` than ``tol`` of ``b``'s largest magnitude (and of their
    own)."""
    x, y = a.detach().double().cpu().reshape(-1), b.detach().double().cpu().reshape(-1)
    if not y.numel():
        return 0.0
    far = (x - y).abs() > tol * largest_magnitude(y) + tol * y.abs()
    return float(far.double().mean())


_FLIPPED = 0.01  # a mask the saved forward values flip moves a few elements of a gradient, a fault most of them


def _mask_flipped(pa: ApiPair) -> bool:
    """Within a tolerance: whether a backward call's diverging outputs (stored values) differ at a few elements
    only (:data:`_FLIPPED`): its saved forward values, which agree only within the tolerance, flipped a mask there
    (relu's gradient passes where its forward value was above 0, and bf16 rounds values near 0 to either side)."""
    if (pa.a or {}).get("dir") != "backward":
        return False
    outs = [r for r in pa.rows if r["_io"] == "outputs" and r["_match"] is False]
    return bool(outs) and all(isinstance(r.get("_far"), float) and r["_far"] <= _FLIPPED for r in outs)


def _absolute_error(m: Optional[Dict[str, Any]]) -> Optional[float]:
    """A tensor pair's largest absolute difference (stored tensors), else the largest difference of their minima
    and maxima (statistics, a lower bound)."""
    if not m:
        return None
    if isinstance(m.get("max_abs"), float):
        return m["max_abs"]
    diffs = [abs(m[k]) for k in ("max_diff", "min_diff") if isinstance(m.get(k), (int, float)) and math.isfinite(m[k])]
    return max(diffs) if diffs else None


def _largest_magnitude(ta: Optional[Dict[str, Any]], tb: Optional[Dict[str, Any]]) -> Optional[float]:
    """The largest magnitude either side of a tensor pair holds, by its statistics (None without them)."""
    sizes = [s for s in (_magnitude(ta), _magnitude(tb)) if s is not None]
    return max(sizes) if sizes else None


def _smaller_side(ta: Optional[Dict[str, Any]], tb: Optional[Dict[str, Any]]) -> Optional[float]:
    """The smaller of the two sides' largest magnitudes (None unless both sides have statistics)."""
    sizes = [_magnitude(ta), _magnitude(tb)]
    return None if None in sizes else min(sizes)


def _magnitude(t: Optional[Dict[str, Any]]) -> Optional[float]:
    """The largest magnitude a tensor holds, by its statistics (None without them)."""
    sizes = [abs(float(v)) for k in ("max", "min") for v in [((t or {}).get("stats") or {}).get(k)]
             if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    return max(sizes) if sizes else None


def _error_carried(pa: ApiPair, tol: float) -> bool:
    """Within a tolerance: whether the call's computed inputs already carry an error comparable to its diverging
    output's (:data:`_GROWTH`), so the call is no root cause even where each input passes the tolerance -- relative
    to each tensor's size, or in absolute terms: an output much smaller than the values it is computed from (a
    bias gradient, the sum of rows that nearly cancel) carries their rounding as an error large for its own size;
    an output with fewer elements than its largest input (a reduction of k values each) may grow it sqrt(k) times.
    So does an output that, on both sides, lies within ``tol`` of its inputs' largest magnitude: a value that is
    zero at the precision it was computed from (the bias gradient of a layer before a normalization).  The
    absolute and the zero-at-that-precision excuses hold for backward entries only (gradients summed over a batch):
    a forward product by a small factor (a layer scale of 1e-3) shrinks the absolute error it carries, and a
    wrong one had been excused."""
    growth = _growth(pa)
    backward = (pa.a or {}).get("dir") == "backward"
    for kind in ("", "_abs") if backward else ("",):
        ins, outs = pa.errors.get(f"inputs{kind}") or [], pa.errors.get(f"outputs{kind}") or []
        if ins and outs and max(ins) * growth >= max(outs):
            return True
    return backward and _within_tol_of_inputs(pa, tol)


def _within_tol_of_inputs(pa: ApiPair, tol: float) -> bool:
    """Whether the call's diverging outputs lie, in both runs, within ``tol`` of its inputs' largest magnitude."""
    ins, outs = pa.errors.get("inputs_size") or [], pa.errors.get("outputs_size") or []
    return bool(ins and outs) and max(outs) <= tol * max(ins)


def _growth(pa: ApiPair) -> float:
    """How much larger than its inputs' a call's rounding error may grow: :data:`_GROWTH`, times sqrt(k) for an
    output that sums k of its inputs' values (a weight's gradient over the batch), as rounding errors add up like a
    random walk."""
    n_in, n_out = pa.errors.get("inputs_numel") or [], pa.errors.get("outputs_numel") or []
    return _GROWTH * math.sqrt(max(1.0, max(n_in) / max(1, min(n_out)))) if n_in and n_out else _GROWTH


def _zero_at_precision(pa: ApiPair, tol: float, fine: Optional[float]) -> bool:
    """Of a comparison between runs of two dtypes (``fine``: the eps of the finer one, else None): a backward call
    whose diverging outputs are, in both runs, within ``tol`` of its inputs' largest magnitude and, in the run that
    holds them smaller, within the finer dtype's rounding of it (times :func:`_growth`) -- gradients zero in exact
    arithmetic, each run's value its own rounding noise (BERT's attention key bias: 2.4e-13 in float32, 3.7e-9 under
    bf16 autocast).  A gradient that one run computes above its rounding is a value, however small next to its
    inputs: not this."""
    if fine is None or (pa.a or {}).get("dir") != "backward":
        return False
    smaller = pa.errors.get("outputs_smaller") or []
    if len(smaller) != len(pa.errors.get("outputs") or []):
        return False
    return _rounding_noise(pa.errors.get("outputs_size") or [], smaller, pa.errors.get("inputs_size") or [],
                           _growth(pa), tol, fine)


def _rounding_noise(sizes: List[float], smaller: List[float], given: List[float], growth: float, tol: float,
                    fine: float) -> bool:
    """Whether outputs of ``sizes`` (the larger run's) and ``smaller`` (the other run's) are a value zero in exact
    arithmetic: within ``tol`` of the largest magnitude the call was ``given``, and in the run that holds them
    smaller within ``growth`` times the finer dtype's rounding (``fine``) of it."""
    return bool(sizes and smaller and given) and max(sizes) <= tol * max(given) \
        and max(smaller) <= growth * fine * max(given)


def _choice_flipped(pa: ApiPair) -> bool:
    """Within a tolerance: whether every diverging output of the call is a discrete value (integers, booleans:
    ``topk``'s indices, ``argmax``, a comparison), judged exactly, while some computed floating input differs at
    all, within the tolerance: a near tie that the input's rounding flips, which the call need not have computed
    wrong.  Inputs the same bit for bit leave no such excuse."""
    outs = [r for r in pa.rows if r["_io"] == "outputs" and r["_match"] is False]
    if not outs or any(is_float(r.get("NPU Tensor Dtype")) or is_float(r.get("Bench Tensor Dtype"))
                       or r.get("NPU Tensor Dtype") in (None, "N/A") or not _few_flipped(r) for r in outs):
        return False
    return any(r["_io"] == "inputs" and r["_match"] is True and r.get("Bitwise Equal") != "Yes"
               and is_float(r.get("Bench Tensor Dtype")) for r in pa.rows)


_CASTS = frozenset({"Tensor.float", "Tensor.half", "Tensor.bfloat16", "Tensor.double", "Tensor.to", "Tensor.type",
                    "Tensor.type_as", "Torch._to_copy"})
"""Calls that only change a tensor's dtype: a run in a narrower dtype (autocast) has some the other lacks."""


def _output_hashes(entry: Dict[str, Any]) -> List[Optional[str]]:
    return [t.get("hash") for t in entry.get("outputs", [])]


def _read_out_of(pa: ApiPair, noise: Dict[tuple, ApiPair], tol: float, fine: Optional[float]) -> Optional[ApiPair]:
    """The negligible call an output of which a ``Parameter`` read-out holds in each dump (the same fingerprints;
    the two runs may order a backward's outputs differently), when the read-out itself is what that call's excuse
    says of its outputs: within ``tol`` of the gradients the call was given in both runs, and within the finer
    dtype's rounding of them in the run that holds it smaller.  A read-out of another of the call's outputs (two
    parameters' gradients swapped) is a value, not that noise."""
    sources = [noise.get((side, h)) for side, e in (("a", pa.a), ("b", pa.b)) for h in _output_hashes(e)]
    if fine is None or not sources or any(q is None or q is not sources[0] for q in sources):
        return None
    source = sources[0]
    if not _rounding_noise(pa.errors.get("outputs_size") or [], pa.errors.get("outputs_smaller") or [],
                           source.errors.get("inputs_size") or [], _growth(source), tol, fine):
        return None
    return source


def _excuse(pa: ApiPair, tol: float) -> Optional[str]:
    """Within a tolerance, for a call whose inputs agree and whose output diverges: why it is no root cause (the
    precision its inputs carry, a near tie its discrete result flips, a gradient mask its saved values flip), or
    None when nothing explains it."""
    if _error_carried(pa, tol):
        return "its inputs already carry an error of this size (precision carried along, not made here)"
    if _choice_flipped(pa):
        return ("a discrete result (indices, a comparison) that inputs differing within the tolerance may flip (a "
                "near tie), not shown to be computed wrong here")
    if _mask_flipped(pa):
        return ("a gradient apart at a few elements only, where a mask of its saved forward values (agreeing within "
                "the tolerance) flipped, not shown to be computed wrong")
    return None


_FEW = 0.25  # a near tie flips some entries of a discrete result, not most of them


def _few_flipped(row: Dict[str, Any]) -> bool:
    """Whether a discrete output differs in few entries, as near ties flip them: at most :data:`_FEW` of them
    (stored values), or, from statistics, a mean moved by at most :data:`_FEW` of the values' range (an argmax that
    returns 0 everywhere moves most of its entries, and its mean with them)."""
    exact = row.get("One Thousandth Err Ratio")  # the share of entries within 1e-3: of integers, the equal ones
    if isinstance(exact, float):
        return 1.0 - exact <= _FEW
    nums = [row.get(f"{side} {k}") for side in ("NPU", "Bench") for k in ("min", "max", "mean")]
    if not all(isinstance(v, (int, float)) for v in nums):
        return False
    (a_min, a_max, a_mean), (b_min, b_max, b_mean) = nums[:3], nums[3:]
    return abs(a_mean - b_mean) <= _FEW * max(a_max - a_min, b_max - b_min, 1)


def check_tol(tol: Any, what: str = "tol") -> float:
    """``tol`` as a float; a :class:`ConfigError` when it is not a finite number >= 0 (a NaN tolerance would
    pass nothing, a negative one everything)."""
    if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not math.isfinite(tol) or tol < 0:
        raise ConfigError(f"{what} must be a finite number >= 0, got {tol!r}")
    return float(tol)


def compare_dumps(a: Union[str, Path, Dump], b: Union[str, Path, Dump], exact: Optional[bool] = None,
                  tol: float = DEFAULT_TOL) -> DumpComparison:
    """Align two dumps (``a`` is the NPU/test side, ``b`` the benchmark) and judge every tensor.

    ``exact`` (bitwise verdicts) defaults to True only when both dumps ran on the same device type in the same
    dtypes; otherwise the verdicts are the core's within ``tol``, widened to the dtypes' tolerance (module
    docstring).  A path is read by :func:`~.parse.open_dump`: a dump whose writer was killed compares up to its
    last complete entry."""
    tol = check_tol(tol, "compare: tol")
    da = a if isinstance(a, Dump) else open_dump(a)
    db = b if isinstance(b, Dump) else open_dump(b)
    for d in (da, db):
        _warn_missing_payloads(d)
    pairs = _aligned_pairs(da, db)
    mixed = _dtypes_differ(pairs)
    if exact is None:
        exact = da.header.get("device") == db.header.get("device") and not mixed
    fine = None  # the eps of the finer dtype of runs computed in two (see _zero_at_precision)
    if mixed:  # values computed in float32 from bfloat16 inputs carry bfloat16's rounding: judge all at its precision
        tol = dtype_tol(tol, *_float_dtypes(pairs))
        fine = _finest_eps(_float_dtypes(pairs))
    rule = InputsRule()
    last_seq: Optional[int] = None  # ``seq`` of the last call of dump a met (where a call of b alone falls)
    judged_any = False
    judged: List[Pair] = []
    api: Dict[int, ApiPair] = {}
    made_alone: Dict[str, Dict[str, Any]] = {}  # fingerprint of an output of a call one dump alone has -> that call
    noise: Dict[tuple, ApiPair] = {}  # (side, fingerprint of a negligible call's output there) -> that call
    for pa in pairs:
        if pa.a is None or pa.b is None:
            for side, e, d in (("NPU", pa.a, da), ("Bench", pa.b, db)):
                if e is not None:
                    _unmatched_rows(pa, e, side)
                    made_alone.update((t["hash"], e) for t in e.get("outputs", []) if t.get("hash"))
            if pa.a is not None and isinstance(pa.a.get("seq"), int):
                last_seq = pa.a["seq"]
            rule.unpaired(last_seq)
            continue
        if isinstance(pa.a.get("seq"), int):
            last_seq = pa.a["seq"]
        v = _pair_tensors(pa, da, db, exact, tol)
        if str(pa.a.get("op", "")).startswith("Parameter.") and made_alone:
            pa.handed_by = next((made_alone[t["hash"]] for e in (pa.a, pa.b) for t in e.get("outputs", [])
                                 if t.get("hash") in made_alone), None)
        ins = rule.inputs_agree(pa.a, v["inputs"], v["given"])
        pa.inputs_match = ins
        pa.output_diverges = any(x is False for x in v["outputs"])
        judged_any = judged_any or any(x is not None for x in v["outputs"])
        rule.output_judged(pa.a, pa.output_diverges)
        note = _excuse(pa, tol) if not exact and ins and pa.output_diverges else None
        carried = note is not None
        if carried and _zero_at_precision(pa, tol, fine):
            pa.negligible = True
            note = ("a gradient zero in exact arithmetic: one run holds it within its finer dtype's rounding of the "
                    "gradients the call was given, the other within the tolerance (apart only in rounding noise)")
            noise.update(((side, h), pa) for side, e in (("a", pa.a), ("b", pa.b)) for h in _output_hashes(e) if h)
        elif pa.output_diverges and str(pa.a.get("op", "")).startswith("Parameter.") and not exact:
            source = _read_out_of(pa, noise, tol, fine)
            if source is not None:  # the parameter's gradient read out: the very values that call left
                pa.negligible, carried = True, True
                note = f"the gradient {source.name} left, zero in exact arithmetic there (rounding noise)"
        if carried:
            for r in pa.rows:
                if r["_io"] == "outputs" and r["_match"] is False:
                    r["Err_message"] = f"{r['Err_message']}; {note}" if r["Err_message"] else note
            pa.explained = note
        # a compiled region whose own FX nodes diverge is explained by them: its inputs do not agree
        p = Pair(_to_record(pa.a, "a", 0), _to_record(pa.b, "b", 0), equal=not pa.output_diverges,
                 inputs_equal=ins and not carried and not cc.explained_by_nodes(pa.nodes))
        judged.append(p)
        api[id(p)] = pa
    for p in find_roots(judged, "bitwise" if exact else "tolerance", strict=True).root_causes:
        api[id(p)].root_cause = True
    for pa in pairs:
        if pa.a is not None and pa.b is not None:
            _note(pa)
        if pa.root_cause:
            for r in pa.rows:
                if r["_io"] == "outputs" and r["_match"] is False:
                    r["Root Cause"] = "Yes"
    return DumpComparison(pairs, exact, partial=any(d.partial or d.cut for d in (da, db)), judged=judged_any)


def _warn_missing_payloads(d: Dump) -> None:
    """One line when the index names tensor payloads its data directory no longer holds."""
    if d.has_payloads:
        return
    if any("payload" in t for e in d.entries for io_ in ("inputs", "outputs") for t in e.get(io_, [])):
        where = (d.data_dir or data_dir_of(d.path)) / PAYLOAD_FILE
        log.warning("compare: %s references tensor payloads, but %s is missing: comparing on statistics only",
                    d.path, where)


def _float_dtypes(pairs: List[ApiPair]) -> set:
    """The dtypes of every paired call's tensors, both sides."""
    return {t["dtype"] for p in pairs if p.a is not None and p.b is not None for e in (p.a, p.b)
            for io_ in ("inputs", "outputs") for t in e.get(io_, []) if "dtype" in t}


def _finest_eps(names: set) -> Optional[float]:
    """The eps of the finest floating dtype among ``names`` (``"torch.float32"``...), None when there is none."""
    dtypes = [getattr(torch, str(n).replace("torch.", ""), None) for n in names]
    return min((torch.finfo(d).eps for d in dtypes if isinstance(d, torch.dtype) and d.is_floating_point),
               default=None)


def _dtypes_differ(pairs: List[ApiPair]) -> bool:
    """Did the two runs compute in different dtypes (some paired tensor has another dtype on each side)?

    Then even the ops that see the same dtype on both sides (after a ``.float()``) are judged by tolerance:
    their inputs carry the rounding of the other dtype, so bitwise equality means nothing there."""
    for p in pairs:
        if p.a is None or p.b is None:
            continue
        for io_ in ("inputs", "outputs"):
            dtypes = {t.get("name"): t.get("dtype") for t in p.a.get(io_, []) if "dtype" in t}
            if any(t.get("name") in dtypes and dtypes[t.get("name")] != t["dtype"]
                   for t in p.b.get(io_, []) if "dtype" in t):
                return True
    return False


def _aligned_pairs(da: Dump, db: Dump) -> List[ApiPair]:
    """Calls paired by alignment; each compiled region pair preceded by the pairs of its FX-node entries."""
    top_a, inner_a = cc.split_entries(da.entries)
    top_b, inner_b = cc.split_entries(db.entries)
    ra = [_to_record(da.entries[i], "a", i) for i in top_a]
    rb = [_to_record(db.entries[i], "b", i) for i in top_b]
    pairs: List[ApiPair] = []
    for p in align(ra, rb):
        ea = da.entries[p.a.extra["i"]] if p.a is not None else None
        eb = db.entries[p.b.extra["i"]] if p.b is not None else None
        ka, kb = cc.region_key(ea), cc.region_key(eb)
        nodes = [ApiPair(da.entries[i] if i is not None else None, db.entries[j] if j is not None else None)
                 for i, j in cc.pair_nodes(da.entries, db.entries, inner_a.get(ka), inner_b.get(kb))]
        pairs.extend(nodes)
        pairs.append(ApiPair(ea, eb, nodes=nodes))
    return pairs


def _note(pa: ApiPair) -> None:
    """Say in the CSV what a compiled region's verdict means."""
    note = None
    if (pa.a or {}).get("opaque") or (pa.b or {}).get("opaque"):
        note = cc.OPAQUE_HINT
    elif cc.nodes_unpaired(pa.nodes):
        note = cc.UNPAIRED_HINT
    elif pa.nodes and pa.output_diverges and not pa.root_cause and pa.inputs_match:
        note = "the divergence starts at one of its FX nodes (see the root cause above)"
    if note:
        for r in pa.rows:
            r["Err_message"] = f"{r['Err_message']}; {note}" if r["Err_message"] else note


def _unmatched_rows(pa: ApiPair, e: Dict[str, Any], side: str) -> None:
    for io_ in ("inputs", "outputs"):
        for t in e.get(io_, []):
            n = f"{e['name']}_{t.get('name')}"
            row, _, _ = _tensor_row(n if side == "NPU" else None, n if side == "Bench" else None,
                                    t if side == "NPU" else None, t if side == "Bench" else None, None, None, False)
            row["_io"], row["_match"] = io_, None
            pa.rows.append(row)


def write_csv(cmp: DumpComparison, path: Path, stack_mode: bool = False) -> Path:
    buf = io.StringIO()
    cols = CSV_COLUMNS + ([_STACK_COLUMN] if stack_mode else [])
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    for p in cmp.pairs:
        stack = "\n".join((p.a or {}).get("stack") or []) if stack_mode else None
        for i, r in enumerate(p.rows):
            row = dict(r)
            if stack_mode:
                row[_STACK_COLUMN] = stack if i == 0 else ""
            w.writerow(row)
    atomic_write_text(path, buf.getvalue())
    cmp.csv_path = path
    return path


def analysis(cmp: DumpComparison) -> str:
    """The first root-cause API with its source and stack, as text (what :func:`analyze` prints)."""
    roots = cmp.root_causes
    if roots:
        p = roots[0]
        bad = [r for r in p.rows if r["Root Cause"] == "Yes"] or p.rows
        r = bad[0]
        given = [row["NPU Name"] for row in p.rows if row.get("_io") == "inputs" and row.get("_match") is False]
        lines = [f"root cause: {p.a['name']} (bench: {p.b['name']}): " +
                 (f"its output differs, and so does what it was given ({', '.join(given)}), while nothing before it "
                  f"diverged" if given else "its inputs match but its output does not"),
                 f"  {r['NPU Name']}: Cosine={r['Cosine']} MaxAbsErr={r['MaxAbsErr']} "
                 f"Bitwise Equal={r['Bitwise Equal']} Accuracy Reached or Not={r['Accuracy Reached or Not']}",
                 f"  at {p.a.get('source') or '?'}"]
        where = cc.node_note(p.a)
        if where:
            lines.insert(1, f"  {where}")
        elif p.a.get("opaque"):
            lines.append(f"  ({cc.OPAQUE_HINT})")
        elif cc.nodes_unpaired(p.nodes):
            lines.append(f"  ({cc.UNPAIRED_HINT})")
        lines += [f"    {s}" for s in p.a.get("stack") or []]
        if p.handed_by:
            lines.append(f"  its value is the output of {p.handed_by['name']}, a call one dump alone has (at "
                         f"{p.handed_by.get('source') or '?'}): look there")
        if len(roots) > 1:
            lines.append(f"  ({len(roots) - 1} more root-cause APIs in the CSV)")
    elif cmp.first_divergence is not None and not cmp.divergent:
        p = cmp.first_divergence
        lines = [f"no divergence beyond the dtypes' precision: {p.name} differs, but {p.explained}; nothing else "
                 f"diverges ({cmp.unpaired} unpaired calls)",
                 f"  at {(p.a or {}).get('source') or '?'}"]
    elif cmp.first_divergence is not None:
        p = cmp.first_divergence
        why = (f"its inputs agree within the tolerance, but {p.explained}" if p.explained
               else "but its inputs already differ")
        lines = [f"first divergence: {p.name}, {why}: no root cause among the paired APIs",
                 f"  at {(p.a or {}).get('source') or '?'}"]
        i = cmp.pairs.index(p)
        extra: List[ApiPair] = []  # the calls one dump alone has since the last paired call that diverged, latest 5
        for q in reversed(cmp.pairs[:i]):
            if q.a is not None and q.b is not None and q.output_diverges:
                break
            if q.a is None or q.b is None:
                extra.insert(0, q)
        if p.explained:  # precision carried along: the casts only the narrower run has are no culprits
            extra = [q for q in extra if str((q.a or q.b).get("op", "")) not in _CASTS]
        extra = extra[-5:]
        if extra:
            lines.append("  unpaired calls just before it (present in one dump only; a likely culprit): " +
                         ", ".join(f"{q.name} ({'NPU' if q.a else 'bench'}"
                                   f"{', at ' + (q.a or q.b)['source'] if (q.a or q.b).get('source') else ''})"
                                   for q in extra))
        elif not p.explained:
            lines.append("  (the model inputs differ, or the culprit was not dumped)")
    elif not cmp.paired:
        lines = [f"no call of one dump pairs with a call of the other ({cmp.unpaired} calls in one dump only): the "
                 f"runs are not shown to agree"]
    elif not cmp.judged:
        lines = ["nothing to judge: no paired call has an output value in both dumps (a dump of mode 'stack' holds "
                 "none): the runs are not shown to agree"]
    else:
        lines = [f"no divergence: every paired API agrees ({cmp.unpaired} unpaired calls)" if cmp.shown_to_agree
                 else f"no divergence among the paired APIs, but a dump was cut short and {cmp.unpaired} calls are "
                      f"in one dump only: the runs are not shown to agree"]
    return "\n".join(lines)


def analyze(cmp: DumpComparison, out=None) -> str:
    """Name the first root-cause API with its source and stack (printed, and returned)."""
    text = analysis(cmp)
    print(text, file=out)
    return text


auto_analyze = analyze


def _timestamp() -> str:
    return time.strftime("%Y%m%d%H%M%S")


def _unique(path: Path) -> Path:
    n, p = 1, path
    while p.exists():
        p = path.with_name(f"{path.stem}_{n}{path.suffix}")
        n += 1
    return p


def _check_suffix(suffix: Any, who: str) -> None:
    """``suffix`` goes into file names inside the output directory: a string that names no other directory."""
    if not isinstance(suffix, str):
        raise ConfigError(f"{who}: suffix must be a string, got {type(suffix).__name__} {suffix!r}")
    if "/" in suffix or os.sep in suffix or (os.altsep and os.altsep in suffix) or "\0" in suffix:
        raise ConfigError(f"{who}: suffix {suffix!r} must not hold a path separator (it is part of the file names "
                          f"written into the output directory)")


def compare(input_param: Dict[str, Any], output_path: Union[str, Path], stack_mode: bool = False,
            auto_analyze: bool = True, suffix: str = "", fuzzy_match: bool = False,
            exact: Optional[bool] = None, tol: float = DEFAULT_TOL) -> DumpComparison:
    """ptdbg's ``compare``: writes ``compare_result{suffix}_{timestamp}.csv`` into ``output_path``.

    ``input_param``: ``npu_pkl_path`` and ``bench_pkl_path`` (index files or rank directories);
    ``npu_dump_data_dir``/``bench_dump_data_dir``: where that side's ``tensors.bin`` lies when it is not in the
    directory named after its index (a dump moved or renamed); ``is_print_compare_log`` (default True): print
    the analysis -- False still writes it to the advisor file.  ``exact``/``tol``: see :func:`compare_dumps`.
    Pairing is always by alignment, so ``fuzzy_match`` has no effect."""
    if not isinstance(input_param, dict):
        raise ConfigError(f"compare: input_param must be a dict, got {type(input_param).__name__}")
    for key in ("npu_pkl_path", "bench_pkl_path"):
        if not input_param.get(key):
            raise ConfigError(f"compare: input_param needs {key!r} (a dump.pkl index or rank directory)")
        check_path(input_param[key], f"compare: input_param[{key!r}]")
    data_dirs = []
    for key in ("npu_dump_data_dir", "bench_dump_data_dir"):
        d = input_param.get(key)
        if d and not check_path(d, f"compare: input_param[{key!r}]").is_dir():
            raise TraceFormatError(f"compare: {key} {d}: no such directory")
        data_dirs.append(d or None)
    printing = input_param.get("is_print_compare_log", True)
    if not isinstance(printing, bool):
        raise ConfigError(f"compare: input_param['is_print_compare_log'] must be True or False, got {printing!r}")
    out = check_path(output_path, "compare: output_path")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"compare: output_path {out} is not a directory")
    tol = check_tol(tol, "compare: tol")
    _check_suffix(suffix, "compare")
    da = open_dump(input_param["npu_pkl_path"], data_dirs[0])
    db = open_dump(input_param["bench_pkl_path"], data_dirs[1])
    cmp = compare_dumps(da, db, exact, tol)
    if stack_mode and not any(e.get("stack") for e in da.entries):
        log.warning("compare: stack_mode: %s holds no call stacks, so NPU_Stack_Info stays empty (dump it with "
                    "set_dump_switch('ON', mode='api_stack'), or mode='stack')", da.path)
    out.mkdir(parents=True, exist_ok=True)
    ts = _timestamp()
    write_csv(cmp, _unique(out / f"compare_result{suffix}_{ts}.csv"), stack_mode)
    if auto_analyze:
        cmp.analysis = analysis(cmp)
        if printing:
            print(cmp.analysis)
        cmp.advisor_path = _unique(out / f"advisor{suffix}_{ts}.txt")
        atomic_write_text(cmp.advisor_path, cmp.analysis + "\n")
    log.info("compare: wrote %s", cmp.csv_path)
    return cmp


def compare_distributed(npu_dump_dir: Union[str, Path], bench_dump_dir: Union[str, Path],
                        output_path: Union[str, Path], **kwargs: Any) -> List[DumpComparison]:
    """Compare rank by rank: ``<npu>/rank<N>`` with ``<bench>/rank<N>``; both runs must have the same ranks.

    ``kwargs``: those of :func:`compare`, and ``is_print_compare_log`` (its ``input_param`` key); a ``suffix``
    goes before each rank's own ``_rank<N>-rank<N>``."""
    printing = kwargs.pop("is_print_compare_log", True)
    suffix = kwargs.pop("suffix", "")
    _check_suffix(suffix, "compare_distributed")
    ra, rb = rank_dirs(npu_dump_dir), rank_dirs(bench_dump_dir)
    if not ra:
        raise TraceFormatError(f"{npu_dump_dir}: no rank<N> directories")
    if sorted(ra) != sorted(rb):
        same = "the same ranks" if len(ra) == len(rb) else "the same number of ranks"
        raise TraceFormatError(f"compare_distributed: {npu_dump_dir} has ranks {sorted(ra)} but {bench_dump_dir} has "
                               f"{sorted(rb)}; both runs must use {same}")
    indexes = {rank: (find_index(ra[rank]), find_index(rb[rank])) for rank in ra}
    for side, root in enumerate((npu_dump_dir, bench_dump_dir)):
        check_rank_folders(root, {rank: (pair[side], read_header(pair[side])) for rank, pair in indexes.items()})
    results = []
    for rank in ra:
        pa, pb = indexes[rank]
        param = {"npu_pkl_path": str(pa), "bench_pkl_path": str(pb), "is_print_compare_log": printing}
        cmp = compare(param, output_path, suffix=f"{suffix}_rank{rank}-rank{rank}", **kwargs)
        cmp.rank = rank
        results.append(cmp)
    return results
