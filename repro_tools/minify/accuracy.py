"""Is a compiled graph as accurate as eager?  ``same()`` over pytrees and ``same_two_models``.

The criterion is the one behind PyTorch's ``same(..., fp64_ref)``, the compare
core's :func:`determ_backend.compare.judge`: compiled may differ from eager when its
RMSE against an fp64 run stays within ``multiplier`` times eager's own RMSE.
Non-floating outputs are ignored unless ``strict`` (then compared exactly; with
``strict`` and ``tol == 0`` every output is compared bitwise).

:func:`same_two_models` never swallows an exception: a failure of the eager or
fp64 reference, or of the comparison itself, is a ``checker_error``; a failure of
the compiled function is a ``compiled_error``; both are distinct from a
divergence.  A graph whose eager run draws random numbers is ``not_judged``: eager and
compiled code never draw the same numbers (inductor's random kernels follow their own
seeds), so their values say nothing about the compiler.  The after-AOT flow first takes
such draws as inputs (:func:`determ_backend.backends.extract.lift_random_draws`), and
judges the graph that remains.  The flows that act on the verdict live in :mod:`repro_tools.flows.after_dynamo`
and :mod:`repro_tools.flows.after_aot`; the eager run is :func:`determ_backend.backends.eager.run_eager`
and the inputs' clones :func:`determ_backend.clones.clone_inputs`.
"""

from __future__ import annotations

import copy
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from determ_backend import _torch_compat as tc
from determ_backend import devices
from determ_backend.backends.checks import graph_in_dtype
from determ_backend.backends.eager import run_eager
from determ_backend.clones import (AttributeState, Saved, attribute_tensors, clone_inputs, mark_written,
                                   read_attributes_in, same_bits, written_attributes)
from determ_backend.compare import DEFAULT_FP64_MULTIPLIER, DEFAULT_TOL, judge, tensor_metrics

__all__ = ["same", "first_mismatch", "same_two_models", "AccuracyResult", "run_fwd_maybe_bwd", "cast_to_fp64",
           "cast_to", "call_maybe_boxed", "flatten"]

log = logging.getLogger(__name__)


def flatten(tree: Any) -> List[Any]:
    """Leaves of nested lists, tuples and dicts (dicts in key order), in order."""
    if isinstance(tree, (list, tuple)):
        return [leaf for v in tree for leaf in flatten(v)]
    if isinstance(tree, dict):
        return [leaf for k in sorted(tree, key=str) for leaf in flatten(tree[k])]
    return [tree]


def first_mismatch(ref: Any, res: Any, fp64_ref: Any = None, tol: float = DEFAULT_TOL,
                   multiplier: float = DEFAULT_FP64_MULTIPLIER, strict: bool = False) -> Optional[Tuple[int, str]]:
    """``(leaf index, description)`` of the first leaf where ``res`` is not as accurate as ``ref``, or None."""
    a, b = flatten(ref), flatten(res)
    if len(a) != len(b):
        return -1, f"different output structure: {len(a)} leaves vs {len(b)}"
    c = flatten(fp64_ref) if fp64_ref is not None else [None] * len(a)
    if len(c) != len(a):
        c = [None] * len(a)
    for i, (x, y, z) in enumerate(zip(a, b, c)):
        if judge(x, y, z, tol=tol, fp64_multiplier=multiplier, strict=strict) is False:
            return i, _describe(x, y, z)
    return None


def _describe(x: Any, y: Any, z: Any) -> str:
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
        return f"{type(x).__name__} {x!r:.60} vs {type(y).__name__} {y!r:.60}"
    m = tensor_metrics(x.detach(), y.detach(), z if isinstance(z, torch.Tensor) and z.shape == x.shape else None)
    keys = ("max_abs", "max_rel", "cosine", "err_a_vs_fp64", "err_b_vs_fp64", "shape_mismatch")
    names = {"err_a_vs_fp64": "eager_rmse_vs_fp64", "err_b_vs_fp64": "compiled_rmse_vs_fp64"}
    parts = [f"{names.get(k, k)}={m[k]:.3g}" if isinstance(m[k], float) else f"{names.get(k, k)}={m[k]}"
             for k in keys if k in m]
    return f"{tuple(x.shape)} {str(x.dtype).replace('torch.', '')}: " + " ".join(parts)


