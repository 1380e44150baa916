"""Backward records: the gradients that flow through one recorded call.

ptdbg's ``..._backward`` record of a call has as *inputs* the gradients with
respect to the call's outputs and as *outputs* the gradients with respect to its
inputs.  We get both without wrapping any tensor (wrapping would turn outputs
into views and break later in-place ops): before the call we note the autograd
edge of every input that requires grad; after it we walk the autograd nodes the
call created, from its outputs back to those edges, and hook them --

* a pre-hook on each output's ``grad_fn`` reads the gradient of that output;
* a hook on every node with an edge into an input reads the gradient sent
  along that edge (edges into the same input are summed).

When every hooked node has fired the record is complete; records left
incomplete (an output that did not reach the loss) are flushed when the
backward pass ends.  Another pass through the same graph (``retain_graph``)
fires the hooks again and writes a record of its own, under the same name.

Forward recording lives in :mod:`.hooks`.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.autograd.graph import get_gradient_edge

from determ_backend import _torch_compat

__all__ = ["InputEdges", "prepare", "attach", "BackwardFlusher", "sequence_probe"]

_MAX_NODES = 4096

InputEdges = Dict[Tuple[int, int], List[str]]


def sequence_probe() -> int:
    """A sequence number below that of every autograd node created from now on (in this thread)."""
    with torch.enable_grad():
        return torch.empty(0, requires_grad=True).view(0).grad_fn._sequence_nr()


def _whole_view_base(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The base of ``t`` when ``t`` is a view of all of it, element for element (a reshape: ``linear``'s output for
    3-D input is a view of its ``addmm``'s), and the base has an autograd node; else None.  An in-place op on such
    a view (``h.relu_()``, ``y += x``) takes the view's node out of the graph, while the base's stays in it: the
    gradient of the view's values, before and after the op, is the base's, reshaped."""
    base = _torch_compat.view_base(t)
    if (base is None or base.grad_fn is None or base.numel() != t.numel() or not t.is_contiguous()
            or not base.is_contiguous()):
        return None
    return base


def prepare(items: Sequence[Tuple[str, Any]], inplace: bool = False) -> Tuple[InputEdges, set, List[Any], dict]:
    """Before the call: ``({(id(node), output_nr): [input names]}, {id(node)}, keep-alive nodes, reshapes)``.
    ``inplace``: the call may write its inputs; an input that is a view of all of its base is also found where the
    gradient reaches the base (the write replaces the view's node), read in the input's shape (``reshapes``:
    ``{(id(node), output_nr): shape}``)."""
    edges: InputEdges = {}
    nodes: set = set()
    alive: List[Any] = []
    reshapes: Dict[Tuple[int, int], Tuple[int, ...]] = {}
    for name, v in items:
        if isinstance(v, torch.Tensor) and v.requires_grad:
            e = get_gradient_edge(v)
            edges.setdefault((id(e.node), e.output_nr), []).append(name)
            nodes.add(id(e.node))
            alive.append(e.node)
            base = _whole_view_base(v) if inplace else None
            if base is not None:
                key = (id(base.grad_fn), base.output_nr)
                if key not in edges:  # an edge of an input of its own wins
                    edges[key] = [name]
                    reshapes[key] = tuple(v.shape)
                    nodes.add(key[0])
                    alive.append(base.grad_fn)
    return edges, nodes, alive, reshapes


def _walk(roots: List[Any], edges: InputEdges, in_nodes: set, min_seq: Optional[int]):
    """Nodes created by the call and their edges into inputs: ``([(node, j, (id(next node), its output_nr))],
    {id(node): {id of each walked node with an edge to it}})``, or None past ``_MAX_NODES``."""
    seen: Dict[int, Any] = {}
    users: Dict[int, set] = {}
    into_inputs: List[Tuple[Any, int, Tuple[int, int]]] = []
    stack = [r for r in roots if id(r) not in in_nodes]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        if min_seq is not None and node._sequence_nr() < min_seq:
            continue
        seen[id(node)] = node
        if len(seen) > _MAX_NODES:
            return None
        for j, (nxt, nr) in enumerate(node.next_functions):
            if nxt is None:
                continue
            users.setdefault(id(nxt), set()).add(id(node))
            if (id(nxt), nr) in edges:
                into_inputs.append((node, j, (id(nxt), nr)))
            elif id(nxt) not in in_nodes:
                stack.append(nxt)
    return into_inputs, {k: users.get(k, set()) for k in seen}


