"""Localization: one instrumented run names the culprit node; its cut is verified with one query.

The current candidate is compiled once with every intermediate tensor as an extra
output (works with any compiler, inductor on CPU included).  Then, per node in
graph order, the node's *local* error is measured:

* accuracy: the compiled value against an eager re-execution of that node alone on
  the *compiled* values of its inputs (fp64 re-execution as the reference), so
  error inherited from upstream does not count;
* nondeterminism: the first node whose two runs differ bitwise while its inputs agree;
* cross_device: the first node whose device-A and device-B values differ beyond
  tolerance while its inputs agree.

The first node with local error is the culprit.  Its cut (the node alone, its
inputs as placeholders holding recorded values: the eager reference first, then
the observed values) is asked of the oracle; if the bug needs neighbours, the
producers are added a ring at a time.  When nothing verifies, the minifier falls
back to the general passes, starting from the prefix ending at the culprit.

Re-executing nodes and the causal replay run on the shared eager interpreter
(:mod:`determ_backend.backends.eager`, through :class:`~repro_tools.minify.subgraph.GraphView`);
the same search from the input check's own compile (kernel regions) is
:mod:`repro_tools.minify.passes.kernel_regions`, which uses :func:`has_local_error`,
:func:`find_culprit` and :func:`verify_cut`.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Dict, List, Optional

import torch

from determ_backend import devices
from determ_backend.backends.eager import replay
from determ_backend.compare import Pair, find_roots
from determ_backend.errors import DetermError
from determ_backend.fingerprint.core import hash_tensors
from determ_backend.trace.stream import Record, dtype_name

from repro_tools.minify.oracles import leaf_differs
from repro_tools.minify.reducer import BudgetExhausted, Reducer
from repro_tools.minify.subgraph import Candidate, GraphView

__all__ = ["localize_culprit", "find_culprit", "verify_cut", "has_local_error"]

log = logging.getLogger(__name__)
LOCALIZABLE = ("accuracy", "nondeterminism", "cross_device")
_RINGS = 2


def _observed_of(view: GraphView, name: str, seen: Dict[str, Any]) -> Optional[Any]:
    """The observed value of a node; for a multi-output op, ``{index: value}`` from its getitems."""
    if view.is_tensor(name):
        return seen.get(name)
    parts = {view.by_name[u].args[1]: seen[u] for u in view.users_of(name) if view.is_getitem(u) and u in seen}
    return parts or None


def _pairs(local: Any, got: Any, ref: Any) -> List[tuple]:
    if not isinstance(got, dict):
        return [(local, got, ref)]
    return [(local[i], g, ref[i] if ref is not None else None) for i, g in got.items()]


def _any_differs(pairs: List[tuple], spec) -> bool:
    """Whether any ``(expected, actual, fp64 reference)`` pair differs under the compare core's verdict."""
    return any(leaf_differs(want, have, ref, spec) for want, have, ref in pairs)


def has_local_error(view: GraphView, names: List[str], got: Any, env: Dict[str, Any], spec) -> bool:
    """Whether ``got``, the observed value of the last of nodes ``names`` (a region of the graph, in graph
    order; for a multi-output op ``{index: value}``), differs from an eager re-execution of the region on
    ``env``'s values at its frontier (an fp64 re-execution is the reference), so that error inherited from
    upstream does not count."""
    try:
        local = view.rerun(names, env)
    except Exception as e:  # a region that cannot be re-run eagerly is not judged
        log.debug("cannot re-run %s alone: %s", names[-1], e)
        return False
    if not _any_differs(_pairs(local, got, None), spec):
        return False  # within tolerance already: the fp64 re-run is not needed
    try:
        local64 = view.rerun(names, env, to64=True)
    except Exception:  # no fp64 kernel: judge without the fp64 reference
        local64 = None
    return _any_differs(_pairs(local, got, local64), spec)


def _accuracy_bad(view: GraphView, name: str, comp: Dict[str, Any], env: Dict[str, Any], spec) -> bool:
    got = _observed_of(view, name, comp)
    return got is not None and has_local_error(view, [name], got, env, spec)


