"""``repro-tools xdevice TARGET --devices A,B``: on which device does a graph go wrong, and where?

TARGET is one of

* a ``repro.py`` written by determ (or a minifier graph directory): the graph runs
  in this process on both device specs with the same inputs, every node traced
  (:mod:`repro_tools.xdevice.trace`); ``--minify`` then shrinks it with the
  minifier's cross-device oracle and writes the minimal ``repro.py``;
* a pair of traces recorded elsewhere (``A.jsonl,B.jsonl``, or two trace files or
  run directories, e.g. one per machine): aligned and compared within ``--tol``;
* a user script whose model is compiled with a determ backend: it runs once per
  device in a subprocess with ``DETERM_DEVICE=<spec>`` (the backends move each graph
  there, see :mod:`determ_backend.backends.retarget`), and the two traces are compared.
  ``--backend determ_aot_eager`` forces a determ backend on a script compiled with
  a plain one (through torch's ``TORCH_BISECT_BACKEND`` backend override).

Exit 0: the devices agree within tolerance; 1: they diverge (root cause reported);
2: bad input, or a device that is not present here.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from tqdm import tqdm

from determ_backend.compare import Comparison, metrics_text
from determ_backend.devices import parse_device_spec, require
from determ_backend.errors import ConfigError, DetermError, ReproError, exception_line, first_line

from repro_tools.cli.args import tol_arg
from repro_tools.cli.diff import compare_trace_pair, diff_summary, format_table

__all__ = ["register", "run", "compare_repro", "compare_trace_pair", "compare_script"]

log = logging.getLogger(__name__)
_BACKENDS = ("determ_eager", "determ_aot_eager", "determ_inductor")


# ---------------------------------------------------------------------- targets

def _kind(targets: List[str]) -> str:
    if len(targets) == 2:
        return "traces"
    t = targets[0]
    if "," in t and not Path(t).exists():
        return "traces"
    p = Path(t)
    if p.is_dir():
        from repro_tools.minify.repro_files import repro_target

        try:
            repro_target(p)  # a graph directory, or a repro's (a flow's repro/aot-0 may hold its launcher alone)
            return "repro"
        except ReproError:
            pass
        raise ConfigError(f"{t}: a directory holding no graph.py or repro.py; expected a repro.py (or the directory "
                          f"holding it), a graph directory, a user script, or two traces (A.jsonl,B.jsonl)")
    if p.suffix == ".py":
        from repro_tools.repro.script import read_meta

        try:
            read_meta(p)
            return "repro"
        except ReproError:
            return "script"
    if p.suffix in (".jsonl", ".log"):
        raise ConfigError(f"{t}: a single trace; expected two (A.jsonl,B.jsonl or two paths)")
    raise ConfigError(f"{t}: expected a repro.py, a user script (.py), or two traces (A.jsonl,B.jsonl)")


def _devices(text: Optional[str], needed: bool) -> Tuple[str, ...]:
    if not text:
        if needed:
            raise ConfigError("--devices: expected two device specs, e.g. --devices cpu,cpu:float64 or cuda,cpu")
        return ()
    specs = tuple(s.strip() for s in text.split(",") if s.strip())
    if len(specs) != 2:
        raise ConfigError(f"--devices {text!r}: expected exactly two device specs separated by a comma")
    for s in specs:
        try:
            dev, _ = parse_device_spec(s)
        except ConfigError as e:
            raise ConfigError(f"--devices {text!r}: {e}") from None
        require(dev)
    return specs


# ---------------------------------------------------------------------- modes

def compare_repro(path: str, specs: Tuple[str, ...], tol: float
                  ) -> Tuple[Comparison, Any, List[Any], Optional[str]]:
    """``(comparison, gm, inputs, note)`` for a repro script or graph directory run on both devices; ``note``: why
    the inputs may not be the program's (:func:`~repro_tools.minify.repro_files.regenerated_note`), or None."""
    from repro_tools.minify.repro_files import load_repro_any, regenerated_note
    from repro_tools.repro.script import load_repro
    from repro_tools.xdevice.trace import compare_devices, move_roots_upstream, reference_spec

    # a repro recorded on an accelerator loads on the CPU here; each side moves it where it runs
    gm, inputs, meta = load_repro(path, device="cpu") if Path(path).is_file() else load_repro_any(path)
    ref = reference_spec(specs)
    sides = []
    for s in tqdm(list(specs) + ([ref] if ref else []), desc="xdevice", unit="device", file=sys.stderr,
                  disable=len(gm.graph.nodes) < 200):
        sides.append(_on_side(gm, inputs, s, path))
    cmp = compare_devices(sides[0], sides[1], tol, sides[2] if ref else None)
    move_roots_upstream(cmp, gm, inputs, specs[1], sides[0], sides[1], tol, sides[2] if ref else None)
    return cmp, gm, inputs, regenerated_note(meta or {})


