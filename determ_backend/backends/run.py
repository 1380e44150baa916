"""A run: the output directory of one process's determ session, its trace
writer, its findings, its ``report.json`` and the reference trace
(``DETERM_REFERENCE``) it is compared against online.

Runs are shared by every graph compiled with the same output settings in a
process (a model with graph breaks writes one trace).  They are kept in a small
registry owned by :class:`RunRegistry`; :func:`finish_all` (also registered with
``atexit``) closes traces and writes the final reports.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

from determ_backend import _torch_compat, devices
from determ_backend.backends.flows import write_report
from determ_backend.backends.recorder import ValueMemo
from determ_backend.compare.nonfinite import input_ranges
from determ_backend.compare.roots import pair_row
from determ_backend.compare.verdict import metrics_text
from determ_backend.config import DetermConfig
from determ_backend.errors import AccuracyError, ConfigError, TraceFormatError, first_line
from determ_backend.trace.store import TensorStore
from determ_backend.trace.stream import (TRACE_NAME, Record, TraceWriter, atomic_write_text, encode,
                                         read_trace_file)

__all__ = ["Run", "ReferenceTrace", "get_run", "find_run", "finish_all", "current_rank", "subscribe", "unsubscribe",
           "reuse_run_dir"]

log = logging.getLogger(__name__)
_MAX_NOTES = 50  # masked-divergence notes kept in report.json
_MAX_PAIR_FILES = 3  # findings whose every judged pair is kept (pairs-<k>.jsonl), for the HTML report
REPORT_HTML = "report.html"


def current_rank() -> int:
    return devices.rank_and_world()[0]


_CLAIM = ".determ-run"
"""Created exclusively in a run directory by the run that owns it."""


def _claim_dir(root: Path, run_id: str, rank_part: str, given: str) -> Path:
    """A directory no other run has: ``<root>/<run_id><rank_part>``, else ``<run_id>-2<rank_part>``,
    ``-3``...  A run owns its directory by creating :data:`_CLAIM` in it exclusively, so a directory an
    earlier run wrote (or another process claims at this very moment) is never shared, while one the
    user created empty beforehand is used; every rank of a job picks the same suffix.  One line says
    where the run went when it is not the directory asked for."""
    for k in range(1, 10_000):
        rid = run_id if k == 1 else f"{run_id}-{k}"
        leaf = root / f"{rid}{rank_part}"
        try:
            leaf.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"DETERM_DIR={given!r}: cannot create {leaf} ({e.strerror or e}); "
                              f"expected a writable directory") from None
        if (leaf / TRACE_NAME).exists() or (leaf / "report.json").exists():
            continue  # an earlier run's, from before runs claimed their directory
        try:
            os.close(os.open(leaf / _CLAIM, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            continue
        except OSError as e:
            raise ConfigError(f"DETERM_DIR={given!r}: cannot write into {leaf} ({e.strerror}); "
                              f"expected a writable directory") from None
        if k > 1:
            log.warning("determ: %s already exists (an earlier or concurrent run of the same id); this run "
                        "writes to %s", root / f"{run_id}{rank_part}", leaf)
        return leaf
    raise ConfigError(f"DETERM_RUN_ID={run_id!r}: {root} holds 9999 runs of that id; expected a new id")


def reuse_run_dir(leaf: Path) -> None:
    """Let the next run of the same id write into ``leaf`` again (a tool that reruns a program into one directory
    it owns, such as ``repro-tools xdevice``): the earlier run's trace, report and claim go."""
    for stale in (TRACE_NAME, "report.json", _CLAIM):
        (Path(leaf) / stale).unlink(missing_ok=True)


_AGREED: Dict[str, int] = {}  # output settings' digest -> default run ids agreed for them so far (a counter)


