"""``repro-tools demo``: the whole story on the shipped demo model, in a few minutes on a CPU.

1. A real inductor accuracy bug -- PyTorch's own
   ``torch._inductor.config.cpp.inject_relu_bug_TESTING_ONLY = "accuracy"``,
   compiled with caches disabled so nothing stale can hide it -- is caught by
   ``determ_inductor`` at ``REPRO_LEVEL=4`` (after AOT), localized and minified
   to the relu, and a standalone ``repro.py`` is written.
2. That ``repro.py`` is run in a fresh process and reproduces the bug (exit 1).
3. A nondeterministic op (:func:`determ_backend.demo_model.nondeterministic_op`)
   is caught by ``determ_aot_eager``'s determinism check, which names it as the
   root cause.
4. The same accuracy bug under ``determ_inductor``'s accuracy check
   (``DETERM_CHECK=accuracy``): every buffer judged against eager with an fp64
   reference, the relu named inside its fused kernel, and the run's HTML report
   (``report.html``: the error along the graph, the root cause at its line of the
   demo model) written; its path is printed last.

Everything goes to ``--out`` (default ``./determ_demo``).  Exit 0 when every
step found what it should, 1 otherwise.  The model lives in
:mod:`determ_backend.demo_model`; the flows in :mod:`repro_tools.flows.after_aot`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator

import torch
from tqdm import tqdm

from determ_backend import _torch_compat as tc
from determ_backend.backends.run import find_run, finish_all
from determ_backend.demo_model import DemoTransformer, demo_inputs
from determ_backend.errors import AccuracyError

from repro_tools.repro.script import read_meta

__all__ = ["register", "run"]

log = logging.getLogger(__name__)


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="catch, minify and reproduce a real inductor bug, catch a nondeterministic "
                                           "op, and write the HTML report",
                              description="Run the determ demo on a small transformer: an injected inductor accuracy "
                                          "bug is caught at REPRO_LEVEL=4, minified to the faulty relu and written as "
                                          "a standalone repro.py; then a nondeterministic op is caught by the "
                                          "determinism check; last, the accuracy check writes the run's HTML report. "
                                          "Exit 0 when every step found what it should.")
    p.add_argument("--out", default="determ_demo", help="directory for everything the demo writes (default: ./determ_demo)")
    p.set_defaults(func=run)


@contextlib.contextmanager
def _chdir(path: Path) -> Iterator[None]:
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def _accuracy_bug(out: Path) -> Dict[str, Any]:
    """Step 1: determ_inductor, REPRO_AFTER=aot, REPRO_LEVEL=4, on a model compiled with the injected relu bug."""
    torch.compiler.reset()
    torch.manual_seed(0)
    model = DemoTransformer().eval()
    (x,) = demo_inputs()
    options = {"repro_after": "aot", "repro_level": 4, "dir": str(out / "runs"), "run_id": "accuracy", "trace": False}
    compiled = torch.compile(model, backend="determ_inductor", options=options)
    found: Dict[str, Any] = {"caught": False}
    with tc.inductor_config_patch({"cpp.inject_relu_bug_TESTING_ONLY": "accuracy", "force_disable_caches": True}):
        with torch.no_grad():
            try:
                compiled(x)
            except AccuracyError as e:
                found.update(caught=True, message=str(e).split(";")[0])
    repro = out / "repro.py"
    if found["caught"] and repro.is_file():
        found.update(repro=repro, minified=read_meta(repro).get("minified", True))
    return found


def _reproduce(repro: Path) -> Dict[str, Any]:
    """Step 2: the repro alone, in a fresh process."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(repro)], capture_output=True, text=True, cwd=repro.parent, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(("reproduced", "not reproduced"))), "")
    return {"rc": proc.returncode, "line": line}


def _nondeterminism(out: Path) -> Dict[str, Any]:
    """Step 3: determ_aot_eager with the determinism check on the model with the nondeterministic op."""
    torch.compiler.reset()
    torch.manual_seed(0)
    model = DemoTransformer(nondeterministic=True).eval()
    (x,) = demo_inputs()
    options = {"check": "determinism", "dir": str(out / "runs"), "run_id": "determinism"}
    with torch.no_grad():
        torch.compile(model, backend="determ_aot_eager", options=options)(x)
    report_path = out / "runs" / "determinism" / "report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    return {"caught": bool(report.get("divergent")), "first": report.get("first_divergence") or {}, "report": report_path}