def same(ref: Any, res: Any, fp64_ref: Any = None, tol: float = DEFAULT_TOL,
         multiplier: float = DEFAULT_FP64_MULTIPLIER, strict: bool = False) -> bool:
    """Whether ``res`` is as accurate as ``ref`` (pytrees of tensors and Python values), judged against ``fp64_ref``."""
    return first_mismatch(ref, res, fp64_ref, tol, multiplier, strict) is None


def cast_to(dtype: torch.dtype, model: Any, inputs: Sequence[Any]) -> Tuple[Any, List[Any]]:
    """A deep copy of ``model`` (when it is a module) and of ``inputs`` with floating tensors in ``dtype``;
    a graph's own floating dtypes (factory ops, conversions) are ``dtype`` too."""
    if isinstance(model, torch.nn.Module):
        model = copy.deepcopy(model).to(dtype)
        if isinstance(model, fx.GraphModule):
            model = graph_in_dtype(model, dtype)
            # tensors the graph reads as plain attributes (not parameters or buffers: ``.to`` leaves them) in dtype
            # too, its own: a run updates them there, where the comparison reads what it wrote
            for target, t in attribute_tensors(model).items():
                if t.is_floating_point() and t.dtype != dtype:
                    *path, leaf = target.split(".")
                    owner = functools.reduce(getattr, path, model)
                    new = t.detach().to(dtype)
                    setattr(owner, leaf, torch.nn.Parameter(new, t.requires_grad)
                            if isinstance(t, torch.nn.Parameter) else new.requires_grad_(t.requires_grad))
            read_attributes_in(model, None)
    cast = []
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            cast.append(x.detach().to(dtype).requires_grad_(x.requires_grad))
        else:
            cast.append(x)
    return model, cast


def cast_to_fp64(model: Any, inputs: Sequence[Any]) -> Tuple[Any, List[Any]]:
    return cast_to(torch.float64, model, inputs)


def call_maybe_boxed(fn: Callable, args: Sequence[Any]) -> Any:
    """Call a compiled graph honouring the boxed calling convention (``_boxed_call``: one list argument)."""
    if tc.is_boxed(fn):
        return fn(list(args))
    return fn(*args)


def _fwd_bwd(fn: Callable, args: Sequence[Any], only_fwd: bool,
             params: Optional[Sequence[torch.Tensor]], after: Optional[List[Any]] = None) -> Tuple[List[Any], List[Any]]:
    """``after``: receives the argument copies the run was given, as the run left them."""
    args = clone_inputs(args)
    if after is not None:
        after.extend(args)
    if params is None:
        params = list(fn.parameters()) if isinstance(fn, torch.nn.Module) else []
    with torch.set_grad_enabled(torch.is_grad_enabled() and not only_fwd):  # as the graph was called
        eager = isinstance(fn, fx.GraphModule) and not tc.is_boxed(fn)
        outs = flatten(run_eager(fn, args) if eager else call_maybe_boxed(fn, args))
    diff = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad] + list(params)
    result = [o.detach() if isinstance(o, torch.Tensor) else o for o in outs]
    if only_fwd or not diff or not leaves:
        return result, []
    loss = sum(o.float().mean() if o.numel() else o.float().sum() for o in diff)
    return result, list(torch.autograd.grad(loss, leaves, allow_unused=True))


def run_fwd_maybe_bwd(fn: Callable, args: Sequence[Any], only_fwd: bool = False,
                      params: Optional[Sequence[torch.Tensor]] = None) -> List[Any]:
    """Outputs of ``fn(*clones of args)``, then (unless ``only_fwd``) the gradients of a scalar loss
    with respect to the inputs that require grad and ``params`` (default: ``fn``'s parameters)."""
    outs, grads = _fwd_bwd(fn, args, only_fwd, params)
    return outs + grads


@dataclass
class AccuracyResult:
    """The verdict of :func:`same_two_models`; truthy only when ``status == "same"``."""

    status: str
    """``same``, ``diverged``, ``compiled_error`` (the compiled function raised), ``checker_error`` or
    ``not_judged`` (the eager run drew random numbers)."""
    detail: str = ""
    leaf: Optional[int] = None
    error: Optional[BaseException] = field(default=None, repr=False)
    fp64: bool = True
    """Whether an fp64 reference took part in the verdict."""

    def __bool__(self) -> bool:
        return self.status == "same"


