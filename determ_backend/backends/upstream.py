"""Does a root cause compute its value right from its inputs?  The rule that moves a root upstream.

A root cause of the causal rule (:mod:`determ_backend.compare.roots`) is a node whose inputs agree
within the tolerance while its output does not.  An absolute tolerance passes any two small tensors,
so a node that only amplifies an error it was handed looks guilty: a LayerNorm after a cancellation
(``(x + 1e3) - 1e3`` in float32 is wrong by a third of its small size), a matmul fed ``relu(x) * 1e-4``.

:class:`Upstream` asks of such a node whether it is **innocent**: the reference graph is replayed
with the suspect side's values of the node's inputs substituted, and the node's replayed value is
compared with the suspect's own value, up to the rounding of what it sums for a sum or matmul (one that
cancels is judged at the size of its terms, :func:`_within_sum_rounding`), or relative to its size
(:func:`~determ_backend.compare.close_to_scale`) and element by element.  If they agree, the node
computes the suspect value from the suspect inputs: the error came in through them.
:func:`move_innocent_roots` then follows the one input that carries the error (differs relative to its
size), step by step, while each is innocent in turn; where several inputs carry it, or none does, the
root stays and says it computes right from its inputs.

Used by the backends' accuracy check (compiled against eager) and by ``repro-tools xdevice`` (one
device against another).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch
import torch.fx as fx

from determ_backend.backends.eager import replay
from determ_backend.backends.extract import ancestors
from determ_backend.backends.instrument import op_name
from determ_backend.compare import KERNEL_ULPS, Comparison, Pair, close_to_scale

__all__ = ["Upstream", "move_innocent_roots", "MAX_UPSTREAM"]

log = logging.getLogger(__name__)

MAX_UPSTREAM = 8
"""Steps a root found innocent is followed upstream (one replay each)."""


class Upstream:
    """The innocence test on one graph call.

    Args:
        gm: the reference graph, replayed with substituted values.
        args: its inputs; ``rng_state``: the RNG state (:func:`determ_backend.devices.get_rng_state`) it ran from.
        suspect: the suspect side's values by node name; ``reference``: the reference side's.
        tol: the tolerance, relative to each value's largest magnitude.
        holds: whether ``suspect[name]`` is that node's whole value (an inductor buffer may be less).
        convert: a suspect value as the reference graph takes it (another device or dtype).
    """

    def __init__(self, gm: fx.GraphModule, args: Sequence[Any], rng_state: Dict[str, Any],
                 suspect: Mapping[str, Any], reference: Mapping[str, Any], tol: float,
                 holds: Callable[[str], bool] = lambda name: True, convert: Callable[[Any], Any] = lambda v: v):
        self.gm, self.args, self.rng = gm, args, rng_state
        self.suspect, self.reference, self.tol = suspect, reference, tol
        self.holds, self.convert = holds, convert
        self.nodes: Dict[str, fx.Node] = {n.name: n for n in gm.graph.nodes}

    def innocent(self, name: str) -> Optional[bool]:
        """Whether node ``name`` computes its suspect value from the suspect values of its inputs (True: the error
        came in through them); None: cannot tell (no such node, no inputs captured, the replay failed)."""
        node, value = self.nodes.get(name), self.suspect.get(name)
        if node is None or not isinstance(value, torch.Tensor):
            return None
        inject = {n.name: self._as_reference(n.name) for n in self.frontier(node)}
        if not inject:
            return None
        args = [a.name for a in node.all_input_nodes]
        try:
            values = replay(self.gm, self.args, self.rng, inject=inject, keep={name, *args}, rank_local=True)
        except Exception as e:
            log.info("determ: replay of %s from the suspect side's inputs failed (%s)", name, e)
            return None
        replayed = values.get(name)
        if _within_sum_rounding(node, replayed, value, values):
            return True  # a sum that cancels differs by the rounding of what it sums, however small its result
        scaled = close_to_scale(replayed, value, self.tol)
        if scaled is not True:
            return scaled
        # element by element too, as the verdict judges: relative to the largest value alone, a wrong relu whose
        # tensor holds one large element (an error of 1 beside 1e4) would pass for computing right
        r, v = replayed.detach().double().cpu(), value.detach().double().cpu()
        return bool(torch.allclose(r, v, atol=self.tol, rtol=self.tol, equal_nan=True))

    def _as_reference(self, name: str) -> Any:
        """The suspect's value of node ``name`` as the reference graph holds it: converted (another device), and in
        the reference's dtype where that differs (a float64 suspect replayed on a float32 side, which runs its ops,
        a float32-only kernel bug included, in float32)."""
        value, ref = self.convert(self.suspect[name]), self.reference.get(name)
        if isinstance(ref, torch.Tensor) and isinstance(value, torch.Tensor) and ref.dtype != value.dtype \
                and ref.is_floating_point() and value.is_floating_point():
            value = value.to(ref.dtype)
        return value

    def carriers(self, name: str) -> List[str]:
        """The inputs of node ``name`` (:meth:`frontier`) whose suspect values differ from the reference's relative
        to their size."""
        node = self.nodes.get(name)
        return [n.name for n in (self.frontier(node) if node is not None else ())
                if close_to_scale(self.reference.get(n.name), self.suspect.get(n.name), self.tol) is False]

    def frontier(self, node: fx.Node, limit: int = 64) -> List[fx.Node]:
        """The nearest nodes upstream of ``node`` whose whole suspect value is known: its inputs, looked through
        the nodes that have none (views and fused nodes without a buffer); graph inputs end the walk (both sides
        are given the same)."""
        found, seen, stack = [], set(), list(node.all_input_nodes)
        while stack and len(seen) < limit:
            n = stack.pop(0)
            if n.name in seen or n.op == "placeholder":
                continue
            seen.add(n.name)
            if isinstance(self.suspect.get(n.name), torch.Tensor) and self.holds(n.name):
                found.append(n)
            else:
                stack.extend(n.all_input_nodes)
        return found


_SUMS = frozenset({"sum", "mean", "mm", "bmm", "matmul", "addmm", "linear"})
"""Ops whose value is a sum of products of their inputs' elements (``operator.matmul`` included): evaluated on the
inputs' magnitudes, each gives the sum of the magnitudes of the terms an output element adds up."""


