"""What the repro flows do once a graph fails: dump, minify, copy, summarize.

Shared by :mod:`repro_tools.flows.after_dynamo` and :mod:`repro_tools.flows.after_aot`
(which decide *when* a graph failed, per ``REPRO_LEVEL``).  A :class:`GraphDump`
owns one failing graph's directory ``<DETERM_DIR>/<run id>/repro/<after>-<n>/``:
``repro.py`` (level 1) or ``minifier_launcher.py`` (levels 2-4; level 3 writes it
before compiling), the minifier's checkpoints and minimal result under
``minify/``; nothing there is ever overwritten.  The final ``repro.py`` is also
copied to the working directory (a different ``./repro.py`` already there is kept
as ``repro.prev-N.py``) and its path is the last line of the stderr summary.
Level 4 minifies in this process, except inside a compile's fake tensor mode
(a compile error after AOT), where it runs in a process of its own as level 3 does.

The flows must never break the user's program: a failure of their own machinery
(copying or dumping the graph, writing the launcher, minifying) is
:func:`report_flow_error`: a checker error in ``report.json`` and one line on
stderr, after which the model goes on as the wrapped compiler would.
:func:`graph_snapshot` (:mod:`determ_backend.backends.extract`) is the flows' copy of a graph: its structure copied, its
tensors shared, so taking it creates no tensor (safe under AOT's fake mode).

:func:`minify_script` is what a launcher's ``minify`` subcommand runs: it checks
that the script fails here and how (one ``run`` in a child process; skipped when
the flows saw it fail), runs the minifier (:func:`repro_tools.minify.minifier.minify_repro`,
through the ``minify`` command's own option parser and handler,
:mod:`repro_tools.cli.minify`: the same options, output and exit codes as
``repro-tools minify``), and copies the result; when the minifier stops on a failure
the flows saw, the full graph is kept, clearly labelled "not minified".  When the
script being minified is ``./repro.py`` itself, the result goes to
``./repro.min.py`` and the script is left as it is.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from determ_backend import _torch_compat as tc
from determ_backend.config import DetermConfig
from determ_backend.errors import AccuracyError, DetermError, ReproError, first_line
from determ_backend.backends.extract import graph_snapshot
from determ_backend.backends.instrument import written_inputs
from determ_backend.backends.run import get_run
from determ_backend.trace.stream import is_module_place

from repro_tools.cli import configure_logging
from repro_tools.cli import minify as minify_command
from repro_tools.minify.subgraph import source_line
from repro_tools.repro.script import capture_compile_config, copy_repro, read_meta, write_repro

__all__ = ["GraphDump", "graph_snapshot", "report_flow_error", "minify_script", "print_summary", "LAUNCHER", "REPRO"]

log = logging.getLogger(__name__)

LAUNCHER = "minifier_launcher.py"
REPRO = "repro.py"
MINIMAL = "repro.min.py"
"""Where ``minify`` copies its result when the script being minified is ``./repro.py`` itself."""
_REPRODUCED = re.compile(r"^reproduced (\w+):", re.M)


def _unique_dir(parent: Path, prefix: str) -> Path:
    parent.mkdir(parents=True, exist_ok=True)
    n = 0
    while True:
        d = parent / f"{prefix}-{n}"
        try:
            d.mkdir()
            return d
        except FileExistsError:
            n += 1


def print_summary(title: str, lines: Sequence[str], final: Optional[Path]) -> None:
    """A short block on stderr; the last line is the path to act on."""
    out = [f"determ repro: {title}"] + [f"  {ln}" for ln in lines]
    if final is not None:
        out.append(str(final))
    print("\n".join(out), file=sys.stderr, flush=True)


_KEEP_BYTES = 256 << 20  # inputs a graph writes in place, kept per call for a runtime error's dump up to this size


class InputsBefore:
    """The values of the inputs a graph writes in place (:func:`~determ_backend.backends.instrument.written_inputs`),
    kept before each call, so a runtime error is dumped with the inputs the program passed, not with what the failing
    call had already written into them (``x.mul_(2)`` before the kernel that raised: the repro doubled ``x`` again).
    Kept up to ``_KEEP_BYTES`` a call; past it the dump says its written inputs hold what the failing call left."""

    def __init__(self, gm: fx.GraphModule):
        try:
            written = set(written_inputs(gm))
            self.positions = [i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")
                              if n.name in written]
        except Exception:  # a graph this cannot read: its inputs are dumped as the call leaves them
            self.positions = []

    def keep(self, args: Sequence[Any]) -> Dict[int, Any]:
        """The written inputs' values now (``{position: copy}``); empty when they are too large to copy."""
        held = [i for i in self.positions if i < len(args) and isinstance(args[i], torch.Tensor)]
        if not held or sum(args[i].numel() * args[i].element_size() for i in held) > _KEEP_BYTES:
            return {}
        with torch.no_grad():
            return {i: args[i].detach().clone() for i in held}

    def restore(self, args: Sequence[Any], kept: Dict[int, Any], dump: "GraphDump") -> List[Any]:
        """``args`` with the kept values in place of what the call wrote; the dump notes written inputs not kept."""
        out = list(args)
        for i, v in kept.items():
            out[i] = v
        lost = [i for i in self.positions if i < len(args) and i not in kept and isinstance(args[i], torch.Tensor)]
        if lost:
            dump.extra_meta["inputs_note"] = (f"inputs {lost} are written in place by the graph and were too large to "
                                              f"keep: they hold what the failing call left in them")
        return out