def _default_run_id(settings: tuple = ()) -> str:
    """``<time>-<pid>``; under ``torch.distributed``, the one every rank takes: the first rank to reach the process
    group's store puts its own there, and the others read it (no collective: ranks need not be in step), so a job
    writes ``<run id>/rank<N>/`` under one id.  ``settings``: what sets the run's output apart (two runs of other
    settings in one job get two ids)."""
    local = time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
    if devices.world_size() < 2:
        return local
    store = _torch_compat.process_group_store()
    if store is None:
        return local
    digest = hashlib.blake2b(repr(settings).encode(), digest_size=6).hexdigest()
    n = _AGREED.get(digest, 0)
    _AGREED[digest] = n + 1
    try:
        got = store.compare_set(f"determ/run_id/{digest}/{n}", "", local)
    except Exception as e:  # a store that is gone or refuses: each rank keeps its own id
        log.info("determ: run id not agreed with the other ranks (%s: %s)", type(e).__name__, first_line(e))
        return local
    return got.decode() if isinstance(got, bytes) else str(got)


class ReferenceTrace:
    """A whole trace read (strictly) for online comparison, its records grouped by ``(graph, stage, call)``,
    the device it was recorded on (trace header, when known) and its tensor store (when it has one)."""

    def __init__(self, path: str):
        self.name = path
        try:
            tf = read_trace_file(path)
        except TraceFormatError as e:
            raise TraceFormatError(f"DETERM_REFERENCE: {e}") from None
        self.path = tf.path
        self.device: Optional[str] = tf.header.get("device")
        self.groups: Dict[tuple, List[Record]] = {}
        for r in tf.records:
            self.groups.setdefault((r.graph, r.stage, r.call), []).append(r)
        store = self.path.parent / "tensors"
        self.store = TensorStore(store) if store.is_dir() else None

    def calls(self, graph: str, stage: str) -> int:
        """How many calls of this graph and stage the reference recorded."""
        return sum(1 for g, s, _ in self.groups if (g, s) == (graph, stage))

    def graph_stages(self) -> List[str]:
        return sorted({f"{g}/{s}" for g, s, _ in self.groups})


def _divergence_key(check: str, summary: Dict[str, Any]) -> Optional[tuple]:
    """What makes two findings of ``check`` the same divergence: the graph, stage and node of the first divergence
    and the root causes' nodes (not the call).  None for a finding without one (a repro flow's one-line detail)."""
    fd = summary.get("first_divergence")
    if not isinstance(fd, dict) or fd.get("graph") is None or fd.get("node") is None:
        return None
    roots = tuple(sorted(str(r.get("node")) for r in summary.get("root_causes") or [] if isinstance(r, dict)))
    return check, fd.get("graph"), fd.get("stage"), fd.get("node"), roots


def _size_of(metrics: Optional[Dict[str, Any]]) -> Optional[float]:
    """How large a divergence is, from its metrics (the largest error measure present); None when none is."""
    vals = [v for k, v in (metrics or {}).items() if k in _SIZE_KEYS and isinstance(v, (int, float))
            and not isinstance(v, bool)]
    return max(vals) if vals else None


_SIZE_KEYS = ("max_abs", "l2_rel", "rmse", "err_compiled_vs_fp64", "max_diff", "l2_diff")


def _grew(finding: Dict[str, Any], fd: Dict[str, Any]) -> bool:
    """Whether this call's divergence is more than ten times the worst one ``finding`` holds, or non-finite where
    that was finite (a repeat that grew is said again)."""
    worst = (finding.get("worst_call") or {}).get("metrics") or (finding.get("first_divergence") or {}).get("metrics")
    before, now = _size_of(worst), _size_of(fd.get("metrics"))
    if now is None or before is None:
        return False
    if not math.isfinite(now):
        return math.isfinite(before)
    return now > 10 * before


