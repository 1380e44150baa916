"""Pairing the records of two traces.

:func:`align` pairs by ``(graph, stage, call, node)`` when the names line up, else by
sequence alignment of op signatures (one extra op, eager vs compiled, another
device's decomposition).  Judging a pair lives in :mod:`.verdict`; the root-cause
rule in :mod:`.roots`.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from determ_backend.compare.verdict import is_float
from determ_backend.trace.stream import Record

__all__ = ["Pair", "align", "carries"]


@dataclass
class Pair:
    """Two records of the same value (either may be missing), the verdict on them and its metrics."""

    a: Optional[Record]
    b: Optional[Record]
    equal: Optional[bool] = None
    """True agree, False differ, None not judged (a view, a partial buffer, a value not compared)."""
    metrics: Dict[str, Any] = field(default_factory=dict)
    root_cause: bool = False
    inputs_equal: Optional[bool] = None
    """The verdict on the inputs when the caller judged them itself (an API dump holds every call's
    arguments); None: from the records' dependency links."""
    inside: Optional[Dict[str, Any]] = None
    """A root narrowed inside its fused kernel (:mod:`determ_backend.backends.narrow`): ``kernel``, ``region`` and,
    when one node of the region diverges alone, its ``node``, ``op``, ``source`` and ``metrics``."""
    reaches_output: Optional[bool] = None
    """For a differing pair in a graph with dependency links, set by the root-cause rule: whether a chain of
    differing (or unjudged) values leads from it to a failing output (False: a masked divergence)."""

    @property
    def rec(self) -> Record:
        return self.a if self.a is not None else self.b  # type: ignore[return-value]

    @property
    def paired(self) -> bool:
        return self.a is not None and self.b is not None


_CARRIES = frozenset({"aten._to_copy", "aten.to", "aten.clone", "aten.detach", "aten.alias", "aten.lift_fresh",
                      "aten.lift_fresh_copy", "aten.contiguous", "aten.view", "aten._unsafe_view", "aten.reshape",
                      "aten.t", "aten.transpose", "aten.permute", "aten.expand", "aten.squeeze", "aten.unsqueeze",
                      "prims.convert_element_type"})


def carries(r: Record) -> bool:
    """Whether ``r`` holds its one input's values, converted, copied or re-viewed."""
    op = r.op or ""
    base = op.rsplit(".", 1)[0] if op.count(".") >= 2 else op
    return base in _CARRIES and len(r.inputs) == 1


# views that hold part of their input's values (no value of their own: never where two runs part)
_SUBSET_VIEWS = frozenset({"aten.select", "aten.slice", "aten.narrow", "aten.as_strided", "aten.diagonal",
                           "aten.unfold", "aten.split", "aten.split_with_sizes", "aten.unbind", "aten.chunk"})


def re_views(r: Record) -> bool:
    """Whether ``r`` only re-views part or all of its one input (``w[0]``, a slice, any record marked a view or
    whose fingerprint is derived from its input's)."""
    if len(r.inputs) != 1:
        return False
    if r.kind == "view" or (r.extra or {}).get("derived_hash"):
        return True
    op = r.op or ""
    base = op.rsplit(".", 1)[0] if op.count(".") >= 2 else op
    return base in _SUBSET_VIEWS


def _groups(records: Sequence[Record]) -> Dict[tuple, List[Record]]:
    out: Dict[tuple, List[Record]] = {}
    for r in records:
        out.setdefault((r.graph, r.stage, r.call), []).append(r)
    return out


def align(a: Sequence[Record], b: Sequence[Record]) -> List[Pair]:
    """Pair the records of two traces, in the order of ``a``.

    Graph calls present in both traces are aligned call by call; inside a call,
    records pair by name when the two sides have the same structure, else by
    sequence alignment of op signatures (so one extra or missing op shifts
    nothing).  When the calls do not correspond at all (eager vs compiled,
    another device's graph), the whole traces are sequence-aligned.
    """
    ga, gb = _groups(a), _groups(b)
    if ga and set(ga) == set(gb):
        pairs: List[Pair] = []
        for key, recs in ga.items():
            pairs.extend(_align_group(recs, gb[key]))
        return _apart(pairs, _holds_alike)
    # other stages (an aot_eager trace against an inductor one, eager against compiled): the graphs differ, so
    # only records of one source line are taken for one value (a mul of the next line is not "the" mul)
    sourced = {k[1] for k in ga} != {k[1] for k in gb}
    pairs = _align_group(a, b, sourced)
    return _apart(pairs, _same_source if sourced else _holds_alike)