def _within_sum_rounding(node: fx.Node, replayed: Any, value: Any, values: Mapping[str, Any]) -> bool:
    """Whether ``value`` (the suspect's) differs from ``replayed`` (the node run on the suspect's inputs) by no more
    than summing rounds, element by element: a few units in the last place of the accumulation (the coarser side's
    dtype, but no coarser than float32: bfloat16 sums accumulate in float32) times the square root of the terms'
    count times the sum of their magnitudes, plus two units of the value's own dtype of its size.  A LayerNorm
    backward's ``sum(dy * w * xhat)`` that cancels to ~1e-8 rounds at the size of its ~1e-4 terms; a matmul 10%
    wrong, or any op not a sum (an attention whose mask holds -3.4e38), is not cleared this way."""
    if not (isinstance(replayed, torch.Tensor) and isinstance(value, torch.Tensor)) or replayed.shape != value.shape \
            or not (replayed.is_floating_point() and value.is_floating_point()) or not value.numel():
        return False
    name = op_name(node)
    base = name.split(".")[1] if name.startswith("aten.") else name.rsplit(".", 1)[-1]
    if base not in _SUMS or node.op not in ("call_function", "call_method"):
        return False

    def magnitude(a: Any) -> Any:
        v = values.get(a.name) if isinstance(a, fx.Node) else a
        return v.detach().double().abs() if isinstance(v, torch.Tensor) and v.is_floating_point() else v

    try:
        args = fx.node.map_aggregate(node.args, magnitude)
        kwargs = fx.node.map_aggregate(node.kwargs, magnitude)
        if node.op == "call_method":
            terms = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            terms = node.target(*args, **kwargs)
    except Exception:  # cannot tell: not cleared this way
        return False
    if not isinstance(terms, torch.Tensor) or terms.shape != value.shape:
        return False
    ins = [values.get(a.name) for a in node.all_input_nodes]
    count = max([x.numel() for x in ins if isinstance(x, torch.Tensor)] + [1]) / value.numel()
    own = max(torch.finfo(t.dtype).eps for t in (replayed, value))
    acc = min(torch.finfo(torch.float32).eps, own)  # the coarser side's unit, but bf16 sums accumulate in float32
    r, v, t = replayed.detach().double().cpu(), value.detach().double().cpu(), terms.abs().cpu()
    if not (torch.isfinite(r).all() and torch.isfinite(v).all() and torch.isfinite(t).all()):
        return False  # an overflow, or an inf it sums, bounds nothing: judged as any op is
    bound = KERNEL_ULPS * acc * max(count, 1.0) ** 0.5 * t + 2 * own * v.abs()
    return bool(((r - v).abs() <= bound).all())


