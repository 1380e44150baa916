"""Narrowing an accuracy root cause inside a fused kernel.

A compiled graph's trace holds one record per buffer a kernel writes, so the
causal rule (:mod:`determ_backend.compare.roots`) can only name the buffer whose
inputs agree while its value does not.  When inductor fused several FX nodes
into the kernel that wrote it (an ``add -> relu -> mul`` chain of which only the
``mul`` is stored, a relu whose buffer holds no node's value because a dropout
fallback consumed it), the guilty node is one of those nodes.

The **region** of such a root is its FX node plus every producer reached through
nodes that no record judged, stopping at judged values (which agree, since the
root's inputs do), graph inputs and constants.  Nodes a standalone compile could
not reproduce (random ops, higher-order ops) are not compiled: their eager values
enter the region as inputs, and the walk goes on through their producers.  The
region is compiled alone by the same compiler, fed the eager values at its
frontier, with **every node an output** so each one is stored; the first node in
graph order whose compiled value fails the verdict while its inputs inside the
region pass it is the culprit.  When none fails, the bug needs the whole kernel:
the buffer stays the answer and the region is listed with it.

The walk and the cut themselves are :mod:`determ_backend.backends.extract`'s (the
minifier cuts its candidates with them too); the eager values the region is fed
come from :mod:`determ_backend.backends.eager`.
"""

from __future__ import annotations

import collections
import logging
import operator
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx as fx

from determ_backend import _torch_compat, devices
from determ_backend.backends.eager import EagerInterpreter, holds_collectives
from determ_backend.backends.extract import MissingValue, Step, extract, walk_back
from determ_backend.backends.instrument import is_view, node_source, op_name
from determ_backend.trace.stream import dtype_name
from determ_backend.clones import clone_inputs
from determ_backend.modes.ops import call_draws_random, uninitialized

__all__ = ["region_of", "region_module", "narrow_root", "Narrowed", "CannotNarrow", "MAX_REGION"]

log = logging.getLogger(__name__)

MAX_REGION = 128
"""Regions with more compute nodes are not narrowed (the compile would be the size of the graph)."""

Judge = Callable[[Any, Any, Any], Optional[bool]]


class CannotNarrow(Exception):
    """The region cannot be compiled alone (a value at its frontier was not captured)."""


def _standalone(n: fx.Node) -> bool:
    """Whether ``n`` can be compiled alone with the value it computes in the graph: a deterministic aten
    op (or an item of one's tuple), not a random op or a higher-order op."""
    t = n.target
    if t is operator.getitem:
        src = n.args[0]
        return not isinstance(src, fx.Node) or src.op != "call_function" or _standalone(src)
    if not _torch_compat.is_op_overload(t):
        return False
    return not call_draws_random(t, n.args, n.kwargs)


def _step(judged: Set[str]) -> Callable[[fx.Node], Step]:
    """The region's walk: judged values, graph inputs and constants stop it; nodes a standalone compile
    could not reproduce are walked through without joining."""
    def step(a: fx.Node) -> Step:
        if a.op != "call_function" or a.name in judged:
            return Step.STOP
        return Step.JOIN if _standalone(a) else Step.PASS
    return step


def region_of(gm: fx.GraphModule, node: str, judged: Set[str], limit: int = MAX_REGION) -> List[fx.Node]:
    """The compute nodes behind ``node`` (module docstring), in graph order; [] when ``node`` is not a
    standalone compute node or the region exceeds ``limit`` nodes."""
    root = next((n for n in gm.graph.nodes if n.name == node), None)
    if root is None or root.op != "call_function" or not _standalone(root):
        return []
    return walk_back(root, _step(judged), limit=limit) or []


def region_module(nodes: Sequence[fx.Node], values: Dict[str, Any]) -> Tuple[fx.GraphModule, List[Any], List[str]]:
    """``(module, inputs, output names)``: ``nodes`` as a graph of their own returning every tensor they
    compute; what they read from outside becomes an input holding its value in ``values`` (a tensor)
    or a constant (a Python scalar, a symbolic size's value)."""
    outs = [n.name for n in nodes if isinstance(values.get(n.name), torch.Tensor)]
    try:
        mod, inputs = extract(torch.nn.Module(), nodes, outs, values, inline_scalars=True)
    except MissingValue as e:
        raise CannotNarrow(f"no captured value for {e.node}, which the region reads") from None
    return mod, inputs, outs