class _Writes:
    """What a run left besides its outputs: the argument copies it was given and its module's tensor attributes
    (a graph that updates state in place, a compiled optimizer step, returns nothing).  ``attrs_before``: the
    attributes' values when the run started, for a module whose attributes are put back after the run: what the
    run wrote is copied now.  Without it the attributes are read as they are (a module of the run's own)."""

    def __init__(self, args_after: Sequence[Any], attrs: Optional[AttributeState] = None,
                 attrs_before: Optional[Saved] = None):
        self.after = [a.detach() if isinstance(a, torch.Tensor) else a for a in args_after]  # the run's own copies
        self._state, self._before = attrs, attrs_before or {}
        self.attrs = {k: attrs.tensors[k].detach().clone() for k in attrs.changed(attrs_before)} \
            if attrs is not None and attrs_before else {}

    def attr(self, k: str) -> Optional[torch.Tensor]:
        """Attribute ``k`` as the run left it."""
        if k in self.attrs:
            return self.attrs[k]
        if k in self._before:  # not written: as the run found it
            return self._before[k][0]
        t = self._state.tensors.get(k) if self._state is not None else None
        return None if t is None else t.detach()


def _written(before: torch.Tensor, after: torch.Tensor) -> bool:
    if before.shape != after.shape or before.dtype != after.dtype or before.device != after.device:
        return True
    try:
        return not same_bits(before.detach(), after.detach())
    except Exception:  # a layout without bits to compare (sparse, nested): its outputs say what it did
        return False


def _written_leaves(inputs: Sequence[Any], ref: _Writes, res: _Writes,
                    ref64: Optional[_Writes]) -> Tuple[List[Any], List[Any], List[Any], List[str]]:
    """The values the runs wrote besides their outputs, in both runs and the float64 one, with a name for each:
    every input the eager run wrote (an input only the compiled code wrote is scratch memory it was given, as
    inductor reuses a donated buffer), and every attribute either run wrote (the other run's as it found it)."""
    a, b, c, names = [], [], [], []
    for i, (x, left) in enumerate(zip(inputs, ref.after)):
        if not (isinstance(x, torch.Tensor) and isinstance(left, torch.Tensor) and _written(x, left)):
            continue
        a.append(left)
        b.append(res.after[i] if i < len(res.after) else None)
        c.append(ref64.after[i] if ref64 is not None and i < len(ref64.after) else None)
        names.append(f"input {i} as the graph left it")
    for k in sorted(set(ref.attrs) | set(res.attrs)):
        a.append(ref.attr(k))
        b.append(res.attr(k))
        c.append(ref64.attr(k) if ref64 is not None else None)
        names.append(f"attribute {k} as the graph left it")
    return a, b, c, names


def _fp64_reference(gm: Callable, inputs: Sequence[Any], only_fwd: bool,
                    require_fp64: bool) -> Tuple[Optional[List[Any]], Optional[_Writes]]:
    try:
        m64, in64 = cast_to_fp64(gm, inputs)
        after: List[Any] = []
        outs, grads = _fwd_bwd(m64, in64, only_fwd, None, after)
        return outs + grads, _Writes(after, AttributeState(m64))  # m64 is the run's own: read as it is left
    except Exception as e:  # some ops have no fp64 kernel: say so, and judge with tolerance alone
        if require_fp64:
            raise
        log.warning("accuracy check: no fp64 reference (%s: %s); judging with tolerance only", type(e).__name__, e)
        return None, None


