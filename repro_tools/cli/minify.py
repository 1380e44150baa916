"""``repro-tools minify REPRO``: shrink a failing repro to a minimal one (see :mod:`repro_tools.minify.minifier`).

Exit codes: 1 when the minimal repro is written and still fails (the failure
reproduces), 2 for bad input, including an input repro that does not fail and a
compiler that cannot be resolved; 130 (Ctrl-C) / 143 (SIGTERM) when interrupted,
after the worker is stopped and its temporary files are removed.

This module parses the options, picks the output directory and reports; the
work is :func:`repro_tools.minify.minifier.minify_repro`.  A launcher's ``minify``
subcommand (:func:`repro_tools.flows.failure.minify_script`) runs the same
handler with the same options (:func:`parse_args`).
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional

from determ_backend import _torch_compat as tc
from determ_backend.errors import ConfigError

from repro_tools.cli.args import check_writable_dir, seconds_arg, tol_arg
from repro_tools.minify.minifier import STATE_FILE, minify_repro
from repro_tools.minify.oracles import KINDS
from repro_tools.minify.repro_files import repro_target

__all__ = ["register", "parse_args", "run", "out_dir_for"]

log = logging.getLogger(__name__)


def _config_items(items: List[str]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--config {item!r}: expected KEY=VALUE, e.g. cpp.inject_relu_bug_TESTING_ONLY=accuracy")
        try:
            out[key] = json.loads(raw)
        except ValueError:  # Python's spelling of the JSON literals too (None, True, False), else the text
            out[key] = {"None": None, "True": True, "False": False}.get(raw, raw)
        problem = tc.inductor_config_problem(key, out[key])
        if problem:
            raise ConfigError(f"--config {item!r}: {problem}")
    return out


_DESCRIPTION = ("Shrink a failing repro (repro.py or a graph directory) to a minimal graph that fails the same way. "
                "Exit 1: minimal repro written, failure reproduces; 2: bad input or the input does not fail.")


def register(subparsers) -> None:
    p = subparsers.add_parser("minify", help="shrink a failing repro to a minimal one (localize first, then shrink)",
                              description=_DESCRIPTION)
    _add_arguments(p)


def parse_args(argv: List[str]) -> argparse.Namespace:
    """The ``minify`` command's options (those after ``repro-tools minify``) outside the command line's
    dispatch; argparse's ``SystemExit`` on a usage error, as on the command line."""
    p = argparse.ArgumentParser(prog="repro-tools minify", description=_DESCRIPTION)
    _add_arguments(p)
    return p.parse_args(argv)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("repro", help="repro.py written by determ, or a graph directory (graph.py + inputs.pt)")
    p.add_argument("--kind", choices=KINDS + ("any",), help="failure to preserve (default: the repro's own)")
    p.add_argument("--compiler", help="compiler under test: backend name (inductor, aot_eager, ...), inductor_inner, "
                                      "or module:function (default: the repro's own)")
    p.add_argument("--config", action="append", metavar="KEY=VALUE",
                   help="inductor config entry applied while compiling (repeatable); added to the repro's "
                        "recorded config, overriding the same key")
    p.add_argument("--devices", help="cross_device: two device specs, e.g. cuda,cpu or cpu,cpu:float64")
    p.add_argument("--tol", type=tol_arg, help="accuracy / cross-device tolerance (default 1e-3)")
    p.add_argument("--strict", action="store_true", default=None, help="accuracy: demand bitwise equality")
    p.add_argument("--timeout", type=seconds_arg,
                   help="seconds before an isolated query counts as a hang (default 300)")
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
    p.set_defaults(func=run, _parser=p)


