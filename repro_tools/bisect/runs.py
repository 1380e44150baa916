"""Running the user's command for the bisector: one run per question, failure detection.

:class:`CommandRunner` runs the command in a subprocess with the environment that
selects a stage and a knob, and answers "does it still fail?":

* the stage: ``DETERM_BISECT_STAGE=<stage>`` plus ``TORCH_BISECT_BACKEND=determ_inductor``.
  Torch's ``torch.compile`` swaps every backend for the one ``TORCH_BISECT_BACKEND``
  names; naming a determ backend keeps the user's determ options and checks in
  place (a plain ``inductor``/``aot_eager`` script is bisected through it too), and
  the determ backend then compiles only up to the stage;
* the knob: ``TORCH_BISECT_SUBSYSTEM`` and the run-state files of torch's
  ``CompilerBisector`` in ``<TORCHINDUCTOR_CACHE_DIR>/bisect`` (written through
  :mod:`determ_backend._torch_compat`), which the determ backends scope to the stage;
* failure: a non-zero exit status (also a timeout or a signal) or a determ
  ``report.json`` that says ``divergent``: under the run's ``DETERM_DIR``, or, when
  the script names its own ``options={"dir": ...}``, in the directory named by the
  run's own ``DETERM_RUN_ID`` (looked for up to a few levels below the current
  directory).  ``DETERM_BISECT_DIR`` also carries the run's directory; determ's
  config puts it (and the run id) before the script's ``options``.

Paths handed to the command are absolute (it may change directory).  The command
runs in its own session; a timeout, an interruption, or the command's end kills
the whole process group, so no grandchild outlives its run.  Each run's
stdout/stderr go to ``<workdir>/runs/<n>/``.  The search lives in
:mod:`repro_tools.bisect.core`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from determ_backend import _torch_compat as tc

__all__ = ["RunResult", "CommandRunner"]

log = logging.getLogger(__name__)

_BISECT_ENV = ("TORCH_BISECT_BACKEND", "TORCH_BISECT_SUBSYSTEM", "TORCH_BISECT_MAX", "DETERM_BISECT_STAGE",
               "TORCH_COMPILE_BACKEND", "TORCH_COMPILE_DISABLE", "DETERM_RUN_ID", "DETERM_BISECT_DIR")
_SEARCH_DEPTH = 4
"""How many directory levels below the current one a run's ``DETERM_RUN_ID`` directory is looked for."""


@dataclass(frozen=True)
class RunResult:
    failed: bool
    reason: str
    seconds: float
    log_dir: str
    compiled: bool = True
    """The run compiled a graph through the determ backend (it left a trace or a report)."""


def _compiled_any(roots: Sequence[Path]) -> bool:
    return any(next(root.rglob(name), None) is not None for root in roots for name in ("trace.jsonl", "report.json"))


def _report_failure(roots: Sequence[Path]) -> Optional[str]:
    """A one-line description of the first divergence any determ report under ``roots`` found."""
    for root in roots:
        for path in sorted(root.rglob("report.json")):
            try:
                report = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue  # a report being rewritten by a dying process is not evidence either way
            if isinstance(report, dict) and report.get("divergent"):
                fd = report.get("first_divergence") or {}
                return f"determ {fd.get('check', 'check')} divergence at {fd.get('node')} ({fd.get('op')})"
    return None


def _run_id_dirs(root: Path, run_id: str) -> List[Path]:
    """Directories named ``run_id`` at most :data:`_SEARCH_DEPTH` levels below ``root``."""
    out: List[Path] = []
    for depth in range(_SEARCH_DEPTH + 1):
        out += [p for p in root.glob("/".join(["*"] * depth + [run_id])) if p.is_dir()]
    return out


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the command's process group (it leads its own session): its grandchildren too."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is already gone
        pass
    proc.wait()


