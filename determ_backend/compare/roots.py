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
* A divergence that reaches no failing output is a **masked** note, never a root
  cause.  When the caller can replay the reference with one compiled value
  substituted (``confirm``), a candidate whose substitution alone leaves every
  output within tolerance is masked too (the divergence is absorbed downstream,
  e.g. a wrong boolean mask under ``where(b, x, x)``).

Pairing lives in :mod:`.align`, the verdict on one pair in :mod:`.verdict`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from determ_backend.trace.store import TensorStore
from determ_backend.trace.stream import Record
from determ_backend.compare.align import Pair, align
from determ_backend.compare.verdict import is_float, judge_records

__all__ = ["Comparison", "describe", "pair_row", "find_roots", "compare_traces", "is_output", "Confirm", "MAX_CONFIRM"]

Confirm = Callable[[List[Pair]], List[Optional[bool]]]
"""Given candidate root pairs, for each: True (its value alone makes an output fail), False (it
alone leaves the outputs within tolerance: masked), None (cannot tell)."""

_MAX_NOTES = 20
MAX_CONFIRM = 8
"""Candidates a ``confirm`` callback is asked about (each costs it a replay); later ones stand."""


def is_output(rec: Record) -> bool:
    """Whether ``rec`` is (or is returned as) an output of its graph."""
    return rec.kind == "output" or bool((rec.extra or {}).get("outputs") is not None)


@dataclass
class Comparison:
    pairs: List[Pair]
    root_causes: List[Pair]
    mode: str
    masked: List[Pair] = field(default_factory=list)
    """First divergences that reach no failing output (notes, never root causes)."""
    symptoms: List[Pair] = field(default_factory=list)
    """The failing outputs (or, without dependency information, every divergence)."""

    @property
    def identical(self) -> bool:
        return all(p.equal for p in self.pairs)

    @property
    def divergent(self) -> bool:
        """A finding: some output fails the verdict."""
        return bool(self.symptoms)

    @property
    def first_divergence(self) -> Optional[Pair]:
        if self.root_causes:
            return self.root_causes[0]
        return self.symptoms[0] if self.symptoms else None

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
        if ins.get("node"):
            d["kernel"]["record_metrics"] = d["metrics"]
            d.update({k: ins[k] for k in ("node", "op", "source", "metrics", "dtype", "shape") if k in ins})
    if other is not None and other.node != r.node:
        d["node_b"] = other.node
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


class _Graph:
    """The judged pairs of one graph call, as a dependency graph."""

    def __init__(self, pairs: List[Pair]):
        self.pairs = pairs
        self.by_node: Dict[str, Pair] = {}
        for p in pairs:
            self.by_node.setdefault(p.rec.node, p)
        self.has_deps = any(p.rec.inputs for p in pairs)
        self._eff: Dict[int, List[Optional[bool]]] = {}

    def inputs(self, p: Pair) -> List[Optional[Pair]]:
        return [self.by_node.get(n) for n in p.rec.inputs]

    def outputs(self) -> List[Pair]:
        outs = [p for p in self.pairs if is_output(p.rec)]
        if outs or not self.has_deps:
            return outs
        consumed = {n for p in self.pairs for n in p.rec.inputs}
        return [p for p in self.pairs if p.rec.node not in consumed]  # sinks stand for the outputs

    def effective(self, p: Pair, seen: Optional[set] = None) -> List[Optional[bool]]:
        """Verdicts of ``p``'s inputs, looking through unjudged records to the nearest judged ones."""
        key = id(p)
        if key in self._eff:
            return self._eff[key]
        seen = set() if seen is None else seen
        seen.add(key)
        out: List[Optional[bool]] = []
        for q in self.inputs(p):
            if q is None:
                out.append(None)
            elif q.equal is not None or not q.rec.inputs:
                out.append(q.equal if q.equal is not None else (True if q.rec.kind in ("input", "param") else None))
            elif id(q) in seen:
                out.append(None)
            else:
                out.extend(self.effective(q, seen))
        self._eff[key] = out
        return out

    def inputs_agree(self, p: Pair) -> bool:
        if p.inputs_equal is not None:
            return p.inputs_equal
        a, b = p.a, p.b
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


def _inherit_views(pairs: List[Pair], by_id: Dict[tuple, Pair]) -> None:
    for p in pairs:
        if p.paired and p.a.kind == "view" and p.equal is None:
            verdicts = [by_id[(p.a.graph, p.a.stage, p.a.call, n)].equal for n in p.a.inputs
                        if (p.a.graph, p.a.stage, p.a.call, n) in by_id]
            if verdicts and all(v is True for v in verdicts):
                p.equal = True
            elif any(v is False for v in verdicts):
                p.equal, p.metrics = False, {"inherited_view": True}


def _counts(p: Pair, strict: bool) -> bool:
    return p.equal is False and p.paired and (strict or p.rec.dtype is None or is_float(p.rec.dtype))


def find_roots(pairs: List[Pair], mode: str, *, strict: bool = False,
               confirm: Optional[Confirm] = None) -> Comparison:
    """Apply the causal rule (module docstring) to already-judged ``pairs``."""
    by_id: Dict[tuple, Pair] = {p.a.key: p for p in pairs if p.a is not None}
    _inherit_views(pairs, by_id)
    groups: Dict[tuple, List[Pair]] = {}
    for p in pairs:
        if p.paired:
            groups.setdefault(_group_key(p.rec), []).append(p)
    symptoms: List[Pair] = []
    candidates: List[Pair] = []
    masked: List[Pair] = []
    for group in groups.values():
        g = _Graph(group)
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
        if bad and not here:
            here = [next((p for p in group if id(p) in live and p.equal is False), bad[0])]
        candidates.extend(here)
    roots = _confirmed(candidates, confirm, masked) if candidates else []
    for p in roots:
        p.root_cause = True
    for p in masked:
        p.metrics.setdefault("masked", True)
        p.reaches_output = False
    order = {id(p): i for i, p in enumerate(pairs)}
    masked.sort(key=lambda p: order[id(p)])
    return Comparison(pairs, roots, mode, masked=masked, symptoms=symptoms)


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
        p.equal, p.metrics = judge_records(x, y, tol, store_a, store_b, strict=strict)
    return find_roots(pairs, "bitwise" if tol is None else f"tol={tol:g}", strict=strict)