def _on_side(gm, inputs, spec: str, path: str):
    """:func:`~repro_tools.xdevice.trace.trace_on_device`; a graph that fails there is one line (exit 2), not a
    traceback read as a divergence."""
    from repro_tools.xdevice.trace import trace_on_device

    held = io.StringIO()  # what the run writes to stderr: FX prints the generated code of a graph that raises
    try:
        with contextlib.redirect_stderr(held):
            result = trace_on_device(gm, inputs, spec)
    except DetermError:
        sys.stderr.write(held.getvalue())
        raise
    except Exception as e:  # the graph itself fails on that side (a dtype it cannot run in, an op the device lacks)
        log.debug("%s on %s: %s", path, spec, held.getvalue())
        what = f"{type(e).__name__}: {first_line(e)}"
        raise ReproError(f"{path}: the graph fails on {spec} ({what}){_narrower_hint(spec, what)}") from None
    sys.stderr.write(held.getvalue())
    return result


_DTYPE_CLASH = re.compile(r"same dtype|scalar type|should be the same", re.IGNORECASE)
_NAMES = {torch.bfloat16: ("BFloat16", "bfloat16"), torch.float16: ("Half", "float16")}  # as torch's errors spell them


def _narrower_hint(spec: str, error: str) -> str:
    """Why a side of a floating dtype narrower than float32 fails with ``error``, a clash of dtypes that names the
    side's dtype (``mat1 and mat2 must have the same dtype, but got Float and BFloat16``), where the model itself
    runs in that dtype; "" for any other side or error."""
    try:
        dtype = parse_device_spec(spec)[1]
    except ConfigError:
        return ""
    if dtype is None or not dtype.is_floating_point or torch.finfo(dtype).bits >= 32:
        return ""
    name = str(dtype).replace("torch.", "")
    if not _DTYPE_CLASH.search(error) or not any(n in error for n in _NAMES.get(dtype, (name,))):
        return ""
    return (f"; on a {name} side the float32 the graph names stays float32 (its casts and the dtype= of tensors it "
            f"makes are only widened), so a value the model meant to follow x.dtype, float32 where the graph was "
            f"traced, can meet {name} in an op that does not promote: compare against cpu:float64, or run the model "
            f"itself in {name} on both sides")


def _label(i: int, spec: str) -> str:
    return f"side{i}_" + re.sub(r"[^A-Za-z0-9_.-]", "_", spec)


