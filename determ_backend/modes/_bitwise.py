"""``BitwiseEquivalenceMode``: run every op twice on identical inputs and report bitwise differences.

Each op runs once on its real inputs and once more on stride- and
alias-preserving clones (ops that write to their inputs) or on the same inputs
(ops that do not), with the CPU and every present accelerator's RNG state
restored in between, so random ops must reproduce.  Results are compared by
fingerprint, so NaN payloads and the sign of zero count.  Nothing global is
touched: no anomaly mode, no warning filters; the RNG ends where a plain run
would leave it.

Reported with each mismatch: op, shapes, dtypes, max abs difference and other
metrics, the user stack, and for backward ops the autograd node and the forward
line that created it.  See :mod:`determ_backend.modes.core` for the other modes;
the second run's input clones come from :mod:`determ_backend.clones`, user stacks
from :mod:`determ_backend._frames`, fingerprints from :mod:`determ_backend.fingerprint`.
"""

from __future__ import annotations

import functools
import logging
import math
import struct
import sys
from typing import Any, Dict, List

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from determ_backend import _torch_compat as _compat
from determ_backend import devices
from determ_backend.clones import clone_inputs
from determ_backend._frames import FrameFilter
from determ_backend.args import check_bool, check_count
from determ_backend.modes.ops import mem_key, returns_view, schema_writes, unseen, written_tensors
from determ_backend.modes._record import FORWARD_KEY
from determ_backend.compare import tensor_metrics
from determ_backend.errors import NondeterminismError
from determ_backend.fingerprint.core import hash_tensors

__all__ = ["BitwiseEquivalenceMode"]

logger = logging.getLogger("determ_backend.modes.core")

_SKIP_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_dtensor", "profiler", "prim"})
_SKIP_WORDS = ("empty", "resize", "record_stream", "set_.")


@functools.lru_cache(maxsize=None)
def _protect(code) -> None:
    _compat.dynamo_skip_code(code)


@functools.lru_cache(maxsize=4096)
def _skipped(func) -> bool:
    """Ops not worth (or not safe) running twice: uninitialized memory, collectives, pure views."""
    name = str(func)
    if getattr(func, "namespace", "") in _SKIP_NAMESPACES or any(w in name for w in _SKIP_WORDS):
        return True
    return _compat.op_schema(func) is None or returns_view(func)


