"""Every kind of result determ writes, read into a :class:`~.model.Report`: :func:`build` tells them apart.

* a **run directory** (``report.json``, ``trace.jsonl``, the findings' ``pairs-<k>.jsonl``; a repro flow's
  finding points at its minify output);
* a **single trace** (a ``trace.jsonl`` with no report);
* **two traces** or run directories: compared here as ``repro-tools diff`` does;
* an **xdevice output** (``side0_*`` and ``side1_*`` run directories, as ``repro-tools xdevice`` writes them);
* **two API dumps** (indexes or rank directories), compared as ``repro-tools compare`` does, or a **compare
  output** directory (the ptdbg CSV and advisor text ``compare`` wrote);
* a **minify output** (``minify_state.json``, ``summary.json``, ``minimal/repro.py``).

Verdicts always come from the compare core; this module only reads files.
"""

from __future__ import annotations

import csv
import json
import logging
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from determ_backend.compare import DEFAULT_TOL, metrics_text, pair_row
from determ_backend.errors import ConfigError, TraceFormatError
from determ_backend.trace.stream import TRACE_NAME, rank_subdirs, read_trace_file

from repro_tools.minify.minifier import STATE_FILE, SUMMARY_FILE
from repro_tools.repro.script import repro_class_span
from repro_tools.report.model import (TRACE_COLUMNS, Report, find_row, limit_rows, rows_from_pairs,
                                      rows_from_records, source_snippet)

__all__ = ["build", "detect"]

log = logging.getLogger(__name__)

_CSV_GLOB = "compare_result*.csv"
_DUMP_COLUMNS = ["NPU Name", "Bench Name", "NPU Tensor Dtype", "NPU Tensor Shape", "Cosine", "MaxAbsErr",
                 "MaxRelativeErr", "Bitwise Equal", "Accuracy Reached or Not", "Root Cause", "Err_message"]


def _is_dump(p: Path) -> bool:
    from determ_backend.dump.comparison.parse import INDEX_SUFFIX, holds_index

    return (p.is_file() and p.name.endswith(INDEX_SUFFIX)) or holds_index(p)


def _sides(p: Path) -> List[Path]:
    return sorted(d for d in p.glob("side[01]_*") if d.is_dir()) if p.is_dir() else []


def detect(paths: Sequence[str]) -> str:
    """The kind of result ``paths`` hold (see the module docstring); a :class:`ConfigError` naming the path
    and what was expected otherwise."""
    ps = [Path(p) for p in paths]
    for p, text in zip(ps, paths):
        if not p.exists():
            raise ConfigError(f"{text}: no such file or directory")
    if len(ps) == 2:
        dumps = [_is_dump(p) for p in ps]
        if all(dumps):
            return "dump"
        if any(dumps):
            raise ConfigError(f"{paths[0]} and {paths[1]}: one is an API dump, the other is not; expected two "
                              "dumps or two traces")
        return "diff"
    if len(ps) != 1:
        raise ConfigError(f"expected one result (a run, xdevice, compare or minify directory) or two traces or "
                          f"dumps, got {len(ps)} paths")
    p = ps[0]
    if p.is_dir():
        if (p / "report.json").is_file():
            return "run"
        if (p / STATE_FILE).is_file() or (p / SUMMARY_FILE).is_file():
            return "minify"
        if len(_sides(p)) == 2:
            return "xdevice"
        if any(p.glob(_CSV_GLOB)):
            return "compare"
        if (p / TRACE_NAME).is_file():
            return "trace"
    elif p.suffix == ".csv":
        return "compare"
    elif p.suffix == ".jsonl" or _is_trace_file(p):
        return "trace"
    if _is_dump(p):
        raise ConfigError(f"{paths[0]}: one API dump; expected two (the dump under test and the benchmark) or a "
                          "compare output directory")
    ranks = rank_subdirs(p)
    if ranks:
        names = ", ".join(d.name for d in ranks.values())
        raise ConfigError(f"{paths[0]}: holds rank directories ({names}); pass one rank's directory (a run or a "
                          f"trace: {p / next(iter(ranks.values())).name}), two of them, or the directory "
                          "`compare --distributed` wrote")
    if p.is_dir() and (any(p.glob("step*/rank*/*.pkl")) or any(p.glob("rank*/*.pkl"))):
        below = sorted(str(q.relative_to(p)) for q in [*p.glob("step*/rank*/*.pkl"), *p.glob("rank*/*.pkl")])[:3]
        raise ConfigError(f"{paths[0]}: an API dump's dump_path; its indexes are in its step/rank folders "
                          f"({', '.join(below)}): pass two of those (the dump under test and the benchmark)")
    raise ConfigError(f"{paths[0]}: not a determ result; expected a run directory (report.json), a trace, an "
                      "xdevice, compare or minify output directory, or two traces or dumps")


