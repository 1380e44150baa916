"""What the eager modes need to know about an op call.

* arguments and results: tensors anywhere in ``args``/``kwargs`` (also inside
  lists), the tensors an op returns or writes (:func:`written_tensors`), schema
  facts (writes, views, uninitialized outputs, pure copies);
* tensor identity: a memory key and version counter that survive a tensor crossing
  C++ and coming back as a new Python object;
* :func:`unseen`: run a mode's own work (fingerprints, metrics) below every dispatch
  mode, so an outer mode does not record it as the user's ops;
* which ops draw random numbers (:func:`draws_random`).

The recording itself lives in :mod:`determ_backend.modes._record`; which frames are
user code (an op's source and stack) in :mod:`determ_backend._frames`; private torch
(operator schemas, version counters, the dispatch mode stack) is reached through
:mod:`determ_backend._torch_compat`.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
from typing import Any, Dict, FrozenSet, Optional, Sequence, Tuple

import torch

from determ_backend import _torch_compat
from determ_backend.trace.stream import Record, format_hash

__all__ = ["iter_args", "tensor_args", "written_tensors", "schema_writes", "returns_view",
           "uninitialized", "uninitialized_hash", "COPIES", "same_layout", "version", "mem_key", "unseen",
           "wait_collective", "draws_random", "call_draws_random", "adopts_storage"]


def iter_args(args: Sequence, kwargs: Dict[str, Any], out: list, with_values: bool = False) -> list:
    """Append ``(path, value)`` for every tensor in ``args``/``kwargs``, also inside lists and tuples
    (non-tensor leaves too when ``with_values``).  Paths: ``args[0]``, ``args[1][2]``, ``weight=``."""
    for i, a in enumerate(args):
        _walk(f"args[{i}]", a, out, with_values)
    for k, v in kwargs.items():
        _walk(f"{k}=", v, out, with_values)
    return out


def tensor_args(args: Sequence, kwargs: Dict[str, Any]) -> list:
    """Every tensor in ``args``/``kwargs`` (also inside lists and tuples), in :func:`iter_args`' order, without
    building paths for the common case of tensors passed directly: what a mode that describes no arguments needs
    per op."""
    out: list = []
    for a in itertools.chain(args, kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)) and a and not isinstance(a, torch.Size):
            found: list = []
            _walk("", a, found, False)
            out.extend(t for _, t in found)
    return out


def _walk(path: str, a: Any, out: list, with_values: bool) -> None:
    if isinstance(a, torch.Tensor):
        out.append((path, a))
    elif isinstance(a, (list, tuple)) and a and not isinstance(a, torch.Size):
        for j, x in enumerate(a):
            _walk(f"{path}[{j}]", x, out, with_values)
    elif with_values:
        out.append((path, a))


# ops that write arguments their schema does not mark ``Tensor(a!)``: batch norm updates its running statistics when
# its ``training`` argument is true (a third item: the argument, by position and name, that must be true)
_UNDECLARED_WRITES = {name: ((3, "running_mean", (5, "training")), (4, "running_var", (5, "training")))
                      for name in ("aten::native_batch_norm", "aten::cudnn_batch_norm", "aten::miopen_batch_norm")}


# collectives that return only their ``Work`` and write their outputs without a ``Tensor(a!)`` in their schema (the
# others return the tensors they wrote); point-to-point receives are left out: their values are final only once the
# program waits, which the eager modes must not do for it (see wait_collective)
_COLLECTIVE_WRITES = {"c10d::" + name: ((0, arg),) for name, arg in (
    ("alltoall_base_", "output"), ("allgather_coalesced_", "output_lists"), ("allreduce_coalesced_", "tensors"),
    ("allgather_into_tensor_coalesced_", "outputs"), ("reduce_scatter_tensor_coalesced_", "outputs"),
    ("gather_", "output_tensors"), ("reduce_", "tensors"))}


def schema_writes(func, undeclared: bool = False) -> Tuple[tuple, ...]:
    """Positions and names of the arguments ``func`` writes to (``Tensor(a!)``, and the outputs of the collectives
    whose schema does not say so); ``undeclared``: also those it writes without saying so (batch norm's running
    statistics, in training: such an entry has a third item, the argument that says whether the call writes, which
    :func:`written_tensors` reads)."""
    schema = _torch_compat.op_schema(func)
    name = _torch_compat.op_schema_name(func)
    extra = (_UNDECLARED_WRITES.get(name, ()) if undeclared else ()) + _COLLECTIVE_WRITES.get(name, ())
    if schema is None or not schema.is_mutable:
        return extra
    return tuple((i, a.name) for i, a in enumerate(schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write) + extra


# ops whose output holds exactly the values of one input (when dtype and shape match): schema name -> arg index
COPIES = {"aten::clone": 0, "aten::_to_copy": 0, "aten::copy_": 1, "aten::detach": 0, "aten::alias": 0,
           "aten::lift_fresh": 0, "aten::lift_fresh_copy": 0}


_POINT_TO_POINT = ("c10d::send", "c10d::recv_", "c10d::recv_any_source_", "c10d::barrier", "c10d::monitored_barrier_")


def wait_collective(func, result: Any) -> None:
    """Wait for the work of a ``torch.distributed`` collective (``c10d.allreduce_`` returns its tensors and a
    ``Work``) before its outputs are read: the values are final only then.  Under the eager modes an asynchronous
    collective therefore completes before the next op runs (every rank issues collectives in one order, so this
    waits only for the others to join).  Sends, receives and barriers are left alone: waiting on a send could wait
    for a receive the program posts later."""
    name = _torch_compat.op_schema_name(func) or ""
    if not name.startswith("c10d::") or name in _POINT_TO_POINT:
        return
    for x in (result if isinstance(result, (tuple, list)) else (result,)):  # (tensors, Work), or the Work alone
        if isinstance(x, torch.ScriptObject) and hasattr(x, "wait"):
            x.wait()


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.stride() == b.stride() and a.storage_offset() == b.storage_offset()


def out_args(func) -> Tuple[Tuple[int, str], ...]:
    """Positions and names of ``func``'s ``out=`` arguments: memory it writes its result into without reading what
    was there (``mul.out``; DDP's reducer writes gradients into its bucket this way)."""
    schema = _torch_compat.op_schema(func)
    if schema is None or not schema.is_mutable:
        return ()
    return tuple((i, a.name) for i, a in enumerate(schema.arguments) if getattr(a, "is_out", False))


def out_tensor_ids(outs: Tuple[Tuple[int, str], ...], args: Sequence, kwargs: Dict[str, Any]) -> set:
    """``id()`` of every tensor passed as one of the ``out=`` arguments ``outs`` (:func:`out_args`) and as no other
    argument: ``torch.add(x, y, out=x)`` reads ``x``."""
    found: set = set()
    positions = {i for i, _ in outs}
    names = {n for _, n in outs}
    for i, name in outs:
        a = args[i] if i < len(args) else kwargs.get(name)
        found.update(id(t) for t in _leaves(a, []) if isinstance(t, torch.Tensor))
    read = [a for i, a in enumerate(args) if i not in positions] + [v for k, v in kwargs.items() if k not in names]
    return found - {id(t) for t in _leaves(read, []) if isinstance(t, torch.Tensor)}


# ops that return memory only partly written, by output position: FSDP2's ``all_gather_copy_in`` returns the
# all-gather buffer (``torch.empty``) with only this rank's shard copied in; the all-gather fills the rest; a
# ``resize_`` that grows a tensor keeps its elements and adds memory as the allocator left it
_PARTLY_WRITTEN = {"fsdp::all_gather_copy_in": frozenset({1}), "aten::resize_": frozenset({0}),
                   "aten::resize_as_": frozenset({0})}
class _Every(frozenset):
    """Every output position."""

    def __contains__(self, item) -> bool:
        return True


_ALL = _Every()


def uninitialized(func) -> FrozenSet[int]:
    """Positions of the outputs of ``func`` that hold uninitialized memory (all for ``empty``, ``empty_like``,
    ``new_empty_strided``...; the all-gather buffer of FSDP2's ``all_gather_copy_in``): fingerprinted by dtype
    and shape, never read."""
    schema = _torch_compat.op_schema(func)
    if schema is None:
        return frozenset()
    if "empty" in schema.name and not schema.is_mutable:
        return _ALL
    return _PARTLY_WRITTEN.get(schema.name, frozenset())


def adopts_storage(func) -> bool:
    """``set_(storage, ...)``: the tensor takes memory it did not compute, a batch a ``DataLoader`` worker wrote into
    shared memory (rebuilt in the order the workers' batches arrive, which varies from run to run).  Its values
    enter the process as an input's do."""
    return _torch_compat.op_schema_name(func) == "aten::set_" and \
        _torch_compat.op_overload_name(func)[2].startswith("source_Storage")


def uninitialized_hash(rec: Record) -> str:
    digest = hashlib.blake2b(f"uninitialized|{rec.dtype}|{rec.shape}".encode(), digest_size=8).digest()
    return format_hash(int.from_bytes(digest, "little"))


def returns_view(func) -> bool:
    """Whether every result of ``func`` aliases an input without writing it (a view op)."""
    schema = _torch_compat.op_schema(func)
    returns = schema.returns if schema is not None else ()
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def written_tensors(result: Any, writes: Tuple[tuple, ...], args: Sequence, kwargs: Dict[str, Any]) -> list:
    """Tensors an op produced: those it returns, then those it wrote to but did not return (:func:`schema_writes`;
    an entry written only when an argument is true, only then)."""
    if not writes and isinstance(result, torch.Tensor):  # most ops: one returned tensor
        return [result]
    outs: list = []
    _leaves(result, outs)
    if writes:
        seen = {id(t) for t in outs if isinstance(t, torch.Tensor)}
        for i, name, *when in writes:
            if when and not _argument(args, kwargs, *when[0]):
                continue
            a = _argument(args, kwargs, i, name)
            for t in _leaves(a, []):
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    outs.append(t)
    return outs


def _argument(args: Sequence, kwargs: Dict[str, Any], i: int, name: str) -> Any:
    return args[i] if i < len(args) else kwargs.get(name)


def _leaves(x: Any, out: list) -> list:
    if isinstance(x, (list, tuple)):
        for y in x:
            _leaves(y, out)
    elif isinstance(x, (torch.Tensor, bool, int, float)) and not isinstance(x, torch.SymInt):
        out.append(x)
    return out


def version(t: Optional[torch.Tensor]) -> int:
    if t is None:
        return -1
    try:
        return _torch_compat.tensor_version(t)
    except RuntimeError:  # inference tensors have no version counter
        return -1


def mem_key(t: torch.Tensor) -> Optional[tuple]:
    try:
        return (t.data_ptr(), t.dtype, t.shape, t.stride(), t.device)
    except RuntimeError:  # no storage (sparse, functional wrappers)
        return None


def byte_span(key: tuple) -> Tuple[int, int]:
    """``[first byte, end)`` of the memory a :func:`mem_key` covers (its elements' extent, not its storage's)."""
    ptr, dtype, shape, stride = key[:4]
    if any(s == 0 for s in shape):
        return ptr, ptr
    last = sum((s - 1) * abs(st) for s, st in zip(shape, stride))
    return ptr, ptr + (last + 1) * dtype.itemsize


def storage_start(t: torch.Tensor) -> Optional[int]:
    """The first byte of ``t``'s storage; None for a tensor without one of its own (sparse, meta, a wrapper)."""
    if t.layout is not torch.strided or t.is_meta:
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def unseen():
    """Context for a mode's own torch ops (fingerprints, metrics): no dispatch mode sees them.

    Inside ``__torch_dispatch__`` the running mode is already off the stack, but an outer mode
    (nested eager tools) is not; free when no mode is active."""
    return _torch_compat.dispatch_modes_disabled() if _torch_compat.dispatch_mode_depth() else contextlib.nullcontext()


_SEEDED_PRIMS = frozenset({"prims::inductor_random", "prims::inductor_randint"})
"""Inductor's random prims: compiled, they draw from the seed tensor they are given; run eagerly, they ignore it
and draw from the global generator (their seeds come from ``prims::inductor_seeds``, an op of aten's kind)."""


def call_draws_random(func, args: Sequence[Any], kwargs: Optional[Dict[str, Any]] = None) -> bool:
    """Whether calling ``func(*args, **kwargs)`` draws random numbers: :func:`draws_random`, less the calls
    whose arguments switch the draw off -- a ``dropout_p`` of 0 (attention: every model's
    ``scaled_dot_product_attention`` in eval), ``train=False`` (``native_dropout``)."""
    if not draws_random(func):
        return False
    schema = _torch_compat.op_schema(func)
    if schema is None:
        return True
    kwargs = kwargs or {}
    for i, a in enumerate(schema.arguments):
        v = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name, a.default_value
                                                                          if a.has_default_value() else None)
        if a.name == "dropout_p" and isinstance(v, (int, float)) and v == 0:
            return False
        if a.name == "train" and v is False:
            return False
    return True


def draws_random(func) -> bool:
    """Whether the op ``func`` draws random numbers: ops tagged ``nondeterministic_seeded`` (``rand``,
    ``native_dropout``, ``bernoulli``, ``inductor_seeds``...) and inductor's seeded random prims.  Two runs of
    such an op agree only when they draw from the same generator state in the same way, which an eager
    run and a compiled one do not."""
    if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
        return True
    return _torch_compat.is_op_overload(func) and _torch_compat.op_schema_name(func) in _SEEDED_PRIMS

