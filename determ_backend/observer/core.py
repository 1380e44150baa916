"""The Observer: named observations and op traces of a run, checked against a reference run.

``ObserverContext(dump_dir, name, reference_hash_file=None, raise_on_mismatch=False)``
yields an :class:`Observer`.  Inside it:

* ``observe(name, value)`` fingerprints a pytree of tensors (record ``<name>#<k>``,
  the k-th observation of that name) and checks it against the reference at once;
* ``enable_mode()`` / ``disable_mode()`` switch a :class:`~determ_backend.modes.core.HashMode`
  on and off, tracing every op of a region;
* ``observe_non_deterministic(name, value)`` (or ``(name, fn, *args, **kwargs)``) and
  ``with marking_non_deterministic(): ...`` mark values known to vary from run to run:
  the reference run saves them, later runs substitute the saved values (exactly, with
  their strides; gradients flow through unchanged), so everything downstream stays
  comparable.  Marked records never count as mismatches, except a value the reference run did
  not save (or saved with another shape or dtype): it is not replayed, keeps this run's value and
  is compared as any record (:attr:`Observer.unreplayed`).

On exit the run is written to ``<dump_dir>/<name>.jsonl`` (a trace ``repro-tools
diff`` reads) plus ``<name>.safetensors`` for saved tensors -- no pickles -- and,
with a reference, ``observer.mismatches`` lists the records whose values differ,
paired by name and, when names do not line up, by sequence alignment (one extra op
does not misalign the rest), each with both stacks and a ``root_cause`` flag.

Reading and writing a run's files is :mod:`determ_backend.observer._files`' job, op
tracing :class:`~determ_backend.modes.core.HashMode`'s, pairing and judging records
:mod:`determ_backend.compare`'s; user stacks come from :mod:`determ_backend._frames`.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Union

import torch

from determ_backend import _torch_compat
from determ_backend._frames import user_frames
from determ_backend.args import check_bool
from determ_backend.modes.ops import returns_view, schema_writes, written_tensors
from determ_backend.observer._files import load_reference, tensors_path_for, write_run
from determ_backend.compare import compare_traces
from determ_backend.errors import ConfigError, NondeterminismError, TraceFormatError
from determ_backend.modes.core import HashMode
from determ_backend.trace.stream import Record, read_trace

__all__ = ["Observer", "ObserverContext", "observe", "observe_grad", "observe_non_deterministic",
           "marking_non_deterministic", "enable_mode", "disable_mode", "current_observer"]

logger = logging.getLogger(__name__)
_CURRENT: contextvars.ContextVar = contextvars.ContextVar("determ_observer", default=None)


class _Substitute(torch.autograd.Function):
    """Forward: the saved value (with ``x``'s strides); backward: the gradient unchanged."""

    @staticmethod
    def forward(ctx, x, saved):
        out = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device)
        return out.copy_(saved)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Observer:
    """State of one observed run; create it through :class:`ObserverContext`."""

    def __init__(self, dump_dir: Union[str, Path], name: str, reference_hash_file=None,
                 raise_on_mismatch: bool = False, stack_depth: int = 4):
        if not isinstance(name, str) or not name or "/" in name:
            raise ConfigError(f"name: expected a non-empty run name without '/', got {name!r}")
        if not isinstance(dump_dir, (str, os.PathLike)):
            raise ConfigError(f"dump_dir: expected a directory path, got {dump_dir!r}")
        if name in (".", ".."):
            raise ConfigError(f"name: expected a run name, got {name!r} (it names a directory)")
        check_bool(raise_on_mismatch=raise_on_mismatch)
        if reference_hash_file is not None and not isinstance(reference_hash_file, (str, os.PathLike)):
            raise ConfigError(f"reference_hash_file: expected the path of a reference run's trace or None, got "
                              f"{reference_hash_file!r}")
        self.name = name
        self.trace_path = Path(dump_dir) / f"{name}.jsonl"
        if reference_hash_file is not None and Path(reference_hash_file).resolve() in (
                self.trace_path.resolve(), tensors_path_for(self.trace_path).resolve()):
            raise ConfigError(f"reference_hash_file={str(reference_hash_file)!r} is where run {name!r} writes its own "
                              f"trace: it would overwrite the reference; expected another run name")
        self.raise_on_mismatch = raise_on_mismatch
        self.mismatches: List[Dict[str, Any]] = []
        self.unmatched: Dict[str, List[str]] = {"reference_only": [], "current_only": []}
        self.unreplayed: List[Dict[str, str]] = []  # marked values the reference saved none of (name, why)
        self.mode = HashMode(run=name, stack_depth=stack_depth)
        self.mode.output_hook = self._output_hook
        self._rec = self.mode._recorder
        self._stack_depth = stack_depth
        self._counts: Dict[str, int] = {}
        self._saved: Dict[str, torch.Tensor] = {}
        self._marking: List[list] = []
        self._hooks: list = []
        self.reference: Optional[List[Record]] = None
        self._ref_tensors: Optional[Dict[str, torch.Tensor]] = None
        self._ref_by_key: Dict[tuple, Record] = {}
        if reference_hash_file is not None:
            self.reference, self._ref_tensors, self._ref_tensor_path = load_reference(reference_hash_file)
            self._ref_by_key = {r.key: r for r in self.reference}

    def enable_mode(self) -> None:
        """Trace every op from here on (a :class:`~determ_backend.modes.core.HashMode`)."""
        self.mode.enable()

    def disable_mode(self) -> None:
        self.mode.disable()

    @property
    def is_verification_run(self) -> bool:
        return self.reference is not None

    def _count(self, key: str) -> int:
        k = self._counts.get(key, 0)
        self._counts[key] = k + 1
        return k

    def _where(self):
        frames = user_frames(sys._getframe(2), self._stack_depth)
        return (frames[0].rsplit(" in ", 1)[0] if frames else None), frames

    # -- observations --------------------------------------------------------------------------
    def observe(self, name: str, value: Any) -> None:
        """Fingerprint every tensor (and Python number) in ``value`` and check it against the reference.
        Other leaves of a pytree (strings, None) are skipped; a value with nothing to observe is an error."""
        leaves, _ = _torch_compat.tree_flatten(value)
        items = [(i, x) for i, x in enumerate(leaves) if isinstance(x, (torch.Tensor, int, float, bool))]
        if not items and (leaves or value is None):
            raise ConfigError(f"observe({name!r}): nothing to observe in a value of type {type(value).__name__}; expected a "
                              f"tensor, a number or a pytree (list, tuple, dict) holding some")
        k = self._count(f"observe:{name}")
        source, stack = self._where()
        with self.mode.paused():
            recs = [self._rec.add_external(f"{name}#{k}" if len(items) == 1 else f"{name}#{k}.{i}", "observe",
                                           "observe", x, source, stack, inputs=self._inputs_of(x))
                    for i, x in items]
            self.mode.flush()
        for r in recs:
            self._check_now(r)

    def _inputs_of(self, x) -> list:
        p = self._rec.producer(x) if isinstance(x, torch.Tensor) else None
        return [p] if p is not None else []

    def observe_grad(self, name: str, tensor: torch.Tensor) -> None:
        """Observe ``tensor``'s gradient (as ``<name>.grad``) each time backward computes it."""
        if not tensor.requires_grad:
            raise ConfigError(f"observe_grad({name!r}): the tensor does not require grad")
        self._hooks.append(tensor.register_hook(lambda g: self.observe(f"{name}.grad", g)))

    def _check_now(self, r: Record) -> None:
        ref = self._ref_by_key.get(r.key)
        if ref is None or ref.hash == r.hash:
            return
        info = _mismatch(ref, r, root=False)
        self.mismatches.append(info)
        msg = f"observation {r.node} differs from the reference run (at {r.source or '?'})"
        if self.raise_on_mismatch:
            raise NondeterminismError(msg)
        logger.warning(msg)

    # -- non-deterministic values --------------------------------------------------------------
    def observe_non_deterministic(self, name: str, value: Any, *args, **kwargs) -> Any:
        """Mark ``value`` (a pytree of tensors) as non-deterministic: saved here, replaced by the
        reference's saved value in verification runs.  With a callable, call it with ``args`` inside
        :meth:`marking_non_deterministic` (every op it runs is marked)."""
        if callable(value) and not isinstance(value, torch.Tensor):
            with self.marking_non_deterministic(name):
                return value(*args, **kwargs)
        k = self._count(f"nondet:{name}")
        leaves, spec = _torch_compat.tree_flatten(value)
        source, stack = self._where()
        out = []
        with self.mode.paused():
            for i, x in enumerate(leaves):
                if not isinstance(x, torch.Tensor):
                    out.append(x)
                    continue
                key = f"{name}#{k}.{i}"
                producer = self._rec.producer(x)
                y = self._substitute(key, x)
                replayed = y is not None
                if producer is not None and replayed:
                    producer.extra = dict(producer.extra or {}, non_deterministic=True)
                self._rec.add_external(key, "observe_non_deterministic", "nondet", y if replayed else x, source, stack,
                                       extra={"non_deterministic": True} if replayed else {"not_replayed": True},
                                       inputs=[producer] if producer else [])
                out.append(y if replayed else x)
        return _torch_compat.tree_unflatten(out, spec)

    def _saved_value(self, key: str, like: torch.Tensor) -> Optional[torch.Tensor]:
        """The reference's saved value for ``key``; None (with a warning, and ``key`` in :attr:`unreplayed`) when this
        run marked a value the reference did not save, or one of another shape or dtype: the runs went different ways
        there, which the comparison then shows (a record only this run has, or one that differs), and the run goes on
        with its own value."""
        if self._ref_tensors is None:  # a reference of an earlier release: no word on whether it saved any
            raise TraceFormatError(f"{self._ref_tensor_path}: no such file, so no saved tensor {key!r} (the reference "
                                   f"run marked nothing non-deterministic, or this file was not kept next to its trace)")
        saved = self._ref_tensors.get(key)
        if saved is None:
            why = "the reference run saved no such value (it marked fewer values, or other ops)"
        elif saved.shape != like.shape or saved.dtype != like.dtype:
            why = (f"the reference saved {str(saved.dtype).replace('torch.', '')}{list(saved.shape)}, this run has "
                   f"{str(like.dtype).replace('torch.', '')}{list(like.shape)}")
        else:
            return saved
        self.unreplayed.append({"name": key, "why": why})
        if len(self.unreplayed) == 1:  # one line per run: a loop that marks one value too many would repeat it
            logger.warning("observer %s: marked value %s is not replayed: %s; it keeps this run's value and is "
                           "compared as an ordinary record (obs.unreplayed lists every such value)", self.name, key,
                           why)
        return None

    def _substitute(self, key: str, x: torch.Tensor) -> Optional[torch.Tensor]:
        """``x``'s stand-in: itself (saved) in a reference run, the saved value in a verification run; None when a
        verification run has no saved value for it (:meth:`_saved_value`)."""
        if not self.is_verification_run:
            self._saved[key] = x.detach().cpu().clone()
            return _Substitute.apply(x, x.detach())
        saved = self._saved_value(key, x)
        if saved is None:
            self._saved[key] = x.detach().cpu().clone()
            return None
        self._saved[key] = saved
        return _Substitute.apply(x, saved.to(x.device))

    @contextlib.contextmanager
    def marking_non_deterministic(self, name: str = "non_deterministic") -> Iterator[None]:
        """Every op output inside is saved (reference run) or replaced by the saved value (later runs)."""
        region = [f"{name}#{self._count(f'region:{name}')}", 0]
        self._marking.append(region)
        started = not self.mode.is_recording
        if started:
            self.mode.enable()
        try:
            yield
        finally:
            self._marking.pop()
            if started:
                self.mode.disable()

    def _output_hook(self, func, out, args, kwargs):
        """Called by the mode after each op: substitute marked outputs in place (before autograd sees them)."""
        if not self._marking:
            return out, False
        region = self._marking[-1]
        j = region[1]
        region[1] += 1
        if returns_view(func):
            return out, True  # a view of its input: nothing of its own to substitute
        replayed = True
        for i, t in enumerate(written_tensors(out, schema_writes(func), args, kwargs)):
            if not isinstance(t, torch.Tensor):
                continue
            key = f"{region[0]}/{j}.{i}"
            saved = self._saved_value(key, t) if self.is_verification_run else None
            if saved is not None:
                t.copy_(saved)
                self._saved[key] = saved
            else:  # a reference run's value, or one a verification run cannot replay: compared as it is
                replayed = replayed and not self.is_verification_run
                self._saved[key] = t.detach().cpu().clone()
        return out, replayed

    # -- end of run ----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop tracing, write the run files and compare with the reference."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.mode.close()
        write_run(self.trace_path, self.mode.records, self._saved, self.name)
        if self.reference is not None:
            self._compare()

    def _compare(self) -> None:
        # compare what was written (the JSONL form), exactly as a later run will read it back
        cmp = compare_traces(self.reference, read_trace(self.trace_path))
        self.comparison = cmp
        # a root cause may be an op only one run ran (a hook adding noise in this run): kept, with ``only_in``
        self.mismatches = [_mismatch(p.a, p.b, p.root_cause, p.metrics) for p in cmp.pairs
                           if (p.equal is False and p.a is not None and p.b is not None
                               and not (_nondet(p.a) or _nondet(p.b))) or (p.root_cause and not p.paired)]
        self.unmatched = {"reference_only": [p.a.node for p in cmp.pairs if p.b is None],
                          "current_only": [p.b.node for p in cmp.pairs if p.a is None]}

    def report_mismatches(self) -> bool:
        """Log the mismatches (root causes first) and the records only one run has; True when there are none
        of either (a run that stopped a step short, or ran one more, is not shown to match)."""
        unpaired = self.unpaired_summary()
        if not self.mismatches and unpaired is None:
            logger.info("observer %s: no mismatches with the reference run", self.name)
            return True
        if unpaired is not None:
            logger.warning("observer %s: %s", self.name, unpaired)
        if not self.mismatches:
            return False
        ordered = sorted(self.mismatches, key=lambda m: not m["root_cause"])
        logger.warning("observer %s: %d records differ from the reference run", self.name, len(ordered))
        for m in ordered[:20]:
            logger.warning("  %s%s (%s) at %s; reference at %s", "[root cause] " if m["root_cause"] else "",
                           m["name"], m["op"], m["current_source"] or "?", m["reference_source"] or "?")
        return False

    def unpaired_summary(self) -> Optional[str]:
        """One line on the records only one run has (:attr:`unmatched`), or None when every record paired."""
        ref_only, cur_only = self.unmatched.get("reference_only", []), self.unmatched.get("current_only", [])
        if not ref_only and not cur_only:
            return None
        parts = []
        if ref_only:
            parts.append(f"{len(ref_only)} records of the reference have no counterpart in this run (first: "
                         f"{ref_only[0]})")
        if cur_only:
            parts.append(f"{len(cur_only)} records of this run have none in the reference (first: {cur_only[0]})")
        return "; ".join(parts) + "; the runs did not run the same ops, so they are not shown to match"


