#!/usr/bin/env python3
"""Real-model corpus: run determ's checks and repro flows over small Hugging Face architectures.

Every family of ``tests/real_models.py`` runs, in eval (a no-grad forward) and in train (forward,
backward of ``loss_of(out)``, an SGD step), compiled with ``--backend``:

- under each check (``DETERM_CHECK=determinism``, ``accuracy``, ``nan``): a healthy model must come out clean;
- ``aot4``: the after-AOT level-4 flow (``REPRO_AFTER=aot REPRO_LEVEL=4``), which must stay quiet;
- ``inject``: on families with a relu (``RELU_FAMILIES``) and ``determ_inductor`` only, inductor's
  ``cpp.inject_relu_bug_TESTING_ONLY="accuracy"`` under ``DETERM_CHECK=accuracy``: the root cause
  must be the ``relu`` node.

Each case is a subprocess of its own (a crash or a hang is a row, not the end of the corpus) with its
own directory ``<out>/<case>/`` (stdout.log, stderr.log, ``run/report.json``), a timeout, and a
shared ``TORCHINDUCTOR_CACHE_DIR``.  The table goes to stdout, progress and logs to stderr, every row
to ``<out>/results.json``.  Verdicts are read from each run's ``report.json`` as they are: a false
divergence is reported, never hidden.  Exit 0 only when no healthy case diverged, crashed, timed out
or hit a checker error and every injected bug was found at relu; 1 otherwise; 2 on bad usage.

    .venv/bin/python scripts/corpus.py --quick                        # 3 families, eval, determ_inductor
    .venv/bin/python scripts/corpus.py --backend determ_aot_eager --jobs 2
    .venv/bin/python scripts/corpus.py --families llama,t5 --modes train --flows inject
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import real_models  # noqa: E402

log = logging.getLogger("corpus")

BACKENDS = ("determ_inductor", "determ_aot_eager", "determ_eager")
MODES = ("eval", "train")
CHECKS = ("determinism", "accuracy", "nan")
FLOWS = ("aot4", "inject")
QUICK_FAMILIES = ("llama", "opt", "resnet")
ACCURACY_EXIT = 3  # the child's exit status when the level-4 flow raised AccuracyError (its finding is in report.json)
WITNESS = "witness.json"  # a determinism case's ground truth (see witness())
MARKER = "case.json"  # marks a case directory as the corpus's own (so a rerun may replace it)


@dataclass
class Case:
    """One subprocess: a family in a mode under a check (``determinism``/``accuracy``) or a flow (``aot4``/``inject``)."""

    family: str
    mode: str
    kind: str
    backend: str

    @property
    def name(self) -> str:
        return f"{self.family}-{self.mode}-{self.kind}"

    @property
    def injected(self) -> bool:
        return self.kind == "inject"

    def env(self, case_dir: Path, cache_dir: Path, minify: bool) -> Dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("DETERM_", "REPRO_")) and k != "TORCH_BISECT_BACKEND"}
        env.update(DETERM_DIR=str(case_dir), DETERM_RUN_ID="run", TORCHINDUCTOR_CACHE_DIR=str(cache_dir),
                   DETERM_MINIFY="1" if minify else "0", PYTHONUNBUFFERED="1")
        if self.kind in CHECKS:
            env["DETERM_CHECK"] = self.kind
        elif self.kind == "inject":
            env["DETERM_CHECK"] = "accuracy"
        else:
            env.update(REPRO_AFTER="aot", REPRO_LEVEL="4")
        return env


@dataclass
class Row:
    """A case's outcome: its verdict, where the run put the blame, and whether that is what was expected."""

    case: Case
    verdict: str  # clean | divergent | nondeterministic | checker-error | crash | timeout
    seconds: float
    cause: str = ""
    found_relu: Optional[bool] = None  # inject cases: whether the first root cause is the relu
    notes: List[str] = field(default_factory=list)
    report: Optional[Dict[str, Any]] = None

    @property
    def ok(self) -> bool:
        if self.case.injected:
            return self.verdict == "divergent" and bool(self.found_relu)
        return self.verdict in ("clean", "nondeterministic")


# ---------------------------------------------------------------- the child: one case, in its own process


