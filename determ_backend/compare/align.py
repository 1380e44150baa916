"""Pairing the records of two traces.

:func:`align` pairs by ``(graph, stage, call, node)`` when the names line up, else by
sequence alignment of op signatures (one extra op, eager vs compiled, another
device's decomposition).  Judging a pair lives in :mod:`.verdict`; the root-cause
rule in :mod:`.roots`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from determ_backend.trace.stream import Record

__all__ = ["Pair", "align"]


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
        return pairs
    return _align_group(a, b)


def _align_group(a: Sequence[Record], b: Sequence[Record]) -> List[Pair]:
    if len(a) == len(b) and all(x.node == y.node and x.signature == y.signature for x, y in zip(a, b)):
        return [Pair(x, y) for x, y in zip(a, b)]
    return _align_by_sequence(a, b)


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
    return f"param|{r.node}" if r.kind == "param" else r.op


def _name(r: Record) -> str:
    return f"{r.node}|{r.op}"


def _located(records: Sequence[Record]) -> bool:
    """Whether the records are named after their source lines (the eager modes' ``op@file:function+k#n``)."""
    return any("@" in r.node for r in records)


def _align_by_sequence(a: Sequence[Record], b: Sequence[Record]) -> List[Pair]:
    # by full signature; inside a changed block, records of the same op pair in order, the rest stay unmatched
    by_signature = lambda x, y: _match(x, y, _signature, lambda x2, y2: _match(x2, y2, _op, _unmatched))  # noqa: E731
    if _located(a) and _located(b):
        # names after source lines are stable across runs (an op added elsewhere renames nothing, a run in another
        # dtype keeps every name): by name first.  FX and API names count calls, so one extra shifts them all.
        return _match(a, b, _name, by_signature)
    return by_signature(a, b)
