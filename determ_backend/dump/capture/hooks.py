"""Recording torch API calls: the ``__torch_function__`` mode and the recorder.

:class:`DumpMode` is a :class:`torch.overrides.TorchFunctionMode`: while a dump
is on it sees every top-level call of a torch function, ``Tensor`` method or
``torch.nn.functional`` function (calls made *inside* an API, e.g. the
``Tensor.softmax`` inside ``F.softmax``, are not top-level and are not
recorded, as in ptdbg).  Nothing is monkeypatched for these APIs; the mode is
pushed when the dump switch goes on and popped when it goes off.

:class:`ApiRecorder` turns a call into a forward record (after the call; inputs of
in-place calls are fingerprinted before it) and arranges its backward record
(:mod:`.backward`).  In overflow-check mode it writes only the calls whose
outputs become non-finite from finite inputs (:mod:`.overflow`).

Region records (compiled modules and functions, ``module_dump``) live in
:mod:`.regions`, the FX nodes of compiled graphs in :mod:`.compiled`;
collectives and parameter snapshots in :mod:`.modules`.  Which frames are the
user's (an entry's ``source`` and ``stack``; calls made by determ itself) is
decided by :mod:`determ_backend._frames`, as for the eager modes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.overrides import TorchFunctionMode

from determ_backend import _torch_compat as _compat
from determ_backend._frames import FrameFilter, called_from_determ, caller_outside_torch
from determ_backend.compare.nonfinite import creates, nonfinite
from determ_backend.dump.capture import backward as bw
from determ_backend.dump.capture.apis import ApiInfo, api_table, is_inplace
from determ_backend.dump.capture.entries import call_items, describe, output_items
from determ_backend.dump.capture.overflow import OverflowCounter
from determ_backend.dump.capture.pipeline import fill_fingerprints
from determ_backend.dump.capture.session import DumpSession
from determ_backend.dump.capture.switch import DumpSettings, Selector

__all__ = ["DumpMode", "ApiRecorder", "guard", "busy", "passthrough", "enter_opaque", "exit_opaque", "user_source",
           "user_stack", "purge_retired_modes"]

log = logging.getLogger(__name__)

_tls = threading.local()
_BACKWARD_ENTRIES = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)
_FRAMES = FrameFilter(stdlib=False)  # ptdbg-style stacks keep standard-library frames


@contextlib.contextmanager
def guard() -> Iterator[None]:
    """Torch calls made by the dump machinery itself are not recorded."""
    prev = getattr(_tls, "busy", False)
    _tls.busy = True
    try:
        yield
    finally:
        _tls.busy = prev


def busy() -> bool:
    """True while the dump machinery itself runs (its torch calls are not recorded)."""
    return getattr(_tls, "busy", False)


def passthrough() -> bool:
    """True inside the dump machinery or inside a region recorded as a whole (compiled module, module_dump)."""
    return getattr(_tls, "busy", False) or getattr(_tls, "opaque", 0) > 0


def enter_opaque() -> None:
    _tls.opaque = getattr(_tls, "opaque", 0) + 1


def exit_opaque() -> None:
    _tls.opaque = max(0, getattr(_tls, "opaque", 0) - 1)


def user_source() -> Optional[str]:
    """``file:line`` of the innermost frame outside torch and determ."""
    frames = _FRAMES.user_frames(sys._getframe(1), 1)
    return f"{frames[0].f_code.co_filename}:{frames[0].f_lineno}" if frames else None


def user_stack(limit: int = 30) -> List[str]:
    """User frames, innermost first: ``File "x.py", line 3, in forward``."""
    return [f'File "{f.f_code.co_filename}", line {f.f_lineno}, in {f.f_code.co_name}'
            for f in _FRAMES.user_frames(sys._getframe(1), limit)]


class ApiRecorder:
    """Writes the records of one dump session."""

    def __init__(self, session: DumpSession, settings: DumpSettings, overflow: Optional[OverflowCounter] = None,
                 online: Optional[Any] = None):
        self.session = session
        self.settings = settings
        self.selector = Selector(settings)
        self.overflow = overflow
        self.task = "overflow_check" if overflow is not None else settings.task
        # calls whose forward overflowed: their backward reads the saved nan/inf, so its own nan/inf is that
        # overflow again, not a new one (exp's backward multiplies a finite gradient by the inf it returned)
        self._overflowed: set = set()
        self.flusher = bw.BackwardFlusher()
        self._keep_non_float = settings.filter_switch == "OFF"
        self.active = True  # False once the dump is switched off: late backward hooks then record nothing
        self.online = online
        """An :class:`~.online.OnlineBaseline` judging each record as it is written, or None."""
        self._refs: Optional[Dict[int, torch.Tensor]] = None
        if online is not None:
            online.start(session.header.get("device"))
            if session.tensors:  # payloads are stored anyway: judged when the writer has resolved them
                session.pipeline.on_entry = online.check
            else:  # judged at once, while the tensors are at hand to keep those of the first divergences
                self._refs = {}

    # ---- describing and writing ----------------------------------------------------------------
    def describe(self, items: Sequence[Tuple[str, Any]], io: str) -> List[Dict[str, Any]]:
        if self.overflow is None and io != "all" and not self.settings.keeps(io):
            return []
        return describe(items, self.session.cache, data=self.task != "stack", keep_non_float=self._keep_non_float,
                        pipeline=self.session.pipeline, refs=self._refs)

    def describe_io(self, ins: Sequence[Tuple[str, Any]], outs: Sequence[Tuple[str, Any]]):
        """Inputs and outputs of one call in one fingerprint batch: ``(input entries, output entries)``."""
        both = self.describe([x for x in ins if self.overflow is not None or self.settings.keeps("input")] +
                             [x for x in outs if self.overflow is not None or self.settings.keeps("output")], "all")
        return ([e for e in both if e["name"].startswith("input")],
                [e for e in both if e["name"].startswith("output")])

    def write(self, call: str, info: ApiInfo, direction: str, ins: List[Dict[str, Any]],
              outs: List[Dict[str, Any]], source: Optional[str] = None, stack: Optional[List[str]] = None,
              **extra: Any) -> None:
        entry: Dict[str, Any] = {"name": f"{call}_{direction}", "op": info.op, "dir": direction}
        if source:
            entry["source"] = source
        entry["inputs"] = ins
        entry["outputs"] = outs
        if stack is not None:
            entry["stack"] = stack
        entry.update(extra)
        self.session.write(entry, judge=self._judge_online if self._refs is not None else None)

    def _judge_online(self, entry: Dict[str, Any]) -> None:
        """Statistics mode: judge ``entry`` against the baseline now (its fingerprints were computed when its
        tensors were described) and keep the tensors of the first divergent records."""
        refs, self._refs = self._refs, {}
        fill_fingerprints(entry)
        if self.online.check(entry) and self.online.wants_tensors():
            self.online.store(self.session.data_dir, entry, refs)

    # ---- forward --------------------------------------------------------------------------------
    def api_call(self, info: ApiInfo, func: Callable, args: tuple, kwargs: Dict[str, Any]) -> Any:
        call = f"{info.key}_{self.session.next_call(info.key)}"
        if self.overflow is not None:
            return self._overflow_call(call, info, func, args, kwargs)
        fwd = self.selector.select(call, info, "forward")
        bwd = self.selector.may_backward(call, info) and torch.is_grad_enabled()
        if not (fwd or bwd):
            return func(*args, **kwargs)
        with guard():
            items = call_items(args, kwargs)
            inplace = is_inplace(info, kwargs)
            pre = self.describe(items, "input") if fwd and inplace else None
            edges = bw.prepare(items, inplace) if bwd else None
            min_seq = bw.sequence_probe() if edges and edges[0] and inplace else None
            source = user_source()
            stack = user_stack() if self.settings.with_stack else None
        out = func(*args, **kwargs)
        with guard():
            if inplace:
                self.session.cache.forget(items)
            outs = output_items(args[0] if inplace and out is None and args else out)  # __setitem__ returns None
            if fwd:
                if pre is not None:
                    ins, out_entries = pre, self.describe(outs, "output")
                else:
                    ins, out_entries = self.describe_io(items, outs)
                self.write(call, info, "forward", ins, out_entries, source, stack)
            if edges and edges[0]:
                self._attach(call, info, edges, outs, source, stack, min_seq)
        return out

    def _attach(self, call: str, info: ApiInfo, edges, outs, source, stack, min_seq,
                extra: Optional[Callable[[], Dict[str, Any]]] = None,
                on_start: Optional[Callable[[], None]] = None) -> None:
        """Arrange the backward record of ``call``; ``extra()`` gives its additional fields when it is written;
        ``on_start()`` runs when its backward begins."""
        def emit(_name: str, grad_ins, grad_outs) -> None:
            self.emit_backward(call, info, grad_ins, grad_outs, source, stack, **(extra() if extra else {}))

        bw.attach(call, edges[0], edges[1], outs, self.flusher, emit, guard, min_seq, on_start, edges[3])

    def emit_backward(self, call: str, info: ApiInfo, grad_ins, grad_outs, source, stack, **extra: Any) -> None:
        if not self.active or self.session.closed:
            return
        if self.overflow is not None:
            if call not in self._overflowed:
                self._check_overflow(call, info, "backward", grad_ins, grad_outs, None, source)
            return
        if not self.selector.select(call, info, "backward"):
            return
        ins, outs = self.describe_io(grad_ins, grad_outs)
        self.write(call, info, "backward", ins, outs, source, stack, **extra)

    # ---- overflow check -------------------------------------------------------------------------
    def _overflow_call(self, call: str, info: ApiInfo, func: Callable, args: tuple, kwargs: Dict[str, Any]) -> Any:
        if not self.overflow.enabled:
            return func(*args, **kwargs)
        self._overflowed.discard(call)  # a name seen again (counters restarted at a step): judged afresh
        with guard():
            items = call_items(args, kwargs)
            inplace = is_inplace(info, kwargs)
            before = None
            if inplace:  # keep the pre-call values: the call overwrites them
                before = [(n, v.detach().clone() if isinstance(v, torch.Tensor) else v) for n, v in items]
            edges = bw.prepare(items, inplace) if torch.is_grad_enabled() else None
            min_seq = bw.sequence_probe() if edges and edges[0] and inplace else None
        out = func(*args, **kwargs)
        with guard():
            outs = output_items(args[0] if inplace and out is None and args else out)
            source = user_source()
            if edges and edges[0]:
                self._attach(call, info, edges, outs, source, None, min_seq)
            self._check_overflow(call, info, "forward", before if before is not None else items, outs, func, source)
        return out

    def _check_overflow(self, call: str, info: ApiInfo, direction: str, ins, outs, func, source) -> None:
        if not self.overflow.enabled:
            return
        if not creates(nonfinite([v for _, v in outs]), [nonfinite([v for _, v in ins])]):
            return
        if direction == "forward":
            if len(self._overflowed) >= 1 << 16:  # never-stop runs: long finished backwards
                self._overflowed.clear()
            self._overflowed.add(call)
        ins_e, outs_e = self.describe_io(ins, outs)
        self.write(call, info, direction, ins_e, outs_e, source, None, overflow=self.overflow.count + 1)
        name = f"{call}_{direction}"
        log.warning("overflow: %s produced nan/inf from finite inputs (at %s)", name, source or "?")
        if self.overflow.hit(name, source):
            self.overflow.enabled = False
            self.session.close()
            raise self.overflow.stop_error(name, source, self.session.index_path)


class DumpMode(TorchFunctionMode):
    """Routes every top-level torch API call to an :class:`ApiRecorder`."""

    def __init__(self, recorder: ApiRecorder):
        super().__init__()
        self.recorder = recorder
        self.table = api_table()
        self.retired = False  # switched off: every call passes through until the mode is off the stack

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.retired or torch.compiler.is_compiling() or passthrough():
            return func(*args, **kwargs)
        try:
            info = self.table.get(func)
        except TypeError:
            info = None
        ours = called_from_determ(sys._getframe(1))  # determ's own calls are never recorded
        if info is None or ours:
            if not ours and func in _BACKWARD_ENTRIES:
                # this mode is off while its handler runs: back on around the engine's run, it sees the calls made
                # by custom Function backwards, tensor hooks and checkpoints' recomputations (the backward call itself
                # is not an API of the table; the engine's own formulas call no Python)
                with _compat.engine_runs_within(lambda: _in_backward(self)):
                    return func(*args, **kwargs)
            return func(*args, **kwargs)
        if getattr(_tls, "backward", False) and _generated(sys._getframe(1)):
            return func(*args, **kwargs)  # a compiled region's backward: opaque, as its forward is
        return self.recorder.api_call(info, func, args, kwargs)


@contextlib.contextmanager
def _in_backward(mode: "DumpMode") -> Iterator[None]:
    """``mode`` on again around a backward pass, which it marks as such (:func:`_generated` applies there).  Taken
    off after only if it is still on top: a hook that switched the dump off inside the pass took it off already."""
    prev = getattr(_tls, "backward", False)
    _tls.backward = True
    _compat.resume_function_mode(mode)
    try:
        yield
    finally:
        _tls.backward = prev
        _compat.suspend_function_mode(mode)


def purge_retired_modes() -> None:
    """Take the dump modes switched off while torch held them off the stack (a gradient hook that switched the dump
    off inside ``backward()``, whose handler torch puts the mode back after) off the top of this thread's stack."""
    while True:
        top = _compat.current_function_mode()
        if not (isinstance(top, DumpMode) and top.retired) or not _compat.suspend_function_mode(top):
            return


@functools.lru_cache(maxsize=1)
def _generated_roots() -> tuple:
    """Where code a compiler generated lives: inductor's output modules (its cache), determ's instrumented copies of
    them and FX's evaluated graph code."""
    roots = ["<determ instrumented", "<eval_with_key"]
    try:
        roots.append(os.path.join(_compat.inductor_cache_dir(), ""))
    except Exception:  # no inductor here: nothing of it runs either
        pass
    return tuple(roots)


def _generated(frame) -> bool:
    """Whether, inside a backward pass, the first frame from ``frame`` outwards that is neither torch's nor the
    standard library's is code a compiler generated (a compiled graph's backward calling ``torch.mm`` through
    inductor's ``extern_kernels``) or determ's own (the engine entry it runs the pass through: torch's own calls,
    such as a backward graph compiled on first use), which the dump does not open."""
    path = caller_outside_torch(frame, stdlib=True)
    return path is None or path == "<determ>" or path.startswith(_generated_roots())