class _Pending:
    """Gradients of one call, collected as its nodes fire."""

    def __init__(self, name: str, expected: int, flusher: "BackwardFlusher", emit: Callable,
                 on_start: Optional[Callable[[], None]] = None):
        self.name, self.expected, self.flusher, self.emit = name, expected, flusher, emit
        self.on_start = on_start
        self.fired = 0
        self.grad_out: Dict[str, torch.Tensor] = {}
        self.grad_in: Dict[str, List[torch.Tensor]] = {}
        self.done = False

    def renew(self) -> None:
        """A hook of a finished record fired: another backward pass through the same graph (``retain_graph``)
        began, which gives a record of its own, collected afresh."""
        if self.done:
            self.done, self.fired, self.grad_out, self.grad_in = False, 0, {}, {}

    def fire(self) -> None:
        if self.fired == 0:
            self.flusher.started(self)
            if self.on_start is not None:
                self.on_start()
        self.fired += 1
        if self.fired >= self.expected:
            self.finish()

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        ins = [(k, v) for k, v in self.grad_out.items()]
        outs = []
        for k, vs in self.grad_in.items():
            outs.append((k, vs[0] if len(vs) == 1 else torch.stack(vs).sum(0)))
        self.emit(self.name, ins, outs)


class BackwardFlusher:
    """Flushes incomplete backward records at the end of each backward pass."""

    def __init__(self) -> None:
        self._open: List[_Pending] = []
        self._queued = False
        self._lock = threading.Lock()

    def started(self, p: _Pending) -> None:
        with self._lock:
            self._open.append(p)
            queue = not self._queued
            self._queued = True
        if queue:
            _torch_compat.queue_autograd_callback(self.flush)

    def flush(self) -> None:
        with self._lock:
            pending, self._open, self._queued = self._open, [], False
        for p in pending:
            p.finish()


def _backward_name(fwd_name: str, prefix: str) -> str:
    """Forward ``output.1`` -> backward ``input.1``; forward ``input.weight`` -> backward ``output.weight``."""
    rest = fwd_name.split(".", 1)[1] if "." in fwd_name else "0"
    return f"{prefix}.{rest}"


def _in_shape(g: torch.Tensor, shape: Optional[Tuple[int, ...]]) -> torch.Tensor:
    """A base's gradient ``g`` as that of the view of all of it (``shape``); ``g`` itself when no shape is given."""
    return g.reshape(shape) if shape is not None and tuple(g.shape) != shape and g.numel() == math.prod(shape) else g


def attach(name: str, edges: InputEdges, in_nodes: set, outputs: Sequence[Tuple[str, Any]],
           flusher: BackwardFlusher, emit: Callable, guard: Callable, min_seq: Optional[int] = None,
           on_start: Optional[Callable[[], None]] = None, reshapes: Optional[dict] = None) -> bool:
    """After the call: hook the call's autograd nodes so ``emit(name, grad_ins, grad_outs)`` runs in backward;
    ``on_start()`` runs when the first of them fires (the call's backward begins: its outputs' gradients arrive).
    ``reshapes``: from :func:`prepare`."""
    outs = [(n, t) for n, t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    if not outs or not edges:
        return False
    roots = [t.grad_fn for _, t in outs]
    walked = _walk(roots, edges, in_nodes, min_seq)
    if not walked or not walked[0]:
        return False
    into, users = walked
    roots_ids = {id(r) for r in roots}  # a node an output's gradient arrives at directly
    by_root: Dict[int, Tuple[Any, List[Tuple[int, str, Optional[Tuple[int, ...]]]]]] = {}
    for n, t in outs:
        if id(t.grad_fn) in in_nodes:  # the output is (a view of) an input: no gradient of its own
            continue
        node, nr, shape = t.grad_fn, t.output_nr, None
        base = _whole_view_base(t)
        # a view of all of a tensor the call made and used for nothing else (the base's node has the view's for
        # its only user, and is no output's: multi_head_attention's weights are a view of the softmax its bmm also
        # reads): its gradient is the base's, read at the base's node, which stays in the graph when the program
        # writes the view in place
        if base is not None and users.get(id(base.grad_fn)) == {id(t.grad_fn)} and id(base.grad_fn) not in roots_ids:
            node, nr, shape = base.grad_fn, base.output_nr, tuple(t.shape)
        by_root.setdefault(id(node), (node, []))[1].append((nr, _backward_name(n, "input"), shape))
    by_node: Dict[int, Tuple[Any, List[Tuple[int, List[str], Optional[Tuple[int, ...]]]]]] = {}
    for node, j, key in into:
        by_node.setdefault(id(node), (node, []))[1].append(
            (j, [_backward_name(x, "output") for x in edges[key]], (reshapes or {}).get(key)))
    p = _Pending(name, len(by_root) + len(by_node), flusher, emit, on_start)

    def make_pre(slots):
        def pre(grad_outputs):
            with guard():
                p.renew()
                for nr, bname, shape in slots:
                    g = grad_outputs[nr] if nr < len(grad_outputs) else None
                    if g is not None:
                        p.grad_out[bname] = _in_shape(g, shape)
                p.fire()
        return pre

    def make_post(slots):
        def post(grad_inputs, grad_outputs):
            with guard():
                p.renew()
                for j, bnames, shape in slots:
                    g = grad_inputs[j]
                    if g is not None:
                        for b in bnames:
                            p.grad_in.setdefault(b, []).append(_in_shape(g, shape))
                p.fire()
        return post

    for node, slots in by_root.values():
        node.register_prehook(make_pre(slots))
    for node, slots in by_node.values():
        node.register_hook(make_post(slots))
    return True