def _in_fresh_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a thread of its own, under this thread's compiler config: the check runs inside the
    compiled graph's call, whose thread-local dispatch state (AOT's runtime wrappers) a nested compile
    must not inherit, while the config (per thread too) must be the user's."""
    box: Dict[str, Any] = {}
    config = _torch_compat.config_snapshot()

    def target() -> None:
        try:
            with _torch_compat.config_applied(config):
                box["value"] = fn()
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    t = threading.Thread(target=target, name="determ-narrow")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class Narrowed:
    """What narrowing found: the culprit node (None when no node of the region diverges alone), its
    compiled value, and the region's node names."""

    def __init__(self, node: Optional[fx.Node], value: Optional[torch.Tensor], region: List[str]):
        self.node, self.value, self.region = node, value, region

    def describe(self) -> Dict[str, Any]:
        n, v = self.node, self.value
        if n is None or v is None:
            return {"node": None, "region": self.region}
        return {"node": n.name, "op": op_name(n), "source": node_source(n), "region": self.region,
                "dtype": dtype_name(v.dtype), "shape": list(v.shape)}


def _allocates(n: fx.Node) -> bool:
    """Whether node ``n`` returns memory as allocated (``empty``, ``empty_like``...), whose values mean nothing."""
    return n.op == "call_function" and _torch_compat.is_op_overload(n.target) and 0 in uninitialized(n.target)


def narrow_root(gm: fx.GraphModule, node: str, judged: Set[str], ref: Dict[str, Any], ref64: Dict[str, Any],
                compile_region: Callable[[fx.GraphModule, List[Any]], Callable], judge: Judge,
                local: Optional[Callable[[Any, Any, List[Any]], Optional[bool]]] = None) -> Optional[Narrowed]:
    """The first node of ``node``'s fused region (in graph order) whose compiled value fails ``judge``
    when the region is compiled alone; a :class:`Narrowed` with no node when none does; None when there
    is nothing to narrow (a region of one op; one holding collectives, which this rank alone would run, when
    several ranks run).  :class:`CannotNarrow` and the compiler's own errors
    propagate to the caller.

    ``local(expected, compiled, inputs)``: whether a node's compiled value is what eager computes from the
    node's own compiled ``inputs`` (up to the kernel's rounding).  A first failing node that passes it computes
    correctly from inputs that already carried the error, within ``judge``'s absolute tolerance (a 1% wrong
    ``mean`` of small squares, which ``rsqrt`` scales up): the culprit is then the first of its producers in the
    region that fails it (:func:`_computes_wrongly`)."""
    region = region_of(gm, node, judged)
    if sum(1 for n in region if n.target is not operator.getitem) < 2:
        return None
    mod, inputs, outs = region_module(region, ref)
    if devices.world_size() > 1 and holds_collectives(mod):  # run by this rank alone, they would desync the job:
        return None                                              # the kernel's buffer stays the answer

    def compile_and_run() -> Any:
        fn = compile_region(mod, clone_inputs(inputs))
        with torch.no_grad():
            return fn(*clone_inputs(inputs))

    got = _in_fresh_thread(compile_and_run)
    got = dict(zip(outs, got if isinstance(got, (tuple, list)) else [got]))
    names = [n.name for n in region]
    for n in region:
        # a view computes nothing: its value is its input's memory, which the region may write in place later (a
        # slice of an input that ``add_`` updates) -- never the culprit; nor is memory as allocated (``empty_like``
        # that a later ``index_put`` fills: two runs' garbage)
        if n.name in got and not is_view(n) and not _allocates(n) \
                and judge(ref[n.name], got[n.name], ref64.get(n.name)) is False:
            culprit = _computes_wrongly(gm, region, n, got, ref, local) if local is not None else n
            return Narrowed(culprit, got[culprit.name], names)
    log.info("determ accuracy: no node of %s's fused region diverges compiled alone", node)
    return Narrowed(None, None, names)


def _computes_wrongly(gm: fx.GraphModule, region: List[fx.Node], symptom: fx.Node, got: Dict[str, Any],
                      ref: Dict[str, Any], local: Callable[[Any, Any, List[Any]], Optional[bool]]) -> fx.Node:
    """``symptom``, unless it computes its compiled value from its compiled inputs: then the first of its producers
    in ``region`` (graph order) that does not -- run eagerly on the compiled values of its own inputs (the region's
    frontier on the eager ones), its value is not the compiled one; ``symptom`` when none is found."""
    interp = EagerInterpreter(gm, garbage_collect_values=False)
    values = collections.ChainMap(got, ref)

    def wrong(n: fx.Node) -> bool:
        if n.name not in got or is_view(n) or _allocates(n) or not _standalone(n):
            return False
        try:
            with torch.no_grad():
                mine = interp.run_nodes([n], values)
        except Exception:  # cannot tell
            return False
        ins = [values[a.name] for a in n.all_input_nodes if isinstance(values.get(a.name), torch.Tensor)]
        return local(mine, got[n.name], ins) is False

    if wrong(symptom):
        return symptom
    inside = {n.name for n in region}
    ancestors, stack = set(), [symptom]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a.name in inside and a.name not in ancestors:
                ancestors.add(a.name)
                stack.append(a)
    for n in region:
        if n.name in ancestors and wrong(n):
            return n
    return symptom