class CommandRunner:
    """Runs ``command`` once per question; ``runs`` and ``seconds`` count everything spent."""

    def __init__(self, command: Sequence[str], workdir: Path, timeout: Optional[float] = None,
                 progress: Any = None):
        self.command = list(command)
        self.workdir = Path(workdir).resolve()  # the command may change directory
        self.cache = self.workdir / "inductor_cache"
        self.timeout = timeout
        self.progress = progress
        self.runs = 0
        self.seconds = 0.0
        self.history: List[Dict[str, Any]] = []

    # ------------------------------------------------------------------ knob state
    def prepare(self, stage: str, subsystem: str, run_state: str, bounds: Optional[Tuple[int, int]] = None,
                config: Optional[Dict[str, Any]] = None) -> None:
        """Write the files torch's bisector reads in the next run (run state, range, config)."""
        tc.bisector_write_state(str(self.cache), stage, subsystem, run_state, bounds=bounds, config=config)

    def bounds(self, stage: str, subsystem: str) -> Optional[Tuple[int, int]]:
        return tc.bisector_read_bounds(str(self.cache), stage, subsystem)

    def debug_info(self, stage: str, subsystem: str, index: int) -> Optional[str]:
        return tc.bisector_debug_info(str(self.cache), stage, subsystem, index)

    # ------------------------------------------------------------------ running
    def _env(self, stage: Optional[str], subsystem: Optional[str], run_dir: Path) -> Dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _BISECT_ENV}
        out = str(run_dir / "determ_out")
        env.update(TORCHINDUCTOR_CACHE_DIR=str(self.cache), DETERM_DIR=out, DETERM_BISECT_DIR=out,
                   DETERM_RUN_ID=self._run_id(run_dir))
        if stage is None:
            env["TORCH_COMPILE_DISABLE"] = "1"
        else:
            env.update(DETERM_BISECT_STAGE=stage, TORCH_BISECT_BACKEND="determ_inductor")
        if subsystem:
            env["TORCH_BISECT_SUBSYSTEM"] = subsystem
        return env

    @staticmethod
    def _run_id(run_dir: Path) -> str:
        return f"bisect-{os.getpid()}-{run_dir.name}"

    def _execute(self, env: Dict[str, str], run_dir: Path) -> Optional[int]:
        """Run the command in its own session; its exit status, None on timeout.  The group dies with it."""
        with open(run_dir / "stdout.txt", "wb") as out, open(run_dir / "stderr.txt", "wb") as err:
            proc = subprocess.Popen(self.command, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
            try:
                code: Optional[int] = proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                code = None
            finally:  # also on Ctrl-C: nothing the command started outlives its run
                _kill_group(proc)
        return code

    def run(self, stage: Optional[str], subsystem: Optional[str] = None, what: str = "") -> RunResult:
        """Run the command under ``stage`` (and ``subsystem``'s prepared state); did it fail?  ``stage``
        None: with ``torch.compile`` disabled (``TORCH_COMPILE_DISABLE=1``)."""
        run_dir = self.workdir / "runs" / f"{self.runs:03d}"
        run_dir.mkdir(parents=True, exist_ok=True)
        label = (stage or "without torch.compile") + (f" {what}" if what else "")
        if self.progress is not None:
            self.progress.set_postfix_str(label, refresh=True)
        t0 = time.perf_counter()
        code = self._execute(self._env(stage, subsystem, run_dir), run_dir)
        seconds = time.perf_counter() - t0
        if code is None:
            reason = f"timed out after {self.timeout:g} s"
        elif code != 0:
            reason = f"exit status {code}" if code > 0 else f"killed by signal {-code}"
        roots = [run_dir] + _run_id_dirs(Path.cwd(), self._run_id(run_dir))
        if code == 0:
            reason = _report_failure(roots) or ""
        result = RunResult(failed=bool(reason), reason=reason or "passes", seconds=seconds, log_dir=str(run_dir),
                           compiled=stage is not None and _compiled_any(roots))
        self.runs += 1
        self.seconds += seconds
        self.history.append({"run": self.runs, "stage": stage, "knob": what or None, "failed": result.failed,
                             "reason": result.reason, "seconds": round(seconds, 2)})
        log.info("run %d: %s: %s (%.1f s)", self.runs, label, "FAILS, " + reason if reason else "passes", seconds)
        if self.progress is not None:
            self.progress.update(1)
        return result

    def stderr_tail(self, result: RunResult, lines: int = 5) -> str:
        try:
            text = (Path(result.log_dir) / "stderr.txt").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])
