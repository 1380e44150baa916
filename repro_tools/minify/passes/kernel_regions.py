"""Localization from the input check's own compile: kernel regions first, then one node.

(The regions of inductor kernels, as the minifier sees them; the regions the dump
records around compiled calls are :mod:`determ_backend.dump.capture.regions`.)

When the input check also captured compiled values for part of the nodes
(``Reducer.observed``, from :func:`repro_tools.minify.oracles.check_observed`: the nodes
inductor wrote a buffer for), the culprit is searched at that granularity before
any further compile.  The *region* of an observed node is the node plus its
unobserved producers, back to observed values or the candidate's inputs (what
inductor fused into the kernel that wrote it, or recomputed there).  A region
has local error when the node's compiled value and an eager re-execution of the
region on the compiled values at its frontier disagree (an fp64 re-execution is
the reference), so error inherited from upstream does not count.  The first
region with local error, in graph order:

* one op: that op is the culprit; its cut is verified at once (no extra compile);
* several ops (fused): when at most two of them do arithmetic (the others are
  views or copies), their cuts are asked directly -- at most two queries: one op
  with the reference and the compiled values, or two ops with the reference
  values, in graph order -- since a cut that fails is already the verified
  answer (the all-outputs compile of the region would cost one more compile
  before the same cut);
  otherwise, or when none of these cuts fails, one compile of the region alone
  with every node as an output (a small graph) names the node, whose cut is then
  verified (cuts asked before are answered from the cache).

Anything else (no region with local error, a region whose nodes cannot be told
apart, a cut that does not verify) returns False, and
:func:`~repro_tools.minify.passes.localize_culprit` runs the all-outputs compile of the
whole candidate as before.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple

from determ_backend.backends.extract import Step, walk_back
from determ_backend.errors import DetermError

from repro_tools.minify.reducer import BudgetExhausted, Reducer
from repro_tools.minify.subgraph import Candidate, GraphView
from repro_tools.minify.passes.localize import find_culprit, has_local_error, verify_cut

__all__ = ["localize_from_buffers", "first_bad_region"]

log = logging.getLogger(__name__)


def _region(view: GraphView, node: str, keep, observed: Dict[str, Any]) -> List[str]:
    """``node`` and its producers reachable through unobserved kept nodes, in graph order
    (:func:`determ_backend.backends.extract.walk_back`, the walk the backends' narrowing uses)."""
    def step(a) -> Step:
        return Step.STOP if a.name not in keep or a.name in observed else Step.JOIN

    return [n.name for n in walk_back(view.by_name[node], step, order=view.order)]


def first_bad_region(view: GraphView, keep, observed: Dict[str, Any], spec) -> Optional[Tuple[str, List[str]]]:
    """``(observed node, its region)`` of the first region with local error, or None."""
    env = dict(view.ref)
    env.update(observed)
    for n in view.compute:
        if n in keep and n in observed:
            region = _region(view, n, keep, observed)
            if has_local_error(view, region, observed[n], env, spec):
                return n, region
    return None


def _culprit_in_region(r: Reducer, region: List[str]) -> Optional[str]:
    """One all-outputs compile of the region alone (frontier: the compiled values); its first node with local error."""
    view = r.view
    keep = frozenset(region)
    try:
        sides = r.observe(Candidate(keep, view.with_outputs(keep), "side0"))
    except BudgetExhausted:
        raise
    except (DetermError, RuntimeError, TypeError, ValueError, AssertionError) as e:  # compile of the region
        log.info("region run failed (%s: %s)", type(e).__name__, e)
        return None
    base = dict(view.ref)
    base.update(view.value_maps["side0"])
    culprit = find_culprit(view, keep, sides, r.spec, base=base)
    if culprit is not None:
        view.value_maps["side0"].update(view.value_map(sides[0]))
    return culprit


_DATA_MOVEMENT = frozenset({"view", "reshape", "_unsafe_view", "clone", "alias", "contiguous", "expand", "permute",
                            "transpose", "t", "squeeze", "unsqueeze", "flatten", "unflatten", "slice", "select",
                            "as_strided", "detach", "split", "chunk", "unbind"})


def _moves_data_only(view: GraphView, name: str) -> bool:
    """A view or copy of its input (no arithmetic): an unlikely home for an accuracy bug."""
    target = view.by_name[name].target
    if getattr(target, "is_view", False):
        return True
    op = view.op_name(name)
    base = op.split(".")[1] if op.startswith("aten.") else op.rsplit(".", 1)[-1]
    return base in _DATA_MOVEMENT


_DIRECT = 2
"""Direct cut queries for a fused region before its all-outputs compile."""


def _direct_cuts(view: GraphView, ops: List[str]) -> List[Tuple[str, str]]:
    """``(op, value map)`` cuts to ask before compiling the region: its ops doing arithmetic, in graph
    order, when there are at most :data:`_DIRECT` of them; reference values before compiled ones."""
    arith = [n for n in ops if not _moves_data_only(view, n)]
    if not 1 <= len(arith) <= _DIRECT:
        return []
    return [(n, values) for values in ("ref", "side0") for n in arith][:_DIRECT]


def localize_from_buffers(r: Reducer) -> bool:
    """Culprit from the input check's captured values; True when its verified cut still fails."""
    if r.observed is None or r.spec.kind != "accuracy":
        return False
    view, keep = r.view, r.current.keep
    observed = {k: v for k, v in r.observed.items() if k in keep}
    hit = first_bad_region(view, keep, observed, r.spec)
    if hit is None:
        log.info("captured buffers (%d nodes) show no region with local error", len(observed))
        return False
    node, region = hit
    view.value_maps["side0"] = view.value_map(observed)
    ops = [n for n in region if not view.is_getitem(n)]
    log.info("first region with local error ends at %s: %d op(s)", node, len(ops))
    if len(ops) == 1:
        culprit = ops[0]
    else:  # fused: the cuts of its few arithmetic ops are asked first, then the region is compiled
        for op, values in _direct_cuts(view, ops):
            if verify_cut(r, op, keep, [values], rings=1):
                r.culprit = op
                log.info("culprit: %s (%s), its cut asked directly", op, view.op_name(op))
                return True
        culprit = _culprit_in_region(r, region)
    if culprit is None:
        return False
    r.culprit = culprit
    log.info("culprit: %s (%s)", culprit, view.op_name(culprit))
    return verify_cut(r, culprit, keep, ["ref", "side0"])