def _run_script(script: str, script_args: List[str], spec: str, out: Path, backend: Optional[str]) -> Path:
    """Run the script with ``DETERM_DEVICE=spec``; returns its run directory (trace + report)."""
    env = dict(os.environ, DETERM_DEVICE=spec, DETERM_DIR=str(out.parent), DETERM_RUN_ID=out.name)
    env.setdefault("DETERM_SAVE_TENSORS", "1")  # exact per-node metrics instead of statistics
    env.pop("DETERM_BISECT_STAGE", None)
    if backend:
        env["TORCH_BISECT_BACKEND"] = backend
    from determ_backend.backends.run import reuse_run_dir  # not at import: the module registers its exit handler

    out.mkdir(parents=True, exist_ok=True)
    reuse_run_dir(out)  # an earlier run's files, which this run may not rewrite, and its claim on the directory
    t0 = time.perf_counter()
    with open(out / "stdout.txt", "wb") as so, open(out / "stderr.txt", "wb") as se:
        code = subprocess.run([sys.executable, script, *script_args], env=env, stdout=so, stderr=se,
                              stdin=subprocess.DEVNULL).returncode
    log.info("%s on %s: exit %d (%.1f s)", script, spec, code, time.perf_counter() - t0)
    if code != 0:
        what = exception_line((out / "stderr.txt").read_text(errors="replace"))
        raise ReproError(f"{script} exited with status {code} on {spec} ({what}){_narrower_hint(spec, what)}; log: "
                         f"{out / 'stderr.txt'}")
    if not (out / "trace.jsonl").is_file():
        if backend:  # the backend was swapped in, yet nothing compiled: the script never calls torch.compile
            raise ReproError(f"{script} wrote no determ trace on {spec} with --backend {backend}: it never calls "
                             f"torch.compile; trace each device with HashMode(trace_path=...) and pass the two "
                             f"traces as A.jsonl,B.jsonl")
        raise ReproError(f"{script} wrote no determ trace on {spec}: compile the model with one of "
                         f"{', '.join(_BACKENDS)}, or pass --backend determ_aot_eager")
    return out


def compare_script(script: str, script_args: List[str], specs: Tuple[str, ...], tol: float, out: Path,
                   backend: Optional[str]) -> Comparison:
    """Run a user script once per device and compare the two traces."""
    if not Path(script).is_file():
        raise ConfigError(f"{script}: no such script")
    dirs = []
    with tqdm(total=len(specs), desc="xdevice", unit="device", file=sys.stderr) as bar:  # closed before an error
        for i, s in enumerate(specs):
            dirs.append(_run_script(script, script_args, s, out / _label(i, s), backend))
            bar.update(1)
    return compare_trace_pair(str(dirs[0]), str(dirs[1]), tol)


# ---------------------------------------------------------------------- CLI

