"""What an HTML report shows, independent of where it came from: :class:`Report` and its node rows.

Loaders (:mod:`.sources`) fill a :class:`Report` from a run directory, two traces, a dump pair, a
compare output, an ``xdevice`` output or a minify output; :mod:`.render` turns it into one page.
A node row is a plain dict with short keys so a 10,000-node page stays a few MB:

``id`` (row index), ``g``/``s``/``c`` (graph, stage, call), ``n`` (node), ``op``, ``k`` (kind),
``src`` (source line), ``dt`` (dtype), ``sh`` (shape), ``v`` (verdict: ``root``, ``differs``
(reaches a failing output), ``masked``, ``equal``, ``unjudged``, ``unpaired``), ``e`` (the value's
error against the reference), ``r`` (the reference's own error against fp64), ``m`` (metrics),
``ha``/``hb`` (fingerprints), ``in`` (row ids of the inputs' producers), ``ins`` (input names).
The verdicts and the root cause come from the compare core (:func:`determ_backend.compare.pair_row`),
never from here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

__all__ = ["Report", "rows_from_pairs", "rows_from_records", "source_snippet", "plot_error", "reference_error",
           "MAX_ROWS"]

MAX_ROWS = 20_000
"""Rows a page holds; beyond that the first rows, every divergent one and the root's neighbours are kept."""

_STAGE_ORDER = ("dynamo", "aot_forward", "inductor_forward", "forward", "api", "minify", "aot_backward",
                "inductor_backward", "backward")
_ERROR_KEYS = ("rmse", "max_abs", "l2_diff", "mean_diff", "max_diff")
_REF_KEYS = ("err_eager_vs_fp64", "err_b_vs_fp64")
_SOURCE = re.compile(r"^(?P<path>.+?):(?P<line>\d+)(?::|\s|$)")


@dataclass
class Report:
    """One page: its header, the node rows, and the sections only some kinds of result have."""

    kind: str
    """``run``, ``diff``, ``xdevice``, ``dump``, ``compare`` or ``minify``."""
    title: str
    inputs: List[str]
    """The paths the report was made from."""
    checked: str
    """What was checked, one line."""
    divergent: bool
    verdict: str
    """The verdict, one line."""
    root: Optional[Dict[str, Any]] = None
    """The root cause: node, op, graph, stage, call, source, metrics (and ``row``, its row id, when it has one)."""
    snippet: Optional[Dict[str, Any]] = None
    """The root's source line with a few lines around it (:func:`source_snippet`)."""
    rows: List[Dict[str, Any]] = field(default_factory=list)
    columns: List[List[str]] = field(default_factory=list)
    """The node table's columns, ``[key, label]``; default: the trace columns."""
    series: List[str] = field(default_factory=lambda: ["error vs reference", "reference vs fp64"])
    """Labels of the error plot's two series (row keys ``e`` and ``r``)."""
    notes: List[str] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)
    """Checker errors (one line each)."""
    findings: List[Dict[str, Any]] = field(default_factory=list)
    """One line per finding: ``check``, ``where``, ``detail``."""
    minify: Optional[Dict[str, Any]] = None
    """Minify results: before/after, queries, seconds, culprit, the minimal graph's code."""
    table_note: Optional[str] = None
    """Why the table holds fewer rows than the result (aggregated beyond :data:`MAX_ROWS`)."""
    shown_alike: Optional[bool] = None
    """Two traces: whether ``repro-tools diff`` would call them identical (or in agreement within tol); None for
    other results.  The command's exit code follows it, as diff's does."""

    def data(self) -> Dict[str, Any]:
        """Everything the page's script needs, JSON-ready (non-finite floats as strings)."""
        return _json_safe({"kind": self.kind, "rows": self.rows, "columns": self.columns or TRACE_COLUMNS,
                           "series": self.series, "root": self.root.get("row") if self.root else None})