def to_working_dir(src: Path, name: Optional[str] = None) -> Tuple[Path, str]:
    """``src`` copied into the working directory as ``name`` (default ``repro.py``): ``(the copy, "copied to the
    working directory:")``; when the working directory cannot be written (read-only, full), ``(src, why)``: the
    repro written under the run directory is the one to act on, and the flow's work is not called failed."""
    try:
        return copy_repro(src, Path.cwd() / (name or REPRO)), "copied to the working directory:"
    except OSError as e:
        return src, f"not copied to the working directory ({type(e).__name__}: {e.strerror or e}); the repro:"


def report_flow_error(config: DetermConfig, after: str, what: str, error: BaseException) -> None:
    """A failure of the flows' own machinery: a checker error in the run's ``report.json`` and one line
    on stderr (the traceback at debug level).  Never raises: the user's program goes on."""
    log.debug("determ repro (after %s): %s", after, what, exc_info=error)
    message = " ".join(f"{what} raised {type(error).__name__}: {error}".split())[:1000]
    try:
        get_run(config).add_checker_error(f"repro (after {after})", message)
    except Exception as e:  # no run directory to report in: the line on stderr is all there is
        log.error("determ repro (after %s) could not run: %s (not recorded in report.json: %s)", after, message,
                  " ".join(str(e).split())[:300])


_ERROR_CHARS = 4000


