"""The root-cause rule, one for every caller.

* A finding needs a **symptom**: an output of the graph differs (:func:`is_output`:
  ``output`` records of inductor graphs, FX nodes the graph returns).  Non-floating
  outputs count only when ``strict`` (bitwise comparisons pass ``strict=True``).  A
  group of records with no dependency information at all (eager API traces) has
  no notion of output: there every divergence is a symptom.
* A divergence is **live** when a chain of differing (or unjudged) records leads
  from it to a failing output; the **root cause** is the first live record whose
  inputs agree while its own value does not.  Unjudged records (views, buffers that
  hold no node's value, values not compared) are transparent: a record's inputs
  are looked through them to the nearest judged values.
* Inputs agree only when both sides are wired alike: each input of B's record is
  the partner of the matching input of A's (a pairing that went astray, or a
  record fed by something the other run lacks, never passes for agreeing inputs).
* An op **only one run has** (an extra hook, a missing cast) is the root cause when
  its inputs are paired and agree and its value feeds a live divergence of its
  run (through other such ops): the runs part there, before any paired record.
* A value that enters a graph call from outside it (an input, a parameter) is no root
  cause when an earlier failing call of the run handed it on: a forward of its own graph
  for a backward's saved activations and incoming gradients, a backward of its own graph for
  parameters an optimizer updated from wrong gradients, or any call that produced that
  very value in both runs (a graph break's hand-over).
* When no record satisfies the rule, the first live divergence is reported as the
  **first divergence**, never marked a root cause.
* A divergence that reaches no failing output is a **masked** note, never a root
  cause.  When the caller can replay the reference with one compiled value
  substituted (``confirm``), a candidate whose substitution alone leaves every
  output within tolerance is masked too (the divergence is absorbed downstream,
  e.g. a wrong boolean mask under ``where(b, x, x)``).

Pairing lives in :mod:`.align`, the verdict on one pair in :mod:`.verdict`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from determ_backend.trace.store import TensorStore
from determ_backend.trace.stream import Record
from determ_backend.compare.align import Pair, align, carries, re_views
from determ_backend.compare.verdict import KERNEL_ULPS, by_statistics, is_float, judge_records

__all__ = ["Comparison", "describe", "pair_row", "find_roots", "compare_traces", "is_output", "is_allocation", "Confirm",
           "MAX_CONFIRM"]

Confirm = Callable[[List[Pair]], List[Optional[bool]]]
"""Given candidate root pairs, for each: True (its value alone makes an output fail), False (it
alone leaves the outputs within tolerance: masked), None (cannot tell)."""

_MAX_NOTES = 20
MAX_CONFIRM = 8
"""Candidates a ``confirm`` callback is asked about (each costs it a replay); later ones stand."""


def is_output(rec: Record) -> bool:
    """Whether ``rec`` is (or is returned as) an output of its graph, or the last write into one of its inputs
    (``extra.writes_input``: the program sees that value after the call as it sees an output)."""
    if rec.kind == "output":
        return True
    extra = rec.extra or {}
    return extra.get("outputs") is not None or bool(extra.get("writes_input"))


@dataclass
class Comparison:
    pairs: List[Pair]
    root_causes: List[Pair]
    mode: str
    masked: List[Pair] = field(default_factory=list)
    """First divergences that reach no failing output (notes, never root causes)."""
    symptoms: List[Pair] = field(default_factory=list)
    """The failing outputs (or, without dependency information, every divergence)."""
    files: Optional[Dict[str, tuple]] = None
    """``{"a": (path, TraceFile), "b": ...}`` when the two traces were read from files (their completeness)."""
    unexplained: List[Pair] = field(default_factory=list)
    """Where no record satisfies the rule: the first live divergence of each such graph call (reported as the
    first divergence, never as a root cause)."""

    @property
    def identical(self) -> bool:
        return all(p.equal for p in self.pairs)

    @property
    def divergent(self) -> bool:
        """A finding: some output fails the verdict."""
        return bool(self.symptoms)

    @property
    def first_divergence(self) -> Optional[Pair]:
        for found in (self.root_causes, self.unexplained, self.symptoms):
            if found:
                return found[0]
        return None

    @property
    def by_statistics(self) -> int:
        """Paired records that agree by their statistics alone (:func:`~.verdict.by_statistics`): how much of an
        agreement within a tolerance bounds no element error."""
        return sum(1 for p in self.pairs if p.paired and p.equal is True and by_statistics(p.metrics))

    def summary(self, checks: Sequence[str] = ()) -> Dict[str, Any]:
        fd = self.first_divergence
        out = {
            "checks": list(checks),
            "divergent": self.divergent,
            "identical": self.identical,
            "mode": self.mode,
            "pairs": sum(1 for p in self.pairs if p.paired),
            "unmatched_a": sum(1 for p in self.pairs if p.b is None),
            "unmatched_b": sum(1 for p in self.pairs if p.a is None),
            "divergent_pairs": sum(1 for p in self.pairs if p.equal is False and p.paired),
            "failing_outputs": len(self.symptoms),
            "first_divergence": describe(fd) if fd else None,
            "root_causes": [describe(p) for p in self.root_causes],
        }
        if self.masked:
            out["masked"] = [describe(p) for p in self.masked[:_MAX_NOTES]]
        return out


def describe(p: Pair) -> Dict[str, Any]:
    r = p.a if p.a is not None else p.b
    other = p.b if p.a is not None else None
    d = {"graph": r.graph, "stage": r.stage, "call": r.call, "node": r.node, "op": r.op, "kind": r.kind,
         "source": r.source, "rank": r.rank, "dtype": r.dtype, "shape": r.shape, "metrics": p.metrics,
         "root_cause": p.root_cause}
    label = (r.extra or {}).get("holds")
    if label:
        d["holds"] = label
    if p.inside:  # the buffer's kernel fused several nodes: the one that diverges alone is the answer
        ins = p.inside
        d["kernel"] = {"name": ins.get("kernel"), "record": r.node, "region": ins.get("region", [])}
        if ins.get("upstream"):  # the culprit was computed before the record's own kernel, which only read it
            d["kernel"]["upstream"] = True
        if ins.get("node"):
            d["kernel"]["record_metrics"] = d["metrics"]
            d.update({k: ins[k] for k in ("node", "op", "source", "metrics", "dtype", "shape") if k in ins})
    if other is not None and other.node != r.node:
        d["node_b"] = other.node
    if not p.paired:
        d["only_in"] = "a" if p.a is not None else "b"
    return d


def pair_row(p: Pair) -> Dict[str, Any]:
    """Every pair of a comparison as one row (a finding's pairs file, the HTML report): the record's identity,
    its inputs, the verdict, the metrics, both fingerprints, and whether a divergence reaches a failing output.
    Unlike :func:`describe`, a root narrowed inside its kernel keeps the buffer's name (``inside`` names the node)."""
    r = p.rec
    d: Dict[str, Any] = {"graph": r.graph, "stage": r.stage, "call": r.call, "node": r.node, "op": r.op,
                         "kind": r.kind, "source": r.source, "dtype": r.dtype, "shape": r.shape,
                         "inputs": list(r.inputs), "equal": p.equal, "metrics": p.metrics,
                         "root_cause": p.root_cause, "paired": p.paired,
                         "hash_a": p.a.hash if p.a is not None else None,
                         "hash_b": p.b.hash if p.b is not None else None}
    if p.reaches_output is not None:
        d["reaches_output"] = p.reaches_output
    if is_output(r):
        d["output"] = True
    label = (r.extra or {}).get("holds")
    if label:
        d["holds"] = label
    if p.inside:
        d["inside"] = {k: p.inside[k] for k in ("kernel", "node", "op", "source", "metrics") if k in p.inside}
    if p.paired and p.b.node != r.node:
        d["node_b"] = p.b.node
    return d


def _group_key(r: Record) -> tuple:
    return (r.graph, r.stage, r.call)


# ops whose result holds its (first) input's values, converted, copied or re-viewed: one only one run has
# (``weight.float()`` of a float64 reference, an extra ``contiguous``) passes its input on unchanged
_PRECISION = {"float16": 1, "bfloat16": 1, "float32": 2, "float64": 3}  # widening between these loses nothing


class _Graph:
    """The judged pairs of one graph call, as a dependency graph."""

    def __init__(self, pairs: List[Pair], loose: Sequence[Pair] = ()):
        self.pairs = pairs
        self.by_node: Dict[str, Pair] = {}
        self.partner: Dict[str, str] = {}  # A's node -> its partner's node in B
        self.partner_b: Dict[str, str] = {}  # and back
        for p in pairs:
            self.by_node.setdefault(p.rec.node, p)
            self.partner.setdefault(p.a.node, p.b.node)
            self.partner_b.setdefault(p.b.node, p.a.node)
        self.records = ({p.a.node: p.a for p in pairs}, {p.b.node: p.b for p in pairs})  # by node, per side
        self.loose = ({p.a.node: p.a for p in loose if p.a is not None},
                      {p.b.node: p.b for p in loose if p.b is not None})
        self.has_deps = any(p.rec.inputs for p in pairs)
        self._eff: Dict[int, List[Optional[bool]]] = {}

    def _record(self, side: int, name: str) -> Optional[Record]:
        return self.records[side].get(name) or self.loose[side].get(name)

    def passes_on(self, side: int, rec: Record) -> bool:
        """Whether ``rec`` holds its one input's values: a conversion, copy or view, or an op whose fingerprint
        is its input's (``h * 1.0``)."""
        if carries(rec) or re_views(rec):
            return True
        if len(rec.inputs) != 1 or rec.hash is None:
            return False
        src = self._record(side, rec.inputs[0])
        return src is not None and src.hash == rec.hash

    def source(self, side: int, name: str) -> str:
        """``name`` looked through the records only this side has that carry their input on unchanged."""
        seen = set()
        rec = self.loose[side].get(name)
        while rec is not None and self.passes_on(side, rec) and name not in seen:
            seen.add(name)
            name = rec.inputs[0]
            rec = self.loose[side].get(name)
        return name

    def _dtype(self, side: int, name: str) -> Optional[str]:
        rec = self._record(side, name)
        return rec.dtype if rec is not None else None

    def inputs(self, p: Pair) -> List[Optional[Pair]]:
        return [self.by_node.get(self.source(0, n)) for n in p.rec.inputs]

    def harmless(self, side: int, rec: Record) -> bool:
        """Whether ``rec``, a record only ``side`` has, cannot set the runs apart: it copies or re-views a value,
        widens it (a float64 reference's gradient cast back up), or converts it to the dtype the other run holds
        that value in (a float64 reference's ``weight.float()``).  A narrowing cast the other run lacks can."""
        if not self.passes_on(side, rec):
            return False
        before = self._dtype(side, rec.inputs[0])
        if rec.dtype == before or _PRECISION.get(rec.dtype, 0) > _PRECISION.get(before, 9):
            return True
        other = (self.partner if side == 0 else self.partner_b).get(self.source(side, rec.inputs[0]))
        return other is not None and self._dtype(1 - side, other) == rec.dtype

    def outputs(self) -> List[Pair]:
        outs = [p for p in self.pairs if is_output(p.rec)]
        if outs or not self.has_deps:
            return outs
        consumed = {n for p in self.pairs for n in p.rec.inputs}
        return [p for p in self.pairs if p.rec.node not in consumed]  # sinks stand for the outputs

    def effective(self, p: Pair, seen: Optional[set] = None) -> List[Optional[bool]]:
        """The distinct verdicts of ``p``'s inputs, looking through unjudged records to the nearest judged ones."""
        key = id(p)
        if key in self._eff:
            return self._eff[key]
        seen = set() if seen is None else seen  # the records on the path walked to here: a cycle stops the walk,
        seen.add(key)                           # a value reached again along another path (a diamond) does not
        out: List[Optional[bool]] = []
        try:
            for q in self.inputs(p):
                if q is None:
                    out.append(None)
                elif q.equal is not None or not q.rec.inputs:
                    out.append(q.equal if q.equal is not None else (True if q.rec.kind in ("input", "param")
                                                                    else None))
                elif id(q) in seen:
                    out.append(None)
                else:
                    out.extend(self.effective(q, seen))
        finally:
            seen.discard(key)
        out = list(dict.fromkeys(out))  # which verdicts occur is all that counts: a chain of diamonds stays small
        self._eff[key] = out
        return out

    def wired_alike(self, p: Pair) -> Optional[bool]:
        """Whether B's record consumed the partners of A's record's inputs, in order: False when it consumed
        something else (or A's input has no partner in B); None when the records do not tell."""
        a, b = p.a, p.b
        if not a.inputs or not b.inputs:
            return None
        if len(a.inputs) != len(b.inputs):
            return False
        known = True
        for x, y in zip(a.inputs, b.inputs):
            xs, ys = self.source(0, x), self.source(1, y)
            if (xs, ys) != (x, y) and self._dtype(0, x) != self._dtype(1, y):
                return False  # a conversion only one run has left the two values at different precisions
            partner = self.partner.get(xs)
            if partner is None:
                if xs in self.loose[0]:
                    return False
                known = False  # not in the trace (a value made elsewhere): cannot tell
            elif partner != ys:
                return False
        return True if known else None

    def inputs_agree(self, p: Pair) -> bool:
        if p.inputs_equal is not None:
            return p.inputs_equal
        a, b = p.a, p.b
        if self.wired_alike(p) is False:
            return False
        if a.inputs:
            vs = self.effective(p)
            if vs and all(v is True for v in vs):
                return True
            if any(v is False for v in vs):
                return False
        if a.in_hashes or b.in_hashes:
            return a.in_hashes == b.in_hashes
        return not a.inputs  # a source record (graph input, parameter) with nothing upstream

    def live(self, symptoms: List[Pair]) -> set:
        """ids of the pairs from which a chain of differing or unjudged records leads to a symptom."""
        seen = {id(p) for p in symptoms}
        stack = list(symptoms)
        while stack:
            q = stack.pop()
            for r in self.inputs(q):
                if r is not None and r.equal is not True and id(r) not in seen:
                    seen.add(id(r))
                    stack.append(r)
        return seen

    def one_sided_roots(self, loose: Sequence[Pair], live: set) -> List[Pair]:
        """Records only one run has whose inputs are paired and agree and whose value feeds (through other such
        records) a live divergence of that run: where the two runs part."""
        found: List[Pair] = []
        # where the runs are wired apart: a differing record, or one not judged (a view both runs take of values
        # only one run made each: sdpa against bmm attention)
        parted = [p for p in self.pairs if id(p) in live and p.equal is not True and self.wired_alike(p) is False]
        for i, side in enumerate(("a", "b")):
            mine = {getattr(p, side).node: p for p in loose if getattr(p, side) is not None}
            if not mine:
                continue
            paired = {getattr(p, side).node: p for p in self.pairs}
            feeding: set = set()  # one-sided records a live divergence of this side consumes, directly or not
            stack = [n for p in parted for n in getattr(p, side).inputs if n in mine]
            while stack:
                n = stack.pop()
                if n not in feeding:
                    feeding.add(n)
                    stack.extend(m for m in getattr(mine[n], side).inputs if m in mine)
            to_other = self.partner if i == 0 else self.partner_b
            other_calls = {(r.op, tuple(self.source(1 - i, m) for m in r.inputs))
                           for recs in (self.records[1 - i], self.loose[1 - i]) for r in recs.values()}
            for n in feeding:
                rec = getattr(mine[n], side)
                if self.harmless(i, rec) or not all(self.source(i, m) in paired and paired[self.source(i, m)].equal
                                                    is True for m in rec.inputs):
                    continue
                if (rec.op, tuple(to_other[self.source(i, m)] for m in rec.inputs)) in other_calls:
                    continue  # the other run made the same call on the same values: paired elsewhere, not extra
                found.append(mine[n])
        return found


def _derived(r: Record) -> bool:
    """Whether a record's fingerprint is derived from its input's rather than read: a view (``kind`` view, or the
    eager modes' ``derived_hash``), or a copy that took its source's fingerprint (no statistics of its own)."""
    if r.kind == "view" or (r.extra or {}).get("derived_hash"):
        return True
    return r.stats is None and r.hash is not None and r.hash in (r.in_hashes or ())


def _inherit_views(pairs: List[Pair], by_id: Dict[tuple, Pair]) -> None:
    """A pair not judged (fingerprints alone under a tolerance) whose values are its inputs' (:func:`_derived`) takes
    their verdict: agreeing when they all agree, differing when one differs."""
    for p in pairs:
        if p.paired and p.equal is None and _derived(p.a) and _derived(p.b):
            verdicts = [by_id[(p.a.graph, p.a.stage, p.a.call, n)].equal for n in p.a.inputs
                        if (p.a.graph, p.a.stage, p.a.call, n) in by_id]
            if verdicts and all(v is True for v in verdicts):
                p.equal = True
            elif any(v is False for v in verdicts):
                p.equal, p.metrics = False, {"inherited_view": True}


def _given_differently(roots: List[Pair], by_id: Dict[tuple, Pair]) -> List[Pair]:
    """Roots judged within a tolerance whose inputs agree by their statistics alone (:func:`_upstream_by_statistics`)
    carry that in their metrics (``inputs_agree_by_statistics_only``).  In an eager trace, where a record with no
    inputs is a tensor the run was given (a parameter, a batch) rather than one an op made, such a root fed through
    values of that kind by a given tensor whose fingerprint differs (same dtype and shape: not another device's
    rounding) moves to it: the runs were given different values, which statistics within the tolerance cannot show
    to agree element by element (one weight element 10x the tolerance off, the optimizer carrying it into the next
    step where a matmul crosses the tolerance).  With no such tensor (both runs given the same values) the root
    stays where the values first cross the tolerance."""
    out: List[Pair] = []
    walks = [(p, *_upstream_by_statistics(p, by_id)) for p in roots]  # every walk before any pair is changed
    for p, weak, given in walks:
        if weak:
            p.metrics["inputs_agree_by_statistics_only"] = weak
        if not given or p.a is None or p.a.stage != "eager":
            if p not in out:
                out.append(p)
            continue
        p.metrics["carries_a_given_difference"] = [q.a.node for q in given]
        for q in given:
            q.equal, q.reaches_output = False, True
            q.metrics["within_tol_by_statistics_only"] = True
            if q not in out:
                out.append(q)
    return out


def _upstream_by_statistics(p: Pair, by_id: Dict[tuple, Pair]) -> tuple:
    """``(names, given)``: the inputs of ``p`` (looked through views and copies that carry their input's fingerprint)
    whose fingerprints differ and that agree within the tolerance by statistics alone, which bound no element error;
    and the records with no inputs upstream of ``p`` through such values whose fingerprints differ (same dtype and
    shape)."""
    if p.a is None:
        return [], []
    names: List[str] = []
    given: List[Pair] = []
    seen: set = set()
    stack = [((p.a.graph, p.a.stage, p.a.call, n), True) for n in p.a.inputs]
    while stack and len(seen) < 4096:
        key, direct = stack.pop(0)
        q = by_id.get(key)
        if q is None or key in seen or not q.paired:
            continue
        seen.add(key)
        weak = q.equal is True and by_statistics(q.metrics)
        if weak and direct:
            names.append(q.a.node)
        if not (weak or (q.equal is True and _derived(q.a))):
            continue  # agreeing bitwise (or not judged, or differing): no path for a hidden difference
        if not q.a.inputs:
            if weak and q.a.kind in ("input", "param") and q.a.dtype == q.b.dtype and q.a.shape == q.b.shape \
                    and _beyond_rounding(q):
                given.append(q)
            continue
        stack.extend(((q.a.graph, q.a.stage, q.a.call, n), direct and not weak) for n in q.a.inputs)
    return names, given


def _beyond_rounding(q: Pair) -> bool:
    """Whether a pair's statistics differ by more than rounding noise would move them:
    :data:`~determ_backend.compare.verdict.KERNEL_ULPS` units in the last place of the dtype of the L2 norm
    (relative), of the largest magnitude (the min and max), or of the RMS size (the mean: rounding moves each element
    by a unit of its own size at most, so the mean by one of the mean magnitude).  A batch whose rows went through
    preprocessing that rounds apart (one unit) is no difference the run was given; a weight element 1e-2 off, or one
    of a million flipped in sign, is."""
    try:
        eps = torch.finfo(getattr(torch, str(q.a.dtype).replace("torch.", ""))).eps
    except (AttributeError, TypeError):
        return True
    ulps = KERNEL_ULPS * eps
    m, stats = q.metrics, [r.stats or {} for r in (q.a, q.b)]
    scale = max([abs(v) for st in stats for k, v in st.items() if k in ("min", "max")
                 and isinstance(v, (int, float)) and math.isfinite(v)] + [0.0])
    numel = math.prod(q.a.shape) if q.a.shape else 1
    rms = max([abs(st["l2"]) / math.sqrt(numel) for st in stats if isinstance(st.get("l2"), (int, float))
               and math.isfinite(st["l2"]) and numel] + [0.0])
    if isinstance(m.get("l2_rel"), (int, float)) and m["l2_rel"] > ulps:
        return True
    if isinstance(m.get("mean_diff"), (int, float)) and m["mean_diff"] > ulps * rms:
        return True
    return any(isinstance(m.get(k), (int, float)) and m[k] > ulps * scale for k in ("min_diff", "max_diff"))


def _counts(p: Pair, strict: bool) -> bool:
    return p.equal is False and p.paired and (strict or p.rec.dtype is None or is_float(p.rec.dtype))


def find_roots(pairs: List[Pair], mode: str, *, strict: bool = False,
               confirm: Optional[Confirm] = None) -> Comparison:
    """Apply the causal rule (module docstring) to already-judged ``pairs``."""
    by_id: Dict[tuple, Pair] = {p.a.key: p for p in pairs if p.a is not None}
    _inherit_views(pairs, by_id)
    groups: Dict[tuple, List[Pair]] = {}
    loose: Dict[tuple, List[Pair]] = {}  # records only one side has
    for p in pairs:
        (groups if p.paired else loose).setdefault(_group_key(p.rec), []).append(p)
    symptoms: List[Pair] = []
    candidates: List[Pair] = []
    unexplained: List[Pair] = []
    masked: List[Pair] = []
    for key, group in groups.items():
        g = _Graph(group, loose.get(key, ()))
        firsts = [p for p in group if p.equal is False and p.a.kind != "view" and g.inputs_agree(p)]
        if not g.has_deps:
            bad = [p for p in group if _counts(p, True)]
            symptoms.extend(bad)
            candidates.extend(firsts)
            continue
        bad = [p for p in g.outputs() if _counts(p, strict)]
        symptoms.extend(bad)
        live = g.live(bad) if bad else set()
        for p in group:
            if p.equal is False:
                p.reaches_output = id(p) in live
        here = [p for p in firsts if id(p) in live]
        masked.extend(p for p in firsts if id(p) not in live)
        # an op one run lacks is a root only between runs of one kind of program: against another stage (aot_eager
        # against inductor) the other run did not lack it, it fused it into a buffer that holds no node's value
        if bad and key in loose and all(p.a.stage == p.b.stage for p in group):
            for p in g.one_sided_roots(loose[key], live):
                p.metrics["only_in"] = "a" if p.a is not None else "b"
                here.append(p)
        if bad and not here:
            unexplained.append(next((p for p in group if id(p) in live and p.equal is False), bad[0]))
        candidates.extend(here)
    candidates = _not_after_earlier_divergence(candidates, symptoms, pairs)
    # memory allocated and never written holds whatever was there: two runs' differ, and while nothing failing reads
    # it that is no divergence at all (a masked note of garbage made every MoE model's index map look divergent)
    for p in [p for p in masked if is_allocation(p.rec)]:
        masked.remove(p)
        p.equal = True
        p.metrics["uninitialized"] = True
    roots = _given_differently(_confirmed(candidates, confirm, masked) if candidates else [], by_id)
    for p in roots:
        p.root_cause = True
    for p in masked:
        p.metrics.setdefault("masked", True)
        p.reaches_output = False
    order = {id(p): i for i, p in enumerate(pairs)}
    masked.sort(key=lambda p: order[id(p)])
    roots.sort(key=lambda p: order[id(p)])
    return Comparison(pairs, roots, mode, masked=masked, symptoms=symptoms, unexplained=unexplained)


def _not_after_earlier_divergence(candidates: List[Pair], symptoms: List[Pair], pairs: List[Pair]) -> List[Pair]:
    """The candidates, less the values that entered a graph call from outside it (its inputs and parameters) from an
    earlier graph call of the same rank that failed, where data flows from one to the other:

    * a backward's inputs (the activations its forward saved, the incoming gradients) when a forward call of its own
      graph failed before;
    * a forward's parameters when a backward call of its own graph failed before (an optimizer updated them from its
      wrong gradients);
    * any value that is, in both runs, the value of a differing record of an earlier failing call (a graph break's
      hand-over, a cache).

    A value of another graph with no such link (a second model's weight, a later batch of data) stays a root cause.
    Calls are ordered as the trace first holds them (``pairs`` follows it).  Each value passed on keeps the earlier
    call in its metrics (``after_earlier_divergence``)."""
    failing = {(p.rec.rank, _group_key(p.rec)) for p in symptoms}
    if not any(k[1] != _group_key(p.rec) for p in candidates for k in failing):
        return candidates
    order: Dict[tuple, int] = {}
    for p in pairs:
        order.setdefault(_group_key(p.rec), len(order))
    handed: Dict[tuple, tuple] = {}  # (rank, hash a, hash b) of a differing value of a failing call -> that call
    for p in pairs:
        if p.paired and p.equal is False and (p.rec.rank, _group_key(p.rec)) in failing and p.a.hash and p.b.hash:
            handed.setdefault((p.rec.rank, p.a.hash, p.b.hash), _group_key(p.rec))
    keep: List[Pair] = []
    for p in candidates:
        r = p.rec
        if not (p.paired and r.kind in ("input", "param") and not p.a.inputs and not p.b.inputs):
            keep.append(p)
            continue
        key = _group_key(r)
        graph, stage = key[0], key[1]
        here = order.get(key, 0)
        before = sorted((order.get(k, here), k) for rank, k in failing if rank == r.rank and order.get(k, here) < here)
        # a backward's inputs come from a forward of its graph, a forward's parameters from the gradients a backward of
        # its graph computed (a loop of forward calls alone hands no weight from one call to the next)
        own = [k for _, k in before if k[0] == graph and k[1].endswith("forward" if stage.endswith("backward")
                                                                       else "backward")]
        source = handed.get((r.rank, p.a.hash, p.b.hash))
        if source is not None and order.get(source, here) < here:
            link = source
        elif own and (stage.endswith("backward") or r.kind == "param"):
            link = own[-1]
        else:
            keep.append(p)
            continue
        p.metrics["after_earlier_divergence"] = " ".join(map(str, (link[0], link[1], "call", link[2])))
    return keep


_ALLOCATION = re.compile(r"^aten\.(new_)?empty(_like|_strided|_permuted)?\.|^uninitialized$")


def is_allocation(rec: Record) -> bool:
    """Whether ``rec`` is memory as allocated, never written (``empty_like``; inductor's read of such memory): the
    records' side of :func:`determ_backend.modes.ops.uninitialized`, which knows the operator itself."""
    return bool(rec.op and _ALLOCATION.match(rec.op))


def _confirmed(candidates: List[Pair], confirm: Optional[Confirm], masked: List[Pair]) -> List[Pair]:
    if confirm is None or not candidates:
        return candidates
    verdicts = list(confirm(candidates[:MAX_CONFIRM])) + [None] * max(0, len(candidates) - MAX_CONFIRM)
    keep = [p for p, v in zip(candidates, verdicts) if v is not False]
    if not keep:  # no single divergence explains the failure alone: they act together
        for p in candidates:
            p.metrics["joint"] = True
        return candidates
    masked.extend(p for p, v in zip(candidates, verdicts) if v is False)
    return keep


def compare_traces(a: Sequence[Record], b: Sequence[Record], tol: Optional[float] = None,
                   store_a: Optional[TensorStore] = None, store_b: Optional[TensorStore] = None,
                   pairs: Optional[List[Pair]] = None, strict: Optional[bool] = None) -> Comparison:
    """Align ``a`` with ``b``, judge every pair (bitwise, or within ``tol``), and apply the root-cause rule.
    ``strict`` (default: bitwise when ``tol`` is None) makes non-floating outputs count."""
    pairs = align(a, b) if pairs is None else pairs
    strict = tol is None if strict is None else strict
    for p in pairs:
        x, y = p.a, p.b
        if x is None or y is None or (x.kind == "view" and y.kind == "view" and x.hash is None):
            p.equal = None  # views are judged from their inputs in find_roots
            continue
        if x.hash is None and y.hash is None and not x.stats and not y.stats and not x.payload and not y.payload:
            p.equal = None  # nothing to judge on either side (a sparse or nested tensor): judged through its consumers
            continue
        p.equal, p.metrics = judge_records(x, y, tol, store_a, store_b, strict=strict)
    return find_roots(pairs, "bitwise" if tol is None else f"tol={tol:g}", strict=strict)