def move_innocent_roots(cmp: Comparison, up: Upstream, node_of: Callable[[Pair], Optional[str]],
                        remeasure: Callable[[str], Dict[str, Any]]) -> None:
    """Each root of ``cmp`` that :meth:`Upstream.innocent` clears moves to the inputs that carry the error in
    (:meth:`Upstream.carriers`), and on from each while it is innocent in turn: at most :data:`MAX_UPSTREAM` steps
    from a root, and as many replays per root.  ``node_of(pair)``: the graph node whose value the pair holds (None:
    none); ``remeasure(node)``: the metrics of an input that passed only on the absolute tolerance, which is then
    marked divergent (``within_absolute_tol_only``).

    A node cleared (it computes its suspect value from its suspect inputs, element by element) is marked
    ``computes_right_from_its_inputs``; its output differs only because its inputs do, by amounts within the
    tolerance that it amplifies.  It stays a root where no input carries the error it can follow -- unless a root
    not cleared lies upstream of it: then the differences came from there (``explained_by_upstream_root``: a scan's
    ``bmm`` after the ``log1p`` that went wrong); with none upstream they are rounding, and the node is where it
    grew (a cancellation).  A root the replay budget never reached is dropped the same way: nothing showed it
    guilty, and a guilty root upstream explains it (the gradients of a wrong relu in a mixture of experts)."""
    by_node = {name: p for p in cmp.pairs for name in (node_of(p),) if name is not None}
    roots: List[Pair] = []
    untested: set = set()  # roots left when the replay budget ran out: neither cleared nor shown guilty
    for start in cmp.root_causes:
        todo, budget = [(start, 0)], MAX_UPSTREAM
        while todo:
            p, depth = todo.pop(0)
            name = node_of(p)
            upstream: List[Pair] = []
            if name is not None and depth < MAX_UPSTREAM and budget > 0:
                budget -= 1
                if up.innocent(name) is True:
                    p.metrics["computes_right_from_its_inputs"] = True
                    upstream = [by_node[n] for n in up.carriers(name) if n in by_node]
            elif name is not None:
                untested.add(id(p))
            if not upstream:  # guilty, cannot tell, or nothing to follow: a root
                if p not in roots:
                    roots.append(p)
                continue
            p.root_cause = False
            for q in upstream:
                if q.equal is not False:  # it passed only on the absolute tolerance
                    q.equal = False
                    q.metrics = dict(remeasure(node_of(q)), within_absolute_tol_only=True)
                q.reaches_output = True
                if q not in roots and all(q is not t for t, _ in todo):
                    todo.append((q, depth + 1))
    guilty = {node_of(p) for p in roots
              if not p.metrics.get("computes_right_from_its_inputs") and id(p) not in untested} - {None}
    for p in list(roots):
        node = up.nodes.get(node_of(p) or "")
        cleared_or_untested = p.metrics.get("computes_right_from_its_inputs") or id(p) in untested
        if cleared_or_untested and node is not None and guilty & ancestors(node, 4096):
            p.metrics["explained_by_upstream_root"] = True
            roots.remove(p)
    for p in cmp.pairs:
        p.root_cause = any(p is r for r in roots)
    order = {id(p): i for i, p in enumerate(cmp.pairs)}
    cmp.root_causes[:] = sorted(roots, key=lambda p: order.get(id(p), len(order)))


