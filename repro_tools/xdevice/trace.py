"""One graph, two devices: per-node values on each side, paired and judged, root cause.

:func:`trace_on_device` runs a GraphModule on a device spec (``cuda:0``,
``cpu:float64``, ...; the graph's constants and inputs moved there by
:mod:`determ_backend.backends.retarget`) through determ's FX instrumentation and keeps
every node's value.  :func:`compare_devices` pairs two such runs node by node,
judges each pair with the compare core's :func:`determ_backend.compare.judge`
(within ``tol``, or side B's error vs a CPU float64 execution of the graph within
the fp64 multiplier of side A's, when neither side is float64 itself) and applies
the causal root-cause rule of :mod:`determ_backend.compare.roots`.

The command line (``repro-tools xdevice``) lives in :mod:`repro_tools.xdevice.core`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.fx as fx

from determ_backend.compare import (DEFAULT_FP64_MULTIPLIER, Comparison, Pair, dtype_tol, find_roots, judge,
                                    tensor_metrics)
from determ_backend.devices import parse_device_spec
from determ_backend.backends.instrument import graph_node_infos, instrument_graph
from determ_backend.backends.recorder import CallResult, Recorder
from determ_backend.backends.retarget import converter, moved_graph
from determ_backend.backends.upstream import Upstream, move_innocent_roots
from determ_backend import devices

__all__ = ["trace_on_device", "compare_devices", "reference_spec", "move_roots_upstream"]

_SEED = 1234


def trace_on_device(gm: fx.GraphModule, inputs: Sequence[Any], spec: str, stage: str = "xdevice") -> CallResult:
    """Every node's record and value (moved to the CPU) for ``gm`` on device spec ``spec``."""
    conv = converter(spec)
    g = moved_graph(gm, conv)
    infos, index = graph_node_infos(g)
    rec = Recorder("g0", stage, infos, stats=True, run=spec)
    rec.keep_values = True
    inst = instrument_graph(g, rec, index)
    args = [conv(x.detach().clone()) if isinstance(x, torch.Tensor) else x for x in inputs]
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(_SEED)
        inst(*args)
    result = rec.end_call()
    result.values = {k: v.cpu() for k, v in result.values.items()}
    return result


def reference_spec(specs: Sequence[str]) -> Optional[str]:
    """``cpu:float64`` unless one side already computes in float64 (then no separate reference)."""
    for s in specs:
        if parse_device_spec(s)[1] == torch.float64:
            return None
    return "cpu:float64"


def compare_devices(a: CallResult, b: CallResult, tol: float,
                    reference: Optional[CallResult] = None) -> Comparison:
    """Pair the records of two runs of one graph by node, judge each pair within ``tol``, find the roots."""
    by_node = {r.node: r for r in b.records}
    ref_values: Dict[str, torch.Tensor] = reference.values if reference is not None else {}
    pairs: List[Pair] = []
    widened = set()  # the narrow dtypes a tolerance was widened for
    for ra in a.records:
        rb = by_node.get(ra.node)
        p = Pair(ra, rb)
        va, vb = a.values.get(ra.node), b.values.get(ra.node)
        if rb is not None and va is not None and vb is not None:
            ref = ref_values.get(ra.node)
            ref = ref if ref is not None and ref.shape == va.shape else None
            p.equal = judge(va, vb, ref, tol=tol, fp64_multiplier=DEFAULT_FP64_MULTIPLIER, strict=True,
                            symmetric=True)
            if p.equal is False and _within_narrow_rounding(va, vb, tol):
                p.equal = True
                widened.update(str(d).replace("torch.", "") for d in (va.dtype, vb.dtype) if d.itemsize < 4)
            if p.equal is False:
                p.metrics = tensor_metrics(va, vb, ref)
        pairs.append(p)
    mode = f"tol={tol:g}" + (f" (a few units in the last place of {', '.join(sorted(widened))} where a side computes "
                             f"in it)" if widened else "")
    return find_roots(pairs, mode, strict=True)


def _within_narrow_rounding(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    """Whether two values of which one is computed in bfloat16 or float16 agree to a few units in the last place of
    that dtype (:func:`~determ_backend.compare.dtype_tol`) of each element and of the value's RMS size: one unit of
    bfloat16 is 7.8e-3, far beyond a --tol of 1e-3 (a healthy bf16 LayerNorm was named against float64), while a
    softmax whose probabilities (each far below 0.03) are twice what they should be is not within it."""
    wide = dtype_tol(tol, a.dtype, b.dtype)
    if wide <= tol or not (a.is_floating_point() and b.is_floating_point()) or a.shape != b.shape or not b.numel():
        return False
    x, y = a.detach().double().cpu(), b.detach().double().cpu()
    size = float(y.pow(2).mean().sqrt())
    return bool(torch.allclose(x, y, atol=wide * size, rtol=wide, equal_nan=True))


def move_roots_upstream(cmp: Comparison, gm: fx.GraphModule, inputs: Sequence[Any], spec_b: str, a: CallResult,
                        b: CallResult, tol: float, reference: Optional[CallResult] = None) -> None:
    """A root whose node, run as side ``b`` runs it on side ``a``'s values of its inputs, gives side ``a``'s value
    (relative to its size) computes the same on both devices: the difference came in through inputs that passed the
    absolute tolerance only because they are small (a LayerNorm after a float32 cancellation).  The root moves to
    the input that carries it (:mod:`determ_backend.backends.upstream`)."""
    if not cmp.root_causes:
        return
    conv = converter(spec_b)
    g = moved_graph(gm, conv)
    args = [conv(x.detach().clone()) if isinstance(x, torch.Tensor) else x for x in inputs]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)  # as trace_on_device ran each side
        rng = devices.get_rng_state()
    ref = reference.values if reference is not None else {}
    up = Upstream(g, args, rng, a.values, b.values, tol, convert=conv)

    def remeasure(name: str) -> Dict[str, Any]:
        return tensor_metrics(a.values[name], b.values[name], ref.get(name))

    move_innocent_roots(cmp, up, lambda p: p.rec.node if p.rec.kind == "node" else None, remeasure)