def _holds_alike(x: Record, y: Record) -> bool:
    """Whether the two records hold the same kind of value: an inductor buffer labelled ``holds`` (``partial``: a
    ``mean`` realized as the undivided sum) is never the value of a record without that label."""
    return (x.extra or {}).get("holds") == (y.extra or {}).get("holds")


_LINE = re.compile(r"^(.*?:\d+)")


def _line(source: Optional[str]) -> Optional[str]:
    """``file:line`` of a record's source: compiled traces add what runs there (``m.py:37 (forward)``), eager ones
    do not."""
    m = _LINE.match(source) if source else None
    return m.group(1) if m else source


def _same_source(x: Record, y: Record) -> bool:
    return _holds_alike(x, y) and (x.source is None or y.source is None or _line(x.source) == _line(y.source))


def _apart(pairs: List[Pair], alike: Callable[[Record, Record], bool]) -> List[Pair]:
    """``pairs`` with each pair whose records are not ``alike`` split into two records that pair with nothing."""
    if all(not p.paired or alike(p.a, p.b) for p in pairs):
        return pairs
    out: List[Pair] = []
    for p in pairs:
        if p.paired and not alike(p.a, p.b):
            out += [Pair(p.a, None), Pair(None, p.b)]
        else:
            out.append(p)
    return out


def _align_group(a: Sequence[Record], b: Sequence[Record], sourced: bool = False) -> List[Pair]:
    if len(a) == len(b) and all(x.node == y.node and x.signature == y.signature for x, y in zip(a, b)):
        return [Pair(x, y) for x, y in zip(a, b)]
    pairs = _by_inputs(_align_by_sequence(a, b, sourced))
    return _same_name_other_shape(pairs) if _located(a) and _located(b) else pairs


def _same_name_other_shape(pairs: List[Pair]) -> List[Pair]:
    """Pair the records of one name left alone because their shapes differ, or because they came in another order,
    when they consume the same values (the partners of A's record's inputs are B's record's inputs; a record of no
    inputs: the same dtype, shape and fingerprint): one value computed to another shape (a slice one row longer), a
    divergence to report, not two ops each run ran alone; the same allocation made at another moment (the tensors a
    ``DataLoader`` rebuilds from its workers' batches, in the order they arrive).  A name that moved to a value made
    from other inputs (an extra call renumbered the names after it) stays unpaired."""
    lone_b = {p.b.node: p for p in pairs if p.a is None and p.b is not None}
    if not lone_b:
        return pairs
    partner = {p.a.node: p.b.node for p in pairs if p.paired}
    for p in pairs:
        a = p.a
        if a is None or p.b is not None:
            continue
        q = lone_b.get(a.node)
        if q is None or q.b.op != a.op or tuple(partner.get(n) for n in a.inputs) != tuple(q.b.inputs):
            continue
        if not a.inputs and (a.hash is None or (a.hash, a.dtype, a.shape) != (q.b.hash, q.b.dtype, q.b.shape)):
            continue
        p.b, q.b = q.b, None
        del lone_b[a.node]
        partner[a.node] = p.b.node
    _same_value_inputs(pairs)
    return [p for p in pairs if p.a is not None or p.b is not None]


def _same_value_inputs(pairs: List[Pair]) -> None:
    """Pair the lone records of no inputs (a tensor entering the run) that hold the one same value on each side,
    whatever their names: a weight is named after the line that first reads it, which an extra op of one run (a
    poke at it, ``w[0, 0] += e``) moves."""
    def key(r: Record) -> Optional[tuple]:
        return (r.op, r.hash, r.dtype, tuple(r.shape or ())) if not r.inputs and r.hash is not None else None

    lone_a: Dict[tuple, List[Pair]] = {}
    lone_b: Dict[tuple, List[Pair]] = {}
    for p in pairs:
        side, rec = (lone_a, p.a) if p.b is None else (lone_b, p.b) if p.a is None else (None, None)
        k = key(rec) if rec is not None else None
        if k is not None:
            side.setdefault(k, []).append(p)
    for k, found in lone_a.items():
        other = lone_b.get(k)
        if len(found) == 1 and other is not None and len(other) == 1:  # only where the value says which is which
            found[0].b, other[0].b = other[0].b, None


class _Side:
    """One trace's records of a group, for :func:`_by_inputs`: by name, and names looked through the conversions,
    copies and views only this side has (a float64 run's ``.to(float32)``)."""

    def __init__(self, recs: Sequence[Record], paired: set):
        self.by_node = {r.node: r for r in recs}
        self.paired = paired  # ids of the records that have a partner

    def source(self, name: str) -> str:
        seen = set()
        r = self.by_node.get(name)
        while r is not None and id(r) not in self.paired and carries(r) and name not in seen:
            seen.add(name)
            name = r.inputs[0]
            r = self.by_node.get(name)
        return name

    def sources(self, r: Record) -> tuple:
        return tuple(self.source(n) for n in r.inputs)