def _differs(view: GraphView, name: str, a: Dict[str, Any], b: Dict[str, Any], spec, hashes) -> Optional[bool]:
    if name not in a or name not in b:
        return None
    if hashes is not None:
        return hashes[0][name] != hashes[1][name]
    return leaf_differs(a[name], b[name], None, spec)


class _Substitution:
    """Does substituting ``value`` for ``name`` alone make an output of ``keep`` fail?  Both sides are
    eager replays of ``keep`` from ``base`` (:func:`determ_backend.backends.eager.replay`, one RNG state:
    ``name`` computed vs substituted), so only this node's error counts.  The cut and the clean replay are
    the same for every candidate: made once, on the first question that can make them."""

    def __init__(self, view: GraphView, keep, base: Dict[str, Any], spec) -> None:
        self.view, self.keep, self.base, self.spec = view, keep, base, spec
        self.outs = view.frontier(frozenset(keep))
        self.clean: Optional[tuple] = None  # (cut graph, its inputs, RNG state, clean replay)

    def fails(self, name: str, value: Any) -> Optional[bool]:
        """The answer; None when a replay cannot run."""
        try:
            if self.clean is None:
                gm, inputs = self.view.cut([n for n in self.view.compute if n in self.keep], self.outs, self.base)
                state = devices.get_rng_state()
                self.clean = (gm, inputs, state, replay(gm, inputs, state))
            gm, inputs, state, clean = self.clean
            dirty = replay(gm, inputs, state, inject={name: value})
        except Exception as e:  # a node that cannot be re-run on the substituted value: cannot tell
            log.debug("replay with %s substituted failed: %s", name, e)
            return None
        return any(leaf_differs(clean[o], dirty[o], None, self.spec) for o in self.outs if o in clean and o in dirty)


def _record(view: GraphView, keep, name: str, kind: str = "node", inputs: Optional[List[str]] = None) -> Record:
    v = view.ref.get(name)
    dtype = dtype_name(v.dtype) if isinstance(v, torch.Tensor) else None
    return Record(graph="candidate", stage="minify", node=name, op=view.op_name(name) if kind == "node" else kind,
                  kind=kind, dtype=dtype, inputs=inputs if inputs is not None else [i for i in view.inputs_of(name) if i in keep])


def _accuracy_pairs(view: GraphView, keep, order: List[str], local: List[str]) -> List[Pair]:
    """Nodes with local error judged False (their inputs agree by construction: the local error is
    measured on the compiled inputs); other nodes not judged (looked through); the candidate's outputs
    fail (the oracle said so)."""
    bad = set(local)
    pairs = []
    for n in order:
        r = _record(view, keep, n)
        pairs.append(Pair(r, r, equal=False, inputs_equal=True) if n in bad else Pair(r, r))
    for k, o in enumerate(view.frontier(frozenset(keep))):
        r = _record(view, keep, o, kind="output", inputs=[o])
        r.node = f"output.{k}"
        pairs.append(Pair(r, r, equal=False))
    return pairs