def _is_trace_file(p: Path) -> bool:
    from repro_tools.cli.trace_formats import is_trace_file

    return is_trace_file(p)


def build(paths: Sequence[str], tol: Optional[float] = None) -> Report:
    """The report of ``paths`` (any kind :func:`detect` knows).  ``tol``: the verdicts' tolerance where this
    module compares (two traces: default bitwise; an xdevice output: default ``xdevice``'s)."""
    kind = detect(paths)
    paths = [str(p) for p in paths]
    return _load_diff(paths, tol) if kind == "diff" else _load_xdevice(paths, tol) if kind == "xdevice" \
        else _LOADERS[kind](paths)


# ------------------------------------------------------------------------ runs and traces

def _read_json(p: Path) -> Dict[str, Any]:
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TraceFormatError(f"{p}: not readable as JSON ({e}); expected determ's {p.name}") from None


def _read_pairs(p: Path) -> List[Dict[str, Any]]:
    out = []
    i = 0
    try:
        with open(p, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    out.append(json.loads(line))
    except (OSError, ValueError) as e:
        raise TraceFormatError(f"{p}:{i}: not readable as a pairs file ({e}); expected one JSON object per line") \
            from None
    return out


def _findings_pairs(d: Path, findings: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The judged pairs the findings kept, each graph call once: a call two checks judged (accuracy and
    determinism on one call) shows the first finding's verdicts."""
    out: List[Dict[str, Any]] = []
    seen: set = set()
    for f in findings:
        if not isinstance(f.get("pairs"), str) or not (d / f["pairs"]).is_file():
            continue
        rows = _read_pairs(d / f["pairs"])
        groups = {(r.get("graph"), r.get("stage"), r.get("call")) for r in rows}
        out += [r for r in rows if (r.get("graph"), r.get("stage"), r.get("call")) not in seen]
        seen |= groups
    return out


def _where(fd: Dict[str, Any]) -> str:
    if not fd or not fd.get("node"):
        return ""
    return f"{fd.get('node')} ({fd.get('op')}) in graph {fd.get('graph')} {fd.get('stage')}"


def _root_of(fd: Optional[Dict[str, Any]], rows: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    if not fd or not fd.get("node"):
        return None
    root = {k: fd.get(k) for k in ("graph", "stage", "call", "node", "op", "source", "metrics", "dtype", "shape")}
    if fd.get("kernel"):
        root["kernel"] = fd["kernel"]
    if fd.get("inside"):  # the nan check names the op inside a fused kernel here
        ins = fd["inside"]
        root["kernel"] = {"name": ins.get("kernel"), "record": fd.get("node")}
        if ins.get("node"):
            root.update(node=ins["node"], op=ins.get("op"), source=ins.get("source") or fd.get("source"))
    root["row"] = find_row(rows, fd)
    return root


def _finish(rep: Report) -> Report:
    if rep.series[1] and not any(isinstance(r.get("r"), (int, float)) for r in rep.rows):
        # no row has a second value (a reference's error against float64): no key or column names one
        rep.series = [rep.series[0], ""]
        rep.columns = [c for c in (rep.columns or TRACE_COLUMNS) if c[0] != "r"]
    root_row = rep.root.get("row") if rep.root else None
    rep.rows, root_row, rep.table_note = limit_rows(rep.rows, root_row)
    if rep.root:
        rep.root["row"] = root_row
        rep.snippet = source_snippet(rep.root.get("source"))
    return rep


def _trace_records(run_dir: Path, calls: Sequence[Optional[int]]):
    """The run's trace records of these graph calls (None: call 0), read without decoding the other calls'
    lines: a long run's trace is a scan here, not a parse (the page is written inside the user's process)."""
    return read_trace_file(run_dir, allow_partial=True, calls={0 if c is None else c for c in calls}).records


def _minify_dirs(run_dir: Path, repro_dir: Optional[str]) -> List[Path]:
    """The minify outputs under a finding's repro directory (a relative one is the run directory's)."""
    if not repro_dir:
        return []
    p = Path(repro_dir)
    if not p.is_absolute() and not p.is_dir():
        p = run_dir / p
    return sorted(q.parent for q in p.glob("**/" + STATE_FILE)) if p.is_dir() else []


# report.json's fields the page reads, and the types they must have (None always allowed)
_REPORT_FIELDS = {"findings": list, "checks": list, "checker_errors": list, "divergent": bool, "graphs": int,
                  "run": str, "rank": int}


def _run_report(p: Path) -> Dict[str, Any]:
    """``report.json`` of a run directory, checked for the shape the page reads: a one-line
    :class:`TraceFormatError` naming the file for valid JSON of another kind (a minify summary copied in)."""
    rep = _read_json(p)
    if not isinstance(rep, dict):
        raise TraceFormatError(f"{p}: expected determ's report.json (a JSON object), got a JSON "
                               f"{type(rep).__name__}")
    for key, kind in _REPORT_FIELDS.items():
        v = rep.get(key)
        if v is not None and (not isinstance(v, kind) or (kind is int and isinstance(v, bool))):
            raise TraceFormatError(f"{p}: field {key!r}: expected {kind.__name__}, got {type(v).__name__}; not "
                                   f"determ's report.json")
    if not all(isinstance(f, dict) for f in rep.get("findings") or []):
        raise TraceFormatError(f"{p}: field 'findings' holds something other than objects; not determ's report.json")
    if "divergent" not in rep and "findings" not in rep:
        raise TraceFormatError(f"{p}: neither 'divergent' nor 'findings' is there; not determ's report.json")
    return rep


def _load_run(paths: List[str]) -> Report:
    d = Path(paths[0])
    rep_json = _run_report(d / "report.json")
    findings = rep_json.get("findings") or []
    checks = rep_json.get("checks") or []
    first = findings[0] if findings else {}
    fd = first.get("first_divergence") or {}
    pair_rows = _findings_pairs(d, findings)
    series = ["compiled vs eager (RMSE)", "eager vs fp64 (RMSE)"] if first.get("check") == "accuracy" else \
        ["difference", "reference vs fp64"]
    if pair_rows:
        calls = {r.get("call") for r in pair_rows}  # the trace's other graphs of those calls, not judged
        records = _trace_records(d, calls) if (d / TRACE_NAME).is_file() else []
        rows = rows_from_pairs(pair_rows, records)
    elif (d / TRACE_NAME).is_file():
        verdicts = {}
        for f in findings:
            for rc in f.get("root_causes") or []:
                verdicts[(rc.get("graph"), rc.get("stage"), rc.get("call"), rc.get("node"))] = "root"
        rows = rows_from_records(_trace_records(d, [fd.get("call")]), verdicts)
        series = ["NaN + Inf values (statistics)", ""]
    else:
        rows = []
    what = ", ".join(checks) or (first.get("check") if first else "") or "tracing only"
    rep = Report(kind="run", title=f"determ run {rep_json.get('run')}", inputs=paths,
                 checked=f"checks: {what}" + (f"; {rep_json['graphs']} graph(s) compiled" if rep_json.get("graphs") else "")
                 + f"; rank {rep_json.get('rank')}",
                 divergent=bool(rep_json.get("divergent")), verdict="", rows=rows, series=series)
    rep.errors = list(rep_json.get("checker_errors") or [])
    for f in findings:
        where = _where(f.get("first_divergence") or {})
        if f.get("repeats"):  # the same divergence on later calls, counted in this finding
            where += f" (again on {f['repeats']} later call{'s' if f['repeats'] > 1 else ''})"
        rep.findings.append({"check": f.get("check"), "where": where,
                             "detail": f.get("detail") or metrics_text((f.get("first_divergence") or {}).get("metrics")),
                             "repro": f.get("repro")})
    for n in rep_json.get("notes") or []:
        if n.get("skipped"):
            rep.notes.append(f"{n.get('check')}: skipped {n['skipped']}")
        if n.get("notice"):
            rep.notes.append(f"{n.get('check')}: {n['notice']}")
        for m in n.get("masked") or []:
            rep.notes.append(f"{n.get('check')}: masked divergence at {m.get('node')} ({m.get('op')}) "
                             f"{m.get('source') or ''}: reaches no failing output")
    rep.root = _root_of(fd, rows)
    for mdir in _minify_dirs(d, first.get("repro")):
        rep.minify = _minify_info(mdir)
        culprit = rep.minify.get("culprit") or {}
        if rep.root is None and culprit.get("node"):
            rep.root = {"node": culprit["node"], "op": culprit.get("op"), "source": culprit.get("source"),
                        "graph": None, "stage": "minified graph", "metrics": None, "row": None}
        break
    if rep.divergent:
        where = f": root cause {rep.root['node']} ({rep.root.get('op')})" if rep.root else ""
        rep.verdict = f"divergent ({first.get('check')}){where}"
    elif any(n.get("skipped") for n in rep_json.get("notes") or []) and (
            not checks or set(checks) <= set(rep_json.get("unchecked") or [])):
        # the checks asked for skipped every graph: nothing was shown clean
        rep.verdict = "nothing checked: every graph was skipped (see the notes)"
    else:
        rep.verdict = "no divergence found"
    return _finish(rep)


def _load_trace(paths: List[str]) -> Report:
    from repro_tools.cli.trace_formats import load_file

    tf = load_file(paths[0], allow_partial=True)
    rows = rows_from_records(tf.records)
    state = "" if tf.complete else " (incomplete: its producer stopped before closing it)"
    if tf.limited:
        state += f" ({tf.limited})"
    if state:
        log.warning("%s: %s", paths[0], state.strip(" ()"))
    return _finish(Report(kind="trace", title=f"determ trace {tf.path}", inputs=paths,
                          checked=f"one trace, {len(tf.records)} records{state}: nothing compared",
                          divergent=False, verdict="one trace: compare it with another (two paths) for a verdict",
                          rows=rows, series=["NaN + Inf values (statistics)", ""]))


def _comparison_report(kind: str, a: str, b: str, tol: Optional[float], title: str, checked: str) -> Report:
    from repro_tools.cli.diff import compare_trace_pair

    cmp = compare_trace_pair(a, b, tol)
    rows = rows_from_pairs([pair_row(p) for p in cmp.pairs])
    fd = cmp.summary().get("first_divergence")
    rep = Report(kind=kind, title=title, inputs=[a, b], checked=checked, divergent=cmp.divergent, verdict="",
                 rows=rows, series=["difference (a vs b)", "b vs fp64"])
    rep.root = _root_of(fd, rows)
    if cmp.divergent:
        where = f": root cause {rep.root['node']} ({rep.root.get('op')})" if rep.root else ""
        rep.verdict = f"divergent ({cmp.mode}){where}"
    else:
        weak = cmp.by_statistics
        rep.verdict = (("identical" if tol is None else f"agree within tol={tol:g}" + (
            f" ({weak} records by statistics alone, which bound no element error)" if weak else ""))
            if cmp.identical else f"no output differs ({cmp.mode})")
    if kind == "diff" and cmp.files is not None:  # two trace files, as diff reads them: diff's exit rule (xdevice
        # outputs keep xdevice's: a divergence or a partial side, not records that pair with nothing)
        from repro_tools.cli.diff import diff_summary

        summary = diff_summary(cmp, cmp.files)
        rep.shown_alike = bool(summary["identical"])
        if not cmp.divergent and not rep.shown_alike:
            rep.verdict += "; not shown identical: " + ("; ".join(summary.get("notes") or []) or
                                                        "divergences that reach no output (masked)")
    unpaired = sum(1 for p in cmp.pairs if not p.paired)
    if unpaired:
        rep.notes.append(f"{unpaired} records pair with nothing in the other trace")
    for p in cmp.masked[:20]:
        rep.notes.append(f"masked divergence at {p.rec.node} ({p.rec.op}): reaches no failing output")
    return _finish(rep)


def _load_diff(paths: List[str], tol: Optional[float]) -> Report:
    how = "bitwise (fingerprints)" if tol is None else f"within tol={tol:g}"
    return _comparison_report("diff", paths[0], paths[1], tol, f"determ diff {paths[0]} vs {paths[1]}",
                              f"two traces, {how}")


def _load_xdevice(paths: List[str], tol: Optional[float]) -> Report:
    a, b = _sides(Path(paths[0]))
    tol = DEFAULT_TOL if tol is None else tol  # what `repro-tools xdevice` judges with unless told
    rep = _comparison_report("xdevice", str(a), str(b), tol, f"determ xdevice {paths[0]}",
                             f"{a.name[6:]} vs {b.name[6:]} within tol={tol:g}")
    rep.inputs = paths
    return rep


# ------------------------------------------------------------------------ dumps

def _dump_rows(csv_rows: List[Dict[str, str]]) -> List[Dict[str, Any]]:
    rows = []
    for i, r in enumerate(csv_rows):
        bad = r.get("Root Cause") == "Yes"
        acc = r.get("Accuracy Reached or Not", "")
        verdict = "root" if bad else ("differs" if acc == "No" else "equal" if acc == "Yes" else "unpaired"
                                      if "N/A" in (r.get("NPU Name"), r.get("Bench Name")) else "unjudged")
        err = None
        try:
            err = float(r.get("MaxAbsErr") or "")
        except ValueError:
            pass
        row = {"id": i, "n": r.get("NPU Name"), "v": verdict, "e": err, "r": None, "in": [], "ins": []}
        row.update({f"c{j}": r.get(c) or "" for j, c in enumerate(_DUMP_COLUMNS)})
        rows.append(row)
    return rows


def _output_row(name: Optional[str]) -> bool:
    """Whether a compare CSV row (``<api>_forward_output.0``, ``<api>_backward_input.1``) is one of an API's outputs."""
    return bool(name) and name.rsplit("_", 1)[-1].startswith("output")


def _dump_report(kind: str, csv_rows: List[Dict[str, str]], advisor: str, paths: List[str], checked: str,
                 source: Optional[str] = None, divergent: Optional[bool] = None) -> Report:
    """``divergent``: the compare core's verdict when at hand; else an output that differs (or a root cause) makes
    the dumps divergent -- an input alone does not (an ``all_gather`` into buffers that held other values)."""
    rows = _dump_rows(csv_rows)
    root_id = next((r["id"] for r in rows if r["v"] == "root"), None)
    if divergent is None:
        divergent = root_id is not None or any(r["v"] == "differs" and _output_row(r["n"]) for r in rows)
    rep = Report(kind=kind, title=f"determ API dump compare {' vs '.join(paths)}", inputs=paths, checked=checked,
                 divergent=divergent, verdict="", rows=rows,
                 columns=[[f"c{j}", c] for j, c in enumerate(_DUMP_COLUMNS)] + [["v", "verdict"]],
                 series=["MaxAbsErr", ""])
    if root_id is not None:
        r = csv_rows[root_id]
        if source is None:  # a compare output keeps the source in the advisor text only
            source = next((ln.strip()[3:] for ln in advisor.splitlines() if ln.strip().startswith("at ")), None)
        rep.root = {"node": r.get("NPU Name"), "op": None, "source": source, "graph": None, "stage": "api",
                    "metrics": {k: r.get(k) for k in ("Bench Name", "Cosine", "MaxAbsErr", "MaxRelativeErr",
                                                      "Bitwise Equal")}, "row": root_id}
    rep.verdict = (f"divergent: root cause {rep.root['node']}" if rep.root else
                   "divergent: no root cause among the paired APIs" if divergent else "no divergence")
    if advisor:
        rep.notes.extend(line for line in advisor.splitlines() if line.strip())
    return _finish(rep)


def _load_dump(paths: List[str]) -> Report:
    from determ_backend.dump.comparison.dumps import analysis, compare_dumps

    cmp = compare_dumps(paths[0], paths[1])
    csv_rows = [{k: str(v) for k, v in r.items() if not k.startswith("_")} for r in cmp.rows]
    source = (cmp.root_causes[0].a or {}).get("source") if cmp.root_causes else None
    return _dump_report("dump", csv_rows, analysis(cmp), paths,
                        "two API dumps, " + ("bitwise" if cmp.exact else "within tolerance"), source, cmp.divergent)


_RANK_CSV = re.compile(r"_rank(\d+)-rank\d+_")


def _read_compare_csv(csv_path: Path) -> Tuple[List[Dict[str, str]], str]:
    """The rows of one compare_result CSV and the advisor text written with it ("" when none)."""
    try:
        with open(csv_path, newline="", encoding="utf-8") as f:
            csv_rows = list(csv.DictReader(f))
    except (OSError, csv.Error, UnicodeDecodeError) as e:
        raise TraceFormatError(f"{csv_path}: not readable as a compare_result CSV ({e})") from None
    if csv_rows and "NPU Name" not in csv_rows[0]:
        raise TraceFormatError(f"{csv_path}: no 'NPU Name' column; expected a compare_result CSV")
    adv = sorted(csv_path.parent.glob("advisor" + csv_path.stem[len("compare_result"):] + ".txt"))
    return csv_rows, adv[-1].read_text(encoding="utf-8", errors="replace") if adv else ""


def _load_compare(paths: List[str]) -> Report:
    """A compare_result CSV, or the directory ``compare`` wrote into: its newest result, or, for a
    ``compare --distributed`` output, the newest result of every rank on one page (names prefixed ``rank<N>/``)."""
    p = Path(paths[0])
    if not p.is_dir():
        csv_rows, advisor = _read_compare_csv(p)
        return _dump_report("compare", csv_rows, advisor, [str(p)], f"ptdbg compare result {p.name}")
    found = sorted(p.glob(_CSV_GLOB), key=lambda f: f.stat().st_mtime)
    by_rank: Dict[Optional[int], Path] = {}
    for f in found:  # newest last: the newest file of each rank wins
        m = _RANK_CSV.search(f.name)
        by_rank[int(m.group(1)) if m else None] = f
    ranks = sorted(r for r in by_rank if r is not None)
    if not ranks or found[-1] == by_rank.get(None):  # a one-rank compare wrote the newest result
        csv_rows, advisor = _read_compare_csv(found[-1])
        return _dump_report("compare", csv_rows, advisor, [str(found[-1])], f"ptdbg compare result {found[-1].name}")
    rows: List[Dict[str, str]] = []
    notes: List[str] = []
    source: Optional[str] = None  # of the first root cause, in rank order
    for rank in ranks:
        csv_rows, advisor = _read_compare_csv(by_rank[rank])
        if source is None and any(r.get("Root Cause") == "Yes" for r in csv_rows):
            source = next((ln.strip()[3:] for ln in advisor.splitlines() if ln.strip().startswith("at ")), None)
        for r in csv_rows:
            rows.append(dict(r, **{k: f"rank{rank}/{r[k]}" for k in ("NPU Name", "Bench Name")
                                   if r.get(k) and r[k] != "N/A"}))
        notes += [f"rank {rank}: {line}" for line in advisor.splitlines() if line.strip()]
    return _dump_report("compare", rows, "\n".join(notes), [str(by_rank[r]) for r in ranks],
                        f"ptdbg compare --distributed result, {len(ranks)} ranks", source)


# ------------------------------------------------------------------------ minify

def _graph_code(repro: Path) -> str:
    """The ``class Repro`` block of a repro script (the minimal graph), or the whole file."""
    try:
        text = repro.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    lines = text.splitlines()
    span = repro_class_span(lines)
    return "\n".join(lines[span[0]:span[1]]).rstrip() if span else text


def _minify_info(d: Path) -> Dict[str, Any]:
    state = _read_json(d / STATE_FILE) if (d / STATE_FILE).is_file() else {}
    summary = _read_json(d / SUMMARY_FILE) if (d / SUMMARY_FILE).is_file() else {}
    info = {"dir": str(d), "kind": summary.get("kind") or (state.get("spec") or {}).get("kind"),
            "compiler": summary.get("compiler") or (state.get("spec") or {}).get("compiler"),
            "nodes_before": summary.get("nodes_before"), "nodes_after": summary.get("nodes_after"),
            "ops_before": summary.get("ops_before"),
            "ops_after": summary.get("ops_after", len((state.get("current") or {}).get("keep") or []) or None),
            "queries": summary.get("queries", state.get("queries")), "seconds": summary.get("seconds", state.get("seconds")),
            "localized": summary.get("localized", state.get("localized")), "failure": summary.get("failure"),
            "culprit": summary.get("culprit") or ({"node": state["culprit"]} if state.get("culprit") else None)}
    repro = d / "minimal" / "repro.py"
    info["repro"] = str(repro) if repro.is_file() else None
    info["code"] = _graph_code(repro) if repro.is_file() else ""
    return info


def _load_minify(paths: List[str]) -> Report:
    info = _minify_info(Path(paths[0]))
    culprit = info.get("culprit") or {}
    rep = Report(kind="minify", title=f"determ minify {paths[0]}", inputs=paths,
                 checked=f"minified with the {info.get('kind')} oracle ({info.get('compiler')})",
                 divergent=True, verdict=f"minimal repro of {info.get('failure') or info.get('kind')}")
    rep.minify = info
    if culprit.get("node"):
        rep.root = {"node": culprit["node"], "op": culprit.get("op"), "source": culprit.get("source"),
                    "graph": None, "stage": "minified graph", "metrics": None, "row": None}
        rep.verdict += f": culprit {culprit['node']} ({culprit.get('op')})"
    return _finish(rep)


_LOADERS = {"run": _load_run, "trace": _load_trace, "dump": _load_dump, "compare": _load_compare,
            "minify": _load_minify}
