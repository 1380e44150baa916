"""Eager dispatch modes: ``HashMode``, ``HashDebugTrace`` and ``BitwiseEquivalenceMode``.

* :class:`HashMode` records a fingerprint trace of every aten op (forward and
  backward) in the shared trace format; cheap enough to leave on, with
  :meth:`HashMode.enable` / :meth:`HashMode.disable` regions.
* :class:`HashDebugTrace` is a ``HashMode`` that also writes a human-readable
  log per run (``with HashDebugTrace(log_path="trace_first.log"): model(x)``) and
  the JSON Lines trace next to it; :func:`read_hash_log` reads the log back.
* :class:`BitwiseEquivalenceMode` (in :mod:`determ_backend.modes._bitwise`) runs
  every op twice and reports the ones whose results differ bitwise.

``torch.compile``: on torch 2.13 dynamo does not compile while a (non-infra)
dispatch mode is active, so a compiled function called under these modes runs
eagerly and its ops are traced as eager ops.  Such records carry
``extra["compiled_region"] = "eager"`` and the mode logs a warning; to trace the
compiled graphs themselves, use the ``determ_*`` compile backends instead.

Per-op recording lives in :mod:`determ_backend.modes._record`, the log format in
:mod:`determ_backend.modes.log`; comparing traces in :mod:`determ_backend.compare`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import weakref
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch

from determ_backend import _torch_compat as _compat
from determ_backend.modes._bitwise import BitwiseEquivalenceMode
from determ_backend.modes.log import LogWriter, read_hash_log, read_hash_log_file
from determ_backend.modes._record import OpEvent, OpRecorder, recorder_ops
from determ_backend.modes.ops import wait_collective
from determ_backend.args import check_bool as _check_bool, check_count as _check_count, check_path as _check_path
from determ_backend.errors import ConfigError
from determ_backend.compare.nonfinite import Creation, NanLedWatch, input_ranges
from determ_backend.trace.stream import Record, TraceWriter

__all__ = ["HashMode", "HashDebugTrace", "BitwiseEquivalenceMode", "read_hash_log", "read_hash_log_file"]

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _protect(code) -> None:
    _compat.dynamo_skip_code(code)


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _same_file(a: Path, b: Path) -> bool:
    """Whether the file names ``a`` and ``b`` would write the same file.  Two different names, neither of them a
    symbolic link, never do (a writer replaces an existing regular file, so hard links part); otherwise the
    resolved paths decide.  (Two ``lstat`` calls instead of two ``resolve()``: a trace opened per step.)"""
    if a.name != b.name and not os.path.islink(a) and not os.path.islink(b):
        return False
    return a.resolve() == b.resolve()


_OPEN: Dict[str, "weakref.ref"] = {}  # resolved file -> the mode writing it now (one writer per file)
_OPEN_LOCK = threading.Lock()


def _claim(mode: "HashMode", paths: List[Path]) -> None:
    """Note that ``mode`` writes ``paths``; a :class:`ConfigError` when another open mode writes one of them (two
    threads given one trace path each recorded, and the file kept one thread's ops: the other's were lost)."""
    keys = [str(p.resolve()) for p in paths if p is not None]
    with _OPEN_LOCK:
        for k in keys:
            holder = _OPEN.get(k)
            other = holder() if holder is not None else None
            if other is not None and other is not mode and not other._closed:
                raise ConfigError(f"{k}: another {type(other).__name__} is writing this file (a mode of another "
                                  f"thread, or one not closed yet); give each mode its own path")
        for k in keys:
            _OPEN[k] = weakref.ref(mode)


def _release(mode: "HashMode") -> None:
    with _OPEN_LOCK:
        for k in [k for k, ref in _OPEN.items() if ref() is mode or ref() is None]:
            del _OPEN[k]


def _weak_sink(mode: "HashMode") -> Callable[[List[OpEvent], bool], None]:
    """``mode._sink`` without a reference to ``mode``: the recorder the mode owns must not point back at it, so
    that a mode the program lets go of (one per step, say) is freed at once with its records and the tensors it
    was settling, instead of waiting, promoted through the generations, for a full garbage collection."""
    ref = weakref.WeakMethod(mode._sink)

    def sink(events: List[OpEvent], early: bool = False) -> None:
        bound = ref()
        if bound is not None:
            bound(events, early)

    return sink


def _tensor_names(module: Optional[torch.nn.Module]) -> Dict[int, Tuple[weakref.ref, str]]:
    if module is None:
        return {}
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    # a tensor under two names (a tied embedding and output head) takes its first, torch's own (named_parameters())
    out: Dict[int, Tuple[weakref.ref, str]] = {}
    for name, t in (*module.named_parameters(), *module.named_buffers()):
        if t is not None and id(t) not in out:
            out[id(t)] = (weakref.ref(t), name)
    return out


class HashMode(_compat.TorchDispatchMode):
    """Fingerprint trace of every aten op run while active.

    Args:
        trace_path: stream the records to this JSON Lines trace (``repro-tools diff`` reads it).
        run: run name stored in each record.
        stats: also record min/max/mean/L2/NaN/Inf counts (enables ``--tol`` verdicts; slower).
        module: name this module's parameters and buffers in their ``param`` records.
        stack_depth: user frames kept per record (1 = the source line only).
        keep_records: keep the records in :attr:`records` (turn off for long streaming runs).
        batch: ops between fingerprint batches (one host sync each).  A batch that waits on no device (every
            tensor a CPU tensor the native kernel read) is handed on after 64 records.
        check_nan: name the ops that create a NaN/Inf from finite inputs (implies ``stats``): each creating
            op is logged once, as the backends' ``DETERM_CHECK=nan`` does, and kept in :attr:`nan_creations`
            (:class:`~determ_backend.compare.nonfinite.Creation`); ops that carry one along are not named.  As
            there, an Inf alone is often meant (a ``-inf`` attention mask a softmax turns into 0): an op that
            creates only an Inf is named once a NaN comes of it, and is :attr:`masked_creations` until then.

    Use as a context manager, or :meth:`enable` / :meth:`disable` around regions and
    :meth:`close` at the end.  :attr:`records` is complete after :meth:`flush`.
    """

    def __init__(self, trace_path: Union[str, Path, None] = None, run: Optional[str] = None, stats: bool = False,
                 module: Optional[torch.nn.Module] = None, stack_depth: int = 1, keep_records: bool = True,
                 batch: int = 512, check_nan: bool = False, _describe_args: bool = False):
        super().__init__()
        _check_count("batch", batch, 1)
        _check_count("stack_depth", stack_depth, 0)
        _check_bool(stats=stats, keep_records=keep_records, check_nan=check_nan)
        stats = stats or check_nan  # the rule reads the nan/inf counts of the statistics
        self.nan_creations: List[Creation] = []
        self._nan_watch: Optional[NanLedWatch] = NanLedWatch() if check_nan else None
        self._nan_named: set = set()
        if run is not None and not isinstance(run, str):
            raise ConfigError(f"run={run!r}: expected a string or None")
        trace_path = _check_path("trace_path", trace_path, optional=True)
        _protect(type(self).__torch_dispatch__.__code__)
        self.trace_path = trace_path
        self.run = run
        self.keep_records = keep_records
        self.records: List[Record] = []
        self.output_hook: Optional[Callable] = None  # (func, result, recorder ctx) -> (result, non_deterministic)
        self._recorder = OpRecorder(_weak_sink(self), run=run, stats=stats, stack_depth=stack_depth,
                                    names=_tensor_names(module), describe_args=_describe_args, batch=batch)
        self._begin, self._end = recorder_ops()
        self._set_eval_frame = _compat.eval_frame_setter()
        self._writer: Optional[TraceWriter] = None
        self._held: List[bytes] = []  # trace lines of batches handed on early, not written yet
        self._active = True
        self._on_stack = False
        self._thread: Optional[int] = None  # the thread that entered the mode (it records that thread alone)
        self._via_enable = False
        self._closed = False
        self._warned_compiled = False

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # The default wrapper (torch._dynamo.disable per call) costs ~200 us per op; we instead
        # mark __torch_dispatch__'s code as skipped once and switch the eval-frame callback off inside.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        prior = self._set_eval_frame(None)
        try:
            kwargs = kwargs or {}
            if not self._active:
                return func(*args, **kwargs)
            rec = self._recorder
            with rec.lock:
                ctx = self._begin(rec, func, args, kwargs, sys._getframe(1), prior is not None and prior is not False)
            out = func(*args, **kwargs)
            if ctx[0][6]:  # the op's facts (op_info): a torch.distributed op, whose outputs (read below) are final
                # only once its work is done
                wait_collective(func, out)
            nondet = False
            if self.output_hook is not None:
                out, nondet = self.output_hook(func, out, args, kwargs)
            with rec.lock:
                self._end(rec, ctx, out, args, kwargs, nondet)
            return out
        finally:
            self._set_eval_frame(prior)

    # -- lifecycle ---------------------------------------------------------------------------------
    def _check_thread(self) -> None:
        """A mode records the thread that entered it; entered in another thread while it is on, the two threads'
        records interleaved in one trace under one set of names, lost some, and two identical runs diffed as
        divergent.  One line instead: one mode per thread."""
        if self._on_stack and self._thread != threading.get_ident():
            raise ConfigError(f"{type(self).__name__} is already recording another thread; a mode records the thread "
                              "that entered it: make one per thread, each with its own trace path")

    def __enter__(self):
        if self._closed:
            raise ConfigError(f"{type(self).__name__} was closed; create a new one for another run")
        with self._recorder.lock:
            self._check_thread()
            self._thread = threading.get_ident()
            self._on_stack = True
        self._recorder.rank = _rank()
        try:
            self._open()
        except BaseException:  # a file it may not write (another mode writes it): the mode never went on
            self._on_stack = False
            _release(self)  # nor holds any of its paths
            raise
        self._active = True
        return super().__enter__()

    def __exit__(self, exc_type, exc_val, exc_tb):
        try:
            super().__exit__(exc_type, exc_val, exc_tb)
        finally:
            self._on_stack = False
            if self._via_enable:
                self.flush()
            else:
                # a run that raised is marked so in the files: never compared as a whole run
                self.close(aborted=f"the run raised {exc_type.__name__}" if exc_type is not None else None)

    def enable(self) -> "HashMode":
        """Start (or resume) recording."""
        if self._on_stack:
            self._check_thread()
            self._active = True
            return self
        self._via_enable = True
        self.__enter__()
        return self

    def disable(self) -> None:
        """Stop recording.  Pops the mode when it is the innermost one, else pauses it in place."""
        if not self._on_stack:
            return
        if _compat.current_dispatch_mode() is self:
            self.__exit__(None, None, None)
        else:
            self.flush()
            self._active = False

    @property
    def is_recording(self) -> bool:
        return self._on_stack and self._active

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Ops run inside are not recorded (the mode stays where it is on the dispatch stack)."""
        prev = self._active
        self._active = False
        try:
            yield
        finally:
            self._active = prev

    def flush(self) -> None:
        """Fingerprint pending outputs; afterwards :attr:`records` (and the trace file) are complete."""
        self._flush()

    def _flush(self, last: bool = False) -> None:
        self._recorder.flush(prune=not last)  # the last flush leaves the table to go with the recorder
        if self._writer is not None:
            self._write_held()
            self._writer.flush()

    def _write_held(self) -> None:
        if self._held:
            lines, self._held = self._held, []
            self._writer.write_lines(lines)

    def is_active(self) -> bool:
        """True while the mode is entered and recording."""
        return self.is_recording

    def close(self, aborted: Optional[str] = None) -> None:
        """Flush, finish the trace file and warn about compiled regions that ran eagerly.  ``aborted``: why the
        run stopped early; the trace and log then say so, and readers report them incomplete."""
        if self._closed:
            return
        if self._on_stack:
            self.disable()
            if self._on_stack:
                logger.warning("%s.close(): another dispatch mode entered later is still active, so this mode "
                               "stays on the stack (paused) until that one exits", type(self).__name__)
        self._flush(last=True)
        self._closed = True
        self._finish(aborted)

    @property
    def compiled_ops(self) -> int:
        """Ops of ``torch.compile``'d regions that ran eagerly under this mode."""
        return self._recorder.compiled_ops

    # -- sinks -------------------------------------------------------------------------------------
    def _files(self) -> List[Path]:
        """The files this mode writes (claimed together when it opens them)."""
        return [self.trace_path]

    def _open(self) -> None:
        if self.trace_path is not None and self._writer is None:
            _claim(self, self._files())  # all of them or none
            self._writer = TraceWriter(self.trace_path, run=self.run, meta={"producer": type(self).__name__})

    def _sink(self, events: List[OpEvent], early: bool = False) -> None:
        recs = [r for ev in events for r in ev.outs]
        if self._nan_watch is not None:
            self._note_creations(recs)
        if self.keep_records:
            self.records.extend(recs)
        if self._writer is not None:
            # a batch handed on early is encoded now (bytes: nothing for the collector to walk) and written with
            # the next full batch, or once a batch's worth of lines is held (on the CPU every batch is early: held
            # until the mode closed, the lines grew without bound and a process that died left an empty trace)
            self._held.extend(r.to_line() for r in recs)
            if not early or len(self._held) >= self._recorder.batch:
                self._write_held()
        self._warn_compiled()

    def _note_creations(self, recs: List[Record]) -> None:
        """``check_nan``: the ops of this batch that created a NaN/Inf (op order; first-seen inputs are records too)."""
        for c in self._nan_watch.feed(recs):
            self.nan_creations.append(c)
            r = c.record
            site = (r.op, r.source)
            if site in self._nan_named:  # the same op at the same line, later calls: counted, not logged again
                continue
            self._nan_named.add(site)
            logger.warning("%s: %d NaN and %d Inf created by %s (%s) at %s from finite inputs (%s)", type(self).__name__,
                           c.nan, c.inf, r.node, r.op, r.source or "<unknown source>", input_ranges(c.inputs))

    def _warn_compiled(self) -> None:
        if self.compiled_ops and not self._warned_compiled:
            self._warned_compiled = True
            logger.warning("%s: a torch.compile'd region ran eagerly (dynamo does not compile while a dispatch "
                           "mode is active); its ops are traced as eager ops, marked compiled_region=eager. To "
                           "trace compiled graphs use torch.compile(backend='determ_aot_eager' or "
                           "'determ_inductor') without this mode.", type(self).__name__)

    def _finish(self, aborted: Optional[str] = None) -> None:
        try:
            if self._writer is not None:
                self._writer.close(aborted)
                self._writer = None
        finally:
            _release(self)

    @property
    def masked_creations(self) -> List[Creation]:
        """``check_nan``: the ops that created only an Inf from which no NaN has come (so far)."""
        return self._nan_watch.masked if self._nan_watch is not None else []

    def summary(self) -> List[str]:
        return [f"records: {self._recorder.seq}"] + self._nan_lines() + self._notes()

    def _nan_lines(self) -> List[str]:
        """``check_nan``: how many ops created a NaN/Inf, the first of them, and the masked ones."""
        if self._nan_watch is None:
            return []
        first = self.nan_creations[0].record if self.nan_creations else None
        lines = [f"NaN/Inf created by {len(self.nan_creations)} op(s)" +
                 (f"; first: {first.node} ({first.op}) at {first.source}" if first else "")]
        if self.masked_creations:
            lines.append(f"{len(self.masked_creations)} op(s) created an Inf no NaN came of (masked, not named)")
        return lines

    def _notes(self) -> List[str]:
        if self.compiled_ops:
            return [f"{self.compiled_ops} ops of torch.compile'd regions ran eagerly (compiled_region=eager)"]
        return []