def run_case(spec: Dict[str, str]) -> int:
    """Build, compile and run one case (in the child process); 0 when it ran, ``ACCURACY_EXIT`` on AccuracyError."""
    import torch

    from determ_backend.errors import AccuracyError

    if spec["kind"] == "inject":
        import torch._inductor.config as inductor_config

        inductor_config.cpp.inject_relu_bug_TESTING_ONLY = "accuracy"
    model, inputs = real_models.build(spec["family"])
    compiled = torch.compile(model, backend=spec["backend"])
    try:
        if spec["mode"] == "eval":
            model.eval()
            with torch.no_grad():
                compiled(**inputs)
        else:
            model.train()
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            real_models.loss_of(compiled(**inputs)).backward()
            opt.step()
    except AccuracyError as e:
        print(f"corpus case: AccuracyError: {e}", file=sys.stderr)
        return ACCURACY_EXIT
    if spec["kind"] == "determinism" and _report_has_findings(Path("run") / "report.json"):
        Path(WITNESS).write_text(json.dumps(witness(spec)) + "\n")
    return 0


def _report_has_findings(path: Path) -> bool:
    report = _read_report(path)
    return bool(report and report.get("findings"))


def witness(spec: Dict[str, str]) -> Dict[str, Any]:
    """Ground truth for a determinism finding, without determ: the model compiled by the plain backend
    (``determ_inductor`` -> ``inductor``) runs the same step twice from the same weights, inputs and seed;
    ``nondeterministic`` when an output or a gradient differs bitwise (``where``: the first one)."""
    import copy

    import torch

    torch._dynamo.reset()
    model, inputs = real_models.build(spec["family"])
    state = copy.deepcopy(model.state_dict())
    backend = spec["backend"].replace("determ_", "", 1)
    compiled = torch.compile(model, backend=backend)
    runs = []
    for _ in range(2):
        model.load_state_dict(state)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        values: Dict[str, Any] = {}
        if spec["mode"] == "eval":
            model.eval()
            with torch.no_grad():
                out = compiled(**inputs)
            values["output"] = real_models.first_tensor(out).clone()
        else:
            model.train()
            loss = real_models.loss_of(compiled(**inputs))
            loss.backward()
            values["loss"] = loss.detach().clone()
            values.update({f"grad {n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        runs.append(values)
    where = next((k for k, v in runs[0].items() if k not in runs[1] or not torch.equal(v, runs[1][k])), None)
    return {"nondeterministic": where is not None, "where": where}


# ---------------------------------------------------------------- the parent: launch, time out, read the report


class Launcher:
    """Starts cases, each in a process group of its own under ``<out>/<case>/``; kills a group on timeout
    and every live one on :meth:`kill_all` (an interrupted corpus leaves nothing running)."""

    def __init__(self, out: Path, cache_dir: Path, timeout: float, minify: bool):
        self.out, self.cache_dir, self.timeout, self.minify = out, cache_dir, timeout, minify
        self._live: Dict[int, subprocess.Popen] = {}
        self._lock = threading.Lock()
        self._stopping = False

    def case_dir(self, case: Case) -> Path:
        return self.out / case.name

    def run(self, case: Case) -> Row:
        """Run ``case`` in a subprocess and judge it."""
        case_dir = self.case_dir(case)
        if case_dir.exists():
            shutil.rmtree(case_dir)  # an earlier corpus run's (checked by main)
        case_dir.mkdir(parents=True)
        spec = {"family": case.family, "mode": case.mode, "kind": case.kind, "backend": case.backend}
        (case_dir / MARKER).write_text(json.dumps(spec) + "\n")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--case", json.dumps(spec)]
        t0 = time.monotonic()
        with open(case_dir / "stdout.log", "wb") as so, open(case_dir / "stderr.log", "wb") as se:
            with self._lock:
                if self._stopping:
                    raise KeyboardInterrupt
                proc = subprocess.Popen(cmd, cwd=case_dir, env=case.env(case_dir, self.cache_dir, self.minify),
                                        stdout=so, stderr=se, stdin=subprocess.DEVNULL, start_new_session=True)
                self._live[proc.pid] = proc
            try:
                rc: Optional[int] = proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                rc = None
            finally:
                with self._lock:
                    self._live.pop(proc.pid, None)
        return judge(case, case_dir, rc, time.monotonic() - t0)

    def kill_all(self) -> None:
        with self._lock:
            self._stopping = True
            procs = list(self._live.values())
        for proc in procs:
            _kill_group(proc)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def judge(case: Case, case_dir: Path, rc: Optional[int], seconds: float) -> Row:
    """The row of a finished case, from its exit status, ``run/report.json`` and stderr."""
    stderr = (case_dir / "stderr.log").read_text(errors="replace")
    report = _read_report(case_dir / "run" / "report.json")
    row = Row(case, "clean", seconds, report=report, notes=_notes(stderr))
    if report and report.get("graphs", 1) != 1:
        row.notes.append(f"{report.get('graphs')} graphs")
    if rc is None:
        row.verdict, row.cause = "timeout", "killed after the per-case timeout"
    elif rc not in (0, ACCURACY_EXIT):
        row.verdict, row.cause = "crash", _crash_cause(stderr, rc)
    elif report is None:
        row.verdict, row.cause = "crash", f"exit {rc} but no readable run/report.json"
    elif rc == ACCURACY_EXIT and not report.get("findings"):
        row.verdict, row.cause = "crash", "AccuracyError raised without a finding in report.json"
    elif report.get("findings"):
        row.verdict, row.cause = "divergent", _blame(report)
        seen = _read_report(case_dir / WITNESS) if case.kind == "determinism" else None
        if seen and seen.get("nondeterministic"):  # the plain backend itself is not bitwise reproducible
            row.verdict = "nondeterministic"
            row.notes.append(f"confirmed without determ: {seen.get('where')} differs between two plain runs")
        elif seen is not None:
            row.notes.append("two plain runs agree bitwise")
    elif report.get("checker_errors"):
        row.verdict, row.cause = "checker-error", _one_line(report["checker_errors"][0])
    if report and report.get("findings") and report.get("checker_errors"):
        row.notes.append(f"{len(report['checker_errors'])} checker error(s)")
    if case.injected:
        row.found_relu = row.verdict == "divergent" and _is_relu(report.get("first_divergence") or {})
        if row.verdict == "divergent" and not row.found_relu:
            row.notes += _where_relu_went(report)
    if row.verdict == "divergent" and not row.ok:
        kernel = _kernel_of(case_dir / "run" / "trace.jsonl", report.get("first_divergence") or {})
        if kernel and kernel.startswith(("cpp_fused", "triton_")):  # a fused kernel: which node is to blame?
            row.notes.append(f"buffer of {kernel}")
    return row


def _read_report(path: Path) -> Optional[Dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _is_relu(fd: Dict[str, Any]) -> bool:
    return str(fd.get("op") or "").startswith("aten.relu.") or bool(re.fullmatch(r"relu(_\d+)?", str(fd.get("node"))))


def _where_relu_went(report: Dict[str, Any]) -> List[str]:
    """Notes saying where a missed injected relu ended up in the findings (a later root cause, masked)."""
    notes = []
    for key, what in (("root_causes", "relu is a later root cause"), ("masked", "relu reported as masked")):
        if any(_is_relu(p) for f in report.get("findings", []) for p in f.get(key) or []):
            notes.append(what)
    return notes


def _kernel_of(trace: Path, fd: Dict[str, Any]) -> Optional[str]:
    """The inductor kernel that wrote the first divergence's buffer (``extra.kernel`` of its trace record)."""
    if not fd.get("node") or not trace.is_file():
        return None
    key = (fd.get("graph"), fd.get("stage"), fd.get("call"), fd.get("node"))
    with open(trace) as f:
        for line in f:
            if f'"{fd["node"]}"' not in line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if (rec.get("graph"), rec.get("stage"), rec.get("call"), rec.get("node")) == key:
                return (rec.get("extra") or {}).get("kernel")
    return None


def _blame(report: Dict[str, Any]) -> str:
    """Node, op and source line of the first divergence, or the flow's one-line detail."""
    fd = report.get("first_divergence") or {}
    if fd.get("node"):
        where = f"{fd.get('graph')}/{fd.get('stage')}"
        return f"{fd['node']} {fd.get('op')} @ {_short_source(fd.get('source'))} [{where}]"
    finding = report["findings"][0]
    return f"{finding.get('check')}: {_one_line(str(finding.get('detail') or 'no details'))}"


def _short_source(source: Optional[str]) -> str:
    if not source:
        return "<unknown source>"
    source = source.split(" (")[0]
    for anchor in ("site-packages/", str(ROOT) + "/"):
        if anchor in source:
            return source.split(anchor, 1)[1].replace("transformers/models/", "")
    return source


def _crash_cause(stderr: str, rc: int) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Failed|Interrupt|Exit)\b", ln)]
    last = errors[-1] if errors else (lines[-1] if lines else "no output")
    what = f"signal {-rc}" if rc < 0 else f"exit {rc}"
    return f"{what}: {_one_line(last)}"


def _notes(stderr: str) -> List[str]:
    notes = []
    if "no fp64 reference" in stderr:
        notes.append("no fp64 reference (tolerance only)")
    return notes


def _one_line(text: str, width: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


# ---------------------------------------------------------------- cases, table, summary


def plan(families: List[str], modes: List[str], checks: List[str], flows: List[str], backend: str) -> List[Case]:
    cases = []
    for fam in families:
        for mode in modes:
            cases += [Case(fam, mode, chk, backend) for chk in checks]
            if "aot4" in flows:
                cases.append(Case(fam, mode, "aot4", backend))
            if "inject" in flows and real_models.has_relu(fam) and backend == "determ_inductor":
                cases.append(Case(fam, mode, "inject", backend))
    return cases


def table(rows: List[Row]) -> str:
    head = ("architecture", "mode", "check", "verdict", "ok", "root cause (node op @ source [graph/stage])", "seconds")
    body = [(r.case.family, r.case.mode, "inject-relu" if r.case.injected else r.case.kind, r.verdict,
             "yes" if r.ok else "NO", r.cause + (f"  ({'; '.join(r.notes)})" if r.notes else ""), f"{r.seconds:.1f}")
            for r in rows]
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(b) for b in body])


def summarize(rows: List[Row], seconds: float) -> Dict[str, Any]:
    healthy = [r for r in rows if not r.case.injected]
    injected = [r for r in rows if r.case.injected]
    return {"cases": len(rows), "seconds": round(seconds, 1),
            "clean": sum(r.verdict == "clean" for r in healthy),
            "nondeterministic": sum(r.verdict == "nondeterministic" for r in healthy),
            "false_divergences": sum(r.verdict == "divergent" for r in healthy),
            "checker_errors": sum(r.verdict == "checker-error" for r in rows),
            "crashes": sum(r.verdict == "crash" for r in rows), "timeouts": sum(r.verdict == "timeout" for r in rows),
            "injected": len(injected), "injected_found_at_relu": sum(bool(r.found_relu) for r in injected)}


def summary_line(s: Dict[str, Any]) -> str:
    return (f"summary: {s['cases']} cases in {s['seconds']:.0f} s: {s['clean']} clean, "
            f"{s['nondeterministic']} truly nondeterministic (confirmed without determ), "
            f"{s['false_divergences']} false divergences, {s['checker_errors']} checker errors, "
            f"{s['crashes']} crashes, {s['timeouts']} timeouts; "
            f"injected relu bugs found at relu: {s['injected_found_at_relu']}/{s['injected']}")


def _csv(value: str, allowed, what: str) -> List[str]:
    items = [x.strip() for x in value.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(bad)}; expected some of: {', '.join(allowed)}")
    return items


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="Families: " + ", ".join(real_models.FAMILIES) + ".")
    p.add_argument("--families", type=lambda v: _csv(v, real_models.FAMILIES, "family"),
                   help="comma-separated families (default: all; with --quick: " + ",".join(QUICK_FAMILIES) + ")")
    p.add_argument("--modes", type=lambda v: _csv(v, MODES, "mode"),
                   help="eval (no-grad forward) and/or train (forward, backward, SGD step); default eval,train "
                        "(with --quick: eval)")
    p.add_argument("--checks", type=lambda v: _csv(v, CHECKS, "check"), default=list(CHECKS),
                   help="DETERM_CHECK values to run, one case each (default: determinism,accuracy; '' for none)")
    p.add_argument("--flows", type=lambda v: _csv(v, FLOWS, "flow"), default=list(FLOWS),
                   help="aot4: REPRO_AFTER=aot REPRO_LEVEL=4 on the healthy model; inject: inductor's injected relu "
                        "bug on relu families (determ_inductor only) (default: aot4,inject; '' for none)")
    p.add_argument("--backend", choices=BACKENDS, default="determ_inductor",
                   help="compile backend (default: %(default)s)")
    p.add_argument("--jobs", type=int, default=1, help="cases run in parallel, each its own process (default: 1)")
    p.add_argument("--timeout", type=float, default=900, help="seconds before a case is killed (default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("determ_out/corpus"),
                   help="output directory: one sub-directory per case and results.json (default: %(default)s)")
    p.add_argument("--cache-dir", type=Path,
                   help="TORCHINDUCTOR_CACHE_DIR shared by all cases (default: $TORCHINDUCTOR_CACHE_DIR, else "
                        "<out>/inductor_cache)")
    p.add_argument("--minify", action="store_true", help="let a level-4 divergence minify (DETERM_MINIFY=1; slow)")
    p.add_argument("--quick", action="store_true", help="3 families (" + ", ".join(QUICK_FAMILIES) + "), eval only")
    p.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case (JSON spec) in this process
    args = p.parse_args(argv)
    if args.jobs < 1 or args.timeout <= 0:
        p.error("--jobs must be >= 1 and --timeout > 0")
    if args.families is None:
        args.families = list(QUICK_FAMILIES if args.quick else real_models.FAMILIES)
    args.modes = args.modes if args.modes is not None else (["eval"] if args.quick else list(MODES))
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.case:
        return run_case(json.loads(args.case))
    logging.basicConfig(level=logging.INFO, format="corpus: %(message)s", stream=sys.stderr)
    try:
        cases, out, cache_dir = prepare(args)
    except UsageError as e:
        print(f"corpus: {e}", file=sys.stderr)
        return 2
    log.info("%d cases on %s, %d at a time; output in %s, inductor cache in %s",
             len(cases), args.backend, args.jobs, out, cache_dir)
    t0 = time.monotonic()
    launcher = Launcher(out, cache_dir, args.timeout, args.minify)
    signal.signal(signal.SIGTERM, _interrupt)  # cases run in sessions of their own: stop them on SIGTERM too
    try:
        rows = run_all(cases, launcher, args.jobs)
    except KeyboardInterrupt:
        launcher.kill_all()
        print("corpus: interrupted; running cases killed", file=sys.stderr)
        return 130
    rows.sort(key=lambda r: cases.index(r.case))
    summary = summarize(rows, time.monotonic() - t0)
    write_results(out / "results.json", args.backend, summary, rows)
    print(table(rows))
    print(summary_line(summary))
    bad = summary["false_divergences"] + summary["checker_errors"] + summary["crashes"] + summary["timeouts"]
    return 0 if bad == 0 and summary["injected_found_at_relu"] == summary["injected"] else 1