_NEAR = 16
"""Records of the same op and shape, nearest the current partner, tried for an op in between."""
_WALK = 64
"""Records of B alone walked back through, looking for what a record's partner consumes."""


def _by_inputs(pairs: List[Pair]) -> List[Pair]:
    """Mend pairs the sequence alignment got wrong, by the dependency links: a record whose partner does not consume
    the partners of its inputs is paired instead with the other side's record of the same op and shape that does
    (when one does, and its own partner, if any, does not), or that consumes them with one op of its own run in
    between (then that op, which sequence alignment had taken for A's record, is left to its run); when none does and
    its partner consumes none of them either, the two are left unpaired.  Records of one op
    and shape repeat along a graph (every layer's adds); one extra or missing record nearby, which sequence alignment
    cannot place, then shifts them."""
    if not any(p.rec.inputs for p in pairs):
        return pairs
    a_side = _Side([p.a for p in pairs if p.a is not None], {id(p.a) for p in pairs if p.paired})
    b_side = _Side([p.b for p in pairs if p.b is not None], {id(p.b) for p in pairs if p.paired})
    pair_of_a = {p.a.node: p for p in pairs if p.a is not None}
    pair_of_b = {p.b.node: p for p in pairs if p.b is not None}
    index: Dict[tuple, List[Record]] = {}
    alike: Dict[tuple, List[Record]] = {}  # (op, shape) -> B's records, in order
    where: Dict[str, int] = {}
    for i, r in enumerate(b_side.by_node.values()):
        where[r.node] = i
        if r.inputs:
            index.setdefault((r.op, str(r.shape), b_side.sources(r)), []).append(r)
            alike.setdefault((r.op, str(r.shape)), []).append(r)

    def wanted(a: Record) -> Optional[tuple]:
        out = []
        for n in a_side.sources(a):
            p = pair_of_a.get(n)
            if p is None or p.b is None:
                return None
            out.append(p.b.node)
        return tuple(out)

    def consistent(a: Record, b: Optional[Record]) -> bool:
        return b is not None and wanted(a) == b_side.sources(b)

    def one_op_between(want: tuple, cand: Record) -> bool:
        """Whether ``cand`` consumes the wanted inputs, one or more of them through one op B has in between (a
        forward hook's add on B's path), at least one of them directly."""
        src = b_side.sources(cand)
        if len(src) != len(want) or not any(w == x for w, x in zip(want, src)):
            return False
        for w, x in zip(want, src):
            r = b_side.by_node.get(x)
            if w != x and (r is None or w not in b_side.sources(r)):
                return False
        return True

    def only_b_between(want: tuple, cand: Record) -> bool:
        """Whether every record ``cand`` reads in place of a wanted one is a record of B alone (no partner in A)."""
        for w, x in zip(want, b_side.sources(cand)):
            q = pair_of_b.get(x)
            if w != x and q is not None and q.a is not None:
                return False
        return True

    def candidates(a: Record, want: tuple, near: Optional[Record]):
        yield from index.get((a.op, str(a.shape), want), ())
        same = alike.get((a.op, str(a.shape)), ())
        if near is not None and same:  # the records of this op next to the current partner, nearest first
            at = where.get(near.node, 0)
            yield from (c for c in sorted(same, key=lambda c: abs(where[c.node] - at))[:_NEAR]
                        if one_op_between(want, c))

    def reaches(want: tuple, b: Record) -> bool:
        """Whether ``b`` consumes one of the wanted inputs, directly or through records only B has (the ops a
        forward hook adds on B's path): a walk back that stops at records with a partner in A."""
        wanted_names, todo, seen = set(want), list(b_side.sources(b)), set()
        while todo and len(seen) < _WALK:
            n = todo.pop()
            if n in wanted_names:
                return True
            if n in seen:
                continue
            seen.add(n)
            q = pair_of_b.get(n)
            r = b_side.by_node.get(n)
            if r is not None and (q is None or q.a is None):
                todo.extend(b_side.sources(r))
        return False

    extra: Dict[int, List[Pair]] = {}  # id(pair) -> records of B left without a partner, placed after it
    for p in pairs:
        a = p.a
        if a is None or not a.inputs or consistent(a, p.b):
            continue
        want = wanted(a)
        if want is None or (p.b is not None and one_op_between(want, p.b) and only_b_between(want, p.b)):
            # the partner consumes them through one op only its own run has (a forward hook's add): as good a partner
            # as any candidate, and a multi-output op's outputs of one shape (a layer norm's mean and rstd) must not
            # trade
            continue
        mended = False
        for cand in candidates(a, want, p.b):
            q = pair_of_b[cand.node]
            if q is p or (q.a is not None and consistent(q.a, cand)):
                continue
            q.b = None  # its A record (if any) is left without a partner; a record that stood alone is dropped
            if p.b is not None:
                extra.setdefault(id(p), []).append(Pair(None, p.b))
                pair_of_b[p.b.node] = extra[id(p)][-1]
            p.b = cand
            pair_of_b[cand.node] = p
            mended = True
            break
        if not mended and p.b is not None and want and not reaches(want, p.b):
            # no record of B consumes what A's record consumed, and its partner consumes none of it, not even through
            # ops of its own run alone (one name, two values: a checkpointed run's recomputed forward takes the names
            # of the other run's backward ops): not one value, so no divergence -- each is a record its run alone has
            extra.setdefault(id(p), []).append(Pair(None, p.b))
            pair_of_b[p.b.node] = extra[id(p)][-1]
            p.b = None
    out: List[Pair] = []
    for p in pairs:
        if p.a is not None or p.b is not None:
            out.append(p)
        out.extend(q for q in extra.get(id(p), ()) if q.b is not None and pair_of_b.get(q.b.node) is q)
    return out


