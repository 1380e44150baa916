"""Candidates of the minifier: subsets of the original graph's nodes, and how to build them.

A :class:`Candidate` keeps a set of the original compute nodes (by name) and
optionally an explicit output list.  Every value a kept node needs from a node
that is not kept becomes a placeholder holding that node's recorded value (the
eager reference by default, or another recorded value map, e.g. the compiled
values), so any subset is a runnable graph -- except that a non-tensor value
(a tuple of a multi-output op) cannot be a placeholder, so nodes consuming it
go with it.  :class:`GraphView` holds the original graph and its recorded
values, normalizes candidates (closure, dead-code elimination), materializes them
as ``(GraphModule, inputs)`` and computes a canonical key for the query cache.

The eager interpreter (reference values, re-running a few nodes) is
:mod:`determ_backend.backends.eager`'s and the cut itself
:func:`determ_backend.backends.extract.extract`, both shared with the backends'
accuracy check.  The search over candidates lives in :mod:`repro_tools.minify.reducer`
and the passes.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import operator
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Set, Tuple

import torch
import torch.fx as fx

from determ_backend import _torch_compat as tc
from determ_backend.backends.eager import EagerInterpreter
from determ_backend.backends.extract import MissingValue, extract
from determ_backend.backends.instrument import module_place_of
from determ_backend.clones import clone_inputs
from determ_backend.errors import ReproError, first_line
from determ_backend.fingerprint.core import hash_tensors

__all__ = ["Candidate", "GraphView", "COMPUTE_OPS", "source_line", "target_name", "record_values"]

log = logging.getLogger(__name__)
COMPUTE_OPS = ("call_function", "call_method", "call_module")


@dataclass(frozen=True)
class Candidate:
    keep: FrozenSet[str]
    """Names of the original compute nodes computed by this candidate."""
    outputs: Optional[Tuple[str, ...]] = None
    """Nodes returned; None: every kept tensor whose value is used outside the candidate (the frontier)."""
    values: str = "ref"
    """Which recorded value map feeds the placeholders (``ref``: eager values of the original inputs)."""
    merge_inputs: bool = False
    """Placeholders holding identical tensors are merged into one."""


def record_values(gm: fx.GraphModule, inputs: Sequence[Any]) -> Tuple[Dict[str, Any], Optional[str]]:
    """Every node's eager value (by node name; :class:`~determ_backend.backends.eager.EagerInterpreter`);
    stops at the first failing node (its error is returned)."""
    interp = EagerInterpreter(gm, record=True)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(1234)
            interp.run(*clone_inputs(inputs))
    except Exception as e:  # an eager failure limits which nodes can become placeholders; it is reported
        log.warning("eager run of the graph stops at node %d: %s: %s", len(interp.values), type(e).__name__, e)
        return interp.values, f"{type(e).__name__}: {first_line(e)}"
    return interp.values, None


_DETACHES = frozenset({"detach", "detach_"})


def _stops_gradient(n: fx.Node) -> bool:
    """Whether node ``n`` cuts its value off from autograd (``x.detach()``, ``torch.detach``, ``aten.detach``)."""
    t = n.target
    name = t if isinstance(t, str) else getattr(t, "__name__", "")
    if tc.is_op_overload(t):
        name = tc.op_overload_name(t)[1]
    return name in _DETACHES


def _flat_nodes(arg: Any) -> List[fx.Node]:
    out: List[fx.Node] = []
    fx.node.map_arg(arg, out.append)
    return out


def target_name(n: fx.Node) -> str:
    """A readable, stable name of what a node calls (``aten.erf.default``, ``torch.relu``, ``add``)."""
    t = n.target
    if isinstance(t, str):
        return t if n.op != "call_method" else f".{t}"
    if tc.op_schema(t) is not None:  # an aten/prims operator overload
        return str(t)
    mod = getattr(t, "__module__", None) or ""
    qual = getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or repr(t)
    if mod.startswith("torch") and getattr(t, "__name__", None):  # torch.relu, not torch._VariableFunctionsClass.relu
        qual = t.__name__
    return f"{mod}.{qual}" if mod and mod not in ("builtins", "_operator", "operator") else qual


def source_line(node: Optional[fx.Node]) -> Optional[str]:
    """``file:line: code`` of the user source a node came from (its ``stack_trace`` meta), if known; for a node of
    torch's own modules alone (no user frame), the module it ran in, ``<module 1: ReLU>``, as the backends say."""
    st = (node.meta.get("stack_trace") or "") if node is not None else ""
    lines = [ln.strip() for ln in st.strip().splitlines() if ln.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File "):
            parts = lines[i].split(",")
            loc = parts[0][5:].strip('"') + ":" + parts[1].replace("line", "").strip() if len(parts) > 1 else lines[i]
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
            return f"{loc}: {code}" if code else loc
    return module_place_of(node) if node is not None else None


class GraphView:
    """The original graph with its recorded values; builds and keys candidates."""

    def __init__(self, gm: fx.GraphModule, inputs: Sequence[Any], grads: bool = False):
        """``grads``: candidates are judged by their gradients too, so an input a candidate is cut at requires grad
        where its value did in the whole graph's run with autograd (:meth:`_needs_grad`)."""
        self.gm = gm
        self.nodes = list(gm.graph.nodes)
        self.by_name = {n.name: n for n in self.nodes}
        self.order = {n.name: i for i, n in enumerate(self.nodes)}
        self.compute = [n.name for n in self.nodes if n.op in COMPUTE_OPS]
        out = next(n for n in reversed(self.nodes) if n.op == "output")
        self.out_names = [n.name for n in _flat_nodes(out.args)]
        if not self.compute:
            raise ReproError("graph has no compute nodes: nothing to minify")
        self.ref, self.eager_error = record_values(gm, inputs)
        self.grad_names = self._needs_grad(inputs) if grads else frozenset()
        self.value_maps: Dict[str, Dict[str, Any]] = {"ref": self.ref}
        self._fp_memo: Dict[int, Tuple[Any, int]] = {}
        self._interp: Optional[EagerInterpreter] = None

    # ---------------------------------------------------------------- structure
    def is_tensor(self, name: str) -> bool:
        return isinstance(self.ref.get(name), torch.Tensor)

    def can_feed(self, name: str) -> bool:
        """Whether ``name``'s value can be a placeholder of a candidate: a tensor or a Python scalar (a
        graph's symbolic size, concrete here); not a tuple of a multi-output op."""
        return isinstance(self.ref.get(name), (torch.Tensor, bool, int, float))

    def inputs_of(self, name: str) -> List[str]:
        return [a.name for a in self.by_name[name].all_input_nodes]

    def users_of(self, name: str) -> List[str]:
        return [u.name for u in self.by_name[name].users if u.op != "output"]

    def op_name(self, name: str) -> str:
        return target_name(self.by_name[name])

    def is_getitem(self, name: str) -> bool:
        n = self.by_name[name]
        return n.op == "call_function" and n.target is operator.getitem

    def full(self) -> Candidate:
        return Candidate(frozenset(self.compute), tuple(o for o in self.out_names if o in set(self.compute)))

    def with_outputs(self, keep: FrozenSet[str]) -> Tuple[str, ...]:
        """Every kept tensor node, in graph order (the instrumented all-outputs candidate)."""
        return tuple(n for n in self.compute if n in keep and self.is_tensor(n))

    # ---------------------------------------------------------------- candidates
    def frontier(self, keep: FrozenSet[str]) -> Tuple[str, ...]:
        outs = set(self.out_names)
        return tuple(n for n in self.compute if n in keep and self.is_tensor(n)
                     and (n in outs or any(u.name not in keep for u in self.by_name[n].users)))

    def outputs_of(self, cand: Candidate) -> Tuple[str, ...]:
        return cand.outputs if cand.outputs is not None else self.frontier(cand.keep)

    def without(self, cand: Candidate, names) -> Candidate:
        """``cand`` minus ``names``: removed nodes become placeholders; a removed output passes its
        output role to its nearest kept producers (so removing the last node keeps its inputs observable)."""
        keep = cand.keep - set(names)
        outs: List[str] = []
        stack = list(reversed(self.outputs_of(cand)))
        seen = set()
        while stack:
            o = stack.pop()
            if o in seen:
                continue
            seen.add(o)
            if o in keep:
                outs.append(o)
            elif o in cand.keep:
                stack.extend(reversed(self.inputs_of(o)))
        outs = sorted(set(outs), key=self.order.__getitem__)
        return replace(cand, keep=keep, outputs=tuple(outs))

    def normalize(self, cand: Candidate) -> Optional[Candidate]:
        """Closure over non-placeholder values, then dead-code elimination; None when nothing is left."""
        keep = set(cand.keep) & set(self.compute)
        changed = True
        while changed:
            changed = False
            for n in sorted(keep, key=self.order.__getitem__):
                if any(a not in keep and not self.can_feed(a) for a in self.inputs_of(n)):
                    keep.discard(n)
                    changed = True
        fkeep = frozenset(keep)
        outs = [o for o in (cand.outputs if cand.outputs is not None else self.frontier(fkeep))
                if o in keep and self.is_tensor(o)]
        live, stack = set(), list(outs)
        while stack:
            n = stack.pop()
            if n in live:
                continue
            live.add(n)
            stack.extend(a for a in self.inputs_of(n) if a in keep)
        if not live or not outs:
            return None
        explicit = tuple(outs) if cand.outputs is not None else None
        if explicit is None and self.frontier(frozenset(live)) != tuple(outs):
            explicit = tuple(outs)  # dead nodes removed: pin the outputs so the frontier does not grow
        return replace(cand, keep=frozenset(live), outputs=explicit)

    def external_inputs(self, cand: Candidate) -> List[str]:
        ext = {a for n in cand.keep for a in self.inputs_of(n) if a not in cand.keep}
        return sorted(ext, key=self.order.__getitem__)

    def size(self, cand: Candidate) -> Tuple[int, int, int]:
        """(nodes, outputs, distinct placeholders): what "smaller" means."""
        ext = self.external_inputs(cand)
        if cand.merge_inputs:
            vals = self.value_maps[cand.values]
            keys = set()
            for name in ext:
                v = vals.get(name, self.ref.get(name))
                keys.add(self._value_key(v) if isinstance(v, torch.Tensor) else name)
            return len(cand.keep), len(self.outputs_of(cand)), len(keys)
        return len(cand.keep), len(self.outputs_of(cand)), len(ext)

    def materialize(self, cand: Candidate) -> Tuple[fx.GraphModule, List[Any]]:
        """The candidate as a runnable ``(GraphModule, inputs)`` returning a flat tuple."""
        values = collections.ChainMap(self.value_maps[cand.values], self.ref)
        merge = self._merge_key if cand.merge_inputs else None
        gm, inputs = self.cut([n for n in self.compute if n in cand.keep], self.outputs_of(cand), values, merge)
        if self.grad_names:
            places = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
            inputs = [v.detach().requires_grad_(True) if name in self.grad_names and isinstance(v, torch.Tensor)
                      and not v.requires_grad else v for name, v in zip(places, inputs)]
        return gm, inputs

    def _needs_grad(self, inputs: Sequence[Any]) -> FrozenSet[str]:
        """The nodes whose values require grad in a run of the whole graph with autograd on: the floating-point
        values computed from an input or a parameter that requires grad (recorded values are taken without
        autograd)."""
        need: Set[str] = set()
        args = iter(inputs)
        grad_on = True  # a dynamo graph's ``with torch.no_grad()`` is a pair of _set_grad_enabled calls
        for n in self.nodes:
            v = self.ref.get(n.name)
            traced = tc.example_value(n)  # what the graph's tracer saw, where it kept that: authoritative
            if n.op == "placeholder":
                x = next(args, None)
                hit = isinstance(x, torch.Tensor) and x.requires_grad
            elif n.op == "call_function" and tc.is_set_grad_enabled(n.target):
                grad_on = bool(n.args[0]) if n.args else grad_on
                continue
            elif n.op == "get_attr":
                hit = isinstance(v, torch.Tensor) and v.requires_grad
            elif isinstance(traced, torch.Tensor):
                hit = traced.requires_grad
            else:
                hit = grad_on and not _stops_gradient(n) and any(a.name in need for a in n.all_input_nodes)
            if hit and (not isinstance(v, torch.Tensor) or v.is_floating_point() or v.is_complex()):
                need.add(n.name)  # a tuple of a multi-output op passes it to its getitems
        return frozenset(need)

    def cut(self, names: Sequence[str], outputs: Sequence[str], values: Mapping[str, Any],
            merge_key: Optional[Callable[[Any], Any]] = None) -> Tuple[fx.GraphModule, List[Any]]:
        """Nodes ``names`` (graph order) as ``(GraphModule, inputs)`` returning ``outputs``; the nodes they
        read from outside are placeholders fed from ``values``
        (:func:`determ_backend.backends.extract.extract`)."""
        try:
            return extract(self.gm, [self.by_name[n] for n in names], outputs, values, merge_key=merge_key)
        except MissingValue as e:
            raise ReproError(f"no recorded value for node {e.node!r} (the eager run stopped before it)") from None

    def _merge_key(self, v: Any) -> Optional[Tuple]:
        return self._value_key(v) if isinstance(v, torch.Tensor) else None

    # ---------------------------------------------------------------- re-running parts
    def rerun(self, names: Sequence[str], env: Mapping[str, Any], to64: bool = False) -> Any:
        """The last of nodes ``names`` (graph order), re-executed eagerly with what they read from outside
        them taken from ``env`` (in float64 with ``to64``)."""
        if self._interp is None:
            self._interp = EagerInterpreter(self.gm, garbage_collect_values=False)
        with torch.no_grad():
            return self._interp.run_nodes([self.by_name[n] for n in names], env, to64=to64)

    def value_map(self, side: Mapping[str, Any]) -> Dict[str, Any]:
        """Observed tensors (by node name) cast back to the reference's dtype and device."""
        out = {}
        for k, v in side.items():
            ref = self.ref.get(k)
            if isinstance(v, torch.Tensor) and isinstance(ref, torch.Tensor):
                out[k] = v.detach().to(device=ref.device, dtype=ref.dtype)
        return out

    # ---------------------------------------------------------------- cache key
    def _fingerprint(self, t: torch.Tensor) -> int:
        hit = self._fp_memo.get(id(t))
        if hit is None or hit[0] is not t:
            hit = (t, hash_tensors([t])[0])
            self._fp_memo[id(t)] = hit
        return hit[1]

    def _value_key(self, v: torch.Tensor) -> Tuple:
        return str(v.dtype), tuple(v.shape), self._fingerprint(v)

    def key(self, gm: fx.GraphModule, inputs: Sequence[Any]) -> str:
        """Canonical hash of a materialized candidate: structure (names normalized) plus input fingerprints."""
        names: Dict[fx.Node, str] = {}
        parts = []
        for i, n in enumerate(gm.graph.nodes):
            names[n] = f"v{i}"
            tgt = target_name(n)
            args = fx.node.map_arg((n.args, n.kwargs), lambda a: names[a])
            parts.append(f"{n.op}|{tgt if n.op != 'placeholder' else ''}|{args!r}")
        fps = [self._value_key(x) if isinstance(x, torch.Tensor) else repr(x) for x in inputs]
        return hashlib.sha256(("\n".join(parts) + "\n" + repr(fps)).encode()).hexdigest()