def _accuracy_report(out: Path) -> Dict[str, Any]:
    """Step 4: determ_inductor's accuracy check on the injected relu bug; the run writes its report.html."""
    torch.compiler.reset()
    torch.manual_seed(0)
    model = DemoTransformer().eval()
    (x,) = demo_inputs()
    options = {"check": "accuracy", "dir": str(out / "runs"), "run_id": "accuracy_check"}
    compiled = torch.compile(model, backend="determ_inductor", options=options)
    with tc.inductor_config_patch({"cpp.inject_relu_bug_TESTING_ONLY": "accuracy", "force_disable_caches": True}):
        with torch.no_grad():
            compiled(x)
    run = find_run("accuracy_check")
    run_dir = run.dir if run is not None else out / "runs" / "accuracy_check"  # -2, -3... when rerun in place
    finish_all()  # closes the run: its report.html again, with the whole trace
    report = json.loads((run_dir / "report.json").read_text()) if (run_dir / "report.json").is_file() else {}
    page = run_dir / "report.html"
    return {"caught": bool(report.get("divergent")), "first": report.get("first_divergence") or {},
            "page": page if page.is_file() else None}


def _forward_lines(repro: Path) -> str:
    text = repro.read_text()
    body = text[text.index("    def forward("):]
    lines = []
    for ln in body.splitlines()[1:]:
        if ln.strip() and not ln.startswith("        "):
            break
        if ln.strip() and not ln.strip().startswith("#"):
            lines.append(ln.strip())
    return "\n".join(f"      {ln}" for ln in lines)


def _summary(acc: Dict[str, Any], rep: Dict[str, Any], nd: Dict[str, Any], page: Dict[str, Any], out: Path,
             seconds: float) -> bool:
    ok = bool(acc.get("caught") and acc.get("repro") and rep.get("rc") == 1 and nd.get("caught")
              and page.get("page"))
    print(f"determ demo ({seconds:.0f} s): {'every step found what it should' if ok else 'SOMETHING WAS NOT FOUND'}")
    print(f"  1. accuracy bug caught at REPRO_LEVEL=4: {'yes' if acc.get('caught') else 'NO'}"
          + (f" ({acc.get('message')})" if acc.get("message") else ""))
    if acc.get("repro"):
        print(f"     {'minified' if acc.get('minified', True) else 'NOT minified'}: repro.py's Repro.forward is")
        print(_forward_lines(acc["repro"]))
    print(f"  2. repro.py in a fresh process: exit {rep.get('rc')}: {rep.get('line')}")
    f = nd.get("first", {})
    print(f"  3. nondeterminism caught: {'yes' if nd.get('caught') else 'NO'}; root cause: node {f.get('node')} "
          f"op {f.get('op')} at {f.get('source')}")
    f = page.get("first", {})
    print(f"  4. accuracy check's report: root cause: node {f.get('node')} op {f.get('op')} at {f.get('source')}")
    if acc.get("repro"):
        print(f"  repro: {acc['repro']}  (run it: python {acc['repro']}; analyze it: python {acc['repro']} analyze)")
    print(f"  all files: {out} (runs/accuracy/repro/: launcher, checkpoints, minimal; runs/determinism/report.json)")
    print(f"  report: {page.get('page') or 'NOT WRITTEN'}  (open it in a browser)")
    return ok


def run(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    bar = tqdm(total=4, desc="demo", unit="step", file=sys.stderr, dynamic_ncols=True)
    rep: Dict[str, Any] = {}
    with _chdir(out):
        bar.set_postfix_str("1/4 inductor accuracy bug at REPRO_LEVEL=4")
        acc = _accuracy_bug(out)
        bar.update()
        bar.set_postfix_str("2/4 running repro.py")
        if acc.get("repro"):
            rep = _reproduce(acc["repro"])
        bar.update()
        bar.set_postfix_str("3/4 determinism check")
        nd = _nondeterminism(out)
        bar.update()
        bar.set_postfix_str("4/4 accuracy check and its report")
        page = _accuracy_report(out)
        bar.update()
    bar.close()
    return 0 if _summary(acc, rep, nd, page, out, time.perf_counter() - t0) else 1