def _nondet(r: Record) -> bool:
    return bool(r.extra and r.extra.get("non_deterministic"))


def _stack(r: Record) -> List[str]:
    return list((r.extra or {}).get("stack") or ([r.source] if r.source else []))


def _mismatch(ref: Optional[Record], cur: Optional[Record], root: bool,
              metrics: Optional[dict] = None) -> Dict[str, Any]:
    """One mismatch; ``ref`` or ``cur`` is None for a record only the other run has (``only_in`` says which)."""
    one = cur if cur is not None else ref
    metrics = dict(metrics or {})
    if "only_in" in metrics:  # the comparison's sides, a and b, are the reference and this run
        metrics["only_in"] = {"a": "reference", "b": "current"}.get(metrics["only_in"], metrics["only_in"])
    out = {"name": one.node, "reference_name": ref.node if ref is not None else None, "op": one.op, "kind": one.kind,
           "current": cur.hash if cur is not None else None, "reference": ref.hash if ref is not None else None,
           "root_cause": root, "metrics": metrics,
           "current_source": cur.source if cur is not None else None,
           "reference_source": ref.source if ref is not None else None,
           "current_stack": _stack(cur) if cur is not None else [],
           "reference_stack": _stack(ref) if ref is not None else []}
    if cur is None or ref is None:
        out["only_in"] = "current" if ref is None else "reference"
    return out


