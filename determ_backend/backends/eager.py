"""Running an FX graph eagerly, node by node: the one interpreter behind every reference value.

:class:`EagerInterpreter` runs a graph (or a few of its nodes) eagerly, keeps every
node's value when asked, and lets named nodes yield a given value instead of their
own (the causal replay: what one value does downstream).  On it:

* :func:`run_eager` -- a graph's outputs, computed eagerly;
* :func:`eager_node_values` -- every node's value (and ``output.K`` per output leaf);
* :func:`replay` -- the same on clones of the inputs, from a given RNG state, with
  substituted values: the accuracy check's eager reference and its confirmation of
  root-cause candidates (:mod:`determ_backend.backends.checks`), and the minifier's
  reference values and causal confirmation (:mod:`repro_tools.minify`);
* :meth:`EagerInterpreter.run_nodes` -- some nodes alone, on values recorded
  elsewhere (the minifier's local error of a node or a fused region).

Cutting part of a graph out as a graph of its own lives in
:mod:`determ_backend.backends.extract`; cloning inputs in :mod:`determ_backend.clones`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Collection, Dict, List, Mapping, Optional, Sequence

import torch
import torch.fx as fx

from determ_backend import _torch_compat, devices
from determ_backend.backends.instrument import held_written, uses_functorch
from determ_backend.clones import attributes_dtype, clone_inputs, written_attributes

__all__ = ["EagerInterpreter", "run_eager", "eager_node_values", "replay", "holds_collectives", "RankLocalReplay"]

_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


class EagerInterpreter(fx.Interpreter):
    """Runs a (compiled graph's) FX graph eagerly.  A functional ``view`` of a compiled graph may assume
    the layout inductor chose for its input; eagerly that input can be laid out otherwise, and the value
    is the same ``reshape``.

    ``record``: :attr:`values` keeps every node's value by node name -- tensors as detached clones,
    other values (sizes, scalars, the tuple of a multi-output op) as they are -- and each tensor leaf of
    the output as ``output.K``.  ``inject``: nodes (by name) that yield the given value (a clone of a
    tensor) instead of computing their own.  ``keep``: with ``record``, only these nodes' values are kept.
    The tensor attributes the graph writes (:func:`~determ_backend.clones.mark_written`) are read as copies,
    made at their first read in this run: the run writes into those, never into the program's tensors; a
    graph marked to read its float attributes in another dtype (:func:`~determ_backend.clones.read_attributes_in`:
    a float64 reference) reads them as copies in that dtype."""

    def __init__(self, gm: fx.GraphModule, record: bool = False, inject: Optional[Mapping[str, Any]] = None,
                 garbage_collect_values: bool = True, keep: Optional[Collection[str]] = None):
        super().__init__(gm, garbage_collect_values=garbage_collect_values)
        self.record = record
        self.inject = dict(inject or {})
        self.keep = None if keep is None else frozenset(keep)
        self.values: Dict[str, Any] = {}
        self._written = written_attributes(gm)
        self._widen = attributes_dtype(gm)
        self._copies: Dict[str, Any] = {}

    def fetch_attr(self, target: str) -> Any:
        v = super().fetch_attr(target)
        if not isinstance(v, torch.Tensor):
            return v
        widen = self._widen is not None and v.is_floating_point()
        if not widen and target not in self._written:
            return v
        if target not in self._copies:  # one copy per target: two reads of it alias, as in the graph
            self._copies[target] = v.detach().to(self._widen, copy=True) if widen else clone_inputs([v])[0]
        return self._copies[target]

    def run_node(self, n: fx.Node) -> Any:
        if held_written(n) is not None:
            return self._run_writer(n)
        if n.name in self.inject:
            v = self.inject[n.name]
            v = v.clone() if isinstance(v, torch.Tensor) else v
        else:
            v = self._compute(n)
        if self.record and (self.keep is None or n.name in self.keep):
            self._keep(n, v)
        return v

    def _run_writer(self, n: fx.Node) -> Any:
        """An item assignment or in-place foreach op (:func:`~determ_backend.backends.instrument.held_written`): its
        value is what it wrote (``n``, or ``n.j`` for the j-th tensor of a foreach op), kept and substituted there;
        its own value is None."""
        written = self.fetch_args_kwargs_from_env(n)[0][0]
        v = self._compute(n)
        many = isinstance(written, (list, tuple))
        # inside a vmap or grad the written tensors are wrappers: what they wrote is in the tensors they wrap
        functorch = _torch_compat.functorch_active()
        with _torch_compat.functorch_disabled() if functorch else contextlib.nullcontext():
            for j, t in enumerate(written if many else (written,)):
                key = f"{n.name}.{j}" if many else n.name
                if not isinstance(t, torch.Tensor):
                    continue
                if functorch:
                    t = _torch_compat.functorch_unwrapped(t)
                if key in self.inject:
                    with torch.no_grad():
                        t.copy_(self.inject[key])
                if self.record and (self.keep is None or key in self.keep or n.name in self.keep):
                    self.values[key] = t.detach().clone()
        return v

    def _compute(self, n: fx.Node) -> Any:
        try:
            return super().run_node(n)
        except RuntimeError:
            if n.target not in _VIEWS:
                raise
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            return torch.ops.aten.reshape.default(*args, **kwargs)

    def _keep(self, n: fx.Node, v: Any) -> None:
        if _torch_compat.functorch_active():  # inside a vmap or grad: kept as the plain tensor the wrapper wraps
            with _torch_compat.functorch_disabled():
                self._keep_plain(n, _torch_compat.functorch_unwrapped(v))
            return
        self._keep_plain(n, v)

    def _keep_plain(self, n: fx.Node, v: Any) -> None:
        if n.op != "output":
            self.values[n.name] = v.detach().clone() if isinstance(v, torch.Tensor) else v
            return
        leaves: List[Any] = []
        fx.node.map_aggregate(v, leaves.append)
        for k, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                self.values[f"output.{k}"] = leaf.detach().clone()

    def run_nodes(self, nodes: Sequence[fx.Node], values: Mapping[str, Any], to64: bool = False) -> Any:
        """Runs only ``nodes`` (compute nodes of this graph, in graph order); what they read from outside
        them comes from ``values`` (by node name; tensors cloned, floating ones in float64 with ``to64``).
        Returns the last node's value."""
        inside = set(nodes)
        self.env = {}
        for n in nodes:
            for a in n.all_input_nodes:
                if a not in inside and a not in self.env:
                    self.env[a] = _fresh(values[a.name], to64)
            self.env[n] = self.run_node(n)
        return self.env[nodes[-1]]


def _fresh(v: Any, to64: bool) -> Any:
    if not isinstance(v, torch.Tensor):
        return v
    # copy=True: a float64 value must not come back as the same storage (the nodes run may write in place)
    return v.detach().to(torch.float64, copy=True) if to64 and v.is_floating_point() else v.clone()


def run_eager(gm: fx.GraphModule, args: Sequence[Any]) -> Any:
    """``gm(*args)`` through :class:`EagerInterpreter`."""
    return EagerInterpreter(gm).run(*args)


def eager_node_values(gm: fx.GraphModule, args: Sequence[Any], inject: Optional[Mapping[str, Any]] = None,
                      keep: Optional[Collection[str]] = None) -> Dict[str, Any]:
    """Every node's value (and ``output.K`` per output leaf), or only those named in ``keep``, from an eager run
    of ``gm`` without autograd; nodes named in ``inject`` take the given values instead."""
    interp = EagerInterpreter(gm, record=True, inject=inject, keep=keep)
    # a graph of ``torch.func.grad`` computes gradients itself: under no_grad they came out as zeros
    with torch.no_grad() if not uses_functorch(gm) else contextlib.nullcontext():
        interp.run(*args)
    return interp.values


class RankLocalReplay(RuntimeError):
    """A replay that only this rank would run, of a graph holding collectives: refused before it starts."""


_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "c10d", "_dtensor"})