def _match(a: Sequence[Record], b: Sequence[Record], key: Callable[[Record], str],
           changed: Callable[[Sequence[Record], Sequence[Record]], List[Pair]]) -> List[Pair]:
    """Pair equal runs of ``key`` by sequence alignment; hand each changed block to ``changed``."""
    pairs: List[Pair] = []
    matcher = difflib.SequenceMatcher(None, [key(r) for r in a], [key(r) for r in b], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            pairs.extend(Pair(a[i], b[j]) for i, j in zip(range(i1, i2), range(j1, j2)))
        else:
            pairs.extend(changed(a[i1:i2], b[j1:j2]))
    return pairs


def _unmatched(a: Sequence[Record], b: Sequence[Record]) -> List[Pair]:
    return [Pair(r, None) for r in a] + [Pair(None, r) for r in b]


def _signature(r: Record) -> str:
    # a parameter is one named tensor: it pairs only with the parameter of that name (by signature alone, every
    # parameter of a shape would stand in for every other)
    return f"{r.signature}|{r.node}" if r.kind == "param" else r.signature


def _op(r: Record) -> str:
    # values of different shapes are never one value: they stay unmatched rather than pair into a false divergence
    return f"param|{r.node}" if r.kind == "param" else f"{r.op}|{r.shape}"


def _name(r: Record) -> str:
    # the shape too: one extra call in a run renumbers the calls after it (``#0`` becomes ``#1``), and a name that
    # moved to a value of another shape is another value (a weight paired with an input as a false divergence)
    return f"{r.node}|{r.op}|{r.shape}"


def _located(records: Sequence[Record]) -> bool:
    """Whether the records are named after their source lines (the eager modes' ``op@file:function+k#n``)."""
    return any("@" in r.node for r in records)


def _float_dtypes(records: Sequence[Record]) -> set:
    return {r.dtype for r in records if r.dtype and is_float(r.dtype)}


def _any_float(r: Record) -> str:
    """:func:`_signature` with every floating dtype spelled alike."""
    if r.dtype and is_float(r.dtype):
        return f"{r.kind}|{r.op}|float|{r.shape}|{r.node}" if r.kind == "param" else f"{r.kind}|{r.op}|float|{r.shape}"
    return _signature(r)


def _align_by_sequence(a: Sequence[Record], b: Sequence[Record], sourced: bool = False) -> List[Pair]:
    # by full signature; inside a changed block, records of the same op and shape pair in order, the rest stay
    # unmatched.
    # Runs that computed in different floating dtypes (float32 against float64, bfloat16 against float32) share
    # no float signature: there the floating dtype is left out, or every value would pair by op in order and
    # one extra cast would shift every pair after it.
    sig = _any_float if _float_dtypes(a) != _float_dtypes(b) else _signature
    op = _op
    if sourced:  # ``sourced``: records of one source line only (see :func:`align`)
        sig, op = (lambda r, f=sig: f"{_line(r.source)}|{f(r)}"), (lambda r: f"{_line(r.source)}|{_op(r)}")
    by_signature = lambda x, y: _match(x, y, sig, lambda x2, y2: _match(x2, y2, op, _unmatched))  # noqa: E731
    if _located(a) and _located(b):
        # names after source lines are stable across runs (an op added elsewhere renames nothing, a run in another
        # dtype keeps every name): by name first.  FX and API names count calls, so one extra shifts them all.
        return _match(a, b, _name, by_signature)
    return by_signature(a, b)
