"""Where did the first NaN/Inf come from: the creation rule, one home for every tool.

A value is **created** non-finite when it holds a NaN or an Inf while every input of the
operation that produced it is finite; an operation whose input already holds one only
carries it along and is never blamed.  The backends' ``DETERM_CHECK=nan``, the eager
modes' ``check_nan`` and the API dump's overflow check all decide with :func:`creates`.

:class:`NonfiniteWatch` applies the rule to a stream of records (graph order, or op order),
using the nan/inf counts the trace's statistics already hold (no extra pass over the data);
:func:`causal_creations` keeps as root causes the creations of one graph call whose NaN/Inf
reaches an output of the graph holding a NaN (an intentional ``-inf`` attention mask, even one
a training graph saves for its backward, is a masked creation, not a finding); :class:`NanLedWatch`
does the same for a stream without outputs (the eager modes): a creation counts once a NaN comes of it.
:func:`first_created` applies it to the node values of an eager replay, to name the op inside
a fused kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence

import torch

__all__ = ["creates", "nonfinite", "nonfinite_count", "Creation", "NonfiniteWatch", "NanLedWatch",
           "Causal", "causal_creations",
           "first_created", "value_range", "input_ranges"]


def nonfinite_count(stats: Optional[Mapping[str, Any]]) -> Optional[int]:
    """NaN plus Inf elements per a record's statistics; None when the statistics are not known."""
    if not stats or "nan" not in stats:
        return None
    return int(stats.get("nan") or 0) + int(stats.get("inf") or 0)


def creates(output_nonfinite: bool, inputs_nonfinite: Iterable[Optional[bool]]) -> bool:
    """The rule: an output holds NaN/Inf while every input is known to be finite (None: not known)."""
    return bool(output_nonfinite) and all(x is False for x in inputs_nonfinite)


@dataclass
class Creation:
    """A record whose value was created non-finite, with what its inputs held."""

    record: Any
    nan: int
    inf: int
    inputs: List[Dict[str, Any]] = field(default_factory=list)
    """``{"node", "min", "max"}`` of each input record (their ranges show how the creation happened)."""