def _same_scalar(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    return type(a) is type(b) and a == b


class BitwiseEquivalenceMode(_compat.TorchDispatchMode):
    """Run each op twice and record the ones whose results are not bitwise identical.

    Args:
        raise_on_mismatch: raise :class:`~determ_backend.errors.NondeterminismError` at the first mismatch.
        stack_depth: user frames kept per mismatch.
        warn: log each mismatch (``logging``, stderr).

    ``get_mismatches()`` (or :attr:`mismatches`) lists dicts with ``op``, ``index``,
    ``shapes``, ``dtypes``, ``max_diff``, ``metrics``, ``stack`` and, for backward
    ops, ``backward`` and ``forward_source``.
    """

    def __init__(self, raise_on_mismatch: bool = False, stack_depth: int = 8, warn: bool = True):
        super().__init__()
        check_bool(raise_on_mismatch=raise_on_mismatch, warn=warn)
        check_count("stack_depth", stack_depth, 0)
        _protect(type(self).__torch_dispatch__.__code__)
        self.raise_on_mismatch, self.stack_depth, self.warn = raise_on_mismatch, stack_depth, warn
        self.mismatches: List[Dict[str, Any]] = []
        self.ops_checked = 0
        self.compiled_ops = 0  # ops of torch.compile'd regions that ran eagerly under this mode
        self._frames = FrameFilter()
        self._sources: Dict[tuple, tuple] = {}  # output memory -> (storage ref, source): lines for backward ops
        self._writes: Dict[Any, tuple] = {}
        self._set_eval_frame = _compat.eval_frame_setter()
        self._autograd_node = _compat.current_autograd_node_getter()

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # see HashMode._should_skip_dynamo

    def get_mismatches(self) -> List[Dict[str, Any]]:
        return self.mismatches

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        prior = self._set_eval_frame(None)
        try:
            kwargs = kwargs or {}
            if prior is not None and prior is not False:  # inside a torch.compile'd function: it runs eagerly
                self._ran_compiled()
            if _skipped(func):
                return func(*args, **kwargs)
            return self._twice(func, args, kwargs, sys._getframe(1))
        finally:
            self._set_eval_frame(prior)

    def _ran_compiled(self) -> None:
        self.compiled_ops += 1
        if self.compiled_ops == 1:
            logger.warning("BitwiseEquivalenceMode: a torch.compile'd region ran eagerly (dynamo does not compile "
                           "while a dispatch mode is active); its ops are checked as eager ops. To check compiled "
                           "graphs use torch.compile(backend='determ_aot_eager' or 'determ_inductor') with "
                           "DETERM_CHECK=determinism, without this mode.")

    def _twice(self, func, args, kwargs, frame):
        writes = self._writes.get(func)
        if writes is None:
            writes = self._writes[func] = schema_writes(func, undeclared=True)  # the twin must not write them again
        with unseen():  # the clones and the twin run are this mode's work: an outer mode sees the op once
            cargs, ckwargs = clone_inputs([args, kwargs], whole_storage=True) if writes else (args, kwargs)
        gens = _generators(args, kwargs)  # a generator passed explicitly draws like the default ones
        before = devices.get_rng_state(), [g.get_state() for g in gens]
        out1 = func(*args, **kwargs)
        after = devices.get_rng_state(), [g.get_state() for g in gens]
        _set_rng(gens, before)
        try:
            with unseen():
                out2 = func(*cargs, **ckwargs)
        finally:
            _set_rng(gens, after)
        self.ops_checked += 1
        w1 = written_tensors(out1, writes, args, kwargs)
        w2 = written_tensors(out2, writes, cargs, ckwargs)
        with unseen():  # fingerprints and metrics are this mode's work, not ops an outer mode should see
            self._compare(func, w1, w2, args, kwargs, frame)
        return out1

    def _compare(self, func, w1: list, w2: list, args, kwargs, frame) -> None:
        pairs = [(j, a, b) for j, (a, b) in enumerate(zip(w1, w2))]
        # tensors with values of their own (not meta, nested, sparse, nor a FakeTensor: those torch.export traces with
        # hold none, and reading them raised in the user's program); subclasses holding memory are compared
        tensors = [(j, a, b) for j, a, b in pairs if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                   and a.layout == torch.strided and a.device.type != "meta" and not a.is_nested
                   and not _compat.is_fake_tensor(a)]
        hashes = hash_tensors([a for _, a, _ in tensors] + [b for _, _, b in tensors]) if tensors else []
        n = len(tensors)
        bad = [(j, a, b) for k, (j, a, b) in enumerate(tensors)
               if hashes[k] != hashes[n + k] or a.dtype != b.dtype]
        bad += [(j, a, b) for j, a, b in pairs if not isinstance(a, torch.Tensor) and not _same_scalar(a, b)]
        if len(w1) != len(w2):
            bad.append((min(len(w1), len(w2)), None, None))
        self._note_outputs(w1, frame)
        for j, a, b in bad:
            self._report(func, j, a, b, frame)
        self._tag_inputs(args, kwargs)

    def _note_outputs(self, outs: list, frame) -> None:
        frames = self._frames.user_frames(frame, 1)
        source = f"{frames[0].f_code.co_filename}:{frames[0].f_lineno}" if frames else None
        if self._autograd_node() is None:  # (custom autograd Functions run their forward without grad)
            for t in outs:
                key = mem_key(t) if isinstance(t, torch.Tensor) else None
                if key is not None:
                    self._sources[key] = (StorageWeakRef(t.untyped_storage()), source)
            if len(self._sources) > 4096:
                self._sources = {k: v for k, v in self._sources.items() if not v[0].expired()}

    def _tag_inputs(self, args, kwargs) -> None:
        """Give the autograd nodes of this op's inputs the forward line that produced them."""
        if not self._sources or self._autograd_node() is not None:
            return
        for t in _tree_flat(args, kwargs):
            key = mem_key(t)
            ent = self._sources.get(key) if key is not None else None
            if ent is not None and not ent[0].expired() and t.grad_fn is not None:
                md = t.grad_fn.metadata
                if FORWARD_KEY not in md:
                    md[FORWARD_KEY] = (ent[1], None)

    def _report(self, func, j: int, a, b, frame) -> None:
        stack = [f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}"
                 for f in self._frames.user_frames(frame, self.stack_depth)]
        info: Dict[str, Any] = {"op": str(func), "index": j, "stack": stack}
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            m = tensor_metrics(a, b)
            info.update(shapes=[list(a.shape), list(b.shape)], dtypes=[str(a.dtype), str(b.dtype)],
                        max_diff=m.get("max_abs", "shape mismatch"), metrics=m)
        else:
            info.update(shapes=None, dtypes=[type(a).__name__, type(b).__name__], max_diff=_scalar_diff(a, b),
                        metrics={"values": [repr(a), repr(b)]})
        node = self._autograd_node()
        if node is not None:
            info["backward"] = node.name()
            fwd = node.metadata.get(FORWARD_KEY)
            tb = node.metadata.get("traceback_")  # present when the user enabled anomaly mode
            info["forward_source"] = fwd[0] if fwd else (tb[0].strip().splitlines()[-1] if tb else None)
        self.mismatches.append(info)
        where = stack[0] if stack else "?"
        msg = (f"bitwise mismatch in {info['op']} (output {j}, shape {info['shapes'] and info['shapes'][0]}, "
               f"max diff {info['max_diff']}) at {where}")
        if info.get("backward"):
            msg += f"; backward of {info['backward']} created at {info.get('forward_source') or '?'}"
        if self.raise_on_mismatch:
            raise NondeterminismError(msg)
        if self.warn:
            logger.warning(msg)


def _generators(args, kwargs) -> list:
    """The ``torch.Generator`` objects among an op's arguments (``generator=``)."""
    return [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Generator)]


def _set_rng(gens: list, state: tuple) -> None:
    devices.set_rng_state(state[0])
    for g, s in zip(gens, state[1]):
        g.set_state(s)


def _tree_flat(args, kwargs) -> list:
    out: list = []

    def add(x):
        if isinstance(x, torch.Tensor):
            out.append(x)
        return x

    _compat.tree_map(add, (args, kwargs))
    return out


def _scalar_diff(a, b):
    try:
        d = abs(float(a) - float(b))
        return d if not math.isnan(d) else float("nan")
    except (TypeError, ValueError):
        return None