def register(subparsers) -> None:
    p = subparsers.add_parser(
        "xdevice", help="run one graph on two devices and name the first node that diverges",
        description="Compare a graph across two device specs (cpu, cuda[:N], npu[:N], xpu[:N], each with an "
                    "optional :DTYPE such as cpu:float64) and report the root-cause node: the first whose inputs "
                    "agree while its output differs beyond --tol.  Exit 0: devices agree; 1: divergence; "
                    "2: bad input or a device that is not present.",
        epilog="examples:  repro-tools xdevice repro.py --devices cpu,cpu:float64 --minify\n"
               "           repro-tools xdevice train.py --devices cuda,cpu\n"
               "           repro-tools xdevice runs/cuda/trace.jsonl,runs/npu/trace.jsonl",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("targets", nargs="+", metavar="TARGET",
                   help="repro.py, a user script, A.jsonl,B.jsonl, or two trace files / run directories")
    p.add_argument("--devices", help="two device specs, e.g. cpu,cpu:float64 (required except for traces)")
    p.add_argument("--tol", type=tol_arg, default=1e-3,
                   help="a node agrees when its max abs error or its max rel error is <= TOL (default 1e-3)")
    p.add_argument("--json", action="store_true", help="print the comparison summary as JSON")
    p.add_argument("--minify", action="store_true",
                   help="repro targets: shrink to the smallest subgraph that still diverges and write repro.py")
    p.add_argument("--out", help="output directory: user scripts' runs (default ./determ_xdevice, reused), or "
                                 "--minify's checkpoints and minimal repro (default: a new xdevice, xdevice-2, ... "
                                 "next to REPRO)")
    p.add_argument("--script-args", default="", help="arguments for a user script, as one shell-quoted string "
                                                     "(a single option: --script-args=--fast)")
    p.add_argument("--backend", choices=_BACKENDS,
                   help="user scripts: compile with this determ backend whatever the script asks for")
    p.add_argument("--limit", type=int, default=20, help="rows of divergent nodes to print (default 20)")
    p.set_defaults(func=run)


def _script_args(text: str) -> List[str]:
    try:
        return shlex.split(text)
    except ValueError as e:
        raise ConfigError(f"--script-args {text!r}: {e}; expected the script's arguments as one shell-quoted "
                          "string, e.g. --script-args '--steps 1'") from None


def _minify(gm, inputs, specs: Tuple[str, ...], tol: float, out: Path) -> Dict[str, Any]:
    from repro_tools.minify.minifier import minify
    from repro_tools.minify.oracles import OracleSpec

    # the graph runs eagerly on each side (as traced above); the oracle moves its parameters with its inputs
    spec = OracleSpec(kind="cross_device", compiler="eager", devices=specs, tol=tol)
    return dict(minify(gm, inputs, spec, out_dir=out).summary)


def _print(cmp: Comparison, specs: Tuple[str, ...], limit: int, summary: Dict[str, Any]) -> None:
    if specs:
        print(f"devices: a={specs[0]}  b={specs[1]}")
    print(format_table(cmp, limit, summary))
    fd = cmp.first_divergence
    if fd is not None and fd.metrics:
        m = fd.metrics
        print("metrics: " + metrics_text(m))
        if "err_a_vs_fp64" in m and specs:
            worse = specs[0] if m["err_a_vs_fp64"] > m["err_b_vs_fp64"] else specs[1]
            print(f"farther from the float64 reference: {worse}")


def run(args: argparse.Namespace) -> int:
    from repro_tools.cli.minify import out_dir_for
    from repro_tools.minify.repro_files import repro_target

    kind = _kind(args.targets)
    if args.limit < 0:
        raise ConfigError(f"--limit must be >= 0 (rows to print), got {args.limit}")
    if args.minify and kind != "repro":
        raise ConfigError("--minify needs a repro.py (or graph directory) target: traces and scripts carry no graph")
    script_args = _script_args(args.script_args)
    specs = _devices(args.devices, needed=kind != "traces")
    src = repro_target(args.targets[0]) if kind == "repro" else Path(args.targets[0])
    min_out = out_dir_for(src, args.out, name="xdevice") if args.minify else None
    summary: Dict[str, Any] = {"target": kind, "devices": list(specs)}
    if kind == "traces":
        pair = args.targets if len(args.targets) == 2 else args.targets[0].split(",")
        if len(pair) != 2:
            raise ConfigError(f"{args.targets[0]}: expected two traces separated by one comma")
        cmp = compare_trace_pair(pair[0], pair[1], args.tol)
    elif kind == "repro":
        cmp, gm, inputs, note = compare_repro(str(src), specs, args.tol)
        if note:
            summary["inputs_note"] = note
    else:
        out = Path(args.out or "determ_xdevice")
        cmp = compare_script(args.targets[0], script_args, specs, args.tol, out, args.backend)
        summary["runs"] = str(out)
    summary.update(cmp.summary(["xdevice"]) if cmp.files is None else diff_summary(cmp, cmp.files, ["xdevice"]))
    if not summary["pairs"]:  # nothing was compared: never "the devices agree"
        raise ConfigError(f"{args.targets[0]}: no record of one side pairs with the other "
                              f"({summary['unmatched_a']} vs {summary['unmatched_b']} records); expected runs of "
                              "the same model with the same determ backend")
    if args.minify and cmp.divergent:
        summary["minify"] = _minify(gm, inputs, specs, args.tol, min_out)
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        _print(cmp, specs, args.limit, summary)
        if summary.get("inputs_note"):
            print(f"note: {summary['inputs_note']}")
        if "minify" in summary:
            s = summary["minify"]
            print(f"minified: {s['nodes_before']} -> {s['nodes_after']} nodes, {s['queries']} queries, "
                  f"{s['seconds']:.1f} s; repro: {s['repro_path']}")
    # a side whose run died or raised shows nothing about the records it never wrote
    partial = cmp.files is not None and not all(tf.complete for _, tf in cmp.files.values())
    return 1 if cmp.divergent or partial else 0
