"""Dependency-respecting delta debugging over nodes, ProbDD-style.

Each node carries a probability of being needed for the failure.  Every step
removes the set of least-likely-needed nodes that maximizes the expected number
of nodes removed, ``|R| * prod(1 - p)``; removing a node turns it into a
placeholder for its users (and kills producers nothing else needs).  A failed
step raises the probabilities of the nodes it tried, ``p <- p / (1 - prod(1 - p))``
(a node tried alone becomes certain).  Far fewer queries than plain ddmin on
inputs where most nodes are irrelevant (Wang et al., "Probabilistic Delta
Debugging", FSE 2021).
"""

from __future__ import annotations

import math
from typing import Dict, List

from repro_tools.minify.reducer import Reducer

__all__ = ["remove_nodes_probdd"]


def _pick(alive: List[str], p: Dict[str, float]) -> List[str]:
    ranked = sorted(alive, key=lambda n: p[n])  # stable: ties keep graph order
    best, best_gain, keep_prob = ranked[:1], 0.0, 1.0
    for k, n in enumerate(ranked, 1):
        keep_prob *= 1.0 - p[n]
        if k * keep_prob > best_gain:
            best_gain, best = k * keep_prob, ranked[:k]
    return best


def remove_nodes_probdd(r: Reducer, p0: float = 0.0) -> bool:
    items = sorted(r.current.keep, key=r.view.order.__getitem__)
    if len(items) < 2:
        return False
    p0 = p0 or min(0.25, 1.0 / math.sqrt(len(items)))
    p = {n: p0 for n in items}
    progress = False
    while True:
        alive = [n for n in items if n in r.current.keep and p[n] < 1.0]
        if not alive or len(r.current.keep) < 2:
            return progress
        removal = _pick(alive, p)
        if len(removal) >= len(r.current.keep):
            removal = removal[:-1]
        if r.consider(r.view.without(r.current, removal)):
            progress = True
            continue
        fail_prob = 1.0 - math.prod(1.0 - p[n] for n in removal)
        for n in removal:
            p[n] = 1.0 if len(removal) == 1 or fail_prob <= 0 else min(1.0, p[n] / fail_prob)