class ObserverContext:
    """``with ObserverContext(dump_dir, name, reference_hash_file=None, raise_on_mismatch=False) as obs:``

    Makes ``obs`` the current observer (for the module-level :func:`observe` & co.), writes
    ``<dump_dir>/<name>.jsonl`` (+ ``.safetensors``) on exit and, with a reference, fills
    ``obs.mismatches``; ``raise_on_mismatch`` raises :class:`NondeterminismError` then.
    """

    def __init__(self, dump_dir: Union[str, Path], name: str, reference_hash_file=None,
                 raise_on_mismatch: bool = False, stack_depth: int = 4):
        self.observer = Observer(dump_dir, name, reference_hash_file, raise_on_mismatch, stack_depth)
        self._token = None

    def __enter__(self) -> Observer:
        self._token = _CURRENT.set(self.observer)
        return self.observer

    def __exit__(self, exc_type, exc, tb) -> None:
        obs = self.observer
        try:
            obs.close()
        finally:
            _CURRENT.reset(self._token)
        if obs.reference is not None and exc_type is None:
            obs.report_mismatches()
            unpaired = obs.unpaired_summary()
            if obs.raise_on_mismatch and not obs.mismatches and unpaired is not None:
                raise NondeterminismError(f"observer {obs.name}: {unpaired}")
            if obs.raise_on_mismatch and obs.mismatches:
                roots = [m for m in obs.mismatches if m["root_cause"]]
                first = (roots or obs.mismatches)[0]
                what = "first root cause" if roots else "no root cause found; first differing record"
                only = {"current": " (only this run ran it)", "reference": " (only the reference ran it)"}.get(
                    first.get("only_in"), "")
                # with no root cause, the records only one run has may be where it lies (an extra op)
                also = f"; also, {unpaired}" if not roots and unpaired is not None else ""
                raise NondeterminismError(f"observer {obs.name}: {len(obs.mismatches)} records differ from the "
                                          f"reference; {what} {first['name']}{only} at "
                                          f"{first['current_source'] or first['reference_source'] or '?'}{also}")