class Run:
    """One output directory: ``trace.jsonl``, ``report.json`` and any dumps."""

    def __init__(self, config: DetermConfig):
        self.config = config
        self.id = config.run_id or _default_run_id((os.path.abspath(config.dir), config.check, config.reference,
                                                     config.trace))
        self.rank = current_rank()
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        rank_part = f"/rank{self.rank}" if self.rank != 0 or distributed else ""
        # the reference is checked before anything is written: a bad one fails the compile
        self.reference = ReferenceTrace(config.reference) if config.reference else None
        self.reference_compared: set = set()  # (graph, stage, call) of the reference this run was compared with
        self.dir = _claim_dir(Path(config.dir), self.id, rank_part, config.dir)
        self.device: Optional[str] = None  # where the graphs compute (set by the first graph call)
        self.tensors = TensorStore(self.dir / "tensors")  # DETERM_SAVE_TENSORS payloads
        self.memo = ValueMemo()  # fingerprints of the values forward graphs returned, for their backward graphs
        self._writer: Optional[TraceWriter] = None
        self._lock = threading.Lock()
        self._graphs = 0
        self.findings: List[Dict[str, Any]] = []
        self.checker_errors: List[str] = []
        self.notes: List[Dict[str, Any]] = []
        self._found: Dict[tuple, Dict[str, Any]] = {}  # a finding's divergence (_divergence_key) -> that finding
        self.judged: set = set()  # the configured checks that judged at least one graph call
        self.flow_checks: List[str] = []  # checks the repro flows ran (REPRO_LEVEL=4's accuracy check), in order
        self.batch_symbols: Dict[str, Any] = {}  # graph id -> the batch size symbol its forward graph was checked with
        self._write_report()

    @property
    def trace_path(self) -> Path:
        return self.dir / TRACE_NAME

    def next_graph_id(self) -> str:
        with self._lock:
            gid = f"g{self._graphs}"
            self._graphs += 1
            return gid

    def write(self, records: List[Record]) -> None:
        if records:
            _LISTENERS.notify(records)
        if not self.config.trace or not records:
            return
        self._trace_writer().write(records)

    def write_call(self, result) -> None:
        """Write one graph call's :class:`~determ_backend.backends.recorder.CallResult` (its records are only
        built when a listener wants them)."""
        if _LISTENERS:
            self.write(result.records)
        elif self.config.trace:
            lines = result.lines()
            if lines:
                self._trace_writer().write_lines(lines)

    def _trace_writer(self) -> TraceWriter:
        with self._lock:
            if self._writer is None:
                self._writer = TraceWriter(self.trace_path, run=self.id, meta={"rank": self.rank, "device": self.device})
            return self._writer

    def store_payloads(self, result) -> None:
        """Save each captured tensor once in ``<run dir>/tensors/``, the run's tensor store (DETERM_SAVE_TENSORS)."""
        for rec in result.records:
            value = result.values.get(rec.node)
            if value is not None and rec.hash is not None:
                rec.payload = self.tensors.put(rec.hash, value)

    def add_finding(self, check: str, summary: Dict[str, Any], pairs: Optional[List[Any]] = None) -> Dict[str, Any]:
        """Record a divergence found by ``check``; log one line; raise if configured to.  Returns the finding (for
        :meth:`amend_finding`).

        ``summary``: a :meth:`~determ_backend.compare.Comparison.summary`, or (a divergence found
        without per-node records, e.g. by a repro flow) a dict with a one-line ``detail``.  ``pairs``:
        the comparison's judged pairs, kept in ``pairs-<k>.jsonl`` (the first findings only) for the
        HTML report, which is written (``report.html``, unless ``DETERM_REPORT=0``) before the line."""
        fd = summary.get("first_divergence") or {}
        key = _divergence_key(check, summary)
        with self._lock:
            earlier = self._found.get(key) if key is not None else None
            if earlier is not None:
                earlier["repeats"] = earlier.get("repeats", 0) + 1
                earlier["last_call"] = fd.get("call")
                grown = _grew(earlier, fd)
                if grown:
                    earlier["worst_call"] = {"call": fd.get("call"), "metrics": fd.get("metrics")}
            else:
                finding = {"check": check, **summary}
                if key is not None:
                    self._found[key] = finding
        if earlier is not None:
            return self._found_again(check, earlier, fd, grown)
        if not isinstance(finding.get("pairs"), str):  # a comparison's count of paired records: ``pairs`` names
            finding["paired"] = finding.pop("pairs", None)  # the file of its verdicts, kept for the first findings
        with self._lock:
            k = len(self.findings)
            self.findings.append(finding)
        if pairs is not None and k < _MAX_PAIR_FILES:
            finding["pairs"] = self._write_pairs(k, pairs)
        html = self._write_html() if k < _MAX_PAIR_FILES else self._write_report()
        where = f"; report: {html}" if html else ""
        if fd and check == "nan":
            ins = fd.get("inside") or {}
            inside = (f"; inside {ins.get('kernel')}: {ins.get('node')} ({ins.get('op')}) at {ins.get('source') or '?'}"
                      if ins.get("node") else f"; {ins['note']}" if ins.get("note") else "")
            ranges = input_ranges(fd.get("inputs") or [])
            log.warning("determ nan: %s NaN and %s Inf created by graph=%s stage=%s node=%s op=%s at %s from finite "
                        "inputs (%s)%s%s", fd["metrics"].get("nan"), fd["metrics"].get("inf"), fd.get("graph"),
                        fd.get("stage"), fd.get("node"), fd.get("op"), fd.get("source") or "<unknown source>",
                        ranges, inside, where)
        elif fd:
            metrics = metrics_text(fd.get("metrics"))
            k = fd.get("kernel") or {}
            inside = ""
            if k.get("record_metrics") and k.get("upstream"):
                inside = (f" inside {k['name']}, upstream of the buffer {k.get('record')}" if k.get("name") else
                          f" upstream of the buffer {k.get('record')}, in a value no buffer holds")
            elif k.get("record_metrics"):
                inside = f" inside {k.get('name')} (its buffer {k.get('record')})"
            # a minifier's culprit names no graph or stage: only the fields the finding has
            named = " ".join(f"{k}={fd[k]}" for k in ("graph", "stage", "node", "op") if fd.get(k) is not None)
            # a first divergence whose inputs were not shown to agree is no root cause: the line says so
            label = "first divergence (no root cause: its inputs were not shown to agree) " \
                if fd.get("root_cause") is False else ""
            log.warning("determ %s divergence: %s%s at %s%s %s%s", check, label, named,
                        fd.get("source") or "<unknown source>", inside, metrics, where)
        else:
            log.warning("determ %s divergence: %s%s", check, summary.get("detail") or "(no details)", where)
        if self.config.raise_on_divergence:
            where = (f"first divergence at node {fd.get('node')} ({fd.get('op')}) {fd.get('source') or ''}" if fd
                     else str(summary.get("detail") or "divergence"))
            raise AccuracyError(f"determ {check}: {where}; report: {self.dir / 'report.json'}")
        return finding

    def _found_again(self, check: str, finding: Dict[str, Any], fd: Dict[str, Any], grown: bool) -> Dict[str, Any]:
        """The divergence of ``finding`` found again on a later call: counted in it (``repeats``, ``last_call``), not
        a new finding and not a new warning line (a training loop would repeat it every step, and rewrite an
        ever longer report each time); still raised when configured to.  A call where it grew past ten times the
        worst seen before (or became non-finite) is ``worst_call``, written at once and said again."""
        n = finding["repeats"]
        if grown or n & (n - 1) == 0:  # the file follows at 1, 2, 4, 8... repeats, and at the end of the run
            self._write_report()
        if grown:
            log.warning("determ %s divergence at node %s (graph=%s stage=%s) grew at call %s: %s", check,
                        fd.get("node"), fd.get("graph"), fd.get("stage"), fd.get("call"), metrics_text(fd.get("metrics")))
        else:
            log.info("determ %s divergence again at node %s (graph=%s stage=%s call %s): %d repeat(s), counted in its "
                     "finding", check, fd.get("node"), fd.get("graph"), fd.get("stage"), fd.get("call"), n)
        if self.config.raise_on_divergence:
            raise AccuracyError(f"determ {check}: first divergence at node {fd.get('node')} ({fd.get('op')}) "
                                f"{fd.get('source') or ''} (again); report: {self.dir / 'report.json'}")
        return finding

    def amend_finding(self, finding: Dict[str, Any], fields: Dict[str, Any]) -> None:
        """Add what was learned later about a recorded finding (what the minifier found) and rewrite the report."""
        with self._lock:
            finding.update(fields)
        self._write_report()

    def _write_pairs(self, k: int, pairs: List[Any]) -> Optional[str]:
        """Every judged pair of finding ``k`` as JSON lines in ``pairs-<k>.jsonl``; its file name."""
        name = f"pairs-{k}.jsonl"
        try:
            atomic_write_text(self.dir / name, "".join(encode(pair_row(p)).decode("utf-8") + "\n" for p in pairs))
        except Exception as e:  # the report's bookkeeping never breaks the model
            self.add_checker_error("report", f"writing {name}: {type(e).__name__}: {first_line(e)}")
            return None
        return name

    def _write_html(self) -> Optional[Path]:
        """``report.json`` now, then ``report.html`` beside it (the ``report`` plug-in) unless ``DETERM_REPORT=0``;
        a failure of the report is a checker error, never the model's."""
        self._write_report()
        if not self.config.report:
            return None
        if self._writer is not None:
            self._writer.flush()
        try:
            return Path(write_report(self.dir))
        except Exception as e:
            log.debug("determ report failed", exc_info=True)
            self.add_checker_error("report", f"writing {REPORT_HTML}: {type(e).__name__}: {first_line(e)}")
            return None

    def add_note(self, check: str, summary: Dict[str, Any]) -> None:
        """Record divergences ``check`` found that reach no failing output (masked): no finding, no raise."""
        notes = summary.get("masked") or []
        with self._lock:
            if len(self.notes) >= _MAX_NOTES:
                return
            self.notes.append({"check": check, "masked": notes})
        for n in notes[:1]:
            log.info("determ %s: masked divergence at node %s (%s) %s reaches no failing output", check,
                     n.get("node"), n.get("op"), n.get("source") or "")
        self._write_report()

    def add_notice(self, check: str, notice: str, **details: Any) -> None:
        """Something ``check`` saw that is no finding and no masked divergence (a NaN that came in with a
        parameter): a note in ``report.json``; the caller logs it."""
        with self._lock:
            if len(self.notes) >= _MAX_NOTES:
                return
            self.notes.append({"check": check, "notice": notice, **details})
        self._write_report()

    def add_skip(self, check: str, detail: str) -> None:
        """``check`` does not apply to a graph (say why, once): a note in ``report.json`` and one INFO line."""
        with self._lock:
            if len(self.notes) >= _MAX_NOTES:
                return
            self.notes.append({"check": check, "skipped": detail})
        log.info("determ %s: skipped %s", check, detail)
        self._write_report()

    def add_flow_check(self, check: str) -> None:
        """A repro flow ran ``check`` (on some graph): ``report.json`` lists it with the configured checks, so that a
        clean run says what was checked rather than "tracing only"."""
        with self._lock:
            if check in self.flow_checks:
                return
            self.flow_checks.append(check)
        self._write_report()

    def add_checker_error(self, check: str, message: str) -> None:
        with self._lock:
            self.checker_errors.append(f"{check}: {message}")
        if check == "report":  # the run's own files, not a check
            log.error("determ could not write its report: %s", message)
        else:
            log.error("determ %s check could not run: %s", check, message)
        self._write_report()

    def report(self) -> Dict[str, Any]:
        first = None
        if self.findings:
            fd = self.findings[0].get("first_divergence") or {}
            first = {k: fd.get(k) for k in ("graph", "stage", "call", "node", "op", "source", "metrics")}
            if fd.get("kernel"):
                first["kernel"] = fd["kernel"]
            first["check"] = self.findings[0]["check"]
        configured = list(self.config.check) + (["reference"] if self.config.reference else [])
        checks = configured + self.flow_checks
        return {"run": self.id, "rank": self.rank, "checks": checks,
                # checks asked for that judged no graph call (every graph skipped, or none ran): not shown clean
                "unchecked": [c for c in configured if c not in self.judged and self._graphs],
                "divergent": bool(self.findings), "first_divergence": first, "findings": self.findings,
                "checker_errors": self.checker_errors, "notes": self.notes, "graphs": self._graphs,
                "trace": str(self.trace_path) if self._writer is not None else None}

    def _write_report(self) -> None:
        atomic_write_text(self.dir / "report.json", json.dumps(self.report(), indent=2, default=str))

    def close(self) -> None:
        self._note_reference_left()
        with self._lock:
            if self._writer is not None:
                self._writer.close()
        if self.findings:  # the page again, with every record the trace now holds
            self._write_html()
        else:
            self._write_report()


    def _note_reference_left(self) -> None:
        """Graph calls the reference recorded that this run never made were never compared: a run that stopped
        early, or took another path (no backward at all), must not read as matching its reference."""
        if self.reference is None:
            return
        left = sorted(set(self.reference.groups) - self.reference_compared, key=lambda k: (k[0], k[1], k[2]))
        if not left:
            return
        by: Dict[tuple, List[int]] = {}
        for g, st, c in left:
            by.setdefault((g, st), []).append(c)
        parts = [f"{g}/{st} call{'s' if len(cs) > 1 else ''} {', '.join(map(str, cs[:5]))}{', ...' if len(cs) > 5 else ''}"
                 for (g, st), cs in sorted(by.items())]
        notice = (f"{self.reference.name}: {len(left)} graph call(s) of the reference were never made by this run, so "
                  f"not compared: {'; '.join(parts)} (a run that stopped early, or took another path)")
        with self._lock:
            self.notes.append({"check": "reference", "notice": notice,
                               "not_compared": [[g, st, c] for g, st, c in left[:100]]})
        log.warning("determ reference: %s", notice)