def value_range(stats: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    out = {"min": (stats or {}).get("min"), "max": (stats or {}).get("max")}
    if (stats or {}).get("view"):
        out["view"] = True
    return out


def input_ranges(inputs: Sequence[Mapping[str, Any]]) -> str:
    """A creation's inputs for a log line: ``sub in [-1.3, 0.56], ...`` (``no inputs`` when it has none); a view,
    whose values are not read, by the range of the values it views: ``view within [-0.8, 1.06]``."""
    return ", ".join(f"{i['node']} {'within' if i.get('view') else 'in'} [{i.get('min')}, {i.get('max')}]"
                     for i in inputs) or "no inputs"


class NonfiniteWatch:
    """The creation rule over a stream of records (graph order, or op order for the eager modes).

    A record whose inputs are all known and finite is a creation.  A record without statistics (a view,
    whose data is its base's) holds what its inputs hold.  One with an input not known (not
    traced, or produced so long ago that it was forgotten) is a creation only when nothing before it held
    a NaN/Inf: it cannot have come from elsewhere.  Inputs that arrive non-finite (``input``/``param``
    records) are not creations (the value came from outside).  Memory is bounded: the counts of the
    most recent ``limit`` records are kept."""

    def __init__(self, limit: int = 1 << 16):
        self.limit = limit
        self._seen: Dict[str, Any] = {}  # node -> its statistics (None: not known), most recent last
        self.seen_nonfinite = False

    def feed(self, records: Iterable[Any]) -> List[Creation]:
        """The creations among ``records`` (which follow the ones fed before)."""
        out: List[Creation] = []
        seen = self._seen
        for r in records:
            n = nonfinite_count(r.stats)
            if n is None and r.inputs and r.kind not in ("input", "param"):
                # no statistics: a view (its data is its base's) -- it holds what its inputs hold, when known
                known = [seen.get(name) for name in r.inputs]
                if all(nonfinite_count(k) is not None for k in known):
                    seen[r.node] = {"nan": sum(int(k.get("nan") or 0) for k in known),
                                    "inf": sum(int(k.get("inf") or 0) for k in known), "view": True}
                    lows, highs = [k.get("min") for k in known], [k.get("max") for k in known]
                    if None not in lows and None not in highs:  # its values are among those it views
                        seen[r.node].update(min=min(lows), max=max(highs))
                    self.seen_nonfinite = self.seen_nonfinite or bool(nonfinite_count(seen[r.node]))
                    continue
            seen[r.node] = r.stats
            if not n:
                continue
            if r.kind in ("input", "param"):
                self.seen_nonfinite = True
                continue
            held = [None if k is None else k > 0 for k in (nonfinite_count(seen.get(name)) for name in r.inputs)]
            if any(held):  # carried along from an input
                self.seen_nonfinite = True
                continue
            if creates(True, held) or not self.seen_nonfinite:
                st = r.stats or {}
                out.append(Creation(r, int(st.get("nan") or 0), int(st.get("inf") or 0),
                                    [dict(node=name, **value_range(seen.get(name))) for name in r.inputs]))
            self.seen_nonfinite = True
        if len(seen) > self.limit:
            for k in list(seen)[: len(seen) - self.limit // 2]:
                del seen[k]
        return out

    def holds(self, node: str) -> Optional[int]:
        """NaN plus Inf elements of a record fed (None: not known, or forgotten)."""
        return nonfinite_count(self._seen.get(node))

    def nans(self, node: str) -> int:
        """NaN elements of a record fed (0 when not known)."""
        return int((self._seen.get(node) or {}).get("nan") or 0)


class NanLedWatch:
    """:class:`NonfiniteWatch` for a stream with no graph outputs (the eager modes): the creations that lead to a
    NaN, as :func:`causal_creations` keeps them for a graph.  A creation holding a NaN is one at once; one holding
    only an Inf (an intentional ``-inf`` attention mask, an Inf that a relu's backward drops) is one once a record
    holding a NaN descends from it through records holding a NaN or an Inf, and until then it is :attr:`masked`."""

    _ORIGINS = 16  # pending creations remembered per record (a record descends from few)

    def __init__(self, limit: int = 1 << 16):
        self.watch = NonfiniteWatch(limit)
        self._pending: Dict[str, Creation] = {}  # node -> an Inf-only creation no NaN descends from yet
        self._origins: Dict[str, tuple] = {}  # node of a record holding NaN/Inf -> the pending creations it carries

    @property
    def masked(self) -> List[Creation]:
        """Inf-only creations from which no NaN has descended (so far)."""
        return list(self._pending.values())

    def feed(self, records: Iterable[Any]) -> List[Creation]:
        """The creations that lead to a NaN, as they become known (in the order they do)."""
        out: List[Creation] = []
        watch, origins, pending = self.watch, self._origins, self._pending
        for r in records:
            found = watch.feed([r])
            if found:
                c = found[0]
                if c.nan:
                    out.append(c)
                else:
                    pending[r.node] = c
                    origins[r.node] = (r.node,)
                continue
            if not watch.holds(r.node):
                continue
            carried = tuple(dict.fromkeys(o for i in r.inputs for o in origins.get(i, ()) if o in pending))
            if watch.nans(r.node):
                out.extend(pending.pop(o) for o in carried)
            elif carried:
                origins[r.node] = carried[: self._ORIGINS]
        if len(origins) > watch.limit:
            for k in list(origins)[: len(origins) - watch.limit // 2]:
                del origins[k]
        if len(pending) > watch.limit:
            for k in list(pending)[: len(pending) - watch.limit // 2]:
                del pending[k]
        return out


class Causal(NamedTuple):
    """What :func:`causal_creations` finds in one graph call."""

    roots: List[Creation]  # creations whose NaN/Inf reaches an output of the graph that holds a NaN
    masked: List[Creation]  # creations that reach none: created, but harmless here
    sources: List[Any]  # ``input``/``param`` records holding a NaN/Inf that reaches such an output


def causal_creations(records: Sequence[Any], is_output: Callable[[Any], bool]) -> Causal:
    """The creations of one graph call whose NaN/Inf reaches an output of the graph that holds a NaN (walking
    back through records that hold a NaN or an Inf: ``roots``), those that reach none (``masked``: an Inf that a
    softmax turns into 0, a NaN a ``where`` drops, an Inf mask saved for the backward), and the ``input``/``param``
    records whose NaN/Inf reaches such an output (``sources``: where a NaN came from when the graph created none,
    a weight that holds an Inf).  One walk for all three."""
    watch = NonfiniteWatch(limit=max(1 << 16, 2 * len(records)))
    found = watch.feed(records)
    by_node = {r.node: r for r in records}
    live: set = set()
    # the symptom is a NaN at an output: an Inf alone is often meant (an attention mask a training graph saves
    # for its backward); an Inf that turns into a NaN downstream is reached through that NaN
    todo = [r.node for r in records if is_output(r) and watch.nans(r.node)]
    while todo:
        name = todo.pop()
        if name in live:
            continue
        live.add(name)
        r = by_node.get(name)
        if r is not None:
            todo.extend(i for i in r.inputs if watch.holds(i))
    return Causal(roots=[c for c in found if c.record.node in live],
                  masked=[c for c in found if c.record.node not in live],
                  sources=[r for r in records if r.kind in ("input", "param") and r.node in live])


def _leaves(values: Iterable[Any], out: List[Any]) -> List[Any]:
    for v in values:
        if isinstance(v, (list, tuple)):
            _leaves(v, out)
        else:
            out.append(v)
    return out


def nonfinite(values: Iterable[Any]) -> bool:
    """Whether any value (tensors on any device, nested lists/tuples, floats) holds a NaN or an Inf.  Tensors
    are read with ``aminmax`` (a NaN or an Inf shows in the minimum or maximum): one host transfer per device."""
    leaves = _leaves(values, [])
    if any(isinstance(v, float) and not math.isfinite(v) for v in leaves):
        return True
    by_dev: Dict[Any, List[torch.Tensor]] = {}
    for t in leaves:
        if not (isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.numel()
                and t.layout == torch.strided and t.device.type != "meta"):
            continue
        x = t.detach()
        if x.is_complex():
            x = torch.view_as_real(x)
        if x.element_size() == 1:
            x = x.float()
        mn, mx = torch.aminmax(x.reshape(-1))
        by_dev.setdefault(x.device, []).append(torch.stack([mn.double(), mx.double()]))
    return any(not all(math.isfinite(v) for v in torch.stack(rs).reshape(-1).cpu().tolist())
               for rs in by_dev.values())


def first_created(gm: Any, values: Mapping[str, Any], among: Optional[Iterable[str]] = None) -> Optional[Any]:
    """The first FX node of ``gm`` (graph order; only nodes named in ``among`` when given) whose value in
    ``values`` (an eager replay) was created non-finite by :func:`creates`; None when there is none."""
    wanted = set(among) if among is not None else None
    for node in gm.graph.nodes:
        if node.op != "call_function" or (wanted is not None and node.name not in wanted):
            continue
        if node.name not in values:
            continue
        ins = [values.get(a.name) for a in node.all_input_nodes]
        if creates(nonfinite([values[node.name]]), (nonfinite([v]) for v in ins)):
            return node
    return None
