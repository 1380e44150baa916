"""Truncate suffix: the shortest failing prefix of the graph, by binary search over cut points.

The node whose addition makes the prefix fail is the culprit guess; the pass
then tries that node alone (its inputs as placeholders), one more query.
"""

from __future__ import annotations

from dataclasses import replace

from repro_tools.minify.reducer import Reducer

__all__ = ["truncate_suffix"]


def _cut_around(r: Reducer, name: str) -> frozenset:
    """The node plus, for a multi-output op, the getitems that unpack it."""
    extra = [u for u in r.view.users_of(name) if r.view.is_getitem(u)] if not r.view.is_tensor(name) else []
    return frozenset([name, *extra])


def truncate_suffix(r: Reducer) -> bool:
    order = [n for n in r.view.compute if n in r.current.keep]
    if len(order) < 2:
        return False
    before = r.view.size(r.current)
    lo, hi = 1, len(order)  # the whole current candidate (order[:hi]) fails
    while lo < hi:
        mid = (lo + hi) // 2
        if r.consider(replace(r.current, keep=frozenset(order[:mid]), outputs=None)):
            hi = mid
        else:
            lo = mid + 1
    r.culprit = order[hi - 1]
    if len(r.current.keep) > 1:
        r.consider(replace(r.current, keep=_cut_around(r, r.culprit), outputs=None))
    return r.view.size(r.current) < before