class RecordListeners:
    """Callbacks that see every batch of records any run writes (e.g. the API dump, to show what
    happened inside a compiled region).  Subscribe with :func:`subscribe`, always unsubscribe."""

    def __init__(self) -> None:
        self._fns: List[Callable[[List[Record]], None]] = []
        self._lock = threading.Lock()

    def subscribe(self, fn: Callable[[List[Record]], None]) -> Callable[[List[Record]], None]:
        with self._lock:
            self._fns.append(fn)
        return fn

    def unsubscribe(self, fn: Callable[[List[Record]], None]) -> None:
        with self._lock:
            if fn in self._fns:
                self._fns.remove(fn)

    def __bool__(self) -> bool:
        return bool(self._fns)

    def notify(self, records: List[Record]) -> None:
        with self._lock:
            fns = list(self._fns)
        for fn in fns:
            fn(records)


_LISTENERS = RecordListeners()
subscribe = _LISTENERS.subscribe
unsubscribe = _LISTENERS.unsubscribe


class RunRegistry:
    """Runs of this process keyed by their output directory settings."""

    def __init__(self) -> None:
        self._runs: Dict[tuple, Run] = {}
        self._lock = threading.Lock()

    def get(self, config: DetermConfig) -> Run:
        key = (os.path.abspath(config.dir), config.run_id, config.check, config.reference, config.trace)
        with self._lock:
            run = self._runs.get(key)
            if run is None:
                run = self._runs[key] = Run(config)
            return run

    def find(self, run_id: str, rank: Optional[int] = None) -> Optional[Run]:
        """The open run with this id (and rank), if any."""
        with self._lock:
            for run in self._runs.values():
                if run.id == run_id and (rank is None or run.rank == rank):
                    return run
        return None

    def finish_all(self) -> List[Run]:
        with self._lock:
            runs = list(self._runs.values())
            self._runs.clear()
        for r in runs:
            r.close()
        return runs


_REGISTRY = RunRegistry()
get_run = _REGISTRY.get
find_run = _REGISTRY.find
finish_all = _REGISTRY.finish_all
atexit.register(finish_all)