class HashDebugTrace(HashMode):
    """A per-run, human-readable log of every aten op with its inputs and outputs, plus the trace.

    ``with HashDebugTrace(log_path="trace_first.log"): model(x)`` writes ``trace_first.log``
    (see :mod:`determ_backend.modes.log` for the format) and ``trace_first.jsonl``;
    ``repro-tools diff trace_first.log trace_second.log`` names the first op whose
    inputs agree and outputs differ.

    Args:
        log_path: the text log.  A name ending in ``.jsonl`` names the JSONL trace instead, and the
            text log goes next to it with suffix ``.log`` (``out.jsonl`` -> ``out.log``).
        verbose: also echo the log to stdout.
        max_ops_logged: stop the text log after this many ops (a non-negative integer; None: no
            limit).  The JSONL trace stays complete; ``repro-tools diff`` of limited logs compares
            the logged ops only and never reports them identical.
        jsonl_path: the trace (default: ``log_path`` with suffix ``.jsonl``).
        stats, module, stack_depth, keep_records, check_nan: as for :class:`HashMode` (stats on, two frames, records
            not kept by default); with ``check_nan`` the log's footer also says which op created the first NaN/Inf.
        auto_flush: flush the text log after every batch of ops (default on).
        track_gradients, include_timestamp, show_exec_time: accepted for compatibility with the
            original ``HashDebugTrace``; backward ops are always traced, and the log holds no
            timestamps or timings (they would differ between the two runs being compared).
    """

    def __init__(self, log_path: Union[str, Path] = "tensor_hash_trace.log", verbose: bool = False,
                 max_ops_logged: Optional[int] = None, jsonl_path: Union[str, Path, None] = None,
                 run: Optional[str] = None, stats: bool = True, module: Optional[torch.nn.Module] = None,
                 stack_depth: int = 2, batch: int = 512, auto_flush: bool = True, track_gradients: bool = True,
                 include_timestamp: bool = False, show_exec_time: bool = False, keep_records: bool = False,
                 check_nan: bool = False):
        log_path = _check_path("log_path", log_path)
        jsonl_path = _check_path("jsonl_path", jsonl_path, optional=True)
        _check_count("max_ops_logged", max_ops_logged, 0, optional=True)
        _check_bool(verbose=verbose, auto_flush=auto_flush, track_gradients=track_gradients,
                    include_timestamp=include_timestamp, show_exec_time=show_exec_time)
        if jsonl_path is None:
            if log_path.suffix == ".jsonl":  # the name of the trace: the text log goes next to it
                log_path, jsonl_path = log_path.with_suffix(".log"), log_path
            else:
                jsonl_path = log_path.with_suffix(".jsonl")
        if _same_file(jsonl_path, log_path):
            raise ConfigError(f"jsonl_path: must differ from log_path ({log_path})")
        super().__init__(trace_path=jsonl_path, run=run or log_path.stem, stats=stats, module=module,
                         stack_depth=stack_depth, keep_records=keep_records, batch=batch, check_nan=check_nan,
                         _describe_args=True)
        self.log_path = log_path
        self.jsonl_path = jsonl_path
        self.verbose, self.max_ops_logged, self.auto_flush = verbose, max_ops_logged, auto_flush
        self._log: Optional[LogWriter] = None

    def _files(self) -> List[Path]:
        return [self.log_path, self.jsonl_path]

    def _open(self) -> None:
        super()._open()
        if self._log is None:
            self._log = LogWriter(self.log_path, self.run, torch.__version__, echo=self.verbose,
                                  max_ops=self.max_ops_logged)

    def _sink(self, events: List[OpEvent], early: bool = False) -> None:
        super()._sink(events, early)
        if self._log is not None:
            self._log.write(events, flush=self.auto_flush and not early)

    def _finish(self, aborted: Optional[str] = None) -> None:
        super()._finish(aborted)
        if self._log is not None:
            self._log.close(self._recorder.seq, self._nan_lines() + self._notes(), aborted)
            self._log = None
