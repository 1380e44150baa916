"""``repro-tools analyze REPRO`` (also ``python repro.py analyze``): where inside a repro's graph it goes wrong.

The repro's graph is compiled with the determ backend matching its compiler
(``determ_inductor`` for inductor, ``determ_aot_eager`` for aot_eager-style
graphs, ``determ_eager`` for eager) with the ``accuracy`` and ``determinism``
checks on: every intermediate is traced (on CPU too: inductor's buffers are
captured from the generated wrapper), compared with an eager run judged against
fp64, and the compiled graph is run twice.  The report names the root-cause node
(first node whose inputs agree and output does not), its error metrics, and its
line in the repro.  The tracing and checks are the backends'
(:mod:`determ_backend.backends.core`); this module only drives them and reports.

A compiler determ cannot look inside (any other backend) is analysed at its
outputs only (accuracy vs eager/fp64, two runs bitwise), and the report says so.
A graph that fails to compile or run (a compile- or runtime-error repro) has
nothing to compare: the error is summarized (type, message, where it was raised;
``--traceback`` adds the full traceback) and the exit code is 1 (failure reproduced).
Exit codes: 0 no divergence, 1 divergence found or the graph fails, 2 bad input.
Inputs are cloned for each run by :func:`determ_backend.clones.clone_inputs`.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from determ_backend import _torch_compat as tc
from determ_backend.backends.extract import lift_random_draws
from determ_backend.clones import clone_inputs
from determ_backend.config import CHECKS
from determ_backend.compare import metrics_text
from determ_backend.errors import DetermError

from repro_tools.cli.args import check_writable_dir, tol_arg
from repro_tools.minify.accuracy import call_maybe_boxed, flatten, same_two_models
from repro_tools.minify.repro_files import regenerated_note
from repro_tools.repro.script import add_sys_path, load_repro, repro_class_span

__all__ = ["register", "run", "analyze_repro"]

log = logging.getLogger(__name__)

# the recorded compiler -> determ's traced backend for it (a repro recorded with a determ backend names that backend)
_DETERM_BACKENDS = {"inductor": "determ_inductor", "inductor_inner": "determ_inductor", "aot_eager": "determ_aot_eager",
                    "eager": "determ_eager", "determ_inductor": "determ_inductor",
                    "determ_aot_eager": "determ_aot_eager", "determ_eager": "determ_eager"}


def register(subparsers) -> None:
    p = subparsers.add_parser("analyze", help="trace a repro's intermediates: compiled vs eager vs fp64, determinism",
                              description="Compile a repro.py's graph with determ's instrumented backend, compare every "
                                          "intermediate with eager (fp64-referenced) and across two runs, and report "
                                          "the root-cause node with its metrics and its line in the repro. "
                                          "Exit 0: no divergence; 1: divergence; 2: bad input.")
    p.add_argument("repro", help="a repro.py or minifier_launcher.py written by determ")
    p.add_argument("--checks", default="accuracy,determinism", help="comma-separated subset of accuracy,determinism")
    p.add_argument("--tol", type=tol_arg, help="accuracy tolerance (default: the repro's, else 1e-3)")
    p.add_argument("--out", help="directory for the trace and report (default: <repro dir>/analyze)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--traceback", action="store_true",
                   help="when the graph fails to compile or run: also print the full traceback (stderr)")
    p.set_defaults(func=run)


_FILE_COMMENT = re.compile(r"^\s*# File: (.+?):(\d+) in ")  # the graph code's note of a statement's user line
_SOURCE = re.compile(r"^(.+?):(\d+)(?: \(.*\))?$")  # a finding's source: ``file:line`` or ``file:line (function)``


def _op_base(op: str) -> str:
    """``relu`` of ``aten.relu.default``, ``torch.relu``, ``torch._C._nn.relu``, ``einops.einops.rearrange``: the name
    a call of it ends with (a registered operator ``namespace.name[.overload]`` by its name, any other callable by its
    last part)."""
    parts = op.split(".")
    if len(parts) in (2, 3):
        try:
            getattr(getattr(torch.ops, parts[0]), parts[1])
            return parts[1]
        except (AttributeError, RuntimeError):
            if len(parts) == 3 and parts[0] not in sys.modules:  # an operator of a library not loaded here
                return parts[1]
    return parts[-1]


def _repro_line(path: Path, node: Optional[str], op: Optional[str], source: Optional[str] = None) -> Optional[str]:
    """``repro.py:N: code`` of the statement in ``Repro.forward`` computing ``node``.

    The graph determ traced is the repro's graph traced again, so its names need not be the repro's: after
    dynamo the repro's statements are torch-level calls named after the user's variables (``hidden_states =
    torch.relu(...)``) while the finding names the aten node (``relu``).  A statement is taken by name only where
    it agrees with the finding (same user line when both are known, a call of the op when it calls anything);
    else the one statement under the finding's user line calling the op (``torch.relu(`` for ``aten.relu``);
    else the only statement of the graph calling the op as written.  None when nothing is that certain."""
    lines = path.read_text().splitlines()
    start, end = repro_class_span(lines) or (0, len(lines))
    body, where = [], None  # (index, text, user line of the statement or None)
    for i in range(start, end):
        m = _FILE_COMMENT.match(lines[i])
        if m:
            where = (m.group(1), int(m.group(2)))
        elif lines[i].strip() and not lines[i].strip().startswith("#"):
            body.append((i, lines[i], where))
    m = _SOURCE.match(source or "")
    want = (m.group(1), int(m.group(2))) if m else None
    base = _op_base(op) if op else None
    exact = (f"torch.ops.{op}(" if op.count(".") >= 2 else f"torch.ops.{op}.default(") if op else None

    def calls_op(text: str) -> bool:
        return bool(base) and (exact in text or re.search(rf"[.\s=(]{re.escape(base)}\(", text) is not None)

    by_name = re.compile(rf"^\s+{re.escape(node or '')}(\s*:[^=]*)?\s*=\s")
    hits = [i for i, ln, w in body if node and by_name.match(ln) and (want is None or w is None or w == want)
            and (not base or "(" not in ln.split("=", 1)[1] or calls_op(ln))]
    if not hits and want is not None and base:
        hits = [i for i, ln, w in body if w == want and calls_op(ln)]
        hits = hits if len(hits) == 1 else []
    if not hits and op:
        hits = [i for i, ln, _ in body if exact in ln]
        hits = hits if len(hits) == 1 else []
    return f"{path.name}:{hits[0] + 1}: {lines[hits[0]].strip()}" if hits else None


def _traced(path: Path, gm, inputs, meta, backend: str, checks: List[str], tol: float, out: Path) -> Dict[str, Any]:
    run_id = time.strftime("analyze-%Y%m%d-%H%M%S") + f"-{os.getpid()}"
    options = {"check": ",".join(checks), "dir": str(out), "run_id": run_id, "tol": tol, "repro_after": "",
               "raise_on_divergence": False, "trace": True}
    torch.compiler.reset()
    with tc.inductor_config_patch(dict(meta.get("config") or {})):
        with torch.no_grad():
            try:
                torch.compile(gm, backend=backend, options=options)(*clone_inputs(inputs))
            except DetermError:
                raise
            except Exception as e:  # the repro's own failure (a compile or runtime error): reported, not a traceback
                inner = getattr(e, "inner_exception", None)  # dynamo wraps what a backend raised
                if isinstance(inner, DetermError):
                    raise inner from None
                return _failed("compile" if inner is not None else "compile or run", inner or e, backend)
    report = json.loads((out / run_id / "report.json").read_text())
    findings = []
    for f in report.get("findings", []):
        fd = f.get("first_divergence") or {}
        findings.append({"check": f.get("check"), "node": fd.get("node"), "op": fd.get("op"), "stage": fd.get("stage"),
                         "metrics": fd.get("metrics"), "source": fd.get("source"),
                         "repro_line": _repro_line(path, fd.get("node"), fd.get("op"), fd.get("source"))})
    return {"mode": "per-node", "backend": backend, "findings": findings, "checker_errors": report.get("checker_errors", []),
            "report": str(out / run_id / "report.json")}


def _failed(stage: str, e: BaseException, backend: Optional[str]) -> Dict[str, Any]:
    """The result when the graph cannot be compiled or run: the error, summarized (nothing to compare)."""
    frames = traceback.extract_tb(e.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else None
    log.debug("analyze: the compiled graph failed", exc_info=(type(e), e, e.__traceback__))
    return {"mode": "failed", "backend": backend, "findings": [], "checker_errors": [],
            "failure": {"stage": stage, "type": type(e).__name__, "message": str(e).strip(), "where": where,
                        "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__))}}


def _two_runs_differ(fn, inputs) -> bool:
    a, b = ([o.detach().clone() if isinstance(o, torch.Tensor) else o
             for o in flatten(call_maybe_boxed(fn, clone_inputs(inputs)))] for _ in range(2))
    return not all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


def _opaque(gm, inputs, meta, checks: List[str], tol: float) -> Dict[str, Any]:
    from repro_tools.minify.compilers import compile_graph

    compiler = meta.get("compiler", "eager")
    notes: List[str] = []
    lifted = lift_random_draws(gm, inputs)
    if lifted is not None:  # eager and compiled draws never agree: both read eager's draws instead
        gm, inputs = lifted.gm, lifted.inputs
        notes.append(f"random draws taken as inputs: {', '.join(lifted.draws)}")
    with tc.inductor_config_patch(dict(meta.get("config") or {})):
        try:  # a copy: some compilers rewrite the graph they are handed, and ``gm`` is the eager reference
            compiled = compile_graph(compiler, copy.deepcopy(gm), clone_inputs(inputs))
        except DetermError:
            raise
        except Exception as e:  # the repro's own compile error: reported, not a traceback
            return _failed("compile", e, compiler)
        fn = compiled if meta.get("after") == "aot" else (lambda *a: compiled(*a))  # dynamo calls unboxed
        findings: List[Dict[str, Any]] = []
        if "accuracy" in checks:
            r = same_two_models(gm, fn, inputs, only_fwd=True, tol=tol)
            if r.status == "compiled_error":
                return _failed("run", r.error, compiler)
            if r.status == "not_judged":
                notes.append(f"accuracy not judged: {r.detail}")
            elif r.status != "same":
                findings.append({"check": "accuracy", "node": "<outputs>", "detail": f"{r.status}: {r.detail}"})
        if "determinism" in checks:
            try:
                differ = _two_runs_differ(fn, inputs)
            except Exception as e:  # the repro's own runtime error
                return _failed("run", e, compiler)
            if differ:
                findings.append({"check": "determinism", "node": "<outputs>", "detail": "two runs differ bitwise"})
    note = f"compiler {compiler!r} is opaque to determ: per-node tracing needs inductor, aot_eager or eager"
    return {"mode": "outputs only", "backend": compiler, "findings": findings, "checker_errors": [],
            "note": "; ".join([note] + notes)}


def analyze_repro(path, checks=("accuracy", "determinism"), tol: Optional[float] = None,
                  out_dir=None) -> Dict[str, Any]:
    """Analyse a repro script; returns ``{"mode", "backend", "findings": [...], "checker_errors", ...}``."""
    from determ_backend.errors import ConfigError

    path = Path(path).resolve()
    bad = [c for c in checks if c not in CHECKS]
    if bad or not checks:
        raise ConfigError(f"--checks {','.join(checks)!r}: expected a comma-separated subset of {', '.join(CHECKS)}")
    gm, inputs, meta = load_repro(path)
    add_sys_path(meta, path)  # a "module:function" compiler's home
    tol = float(tol if tol is not None else meta.get("tol", 1e-3))
    backend = _DETERM_BACKENDS.get(meta.get("compiler", "eager"))
    if backend == "determ_eager" and meta.get("after") == "aot":
        backend = "determ_aot_eager"
    out = Path(out_dir) if out_dir else path.parent / "analyze"
    result = _traced(path, gm, inputs, meta, backend, list(checks), tol, out) if backend else \
        _opaque(gm, inputs, meta, list(checks), tol)
    result.update(repro=str(path), checks=list(checks))
    inputs_note = regenerated_note(meta)
    if inputs_note:
        result["inputs_note"] = inputs_note
    return result


def _print_failure(f: Dict[str, Any], full: bool) -> None:
    lines = [ln for ln in f["message"].splitlines() if ln.strip()] or [""]
    stage = {"compile": "compile_error", "run": "runtime_error"}.get(f["stage"], "error")
    print(f"  reproduced {stage}: {f['type']}: {lines[0][:300]}")
    for ln in (lines[1:][-3:] if len(lines) > 1 else []):
        print(f"      {ln[:300]}")
    if f.get("where"):
        print(f"      raised at {f['where']}")
    print(f"  nothing to compare: the graph does not {'compile' if f['stage'] == 'compile' else 'compile and run'}"
          + ("" if full else " (--traceback prints the full traceback)"))
    if full:
        print(f["traceback"].rstrip(), file=sys.stderr)


def _print(r: Dict[str, Any], full_traceback: bool = False) -> None:
    print(f"analyze {r['repro']}: {r['mode']} with {r['backend']}, checks {', '.join(r['checks'])}")
    if r.get("failure"):
        _print_failure(r["failure"], full_traceback)
        return
    if r.get("note"):
        print(f"  note: {r['note']}")
    if r.get("inputs_note"):
        print(f"  note: {r['inputs_note']}")
    for c in r["checks"]:
        mine = [f for f in r["findings"] if f["check"] == c]
        if not mine:
            print(f"  {c}: no divergence")
        for f in mine:
            metrics = metrics_text(f.get("metrics"))
            if f.get("node") == "<outputs>":
                print(f"  {c}: the outputs diverge ({f.get('detail')})")
                continue
            print(f"  {c}: root cause {f.get('node')} ({f.get('op')}) {metrics}".rstrip())
            if f.get("repro_line"):
                print(f"      at {f['repro_line']}")
            if f.get("source"):
                print(f"      from {f['source']}")
    for e in r.get("checker_errors", []):
        print(f"  checker error: {e}")
    if r.get("report"):
        print(f"  report: {r['report']}")


def run(args: argparse.Namespace) -> int:
    checks = tuple(c.strip() for c in args.checks.split(",") if c.strip())
    if args.out:  # the flag the user gave, not the DETERM_DIR the trace is written through
        check_writable_dir(args.out, "--out")
    r = analyze_repro(args.repro, checks, args.tol, args.out)
    if args.json:
        print(json.dumps(r, indent=1, default=str))
    else:
        _print(r, args.traceback)
    return 1 if r["findings"] or r.get("failure") else 0
