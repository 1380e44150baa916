"""The reducer: the current smallest failing candidate, ``consider(candidate)``, a cache and a budget.

Every pass in :mod:`repro_tools.minify.passes` is a plain function ``pass(reducer) -> bool``
(progress made) that proposes candidates through :meth:`Reducer.consider`.  A
candidate is materialized, keyed by its canonical graph hash and asked of the
oracle at most once; a failing candidate smaller than the current one becomes
current (and ``on_improve`` checkpoints it).  Queries beyond ``budget`` raise
:class:`BudgetExhausted`, which :mod:`repro_tools.minify.minifier` turns into an early,
still valid, result.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch.fx as fx

from repro_tools.minify.oracles import OracleSpec, Verdict
from repro_tools.minify.subgraph import Candidate, GraphView

__all__ = ["Reducer", "BudgetExhausted", "PredicateRunner"]

log = logging.getLogger(__name__)


class BudgetExhausted(Exception):
    """The query budget is spent; the current candidate is the answer."""


class PredicateRunner:
    """A runner around a plain ``predicate(gm, inputs) -> bool`` (tests, custom oracles)."""

    def __init__(self, predicate: Callable[[fx.GraphModule, List[Any]], bool]):
        self.predicate = predicate
        self.calls = 0

    def check(self, spec: OracleSpec, gm: fx.GraphModule, inputs: Sequence[Any]) -> Verdict:
        self.calls += 1
        return Verdict(bool(self.predicate(gm, list(inputs))))

    def observe(self, spec: OracleSpec, gm: fx.GraphModule, inputs: Sequence[Any]) -> List[List[Any]]:
        raise NotImplementedError("a predicate has nothing to observe")

    def close(self) -> None:
        pass


class Reducer:
    def __init__(self, view: GraphView, spec: OracleSpec, runner: Any, current: Candidate, *, budget: int = 500,
                 cache: Optional[Dict[str, bool]] = None, queries: int = 0,
                 on_improve: Optional[Callable[["Reducer"], None]] = None,
                 on_query: Optional[Callable[["Reducer"], None]] = None):
        self.view, self.spec, self.runner = view, spec, runner
        norm = view.normalize(current)
        self.current = norm if norm is not None else current
        self.budget = budget
        self.cache: Dict[str, bool] = dict(cache or {})
        self.queries = queries
        self.cache_hits = 0
        self.verified: Dict[str, Verdict] = {}
        """Failing verdicts asked in this run (not restored from a saved cache), by candidate key."""
        self.observed: Optional[Dict[str, Any]] = None
        """Compiled values of the start candidate's nodes from the input check itself, when the runner
        could capture them (inductor's materialized buffers: :func:`repro_tools.minify.oracles.check_observed`)."""
        self.culprit: Optional[str] = None
        self.localized = False
        self.on_improve = on_improve
        self.on_query = on_query

    @property
    def nodes(self) -> int:
        return len(self.current.keep)

    def _spend(self) -> None:
        if self.queries >= self.budget:
            raise BudgetExhausted(f"query budget of {self.budget} spent")
        self.queries += 1

    def _after_query(self) -> None:
        if self.on_query is not None:
            self.on_query(self)

    def consider(self, cand: Candidate) -> bool:
        """Does ``cand`` (normalized first) still fail?  Adopts it when it fails and is smaller."""
        c = self.view.normalize(cand)
        if c is None:
            return False
        gm, inputs = self.view.materialize(c)
        key = self.view.key(gm, inputs)
        fails = self.cache.get(key)
        if fails is None:
            self._spend()
            v = self.runner.check(self.spec, gm, inputs)
            fails = self.cache[key] = bool(v.fails)
            if fails:
                self.verified[key] = v
            log.debug("query %d: %d nodes -> %s (%s)", self.queries, len(c.keep), fails, v.detail)
            self._after_query()
        else:
            self.cache_hits += 1
        if fails and self.view.size(c) < self.view.size(self.current):
            self.current = c
            if self.on_improve is not None:
                self.on_improve(self)
        return fails

    def observe(self, cand: Candidate) -> List[Dict[str, Any]]:
        """One instrumented run of ``cand``: per side, ``{output node name: value}``."""
        c = self.view.normalize(cand) or cand
        gm, inputs = self.view.materialize(c)
        self._spend()
        try:
            sides = self.runner.observe(self.spec, gm, inputs)
        finally:
            self._after_query()
        names = self.view.outputs_of(c)
        return [dict(zip(names, side)) for side in sides]