def holds_collectives(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` calls a ``torch.distributed`` collective (a functional ``all_reduce`` and its wait...)."""
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        module = str(getattr(n.target, "__module__", ""))
        # an operator overload names its namespace; a Dynamo graph's packet (``_c10d_functional.all_reduce``) lives
        # in ``torch._ops.<namespace>``
        namespace = str(getattr(n.target, "namespace", None) or (module.split(".")[2] if module.startswith(
            "torch._ops.") else ""))
        if namespace in _COLLECTIVE_NAMESPACES or module.startswith("torch.distributed"):
            return True
    return False


def replay(gm: fx.GraphModule, args: Sequence[Any], rng_state: Dict[str, Any],
           inject: Optional[Mapping[str, Any]] = None, keep: Optional[Collection[str]] = None,
           rank_local: bool = False) -> Dict[str, Any]:
    """:func:`eager_node_values` on clones of ``args`` with the RNG (CPU and accelerators,
    :func:`determ_backend.devices.get_rng_state`) in ``rng_state`` for the run; the caller's RNG state is
    restored after.  Two replays from one state that differ only in ``inject`` differ only by what the
    substituted values do downstream: random ops draw the same numbers in both.

    ``rank_local``: a replay this rank alone may run (a candidate's confirmation, a NaN's origin), refused with
    :class:`RankLocalReplay` when ``gm`` holds collectives and several ranks run: its collectives would wait
    for ranks that never join, or pair with their next real ones, and the job would hang or fail."""
    if rank_local and devices.world_size() > 1 and holds_collectives(gm):
        raise RankLocalReplay("not replayed: the graph holds collectives that every rank would have to join")
    current = devices.get_rng_state()
    try:
        devices.set_rng_state(rng_state)
        return eager_node_values(gm, clone_inputs(args), inject, keep)
    finally:
        devices.set_rng_state(current)