class UsageError(Exception):
    """Bad options or an unusable output directory (exit 2)."""


def prepare(args: argparse.Namespace):
    """The cases to run, the output directory (created) and the shared inductor cache directory."""
    if not real_models.available():
        raise UsageError("transformers is not installed (pip install -e '.[test]')")
    cases = plan(args.families, args.modes, args.checks, args.flows, args.backend)
    if "inject" in args.flows and args.backend != "determ_inductor":
        log.info("inject: skipped (inductor's injected relu bug needs --backend determ_inductor)")
    if not cases:
        raise UsageError("nothing to run (no check, flow or family selected)")
    out = args.out.resolve()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {args.out}: cannot create it ({e.strerror})") from None
    foreign = [c.name for c in cases if (out / c.name).exists() and not (out / c.name / MARKER).exists()]
    if foreign:
        raise UsageError(f"{out / foreign[0]} exists and is not a corpus case directory; choose another --out")
    cache_dir = args.cache_dir or Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or out / "inductor_cache")
    return cases, out, cache_dir.resolve()


def write_results(path: Path, backend: str, summary: Dict[str, Any], rows: List[Row]) -> None:
    """Every row, machine-readable (``results.json``)."""
    data = {"backend": backend, "summary": summary,
            "rows": [{**asdict(r.case), "name": r.case.name, "verdict": r.verdict, "ok": r.ok, "cause": r.cause,
                      "found_relu": r.found_relu, "notes": r.notes, "seconds": round(r.seconds, 1),
                      "first_divergence": (r.report or {}).get("first_divergence")} for r in rows]}
    path.write_text(json.dumps(data, indent=2) + "\n")


def run_all(cases: List[Case], launcher: Launcher, jobs: int) -> List[Row]:
    """Run every case, ``jobs`` at a time, with a progress bar on stderr; on an interrupt, kill them all."""
    from tqdm import tqdm

    rows: List[Row] = []
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        with tqdm(total=len(cases), file=sys.stderr, unit="case", dynamic_ncols=True) as bar:
            futures = {pool.submit(launcher.run, c): c for c in cases}
            for fut in as_completed(futures):
                row = _row_of(fut, futures[fut])
                rows.append(row)
                bar.set_postfix_str(f"{row.case.name}: {row.verdict}")
                bar.update()
                if not row.ok:
                    tqdm.write(f"corpus: {row.case.name}: {row.verdict} {row.cause}", file=sys.stderr)
    except BaseException:
        launcher.kill_all()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()
    return rows


def _row_of(fut, case: Case) -> Row:
    try:
        return fut.result()
    except KeyboardInterrupt:
        raise
    except Exception:  # a bug in the runner itself: that case is a crash row, the rest go on
        return Row(case, "crash", 0.0, cause="corpus runner: " + _one_line(traceback.format_exc().splitlines()[-1]))


if __name__ == "__main__":
    sys.exit(main())
