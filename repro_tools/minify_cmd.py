"""``repro-tools minify REPRO``: shrink a failing repro to a minimal one (see :mod:`repro_tools.minifier`).

Exit codes: 1 when the minimal repro is written and still fails (the failure
reproduces), 2 for bad input, including an input repro that does not fail.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any, Dict, List

from determ_backend.errors import ConfigError

from .minifier import STATE_FILE, minify
from .oracles import KINDS
from .repro_io import inherited_meta, load_repro_any, spec_from_meta

__all__ = ["register", "run"]

log = logging.getLogger(__name__)


def _config_items(items: List[str]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--config {item!r}: expected KEY=VALUE, e.g. cpp.inject_relu_bug_TESTING_ONLY=accuracy")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


def register(subparsers) -> None:
    p = subparsers.add_parser("minify", help="shrink a failing repro to a minimal one (localize first, then shrink)",
                              description="Shrink a failing repro (repro.py or a graph directory) to a minimal graph "
                                          "that fails the same way. Exit 1: minimal repro written, failure "
                                          "reproduces; 2: bad input or the input does not fail.")
    p.add_argument("repro", help="repro.py written by determ, or a graph directory (graph.py + inputs.pt)")
    p.add_argument("--kind", choices=KINDS + ("any",), help="failure to preserve (default: the repro's own)")
    p.add_argument("--compiler", help="compiler under test: backend name (inductor, aot_eager, ...), inductor_inner, "
                                      "or module:function (default: the repro's own)")
    p.add_argument("--config", action="append", metavar="KEY=VALUE",
                   help="inductor config entry applied while compiling (repeatable)")
    p.add_argument("--devices", help="cross_device: two device specs, e.g. cuda,cpu or cpu,cpu:float64")
    p.add_argument("--tol", type=float, help="accuracy / cross-device tolerance (default 1e-3)")
    p.add_argument("--strict", action="store_true", default=None, help="accuracy: demand bitwise equality")
    p.add_argument("--timeout", type=float, help="seconds before an isolated query counts as a hang (default 300)")
    p.add_argument("--similarity", type=float, help="errors: minimum message similarity 0..1 (default 0.5)")
    p.add_argument("--max-queries", type=int, default=500, help="query budget (default 500)")
    p.add_argument("--no-localize", action="store_true", help="skip localization; use the general reducer only")
    p.add_argument("--in-process", action="store_true",
                   help="ask the oracle in this process (faster start; no protection against crashes/hangs)")
    p.add_argument("--out", help="directory for checkpoints, state and the minimal repro "
                                 "(default: a new minify, minify-2, ... next to REPRO)")
    p.add_argument("--resume", action="store_true", help="continue a killed run from the state in --out")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _print_text(s: Dict[str, Any]) -> None:
    c = s.get("culprit") or {}
    print(f"minified: {s['nodes_before']} -> {s['nodes_after']} nodes ({s['ops_before']} -> {s['ops_after']} ops), "
          f"{s['queries']} queries, {s['seconds']:.1f} s{' (localized)' if s['localized'] else ''}"
          f"{' (budget exhausted)' if s['budget_exhausted'] else ''}")
    print(f"failure: {s['failure']}")
    if c:
        print(f"culprit: {c['node']} = {c['op']}" + (f"  at {c['source']}" if c.get("source") else ""))
    print(f"repro: {s['repro_path']}")


def _out_dir(src: Path, given: str, resume: bool) -> Path:
    """``--out``, or ``minify``, ``minify-2``, ... next to the repro: a new one per run, the latest on resume."""
    if given:
        out = Path(given)
        if not resume and (out / STATE_FILE).exists():
            raise ConfigError(f"--out {out}: holds an earlier minification; pass --resume or another --out")
        return out
    base = (src if src.is_dir() else src.parent) / "minify"
    taken = [base] + [base.with_name(f"minify-{i}") for i in range(2, 1000)]
    used = [d for d in taken if d.exists()]
    if resume:
        return used[-1] if used else base
    return next(d for d in taken if not d.exists())


def run(args: argparse.Namespace) -> int:
    if args.max_queries < 1:
        raise ConfigError(f"--max-queries must be >= 1, got {args.max_queries}")
    gm, inputs, meta = load_repro_any(args.repro)
    spec = spec_from_meta(meta, kind=args.kind, compiler=args.compiler, tol=args.tol, strict=args.strict,
                          timeout=args.timeout, similarity=args.similarity, devices=args.devices,
                          **({"config": _config_items(args.config)} if args.config else {}))
    src = Path(args.repro)
    out = _out_dir(src, args.out, args.resume)
    result = minify(gm, inputs, spec, isolate=not args.in_process, budget=args.max_queries,
                    localize=not args.no_localize, out_dir=out, resume=args.resume,
                    progress=not args.no_progress, meta={**inherited_meta(meta), "source": str(src.resolve())})
    if args.json:
        print(json.dumps(result.summary, indent=1, sort_keys=True))
    else:
        _print_text(result.summary)
    return 1
