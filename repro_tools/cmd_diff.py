"""``repro-tools diff A B``: align two traces, print a table and the root-cause divergence."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from determ_backend.compare import compare_traces
from determ_backend.errors import TraceFormatError
from determ_backend.trace import TensorStore, read_trace, resolve_trace_path

__all__ = ["register", "run_diff"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diff", help="compare two traces and name the first divergent node",
                       description="Align two traces (trace.jsonl files or run directories), print the pairs that "
                                   "differ and the root cause: the first record whose inputs agree and output does not.")
    p.add_argument("a", help="first trace: a trace.jsonl file, a run directory, or a HashDebugTrace log")
    p.add_argument("b", help="second trace, same kinds as A")
    p.add_argument("--tol", type=float, default=None,
                   help="tolerance verdicts (max abs or rel error <= TOL) instead of bitwise equality")
    p.add_argument("--json", action="store_true", help="print the comparison summary as JSON on stdout")
    p.add_argument("--limit", type=int, default=20, help="rows of divergent pairs to print (default 20)")
    p.add_argument("--allow-partial", action="store_true", help="accept traces whose producer died (no end line)")
    p.set_defaults(func=run_diff)


def _load(path: str, allow_partial: bool):
    from . import trace_formats

    return trace_formats.load_any(path, allow_partial=allow_partial)


def _store_for(path: str):
    try:
        p = resolve_trace_path(path)
    except TraceFormatError:
        return None
    root = p.parent / "tensors"
    return TensorStore(root) if root.is_dir() else None


def run_diff(args: argparse.Namespace) -> int:
    a = _load(args.a, args.allow_partial)
    b = _load(args.b, args.allow_partial)
    cmp = compare_traces(a, b, tol=args.tol, store_a=_store_for(args.a), store_b=_store_for(args.b))
    summary = cmp.summary()
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        print(format_table(cmp, args.limit))
    return 1 if cmp.divergent else 0


def format_table(cmp, limit: int = 20) -> str:
    s = cmp.summary()
    lines = [f"pairs: {s['pairs']}  divergent: {s['divergent_pairs']}  unmatched: {s['unmatched_a']}/{s['unmatched_b']}  mode: {s['mode']}"]
    bad = [p for p in cmp.pairs if p.equal is False]
    if bad:
        lines.append(f"{'':2}{'graph':6} {'stage':18} {'node':28} {'op':32} metrics")
        for p in bad[:limit]:
            r = p.rec
            mark = "* " if p.root_cause else "  "
            m = ", ".join(f"{k}={_fmt(v)}" for k, v in p.metrics.items() if k != "bitwise")
            lines.append(f"{mark}{r.graph:6} {r.stage:18} {r.node[:28]:28} {r.op[:32]:32} {m}")
        if len(bad) > limit:
            lines.append(f"  ... {len(bad) - limit} more")
    fd = s["first_divergence"]
    if fd is None:
        lines.append("identical" if s["identical"] else "no divergence among paired records")
    else:
        kind = "root cause" if fd["root_cause"] else "first divergence (inputs also differ; no root cause found)"
        lines.append(f"{kind}: graph={fd['graph']} stage={fd['stage']} node={fd['node']} op={fd['op']} "
                     f"source={fd['source'] or '?'}")
    return "\n".join(lines)


def _fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)
