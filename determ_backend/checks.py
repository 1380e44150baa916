"""Running a compiled graph under determ: tracing and the online checks.

:class:`GraphExec` wraps a compiled callable.  On every call it runs the graph
(instrumented, so a :class:`~determ_backend.recorder.Recorder` captures each
node), writes the records to the run's trace, and applies the configured checks:

* ``determinism``: the graph is first executed on cloned inputs with the RNG
  state saved, then (RNG restored) on the real inputs; records whose
  fingerprints differ are compared and the root cause reported.
* ``accuracy``: every captured value is compared with an eager execution of the
  same FX graph on the same inputs, judged against an fp64 execution
  (:func:`~determ_backend.compare.fp64_close`).
* ``reference``: records are compared online with a trace from another run
  (:class:`~determ_backend.run.ReferenceTrace`, read when the run is created):
  bitwise when both were recorded on the same device and dtype, else within
  ``DETERM_TOL`` as ``repro-tools xdevice`` compares traces (also when
  ``DETERM_TOL`` is given).  A graph call with no counterpart in the reference
  is a checker error, never a silent pass.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.fx as fx

from . import devices
from .compare import Comparison, Pair, align, compare_traces, find_roots, fp64_close, tensor_metrics
from .config import DetermConfig
from .recorder import CallResult, Recorder
from .run import Run
from .trace import Record

__all__ = ["GraphExec", "clone_inputs", "eager_node_values"]

log = logging.getLogger(__name__)


def clone_inputs(args: Sequence[Any]) -> List[Any]:
    """Clones preserving strides (``requires_grad`` kept) of every tensor argument."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            c = torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=a.device)
            with torch.no_grad():
                c.copy_(a)
            c.requires_grad_(a.requires_grad)
            out.append(c)
        else:
            out.append(a)
    return out


class _Capture(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm, garbage_collect_values=False)
        self.values: Dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        v = super().run_node(n)
        if isinstance(v, torch.Tensor):
            self.values[n.name] = v.detach().clone()
        return v


def _to64(args: Sequence[Any]) -> List[Any]:
    return [a.detach().to(torch.float64) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]


def _device_of(args: Sequence[Any]) -> Optional[str]:
    """The device type of the first tensor argument (where a graph computes)."""
    return next((a.device.type for a in args if isinstance(a, torch.Tensor)), None)


def eager_node_values(gm: fx.GraphModule, args: Sequence[Any]) -> Dict[str, torch.Tensor]:
    """Every tensor node's value from an eager (FX Interpreter) run of ``gm``."""
    interp = _Capture(gm)
    with torch.no_grad():
        interp.run(*args)
    return interp.values


