"""``repro-tools diff A B``: align two traces, print a table and the root-cause divergence.

Exit 0 only when the two runs are shown to be the same: every record pairs and no pair
differs, and neither file is a text log cut at ``max_ops_logged``.  Exit 1 when a pair
differs or the comparison cannot show the runs are the same (records that did not pair,
a limited log); a line says which.  Exit 2 for bad input, a trace without records included.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any, Dict, List, Optional, Sequence

from determ_backend.compare import Comparison, compare_traces, is_allocation, metrics_text
from determ_backend.errors import ConfigError
from determ_backend.trace.store import store_for

__all__ = ["register", "run_diff", "format_table", "compare_trace_pair", "diff_summary"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diff", help="compare two traces and name the first divergent node",
                       description="Align two traces (trace.jsonl files or run directories), print the pairs that "
                                   "differ and the root cause: the first record whose inputs agree and output does "
                                   "not.  Exit 0: identical; 1: divergent, or not shown identical (records that "
                                   "did not pair, a limited text log); 2: bad input.")
    p.add_argument("a", help="first trace: a trace.jsonl file, a run directory, or a HashDebugTrace log")
    p.add_argument("b", help="second trace, same kinds as A")
    p.add_argument("--tol", type=float, default=None,
                   help="tolerance verdicts (max abs or rel error <= TOL, TOL >= 0) instead of bitwise equality")
    p.add_argument("--json", action="store_true", help="print the comparison summary as JSON on stdout")
    p.add_argument("--limit", type=int, default=20, help="rows of divergent pairs to print (default 20)")
    p.add_argument("--allow-partial", action="store_true",
                   help="accept traces whose producer died (no end line; a cut last line is dropped)")
    p.set_defaults(func=run_diff)


def _check_args(args: argparse.Namespace) -> None:
    if args.tol is not None and not (math.isfinite(args.tol) and args.tol >= 0):
        raise ConfigError(f"--tol {args.tol}: expected a finite number >= 0")
    if args.limit < 0:
        raise ConfigError(f"--limit {args.limit}: expected a number of rows >= 0")


def compare_trace_pair(a: str, b: str, tol: Optional[float], allow_partial: bool = False) -> Comparison:
    """Two trace files (or run directories, or logs) compared as ``diff`` compares them; ``cmp.files`` holds each
    one's path and :class:`~determ_backend.trace.stream.TraceFile` (completeness, limits) for :func:`diff_summary`.
    A trace holding no records is an input error."""
    from repro_tools.cli.trace_formats import load_compared

    fa, fb = load_compared(a, allow_partial), load_compared(b, allow_partial)
    cmp = compare_traces(fa.records, fb.records, tol=tol, store_a=store_for(a), store_b=store_for(b))
    cmp.files = {"a": (a, fa), "b": (b, fb)}
    return cmp


def run_diff(args: argparse.Namespace) -> int:
    _check_args(args)
    cmp = compare_trace_pair(args.a, args.b, args.tol, args.allow_partial)
    summary = diff_summary(cmp, cmp.files)
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        print(format_table(cmp, args.limit, summary))
    return 0 if summary["identical"] else 1


def diff_summary(cmp: Comparison, files: Dict[str, tuple], checks: Sequence[str] = ()) -> Dict[str, Any]:
    """``cmp.summary(checks)`` plus what the two files are, ``notes`` on why the runs are not shown identical,
    and ``identical`` true only when they are (the exit code is 0 exactly then)."""
    s = cmp.summary(checks)
    s["unjudged"] = sum(1 for p in cmp.pairs if p.a is not None and p.b is not None and p.equal is None)
    s["inputs"] = {side: {"path": str(path), "records": len(tf.records), "complete": tf.complete,
                          "limited": tf.limited} for side, (path, tf) in files.items()}
    notes: List[str] = []
    if s["unmatched_a"] or s["unmatched_b"]:
        why = "" if not all(tf.complete for _, tf in files.values()) else (
            " (records pair by graph, stage, call and node name, else by op signature; traces of different "
            "backends or stages pair only values of one source line)")
        notes.append(f"not paired: {s['unmatched_a']} records of A and {s['unmatched_b']} of B have no counterpart, "
                     f"so the runs are not shown identical{why}")
    if s["unjudged"]:
        unjudged = [p for p in cmp.pairs if p.paired and p.equal is None and p.metrics.get("unjudged")]
        alloc = sum(1 for p in unjudged if is_allocation(p.rec))  # memory as allocated: no values, no statistics
        no_tol = len(unjudged) - alloc
        why = (f"{no_tol} differ in their fingerprints with no statistics or stored values to judge --tol by "
               f"(record them with stats, or DETERM_SAVE_TENSORS=1)" if no_tol else "")
        if alloc:
            why += ("; " if why else "") + (f"{alloc} are memory as allocated (empty, new_empty_strided: no values "
                                            "yet), whose fingerprints hold dtype and shape alone")
        no_tol += alloc
        rest = s["unjudged"] - no_tol
        why += ("; " if why and rest else "") + (f"{rest} carry no fingerprint and no judged input" if rest else "")
        notes.append(f"not judged: {s['unjudged']} paired records: {why}")
    weak = s["by_statistics"] = cmp.by_statistics
    if weak:
        notes.append(f"by statistics: {weak} paired record(s) differ in their fingerprints and agree within the "
                     f"tolerance by their min/max/mean/L2 alone, which bound no element error (the same values in "
                     f"another order keep them all); only stored tensors (DETERM_SAVE_TENSORS=1 on both sides) "
                     f"are judged element by element")
    for side, (path, tf) in files.items():
        if tf.limited:
            notes.append(f"{side.upper()} ({path}): {tf.limited}; only those are compared, so the runs are not "
                         f"shown identical (diff the .jsonl traces for the whole run)")
        if not tf.complete:
            notes.append(f"{side.upper()} ({path}): partial trace (the run died or raised); compared as far as it "
                         f"goes, so the runs are not shown identical")
    s["identical"] = bool(s["identical"] and not any(tf.limited or not tf.complete for _, tf in files.values()))
    s["notes"] = notes
    return s


def format_table(cmp, limit: int = 20, summary: Optional[Dict[str, Any]] = None) -> str:
    s = summary if summary is not None else cmp.summary()
    lines = [f"pairs: {s['pairs']}  divergent: {s['divergent_pairs']}  unmatched: {s['unmatched_a']}/{s['unmatched_b']}  mode: {s['mode']}"]
    bad = [p for p in cmp.pairs if p.equal is False or p.root_cause]  # a root only one run has is unjudged
    if bad:
        lines.append(f"{'':2}{'graph':6} {'stage':18} {'node':28} {'op':32} metrics")
        for p in bad[:limit]:
            r = p.rec
            mark = "* " if p.root_cause else "m " if p.metrics.get("masked") else "  "
            m = metrics_text(p.metrics, skip=("bitwise",))
            lines.append(f"{mark}{r.graph:6} {r.stage:18} {r.node[:28]:28} {r.op[:32]:32} {m}")
        if len(bad) > limit:
            lines.append(f"  ... {len(bad) - limit} more")
    lines.extend(s.get("notes", []))
    fd = s["first_divergence"]
    masked = s.get("masked") or []
    if fd is None and masked:
        m0 = masked[0]
        lines.append(f"no output differs; {len(masked)} masked divergence(s) (marked m) reach no output, first: "
                     f"graph={m0['graph']} stage={m0['stage']} node={m0['node']} op={m0['op']} "
                     f"source={m0['source'] or '?'}")
    elif fd is None:
        if s.get("divergent_pairs"):  # a difference that no failing output shows (not traced to one)
            lines.append(f"{s['divergent_pairs']} paired record(s) differ, but no output differs: no divergence "
                         f"reaches an output")
        elif s["identical"]:
            weak = s.get("by_statistics")
            lines.append("identical" if s["mode"] == "bitwise" else
                         f"agree within {s['mode']}: every record pairs and none differs beyond it" + (
                             f" ({weak} of them by statistics alone, see above)" if weak else ""))
        elif s.get("notes"):
            lines.append(f"no divergence among the {s['pairs']} paired records, but the runs are not shown identical")
        else:
            lines.append("no divergence among paired records")
    else:
        kind = "first divergence (inputs also differ; no root cause found)"
        if fd["root_cause"]:
            side = fd.get("only_in")
            kind = f"root cause (an op only {side.upper()} ran, fed by agreeing values)" if side else "root cause"
        lines.append(f"{kind}: graph={fd['graph']} stage={fd['stage']} node={fd['node']} op={fd['op']} "
                     f"source={fd['source'] or '?'}")
        weak = (fd.get("metrics") or {}).get("inputs_agree_by_statistics_only") if fd["root_cause"] else None
        if weak:
            lines.append(f"  its input {weak[0]}{f' (and {len(weak) - 1} more)' if len(weak) > 1 else ''} differs in "
                         f"its fingerprint and agrees within the tolerance by statistics alone: the difference may "
                         f"have entered there (see 'by statistics' above)")
    return "\n".join(lines)