def current_observer() -> Optional[Observer]:
    return _CURRENT.get()


def observe(name: str, value: Any) -> None:
    """Record ``value`` on the current observer (no-op without one).  Syncs with the device."""
    obs = _CURRENT.get()
    if obs is not None:
        obs.observe(name, value)


def observe_grad(name: str, tensor: torch.Tensor) -> None:
    obs = _CURRENT.get()
    if obs is not None:
        obs.observe_grad(name, tensor)


def observe_non_deterministic(name: str, value: Any, *args, **kwargs) -> Any:
    """See :meth:`Observer.observe_non_deterministic`; without an observer, returns ``value`` (or calls it)."""
    obs = _CURRENT.get()
    if obs is None:
        return value(*args, **kwargs) if callable(value) and not isinstance(value, torch.Tensor) else value
    return obs.observe_non_deterministic(name, value, *args, **kwargs)


def marking_non_deterministic(name: str = "non_deterministic"):
    obs = _CURRENT.get()
    return obs.marking_non_deterministic(name) if obs is not None else contextlib.nullcontext()


def enable_mode() -> None:
    """Trace every op from here on (current observer)."""
    obs = _CURRENT.get()
    if obs is None:
        logger.warning("enable_mode(): no ObserverContext is active")
        return
    obs.mode.enable()


def disable_mode() -> None:
    obs = _CURRENT.get()
    if obs is None:
        logger.warning("disable_mode(): no ObserverContext is active")
        return
    obs.mode.disable()