class GraphExec:
    """A compiled graph plus determ's recording and checks.  ``boxed`` follows AOT's calling convention."""

    def __init__(self, fn: Callable, recorder: Recorder, run: Run, config: DetermConfig,
                 reference_gm: Optional[fx.GraphModule] = None, boxed: bool = False):
        self.fn, self.recorder, self.run, self.config = fn, recorder, run, config
        self.reference_gm, self.boxed = reference_gm, boxed
        self._boxed_call = boxed
        self._unmatched: set = set()  # (graph, stage) already reported as missing from the reference
        recorder.keep_values = "accuracy" in config.check or config.save_tensors

    def _invoke(self, args: List[Any]) -> Any:
        return self.fn(args) if self.boxed else self.fn(*args)

    def __call__(self, *call_args: Any) -> Any:
        if self.boxed:
            (args,) = call_args
            args_list = list(args)
            args.clear()
        else:
            args_list = list(call_args)
        if self.run.device is None:
            self.run.device = _device_of(args_list)
        checks = self.config.check
        twin: Optional[CallResult] = None
        eager_args = clone_inputs(args_list) if "accuracy" in checks and self.reference_gm is not None else None
        if "determinism" in checks:
            rng = devices.get_rng_state()
            self._invoke(clone_inputs(args_list))
            twin = self.recorder.end_call(count=False)
            devices.set_rng_state(rng)
        rng_before = devices.get_rng_state() if eager_args is not None else None
        out = self._invoke(args_list)
        result = self.recorder.end_call()
        if self.config.save_tensors:
            self.run.store_payloads(result)
        self.run.write(result.records)
        if twin is not None:
            self._check_determinism(twin, result)
        if eager_args is not None:
            self._check_accuracy(eager_args, result, rng_before)
        if self.config.reference:
            self._check_reference(result)
        return out

    def _check_determinism(self, twin: CallResult, result: CallResult) -> None:
        cmp = compare_traces(twin.records, result.records)
        if cmp.divergent:
            self.run.add_finding("determinism", cmp.summary(["determinism"]))

    def _check_accuracy(self, eager_args: List[Any], result: CallResult, rng_state) -> None:
        cur = devices.get_rng_state()
        try:
            devices.set_rng_state(rng_state)
            ref = eager_node_values(self.reference_gm, eager_args)
            try:
                devices.set_rng_state(rng_state)
                ref64 = eager_node_values(self.reference_gm, _to64(eager_args))
            except Exception as e:  # some graphs do not run in fp64; judge without the fp64 reference
                log.info("determ accuracy: fp64 reference failed (%s); comparing against eager only", e)
                ref64 = {}
        except Exception as e:
            self.run.add_checker_error("accuracy", f"eager reference run failed: {type(e).__name__}: {e}\n"
                                                   f"{traceback.format_exc(limit=3)}")
            return
        finally:
            devices.set_rng_state(cur)
        pairs = self._accuracy_pairs(result, ref, ref64)
        cmp = find_roots(pairs, mode=f"fp64 tol={self.config.tol:g}")
        if cmp.divergent:
            self.run.add_finding("accuracy", cmp.summary(["accuracy"]))

    def _accuracy_pairs(self, result: CallResult, ref: Dict[str, torch.Tensor], ref64: Dict[str, torch.Tensor]) -> List[Pair]:
        pairs: List[Pair] = []
        for rec in result.records:
            name = (rec.extra or {}).get("placeholder") or rec.node.split("#")[0]
            got = result.values.get(rec.node)
            exp = ref.get(name)
            p = Pair(rec, rec)
            if got is None or exp is None or rec.kind == "output":
                p.equal = None if rec.kind != "input" and rec.kind != "param" else True
            else:
                e64 = ref64.get(name)
                if got.shape != exp.shape:
                    try:
                        exp = exp.reshape(got.shape)
                        e64 = e64.reshape(got.shape) if e64 is not None else None
                    except RuntimeError:
                        p.equal = None
                        pairs.append(p)
                        continue
                p.equal = fp64_close(exp, got, e64, tol=self.config.tol, multiplier=self.config.fp64_multiplier)
                if not p.equal:
                    m = tensor_metrics(got, exp, e64)
                    if "err_a_vs_fp64" in m:
                        m["err_compiled_vs_fp64"] = m.pop("err_a_vs_fp64")
                        m["err_eager_vs_fp64"] = m.pop("err_b_vs_fp64")
                    p.metrics = m
            pairs.append(p)
        return pairs

    def _check_reference(self, result: CallResult) -> None:
        if not result.records:
            return
        ref = self.run.reference
        r0 = result.records[0]
        group = ref.groups.get((r0.graph, r0.stage, r0.call))
        if group is None:
            self._report_unmatched(r0)
            return
        pairs = align(group, result.records)
        other_dtype = any(p.a.dtype != p.b.dtype for p in pairs if p.a is not None and p.b is not None
                          and p.a.dtype and p.b.dtype)
        other_device = bool(ref.device and self.run.device and ref.device != self.run.device)
        tol = self.config.tol if other_dtype or other_device or "tol" in self.config.given else None
        store = self.run.tensors if self.config.save_tensors else None
        cmp = compare_traces(group, result.records, tol=tol, store_a=ref.store, store_b=store, pairs=pairs)
        if cmp.divergent:
            self.run.add_finding("reference", cmp.summary(["reference"]))

    def _report_unmatched(self, r0: Record) -> None:
        """One checker error per graph and stage that the reference cannot be compared with."""
        if (r0.graph, r0.stage) in self._unmatched:
            return
        self._unmatched.add((r0.graph, r0.stage))
        ref = self.run.reference
        calls = ref.calls(r0.graph, r0.stage)
        if calls:
            why = (f"the reference recorded {calls} call(s) of graph {r0.graph} stage {r0.stage}; "
                   f"calls from {r0.call} on are not compared")
        else:
            why = (f"no records of graph {r0.graph} stage {r0.stage} to compare with (the reference has "
                   f"{', '.join(ref.graph_stages()) or 'no records'}; record it with the same backend and model)")
        self.run.add_checker_error("reference", f"{ref.name}: {why}")