TRACE_COLUMNS = [["n", "node"], ["op", "op"], ["k", "kind"], ["s", "stage"], ["src", "source"], ["dt", "dtype"],
                 ["sh", "shape"], ["v", "verdict"], ["e", "error"], ["r", "ref vs fp64"], ["m", "metrics"],
                 ["in", "inputs"], ["ha", "fingerprint a"], ["hb", "fingerprint b"]]


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def _number(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def plot_error(metrics: Dict[str, Any], equal: Optional[bool]) -> Optional[float]:
    """The error a row is plotted at: the first of RMSE, max abs error, statistics differences; 0 when the
    pair is equal without metrics; None when nothing measures it."""
    for k in _ERROR_KEYS:
        v = _number((metrics or {}).get(k))
        if v is not None:
            return v
    return 0.0 if equal is True else None


def reference_error(metrics: Dict[str, Any]) -> Optional[float]:
    """The reference's own error against fp64, when the result measured it."""
    for k in _REF_KEYS:
        v = _number((metrics or {}).get(k))
        if v is not None:
            return v
    return None


def _verdict(d: Dict[str, Any]) -> str:
    if not d.get("paired", True):
        return "unpaired"
    if d.get("root_cause"):
        return "root"
    eq = d.get("equal")
    if eq is False:
        return "masked" if d.get("reaches_output") is False or (d.get("metrics") or {}).get("masked") else "differs"
    return "equal" if eq is True else "unjudged"


def _stage_rank(stage: Optional[str]) -> int:
    return _STAGE_ORDER.index(stage) if stage in _STAGE_ORDER else len(_STAGE_ORDER)


_GRAPH_ID = re.compile(r"^g(\d+)$")


def _graph_rank(graph: Any) -> tuple:
    """Graph ids in compile order (``g2`` before ``g10``); other names after them, by name."""
    m = _GRAPH_ID.match(str(graph))
    return (0, int(m.group(1)), "") if m else (1, 0, str(graph))


def _order(items: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Graph order: by call, forward stages before backward ones, then graph, then as recorded."""
    return [d for _, d in sorted(enumerate(items), key=lambda t: (
        t[1].get("call") or 0, _stage_rank(t[1].get("stage")), _graph_rank(t[1].get("graph")), t[0]))]


def rows_from_pairs(pair_rows: Iterable[Dict[str, Any]], records: Sequence[Any] = ()) -> List[Dict[str, Any]]:
    """Node rows from :func:`determ_backend.compare.pair_row` dicts (a pairs file, a comparison), and from
    the trace ``records`` of graph calls no pair covers (not judged: e.g. the backward graph of a step
    whose forward graph holds the finding), all in graph order."""
    items = [dict(d, _pair=True) for d in pair_rows]
    covered = {(d.get("graph"), d.get("stage"), d.get("call")) for d in items}
    items += [{"graph": r.graph, "stage": r.stage, "call": r.call, "rec": r} for r in records
              if (r.graph, r.stage, r.call) not in covered]
    rows = []
    for d in _order(items):
        if "rec" in d:
            rows.append(_record_row(d["rec"], "unjudged"))
            continue
        m = dict(d.get("metrics") or {})
        v = _verdict(d)
        row = {"g": d.get("graph"), "s": d.get("stage"), "c": d.get("call"), "n": d.get("node"), "op": d.get("op"),
               "k": d.get("kind"), "src": d.get("source"), "dt": d.get("dtype"), "sh": d.get("shape"), "v": v,
               "e": plot_error(m, d.get("equal")), "r": reference_error(m), "ha": d.get("hash_a"),
               "hb": d.get("hash_b"), "ins": list(d.get("inputs") or [])}
        if v not in ("equal", "unjudged"):
            row["m"] = m
        if d.get("inside"):
            row["inside"] = d["inside"]
        rows.append(row)
    return _link(rows)


def rows_from_records(records: Sequence[Any], verdicts: Optional[Dict[tuple, str]] = None) -> List[Dict[str, Any]]:
    """Node rows from trace records with no comparison (a run whose check names its root without pairs):
    statistics as the metrics, ``verdicts`` (by ``(graph, stage, call, node)``) where known."""
    items = [{"graph": r.graph, "stage": r.stage, "call": r.call, "rec": r} for r in records]
    return _link([_record_row(it["rec"], (verdicts or {}).get(it["rec"].key, "unjudged")) for it in _order(items)])


def _record_row(r: Any, verdict: str) -> Dict[str, Any]:
    """A trace record with no comparison: plotted at its count of NaN and Inf values (the statistics')."""
    st = r.stats or {}
    counts = [st.get(k) for k in ("nan", "inf")]
    e = float(sum(counts)) if all(isinstance(c, int) for c in counts) else None
    row = {"g": r.graph, "s": r.stage, "c": r.call, "n": r.node, "op": r.op, "k": r.kind, "src": r.source,
           "dt": r.dtype, "sh": r.shape, "v": verdict, "e": e, "r": None, "ha": r.hash, "ins": list(r.inputs)}
    if st:
        row["m"] = dict(st)
    return row


def _link(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Row ids, and each input's producer row within the same graph call."""
    last: Dict[tuple, int] = {}
    for i, row in enumerate(rows):
        row["id"] = i
        group = (row.get("g"), row.get("s"), row.get("c"))
        row["in"] = [last.get(group + (n,)) for n in row["ins"]]
        last[group + (row.get("n"),)] = i
    return rows


def limit_rows(rows: List[Dict[str, Any]], root: Optional[int], limit: int = MAX_ROWS) -> tuple:
    """At most ``limit`` rows: the root cause and its neighbours, then the first rows up to half the limit,
    then the divergent rows in graph order, renumbered (links to rows left out become unknown producers).
    Returns ``(rows, the root's new id, note or None)``."""
    if len(rows) <= limit:
        return rows, root, None
    keep: List[int] = []
    if root is not None:
        keep += [root] + [i for i in rows[root]["in"] if i is not None] + [r["id"] for r in rows if root in r["in"]]
    chosen = set(keep)
    for r in rows[: limit // 2]:
        chosen.add(r["id"])
    for r in rows:
        if len(chosen) >= limit:
            break
        if r["v"] not in ("equal", "unjudged"):
            chosen.add(r["id"])
    kept = sorted(chosen)  # the limit, or a few more when the root has more neighbours than half of it
    index = {old: new for new, old in enumerate(kept)}
    out = []
    for old in kept:
        row = dict(rows[old])
        row["id"] = index[old]
        row["in"] = [index.get(i) if i is not None else None for i in row["in"]]
        out.append(row)
    return out, index.get(root) if root is not None else None, (
        f"{len(rows)} records: the table and plot show {len(out)} of them (the root cause and its neighbours, the "
        f"first {limit // 2} and the divergent ones in graph order)")


def source_snippet(source: Optional[str], context: int = 3) -> Optional[Dict[str, Any]]:
    """``{"path", "line", "lines": [[number, text], ...]}`` around the ``path:line`` a source string names,
    when that file is readable here; None otherwise."""
    if not source:
        return None
    m = _SOURCE.match(source)
    if not m:
        return None
    path, line = Path(m.group("path")), int(m.group("line"))
    try:
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    if not 1 <= line <= len(text):
        return None
    lo, hi = max(1, line - context), min(len(text), line + context)
    return {"path": str(path), "line": line, "lines": [[k, text[k - 1]] for k in range(lo, hi + 1)]}


def find_row(rows: List[Dict[str, Any]], where: Dict[str, Any]) -> Optional[int]:
    """The row of a described record (graph, stage, call, node), or of its buffer when narrowed inside a kernel."""
    node = ((where.get("kernel") or {}).get("record")) or where.get("node")
    for r in rows:
        if r["n"] == node and r.get("g") == where.get("graph") and r.get("s") == where.get("stage") and \
                (where.get("call") is None or r.get("c") == where.get("call")):
            return r["id"]
    for r in rows:
        if r["n"] == node:
            return r["id"]
    return None
