"""Cutting part of an FX graph out as a runnable graph of its own.

Two pieces, shared by the accuracy check's narrowing inside a fused kernel
(:mod:`determ_backend.backends.narrow`) and the minifier (its candidates and its
kernel regions, :mod:`repro_tools.minify.subgraph` and
:mod:`repro_tools.minify.passes.kernel_regions`):

* :func:`walk_back` -- the nodes behind one node, walking its producers while a
  rule says so (which nodes join, which are walked through, where to stop);
* :func:`extract` -- some nodes as a ``GraphModule`` whose inputs are the values
  (recorded elsewhere) of the nodes they read from outside, and whose outputs are
  the nodes asked for;
* :func:`lift_random_draws` -- a graph whose random draws are inputs instead, fed
  the values one eager run drew (used by the level-4 accuracy check after AOT).

What is judged inside the cut, and how, is the callers' business; running it is
:mod:`determ_backend.backends.eager`'s.
"""

from __future__ import annotations

import enum
import copy
import functools
import operator
from typing import Any, Callable, Dict, Hashable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from determ_backend import _torch_compat, devices
from determ_backend.backends.eager import replay
from determ_backend.modes.ops import call_draws_random, draws_random

__all__ = ["Step", "walk_back", "extract", "MissingValue", "KEEP_META", "Lifted", "lift_random_draws", "node_draws"]

KEEP_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "original_aten")
"""Node meta copied into the cut: where each node came from in the user's code."""


class Step(enum.Enum):
    """What :func:`walk_back` does at a producer."""

    JOIN = "join"
    """the producer is part of the region, and its own producers are walked"""
    PASS = "pass"
    """the producer is not part of the region, but its producers are walked"""
    STOP = "stop"
    """the producer is outside the region and the walk ends there"""


def walk_back(root: fx.Node, step: Callable[[fx.Node], Step], limit: Optional[int] = None,
              order: Optional[Mapping[str, int]] = None) -> Optional[List[fx.Node]]:
    """``root`` and the producers ``step`` joins, walking back from ``root``'s inputs, in graph order
    (``order``: node name -> position, computed from the graph when not given).  None when more than
    ``limit`` nodes join."""
    keep: Dict[str, fx.Node] = {root.name: root}
    seen = {root.name}
    stack = list(root.all_input_nodes)
    while stack:
        a = stack.pop()
        if a.name in seen:
            continue
        seen.add(a.name)
        what = step(a)
        if what is Step.STOP:
            continue
        if what is Step.JOIN:
            keep[a.name] = a
            if limit is not None and len(keep) > limit:
                return None
        stack.extend(a.all_input_nodes)
    if order is None:
        order = {n.name: i for i, n in enumerate(root.graph.nodes)}
    return sorted(keep.values(), key=lambda n: order[n.name])