def find_culprit(view: GraphView, keep, sides: List[Dict[str, Any]], spec,
                 base: Optional[Dict[str, Any]] = None) -> Optional[str]:
    """The root cause by the compare core's causal rule (:func:`~determ_backend.compare.find_roots`), or
    None.  ``base``: the values the observed candidate's placeholders held (default: the eager reference).

    Accuracy: the candidates are the nodes with local error; each is confirmed by substituting its
    compiled value alone into an eager replay of the nodes after it: a node whose substitution leaves
    every output within tolerance is masked (its error is absorbed downstream).  Nondeterminism and
    cross-device: a node that differs while its inputs inside the candidate do not, on a chain of
    differing values to a differing output."""
    order = [n for n in view.compute if n in keep]
    if spec.kind == "accuracy":
        comp = sides[0]
        base = base if base is not None else view.ref
        env = dict(base)
        env.update(comp)
        local = [n for n in order if not view.is_getitem(n) and _accuracy_bad(view, n, comp, env, spec)]
        if not local:
            return None

        substitution = _Substitution(view, keep, base, spec)

        def confirm(cands: List[Pair]) -> List[Optional[bool]]:
            out = []
            for c in cands:
                value = comp.get(c.rec.node)
                out.append(substitution.fails(c.rec.node, value) if isinstance(value, torch.Tensor) else None)
            return out

        cmp = find_roots(_accuracy_pairs(view, keep, order, local), spec.kind, confirm=confirm)
        for p in cmp.masked:
            log.info("%s differs but its error reaches no output (masked); not the culprit", p.rec.node)
        return cmp.root_causes[0].rec.node if cmp.root_causes else local[0]
    hashes = None
    if spec.kind == "nondeterminism":
        hashes = []
        for side in sides[:2]:
            names = [k for k, v in side.items() if isinstance(v, torch.Tensor)]
            hashes.append(dict(zip(names, hash_tensors([side[k] for k in names]))))
    a, b = sides[0], sides[1]
    outs = set(view.frontier(frozenset(keep)))
    pairs = []
    for n in order:
        d = _differs(view, n, a, b, spec, hashes)
        r = _record(view, keep, n)
        if n in outs:
            r.extra = {"outputs": [0]}
        ins = [_differs(view, i, a, b, spec, hashes) for i in r.inputs]
        pairs.append(Pair(r, r, equal=None if d is None else not d, inputs_equal=not any(ins)))
    cmp = find_roots(pairs, spec.kind, strict=True)
    if not cmp.root_causes:
        return None
    n = cmp.root_causes[0].rec.node
    src = view.inputs_of(n)[0] if view.is_getitem(n) else None
    return src if src is not None and src in keep and not view.is_tensor(src) else n


def _rings(view: GraphView, culprit: str, keep) -> List[frozenset]:
    core = {culprit} | {u for u in view.users_of(culprit) if view.is_getitem(u) and not view.is_tensor(culprit)}
    out, cur = [frozenset(core)], set(core)
    for _ in range(_RINGS):
        grown = cur | {a for n in cur for a in view.inputs_of(n) if a in keep}
        grown |= {u for a in grown if not view.is_tensor(a) for u in view.users_of(a) if view.is_getitem(u) and u in keep}
        if grown == cur:
            break
        out.append(frozenset(grown))
        cur = grown
    return out


def verify_cut(r: Reducer, culprit: str, keep, value_maps: List[str], rings: int = _RINGS + 1) -> bool:
    """Ask the cut around ``culprit`` (then a ring of producers more, ... ``rings`` in all) with each
    recorded value map feeding its placeholders; True (and ``r.localized``) as soon as one still fails."""
    for ring in _rings(r.view, culprit, keep)[:rings]:
        for values in value_maps:
            if r.consider(Candidate(ring, None, values)):
                r.localized = True
                return True
    return False


def localize_culprit(r: Reducer) -> bool:
    """Instrumented run, culprit, verified cut.  True when a cut around the culprit still fails."""
    if r.spec.kind not in LOCALIZABLE:
        return False
    view, start = r.view, r.current
    inst = Candidate(start.keep, view.with_outputs(start.keep), start.values)
    try:
        sides = r.observe(inst)
    except BudgetExhausted:
        raise
    except (DetermError, RuntimeError, TypeError, ValueError, AssertionError) as e:  # compile of the instrumented graph
        log.info("instrumented run failed (%s: %s); falling back to the general reducer", type(e).__name__, e)
        return False
    culprit = find_culprit(view, start.keep, sides, r.spec)
    if culprit is None:
        log.info("instrumented run shows no node with local error; falling back to the general reducer")
        return False
    r.culprit = culprit
    log.info("culprit: %s (%s)", culprit, view.op_name(culprit))
    names = ["ref"]
    for i, side in enumerate(sides[:2]):
        view.value_maps[f"side{i}"] = view.value_map(side)
        names.append(f"side{i}")
    if verify_cut(r, culprit, start.keep, names):
        return True
    order = [n for n in view.compute if n in start.keep]
    r.consider(replace(start, keep=frozenset(order[:order.index(culprit) + 1]), outputs=None))
    return False