def _print_text(s: Dict[str, Any]) -> None:
    c = s.get("culprit") or {}
    print(f"minified: {s['nodes_before']} -> {s['nodes_after']} nodes ({s['ops_before']} -> {s['ops_after']} ops), "
          f"{s['queries']} queries, {s['seconds']:.1f} s{' (localized)' if s['localized'] else ''}"
          f"{' (budget exhausted)' if s['budget_exhausted'] else ''}")
    print(f"failure: {s['failure']}")
    if c:
        print(f"culprit: {c['node']} = {c['op']}" + (f"  at {c['source']}" if c.get("source") else ""))
    elif s["ops_after"] > 1:
        print(f"culprit: none named: {s['ops_after']} ops are left and none was localized"
              + (" (the budget ran out before the graph was minimal)" if s["budget_exhausted"] else
                 " (the failure needs them together)"))
    print(f"repro: {s['repro_path']}")


def out_dir_for(src: Path, given: Optional[str], resume: Optional[bool] = None, name: str = "minify",
                what: str = "--out") -> Path:
    """``given`` (checked), or ``NAME``, ``NAME-2``, ... next to the repro: a new one per run, the latest on
    resume.  A given directory holding an earlier minification is refused unless resuming (``resume``
    None: the caller offers no resuming)."""
    if given:
        out = Path(given)
        check_writable_dir(out, what)
        if not resume and (out / STATE_FILE).exists():
            hint = "pass --resume or another" if resume is not None else "delete it or pass another"
            raise ConfigError(f"{what} {out}: holds an earlier minification; {hint} {what}")
        return out
    base = (src if src.is_dir() else src.parent) / name
    taken = [base] + [base.with_name(f"{name}-{i}") for i in range(2, 1000)]
    used = [d for d in taken if d.exists()]
    if resume:
        return used[-1] if used else base
    out = next((d for d in taken if not d.exists()), None)
    if out is None:
        raise ConfigError(f"{base.parent}: {name} .. {name}-999 all exist; pass {what}")
    check_writable_dir(out, what)
    return out


def _on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signum)


def _given_options(args: argparse.Namespace) -> List[str]:
    """The options of ``args`` that differ from their defaults, as a command line gives them (what a resume must
    repeat: the saved progress was judged with them)."""
    parser = getattr(args, "_parser", None)
    out: List[str] = []
    for action in (parser._actions if parser is not None else ()):
        if not action.option_strings or action.dest in ("out", "resume", "help"):
            continue
        value = getattr(args, action.dest, None)
        if value is None or value == action.default:
            continue
        flag = action.option_strings[-1]
        if action.nargs == 0:  # a flag
            out.append(flag)
        elif isinstance(value, list):
            for v in value:
                out += [flag, str(v)]
        else:
            out += [flag, str(value)]
    return out


def _interrupted(e: KeyboardInterrupt, args: argparse.Namespace, out: Path) -> int:
    signum = e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT
    argv = ["repro-tools", "minify", args.repro, "--out", str(out), "--resume", *_given_options(args)]
    print(f"repro-tools minify: interrupted; resume with: {' '.join(shlex.quote(a) for a in argv)}", file=sys.stderr)
    return 128 + int(signum)


def run(args: argparse.Namespace) -> int:
    if args.max_queries < 1:
        raise ConfigError(f"--max-queries must be >= 1, got {args.max_queries}")
    src = repro_target(args.repro)
    out = out_dir_for(src, args.out, args.resume)  # a bad --out fails before the (slow) load and input check
    config = _config_items(args.config)
    overrides = {"kind": args.kind, "compiler": args.compiler, "tol": args.tol, "strict": args.strict,
                 "timeout": args.timeout, "similarity": args.similarity, "devices": args.devices}
    main_thread = threading.current_thread() is threading.main_thread()
    # SIGTERM is cleaned up like Ctrl-C: the worker is stopped and its temporary files are removed
    old = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        result = minify_repro(src, out, overrides=overrides, config=config, isolate=not args.in_process,
                              budget=args.max_queries, localize=not args.no_localize, resume=args.resume,
                              progress=not args.no_progress)
    except KeyboardInterrupt as e:
        return _interrupted(e, args, out)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, old)
    if args.json:
        print(json.dumps(result.summary, indent=1, sort_keys=True))
    else:
        _print_text(result.summary)
    return 1