def _error_text(text: str) -> str:
    """An error's text for a repro's metadata, at most about ``_ERROR_CHARS``: its ``error`` lines first (a C++
    compile error is a few lines among pages of compiler warnings), then its end."""
    if len(text) <= _ERROR_CHARS:
        return text
    errors = [line for line in text.splitlines() if "error" in line.lower()]
    head = "\n".join(errors)[: _ERROR_CHARS // 2]
    return f"{head}\n...\n{text[-(_ERROR_CHARS - len(head)):]}"


class GraphDump:
    """One intercepted graph's dumps: its directory, its launcher/repro, minification, the summary."""

    def __init__(self, config: DetermConfig, after: str, compiler: str, gm: fx.GraphModule,
                 extra_meta: Optional[Dict[str, Any]] = None):
        self.config, self.after, self.compiler, self.gm = config, after, compiler, gm
        self.compile_config = capture_compile_config()  # at compile time, not at dump time
        self.extra_meta = dict(extra_meta or {})
        self._dir: Optional[Path] = None
        self.failed = False

    def with_graph(self, gm: fx.GraphModule, extra_meta: Dict[str, Any]) -> "GraphDump":
        """The dumps of ``gm``, a graph made from this one (its random draws as inputs), with this one's settings
        and compile-time config, and ``extra_meta`` added to its repros' metadata."""
        other = copy.copy(self)
        other.gm, other.extra_meta, other._dir, other.failed = gm, {**self.extra_meta, **extra_meta}, None, False
        return other

    @property
    def dir(self) -> Path:
        if self._dir is None:
            self._dir = _unique_dir(get_run(self.config).dir / "repro", self.after)
        return self._dir

    def meta(self, kind: str, error: Optional[BaseException] = None, launcher: bool = False) -> Dict[str, Any]:
        m = {"kind": kind, "compiler": self.compiler, "after": self.after, "config": self.compile_config,
             "launcher": launcher, "repro_level": self.config.repro_level, "tol": self.config.tol,
             "multiplier": self.config.fp64_multiplier, "strict": self.config.strict}
        if error is not None:
            m["error"] = _error_text("".join(traceback.format_exception(type(error), error, error.__traceback__)))
        m.update(self.extra_meta)
        return m

    def write(self, name: str, inputs: Sequence[Any], kind: str, error: Optional[BaseException] = None,
              launcher: bool = False) -> Path:
        path = self.dir / name
        if path.exists():
            path = self.dir / f"{path.stem}-{len(list(self.dir.glob(path.stem + '*.py')))}.py"
        with tc.real_tensors():  # the graph's constants are real; under AOT's fake mode, reading them would fail
            return write_repro(self.gm, list(inputs), path, meta=self.meta(kind, error, launcher))

    def launcher_before_compile(self, inputs: Sequence[Any]) -> Optional[Path]:
        """Level 3: the launcher, written before compiling (None, reported, when it cannot be written)."""
        try:
            return self.write(LAUNCHER, inputs, "any", launcher=True)
        except Exception as e:
            report_flow_error(self.config, self.after, "writing the minifier launcher before compiling", e)
            return None

    def on_failure(self, kind: str, inputs: Sequence[Any], error: Optional[BaseException] = None,
                   launcher: Optional[Path] = None, detail: str = "") -> Optional[Path]:
        """Dump (and minify, per level) a graph's first failure; returns the final repro (or launcher) path.

        A failure to dump or minify is a checker error (:func:`report_flow_error`), never raised, so the
        caller can go on with the original error or result.  Dynamo's own control flow (a restart of its analysis,
        a frame to skip) raised through the compiler is no failure: nothing is recorded."""
        if self.failed or (error is not None and tc.is_dynamo_control_flow(error)):
            return None
        self.failed = True
        finding = None
        if kind != "accuracy":  # (an accuracy failure is recorded with its detail by act_on_accuracy)
            finding = self._record_failure(kind, error)  # first: the summary below ends with the repro's path
        try:
            path = self._on_failure(kind, inputs, error, launcher, detail)
        except Exception as e:  # never replaces the user's error
            report_flow_error(self.config, self.after, f"dumping or minifying the failing graph ({kind})", e)
            return None
        if finding is not None:  # the dump, and the node the minifier narrowed the error to
            try:
                get_run(self.config).amend_finding(finding, {"repro": str(self.dir), **_minified(self.dir)})
            except Exception as e:
                report_flow_error(self.config, self.after, f"recording the minified {kind} in report.json", e)
        return path

    def _record_failure(self, kind: str, error: Optional[BaseException]) -> Optional[Dict[str, Any]]:
        """A compile or runtime error in ``report.json`` as a finding of check ``repro <kind>``: the run failed, and
        ``repro-tools report`` must not call it clean.  The user's own error follows, never this one."""
        first = f"{type(error).__name__}: {first_line(error)}" if error is not None else kind
        try:
            return get_run(self.config).add_finding(f"repro {kind}", {"divergent": True, "detail": first})
        except AccuracyError:  # DETERM_RAISE: the program raises its own error next
            pass
        except Exception as e:
            report_flow_error(self.config, self.after, f"recording the {kind} in report.json", e)
        return None

    def _on_failure(self, kind: str, inputs: Sequence[Any], error: Optional[BaseException],
                    launcher: Optional[Path], detail: str) -> Optional[Path]:
        level = self.config.repro_level
        what = f"{kind} in a graph compiled with {self.compiler!r} (after {self.after}, level {level})"
        # one line: a C++ compile error holds the command line and the compiler's output after its first
        lines = [detail or (f"{type(error).__name__}: {first_line(error)}" if error else kind)]
        if level == 1:
            path = self.write(REPRO, inputs, kind, error)
            final, where = to_working_dir(path)
            print_summary(what, lines + [f"repro: {path}", where], final)
            return final
        if launcher is None or level != 3:
            launcher = self.write(LAUNCHER, inputs, kind, error, launcher=True)
        if level == 2 or (level == 4 and not self.config.minify):
            hint = "DETERM_MINIFY=0: not minified; " if level == 4 else ""
            print_summary(what, lines + [f"{hint}run the launcher to minify: python {launcher}"], launcher)
            return launcher
        print_summary(what, lines + [f"launcher: {launcher}", "minifying ..."], None)
        if level == 3 or _tensors_made_here_are_fake():
            rc = subprocess.run([sys.executable, str(launcher), "minify", "--kind", kind, "--known-failure"],
                                stdout=_stderr_fd()).returncode
            where = "in a process of its own"
        else:
            with contextlib.redirect_stdout(sys.stderr):  # the program's stdout is not ours to write to
                rc = minify_script(launcher, ["--kind", kind, "--known-failure", "--in-process"], own_process=False)
            where = "in this process"
        if rc != 1:
            raise ReproError(f"minifying {launcher} {where} ended with exit status {rc} (see above); "
                             f"the launcher is kept: python {launcher}")
        # the minifier copied its result into the working directory, unless it cannot be written there
        return Path.cwd() / REPRO if os.access(Path.cwd(), os.W_OK) else launcher


_SOURCE_LINE = re.compile(r"^(.*?:\d+)(?::\s|$)")


def _minified(dump_dir: Path) -> Dict[str, Any]:
    """What the minifier found for the failing graph dumped in ``dump_dir`` (its newest summary, when it ran), as
    report fields: ``minified`` (nodes before and after, the minimal repro) and, when it localized the failure
    to one node or shrank the graph to one op, ``first_divergence`` naming that node."""
    from repro_tools.minify.minifier import SUMMARY_FILE

    found = sorted(Path(dump_dir).glob(f"minify*/{SUMMARY_FILE}"), key=lambda f: f.stat().st_mtime)
    try:
        s = json.loads(found[-1].read_text(encoding="utf-8")) if found else {}
    except (OSError, ValueError):
        return {}
    if not isinstance(s, dict) or not s:
        return {}
    out: Dict[str, Any] = {"minified": {k: s.get(k) for k in ("nodes_before", "nodes_after", "localized", "repro_path")}}
    culprit = s.get("culprit") or {}
    if (s.get("localized") or s.get("ops_after") == 1) and culprit.get("node"):  # one op left: it fails alone
        src = culprit.get("source") or ""
        m = _SOURCE_LINE.match(src)
        out["first_divergence"] = {"node": culprit["node"], "op": culprit.get("op"),
                                   "source": m.group(1) if m else (src if is_module_place(src) else None),
                                   "metrics": {}}
    return out


def _tensors_made_here_are_fake() -> bool:
    """Whether a fake tensor mode is active here, as it is while AOTAutograd hands a graph to its compiler:
    every tensor made in this process (the launcher's inputs, the minifier's values) would then be fake,
    so the minifier must run in a process of its own."""
    return tc.is_fake_tensor(torch.empty(0))


def _stderr_fd() -> Optional[int]:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a replaced stderr without a file descriptor
        return None


def _detect_kind(path: Path, timeout: float, flags: Sequence[str] = ()) -> Optional[str]:
    """How the script fails (None: it does not): ``python script run [flags]`` in a child process
    (isolated, so a crash is seen)."""
    try:
        proc = subprocess.run([sys.executable, str(path), "run", *flags], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return "hang"
    m = _REPRODUCED.search(proc.stdout)
    if proc.returncode == 2:
        raise ReproError(f"{path}: cannot run it ({proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''})")
    return m.group(1) if m else None


_RUN_CANNOT_CHECK = frozenset({"--compiler", "--config", "--devices", "--similarity"})
"""Minify options a script's own ``run`` cannot apply: with them, the minifier alone checks the failure."""


def _run_flags(kind: str, argv: Sequence[str]) -> List[str]:
    """``run`` flags checking for ``kind`` as ``minify`` would (its ``--tol``/``--strict``)."""
    flags = [] if kind in ("any", "error") else ["--kind", kind]
    if "--tol" in argv and argv.index("--tol") + 1 < len(argv):
        flags += ["--tol", argv[argv.index("--tol") + 1]]
    return flags + (["--strict"] if "--strict" in argv else [])


def _pop_option(argv: List[str], name: str) -> Optional[str]:
    if name in argv:
        i = argv.index(name)
        value = argv[i + 1] if i + 1 < len(argv) else None
        del argv[i:i + 2]
        return value
    return None


def minify_script(path: Path, argv: Sequence[str] = (), own_process: bool = True) -> int:
    """Minify a repro/launcher script; the minimal ``repro.py`` goes under ``<script dir>/minify*/`` and to the
    cwd (as ``repro.min.py`` when the script is ``./repro.py``: the source is never overwritten).
    ``own_process``: the process is the command's own (a script's ``minify``), so its logging is set up as the
    command line's; inside the user's program (the level-4 flows) the program's logging is left as it is.

    Exit code: 1 when a minimal repro was written (the failure reproduces), 0 when the script does not
    fail here (nothing is written), 2 for bad input.
    """
    path = Path(path).resolve()
    argv = list(argv)
    known = "--known-failure" in argv  # the flows saw it fail: keep the full graph if minifying stops
    argv = [a for a in argv if a != "--known-failure"]
    meta = read_meta(path)
    kind = _pop_option(argv, "--kind") or meta.get("kind", "any")
    if not known and not _RUN_CANNOT_CHECK.intersection(argv):
        found = _detect_kind(path, float(meta.get("timeout", 300)), _run_flags(kind, argv))
        if found is None:
            print_summary(f"{path.name} does not fail here ({kind}): nothing to minify", [], None)
            return 0
        kind = found if kind == "any" else kind
    given = _pop_option(argv, "--out")
    out = Path(given or _unique_dir(path.parent, "minify"))
    rc = _minify(path, out, kind, argv, own_process)
    minimal = out / "minimal" / REPRO
    if rc != 1 or not minimal.is_file():
        if not given and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # ours, and the minifier left nothing in it
        if not known or rc >= 128:  # an interrupted minifier is not a reason to hand out the full graph
            return rc
        return _not_minified(path, out, kind, f"the minifier stopped (exit {rc}; see above)")
    if _is_cwd_repro(path):  # never over the script being minified: it may be the only full copy
        final, where = to_working_dir(minimal, MINIMAL)
        if final != minimal:
            where = f"copied to the working directory (./{REPRO} is the original, kept):"
    else:
        final, where = to_working_dir(minimal)
    print_summary(f"minimal repro of {kind} ({path.name})",
                  [f"original: {path}", f"checkpoints: {out / 'checkpoints'}", f"minimal: {minimal}", where], final)
    return 1


def _minify(path: Path, out: Path, kind: str, argv: List[str], own_process: bool = True) -> int:
    """The minifier on ``path`` with ``repro-tools minify``'s options ``argv``: parsed by that command's
    parser, run by its handler (:func:`repro_tools.minify.minifier.minify_repro`, the summary, Ctrl-C and
    SIGTERM handling), its errors reported as the command line does; its exit code."""
    if own_process:  # never the user's root logger: it set its own levels and handlers, or chose none
        configure_logging()
    try:
        return minify_command.run(minify_command.parse_args([str(path), "--kind", kind, "--out", str(out)] + argv))
    except SystemExit as e:  # argparse: a usage error (2), or --help (0)
        return int(e.code or 0)
    except DetermError as e:
        print(f"repro-tools minify: error: {e}", file=sys.stderr)
        return 2


def _is_cwd_repro(path: Path) -> bool:
    """Whether ``path`` is ``./repro.py`` (where results are copied)."""
    cwd_repro = Path.cwd() / REPRO
    return cwd_repro.exists() and Path(path).exists() and os.path.samefile(cwd_repro, path)


def _not_minified(path: Path, out: Path, kind: str, why: str) -> int:
    """The full failing graph as the repro, labelled "not minified"."""
    log.warning("%s: not minified (%s); the repro is the full failing graph", path, why)
    out.mkdir(parents=True, exist_ok=True)
    full = copy_repro(path, out / REPRO, {"launcher": False, "minified": False, "kind": kind})
    if _is_cwd_repro(path):  # ./repro.py already is the full graph: left as it is
        print_summary(f"repro of {kind} ({path.name}), NOT minified: {why}",
                      [f"original (unchanged): {path}", "repro:"], full)
        return 1
    final, where = to_working_dir(full)
    print_summary(f"repro of {kind} ({path.name}), NOT minified: {why}",
                  [f"original: {path}", f"repro: {full}", where], final)
    return 1


def act_on_accuracy(result, cfg: DetermConfig, dump: "GraphDump", inputs: List[Any], check: str, what: str) -> None:
    """What the level-4 flows do with a ``same_two_models`` result: nothing when the same; a checker
    error is reported (never taken for a divergence); an error of the compiled graph and a divergence
    are dumped and raised."""
    if result.status not in ("not_judged", "checker_error"):  # it judged this graph: a check that ran
        get_run(cfg).add_flow_check(check)
    if result.status == "same":
        return
    if result.status == "checker_error":
        get_run(cfg).add_checker_error(check, result.detail)
        return
    if result.status == "not_judged":  # no verdict either way: say so where the user looks, and go on
        first = next(filter(None, map(source_line, dump.gm.graph.nodes)), None)
        what = f"{what} starting at {first.split(': ')[0]}" if first else what  # which of the graphs
        log.warning("determ %s: %s not checked: %s", check, what, result.detail)
        get_run(cfg).add_skip(check, f"{what}: {result.detail}")
        return
    if result.status == "compiled_error":
        dump.on_failure("runtime_error", inputs, result.error)
        raise result.error
    dump.on_failure("accuracy", inputs, detail=f"AccuracyError: {result.detail}")
    get_run(cfg).add_finding(check, {"divergent": True, "detail": result.detail, "repro": str(dump.dir),
                                     **_minified(dump.dir)})
    raise AccuracyError(f"{what} is less accurate than eager against fp64: {result.detail}; dumps in {dump.dir}")