def graph_snapshot(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule running a copy of ``gm``'s graph (subgraphs of higher-order ops copied likewise) on
    ``gm``'s own tensor constants and modules, which are shared, not copied.

    Compilers rewrite the graph they are given in place; the snapshot keeps the graph as it was handed
    over.  No tensor is created, so it can be taken under a fake tensor mode, where copying a real
    constant fails."""
    snap = fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    snap.meta.update(getattr(gm, "meta", {}))
    for target in {n.target for n in snap.graph.nodes if n.op in ("get_attr", "call_module")}:
        *path, leaf = target.split(".")
        owner = functools.reduce(getattr, path, snap)
        own = not path or owner is not functools.reduce(getattr, path, gm)  # never set an attribute of gm's
        if own and isinstance(getattr(owner, leaf), fx.GraphModule):
            setattr(owner, leaf, graph_snapshot(getattr(owner, leaf)))
    return snap


def ancestors(node: fx.Node, limit: Optional[int] = None) -> set:
    """Names of the nodes ``node`` depends on (with ``limit``: the walk stops once it has that many)."""
    seen: set = set()
    stack = list(node.all_input_nodes)
    while stack and (limit is None or len(seen) < limit):
        a = stack.pop()
        if a.name not in seen:
            seen.add(a.name)
            stack.extend(a.all_input_nodes)
    return seen


class MissingValue(LookupError):
    """:func:`extract` has no value for a node the cut reads (``.node``: its name)."""

    def __init__(self, node: str):
        super().__init__(node)
        self.node = node


def extract(root: torch.nn.Module, nodes: Sequence[fx.Node], outputs: Sequence[str], values: Mapping[str, Any], *,
            inline_scalars: bool = False,
            merge_key: Optional[Callable[[Any], Optional[Hashable]]] = None) -> Tuple[fx.GraphModule, List[Any]]:
    """``(module, inputs)``: ``nodes`` (of one graph, in graph order) as a graph of their own returning the
    tuple of ``outputs`` (node names).  Each node they read from outside becomes a placeholder of the same
    name, in graph order, fed its value in ``values``; :class:`MissingValue` when there is none.

    ``inline_scalars``: a Python scalar (a symbolic size's value) is written into the graph as a constant
    and only tensors become inputs (another value is missing).  ``merge_key``: inputs whose values get
    the same key (not None) share one placeholder.  ``root`` owns what ``get_attr`` and ``call_module``
    nodes reach."""
    inside = {n.name for n in nodes}
    graph_nodes = list(nodes[0].graph.nodes) if nodes else []
    outside = {a.name: a for n in nodes for a in n.all_input_nodes if a.name not in inside}
    g = fx.Graph()
    env: Dict[str, Any] = {}
    inputs: List[Any] = []
    merged: Dict[Hashable, fx.Node] = {}
    for a in (n for n in graph_nodes if n.name in outside):
        if a.name not in values:
            raise MissingValue(a.name)
        v = values[a.name]
        if inline_scalars and not isinstance(v, torch.Tensor):
            if not isinstance(v, (bool, int, float)):
                raise MissingValue(a.name)
            env[a.name] = v
            continue
        key = merge_key(v) if merge_key is not None else None
        if key is not None and key in merged:
            env[a.name] = merged[key]
            continue
        ph = g.placeholder(a.name)
        ph.meta = {k: a.meta[k] for k in KEEP_META if k in a.meta}
        env[a.name] = ph
        inputs.append(v)
        if key is not None:
            merged[key] = ph
    for n in nodes:
        new = g.node_copy(n, lambda a: env[a.name])
        new.meta = {k: n.meta[k] for k in KEEP_META if k in n.meta}
        env[n.name] = new
    g.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(root, g), inputs


class Lifted(NamedTuple):
    """A graph with its random draws as inputs (:func:`lift_random_draws`)."""

    gm: fx.GraphModule
    inputs: List[Any]
    """the original inputs, then one value per lifted draw"""
    draws: List[str]
    """the lifted nodes' names, in input order, each with its op: ``"inductor_random (prims.inductor_random)"``"""


def _saves_rng_around_a_draw(n: fx.Node) -> bool:
    """``run_and_save_rng_state(op, ...)`` around an op that draws (activation checkpointing's forward)."""
    return n.op == "call_function" and _torch_compat.is_run_and_save_rng_state(n.target) and bool(n.args) \
        and call_draws_random(n.args[0], n.args[1:], n.kwargs)


def node_draws(n: fx.Node) -> bool:
    """Whether running node ``n`` draws random numbers: a drawing op (``rand``, ``native_dropout``...), or
    ``run_and_save_rng_state`` around one."""
    return n.op == "call_function" and (call_draws_random(n.target, n.args, n.kwargs) or _saves_rng_around_a_draw(n))


def _items(n: fx.Node) -> List[fx.Node]:
    """The items of a tuple-valued node, when every use of it takes one; else the node itself."""
    users = list(n.users)
    if users and all(u.op == "call_function" and u.target is operator.getitem for u in users):
        return users
    return [n]


def _drawn_by(d: fx.Node) -> str:
    """The op a draw node holds a result of: ``aten.native_dropout.default``; under activation checkpointing,
    ``aten.native_dropout.default under run_and_save_rng_state`` (its saved state: ``... state``)."""
    n, first = d, None
    while n.target is operator.getitem and isinstance(n.args[0], fx.Node):
        first = n.args[1]
        n = n.args[0]
    if _saves_rng_around_a_draw(n):
        return f"{n.args[0]} under run_and_save_rng_state" + (" (the state it saved)" if d.args[0] is n and
                                                               first == 0 else "")
    return str(n.target)


def _draw_nodes(graph: fx.Graph) -> List[fx.Node]:
    """The nodes whose values are random draws, in graph order: a drawing op's node, or the items of a
    multi-output one's tuple (``native_dropout``'s output and mask); under ``run_and_save_rng_state`` (activation
    checkpointing), the state it saved and the drawing op's items."""
    out: List[fx.Node] = []
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if call_draws_random(n.target, n.args, n.kwargs):
            out.extend(_items(n))
        elif _saves_rng_around_a_draw(n):
            for item in _items(n):  # (state, the op's result)
                out.extend(_items(item) if item is not n and item.args[1] == 1 else [item])
    order = {n: i for i, n in enumerate(graph.nodes)}
    return sorted(out, key=order.__getitem__)


def _erase_dead(node: fx.Node, erased: set) -> None:
    """Erase ``node`` and then each producer left without users that is a computation (a placeholder stays, and
    so does an op with side effects other than drawing random numbers); adds their names to ``erased``."""
    stack = [node]
    while stack:
        n = stack.pop()
        if n.users or n.name in erased or n.op != "call_function":
            continue
        if n.is_impure() and not draws_random(n.target) and n.target is not operator.getitem \
                and not _saves_rng_around_a_draw(n):
            continue
        producers = n.all_input_nodes
        n.graph.erase_node(n)
        erased.add(n.name)
        stack.extend(producers)


def lift_random_draws(gm: fx.GraphModule, inputs: Sequence[Any]) -> Optional[Lifted]:
    """``gm`` with each random draw (:func:`_draw_nodes`) replaced by an input fed the value one eager run of
    ``gm`` on ``inputs`` drew; None when ``gm`` draws nothing.

    Eager and compiled code never draw the same numbers (inductor's random kernels follow their own seeds),
    so values downstream of a draw can only be compared once both sides read the same draws.  The seeds
    that fed only the lifted draws go with them.  ``gm`` is not changed (the result runs on a copy of its
    graph, sharing its parameters and constants); the caller's random state is left as it was."""
    draws = _draw_nodes(gm.graph)
    if not draws:
        return None
    # one eager run from the current random state, which is then restored: the caller's next draws are its own
    values = replay(gm, inputs, devices.get_rng_state(), keep={n.name for n in draws})
    lifted = fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    by_name = {n.name: n for n in lifted.graph.nodes}
    last = [n for n in lifted.graph.nodes if n.op == "placeholder"][-1:]
    placed: Dict[str, fx.Node] = {}
    erased: set = set()
    for d in reversed(draws):  # the last first: the seeds that fed only lifted draws are then gone, not lifted
        if d.name in erased:
            continue
        node = by_name[d.name]
        # each right after the graph's own inputs, so the lifted ones end up in graph order
        with (lifted.graph.inserting_after(last[0]) if last else
              lifted.graph.inserting_before(next(iter(lifted.graph.nodes)))):
            ph = lifted.graph.placeholder(f"random_{d.name}")
        ph.meta = {k: node.meta[k] for k in KEEP_META if k in node.meta}
        node.replace_all_uses_with(ph)
        placed[d.name] = ph
        _erase_dead(node, erased)
    order = {n: i for i, n in enumerate(lifted.graph.nodes)}
    kept = sorted((d for d in draws if d.name in placed), key=lambda d: order[placed[d.name]])
    new_inputs = list(inputs) + [values[d.name] for d in kept]
    labels = [f"{d.name} ({_drawn_by(d)})" for d in kept]
    lifted.graph.lint()
    lifted.recompile()
    return Lifted(lifted, new_inputs, labels)