def same_two_models(gm: Callable, compiled_fn: Callable, example_inputs: Sequence[Any], only_fwd: bool = False, *,
                    tol: float = DEFAULT_TOL, multiplier: float = DEFAULT_FP64_MULTIPLIER, strict: bool = False,
                    require_fp64: bool = False, compiled_attributes: Optional[AttributeState] = None) -> AccuracyResult:
    """Compare ``compiled_fn`` with eager ``gm`` on clones of ``example_inputs`` (forward, and backward
    unless ``only_fwd``), against an fp64 run of ``gm``.  Parameters of ``gm`` are shared with ``compiled_fn``.
    The random state found on entry is restored on return: a check run inside the user's program (the level-4
    flows) leaves its dropout masks and later draws as they would be without it.  So are ``gm``'s tensor
    attributes, before each run too: every run starts from them (a compiled optimizer step updates its
    parameters and state in place).  What a run writes besides its outputs -- its inputs, its tensor attributes
    (``compiled_attributes``: those of the module ``compiled_fn`` was compiled from, when it is not ``gm``; they
    are put back too) -- is compared like an output: a step that returns nothing is judged by its updates."""
    state = devices.get_rng_state()
    attrs = AttributeState(gm)  # a graph that writes its own tensors (a compiled optimizer step's state)
    marks = written_attributes(gm)
    mark_written(gm, ())  # the eager run writes gm's own tensors, where the comparison reads them
    saved = attrs.save() if attrs.tensors else {}
    theirs = compiled_attributes if compiled_attributes is not None else attrs
    theirs_saved = theirs.save() if theirs is not attrs and theirs.tensors else saved
    try:
        return _same_two_models(gm, compiled_fn, example_inputs, only_fwd, tol, multiplier, strict, require_fp64,
                                (attrs, saved), (theirs, theirs_saved))
    finally:
        devices.set_rng_state(state)
        attrs.restore(saved)
        if theirs is not attrs:
            theirs.restore(theirs_saved)
        mark_written(gm, marks)


def _same_two_models(gm, compiled_fn, example_inputs, only_fwd, tol, multiplier, strict, require_fp64,
                     mine: Tuple[AttributeState, Saved], theirs: Tuple[AttributeState, Saved]) -> AccuracyResult:
    """``mine``/``theirs``: the tensor attributes of ``gm`` and of what ``compiled_fn`` runs, with their values on
    entry; each run starts from those, and what a run wrote is read before they are put back."""
    params = list(gm.parameters()) if isinstance(gm, torch.nn.Module) else []
    state = devices.get_rng_state()
    after: List[Any] = []
    try:
        ref, ref_grads = _fwd_bwd(gm, example_inputs, only_fwd, params, after)
    except Exception as e:
        return AccuracyResult("checker_error", f"the eager/fp64 reference raised {type(e).__name__}: {e}", error=e)
    if devices.rng_state_moved(state, devices.get_rng_state()):  # (higher-order ops too: no dispatch mode needed)
        return AccuracyResult("not_judged", "the graph draws random numbers (its eager run moved the random "
                                            "generator), and eager and compiled code do not draw the same ones")
    ref_writes = _Writes(after, *mine)
    mine[0].restore(mine[1])
    try:
        ref64, ref64_writes = _fp64_reference(gm, example_inputs, only_fwd, require_fp64)
    except Exception as e:
        return AccuracyResult("checker_error", f"the eager/fp64 reference raised {type(e).__name__}: {e}", error=e)
    mine[0].restore(mine[1])
    after = []
    try:
        res_outs, res_grads = _fwd_bwd(compiled_fn, example_inputs, only_fwd, params, after)
    except Exception as e:
        return AccuracyResult("compiled_error", f"{type(e).__name__}: {e}", error=e)
    try:
        a, b, c, names = _written_leaves(example_inputs, ref_writes, _Writes(after, *theirs), ref64_writes)
        ref_all, res_all = ref + ref_grads + a, res_outs + res_grads + b
        ref64_all = ref64 + c if ref64 is not None and len(ref64) == len(ref + ref_grads) else None
        bad = first_mismatch(ref_all, res_all, ref64_all, tol, multiplier, strict)
    except Exception as e:
        return AccuracyResult("checker_error", f"comparing outputs raised {type(e).__name__}: {e}", error=e)
    if bad is None:
        return AccuracyResult("same", fp64=ref64 is not None)
    i, what = bad
    n = len(ref) + len(ref_grads)
    label = "outputs" if i < 0 else f"output {i}" if i < len(ref) else f"gradient {i - len(ref)}" if i < n \
        else names[i - n]
    return AccuracyResult("diverged", f"{label}: {what}", leaf=i, fp64=ref64 is not None)
