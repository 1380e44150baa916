"""Oracle queries in a persistent worker process: crash- and hang-proof, torch imported once.

:class:`Worker` (the parent side) starts ``python -m repro_tools.minify.isolate`` once and
reuses it for every query; a query that kills the worker (segfault, ``abort``)
or outlives its timeout is answered from the outside (``crash`` / ``hang``) and
the worker is restarted for the next one.  The worker dies with its parent (Linux
``PR_SET_PDEATHSIG``, plus a parent-pid watchdog elsewhere), so a killed minifier
leaves no worker behind.  Candidates travel as files, never
pickles: the graph as Python source and the values as safetensors files of the one
tensor store (:mod:`repro_tools.repro.graph_code`); requests and
answers are JSON lines on the worker's stdin and a private copy of its stdout
(the worker's own prints go to its log).

For an inductor accuracy oracle, :meth:`Worker.check_observed` also brings back the
values of the buffers inductor materialized during the check's own compile (as
:func:`repro_tools.minify.oracles.check_observed` does in-process), so the minifier can
localize from them in the isolated mode too.  The worker re-traces the graph it
receives, which renames its nodes; values travel keyed by the position of their
node among the compute nodes, and the parent maps them back to its own names
after checking that both graphs list the same ops.

Judging itself lives in :mod:`repro_tools.minify.oracles`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from determ_backend.config import FLOW_VARIABLES
from determ_backend.errors import OracleError

from repro_tools.minify import oracles
from repro_tools.repro.graph_code import load_tensors, read_graph_dir, save_tensors, write_graph_dir
from repro_tools.minify.inductor_values import SUPPORTED
from repro_tools.minify.oracles import OracleSpec, Signature, Verdict
from repro_tools.minify.subgraph import COMPUTE_OPS, record_values, target_name

__all__ = ["Worker", "serve"]

log = logging.getLogger(__name__)
_STARTUP_TIMEOUT = 180.0
_PR_SET_PDEATHSIG = 1
_WATCH_SECONDS = 1.0
_TMP_PREFIX = "determ_worker_"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _remove_orphaned_tmp() -> None:
    """Temporary directories of earlier workers whose parent was killed outright (SIGKILL: no chance to clean
    up): ``determ_worker_<pid>_*`` of this user whose pid no longer runs."""
    for d in Path(tempfile.gettempdir()).glob(f"{_TMP_PREFIX}*_*"):
        pid = d.name[len(_TMP_PREFIX):].split("_", 1)[0]
        try:
            mine = d.is_dir() and d.stat().st_uid == os.getuid()
        except OSError:
            continue
        if mine and pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def _signal_name(returncode: Optional[int]) -> str:
    if returncode is not None and returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit {returncode}"


class Worker:
    """A persistent oracle worker; ``check``/``observe`` like :class:`repro_tools.minify.oracles.InProcessRunner`."""

    def __init__(self, startup_timeout: float = _STARTUP_TIMEOUT, env: Optional[Dict[str, str]] = None):
        self.startup_timeout = startup_timeout
        self.extra_env = dict(env or {})
        _remove_orphaned_tmp()
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}_"))
        self.proc: Optional[subprocess.Popen] = None
        self._buf = b""
        self.calls = 0
        self.starts = 0
        self._log = None

    # ------------------------------------------------------------ process
    def _env(self) -> Dict[str, str]:
        env = dict(os.environ)
        paths = [p for p in sys.path if p] + [env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        for var in FLOW_VARIABLES:  # a worker checks the compiler alone: no repro flow wrapped around it again
            env.pop(var, None)
        env["OMP_NUM_THREADS"] = str(torch.get_num_threads())  # this process's threads (the program's, or the repro's)
        env.update(self.extra_env)
        return env

    def _start(self) -> None:
        self._log = open(self.tmp / "worker.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "repro_tools.minify.isolate", "--parent", str(os.getpid())],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     env=self._env(), start_new_session=True)
        self._buf = b""
        self.starts += 1
        msg = self._read(self.startup_timeout)
        if not isinstance(msg, dict) or not msg.get("ready"):
            tail = self.log_tail()
            self._kill()
            raise OracleError(f"oracle worker failed to start ({msg}); log tail: {tail}")

    def _kill(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the worker and any compile helpers it started
            except ProcessLookupError:
                pass
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, chars: int = 2000) -> str:
        p = self.tmp / "worker.log"
        return p.read_text(errors="replace")[-chars:] if p.exists() else ""

    def _read(self, timeout: float) -> Any:
        """One JSON line from the worker; ``"timeout"`` or ``"died"`` when there is none."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return "died"
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def close(self) -> None:
        self._kill()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ queries
    def _request(self, op: str, spec: OracleSpec, gm: fx.GraphModule, inputs: Sequence[Any]) -> Any:
        self.calls += 1
        qdir = self.tmp / f"q{self.calls}"
        write_graph_dir(gm, inputs, qdir)
        if self.proc is None or self.proc.poll() is not None:
            self._kill()
            self._start()
        req = {"op": op, "dir": str(qdir), "spec": spec.to_json()}
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        ans = self._read(spec.timeout)
        if ans == "timeout":
            self._kill()
        elif ans == "died":
            code = self.proc.wait()
            ans = {"died": _signal_name(code)}
            self._kill()
        return ans, qdir

    def check(self, spec: OracleSpec, gm: fx.GraphModule, inputs: Sequence[Any]) -> Verdict:
        t0 = time.perf_counter()
        ans, qdir = self._request("check", spec, gm, inputs)
        shutil.rmtree(qdir, ignore_errors=True)
        return self._verdict(spec, ans, time.perf_counter() - t0)

    def _verdict(self, spec: OracleSpec, ans: Any, took: float) -> Verdict:
        if ans == "timeout":
            sig = Signature("hang", "timeout", f"no answer within {spec.timeout:g} s")
            return Verdict(spec.kind == "hang", sig, sig.message, took)
        if "died" in ans:
            sig = Signature("crash", ans["died"], self.log_tail(400))
            same = spec.expected is None or spec.expected.type == sig.type
            return Verdict(spec.kind == "crash" and same, sig, f"worker died: {ans['died']}", took)
        if "error" in ans:
            raise OracleError(f"oracle worker: {ans['error']}")
        v = ans["verdict"]
        sig = Signature(**v["signature"]) if v.get("signature") else None
        return Verdict(v["fails"], sig, v.get("detail", ""), took)

    def check_observed(self, spec: OracleSpec, gm: fx.GraphModule, inputs: Sequence[Any],
                       ref: Dict[str, Any]) -> Tuple[Verdict, Optional[Dict[str, Any]]]:
        """:meth:`check`, plus the compiled values of the nodes inductor materialized (inductor accuracy
        oracles; otherwise None), keyed by ``gm``'s node names.  ``ref`` is not sent: the worker runs
        the graph eagerly itself for the shapes and dtypes to match."""
        if spec.kind != "accuracy" or spec.compiler not in SUPPORTED:
            return self.check(spec, gm, inputs), None
        t0 = time.perf_counter()
        ans, qdir = self._request("check_observed", spec, gm, inputs)
        try:
            v = self._verdict(spec, ans, time.perf_counter() - t0)
            return v, _observed_values(gm, ans, qdir)
        finally:
            shutil.rmtree(qdir, ignore_errors=True)

    def observe(self, spec: OracleSpec, gm: fx.GraphModule, inputs: Sequence[Any]) -> List[List[Any]]:
        ans, qdir = self._request("observe", spec, gm, inputs)
        try:
            if ans == "timeout" or "died" in ans:
                raise OracleError(f"instrumented run did not finish ({ans if ans == 'timeout' else ans['died']})")
            if "error" in ans:
                raise OracleError(f"instrumented run failed: {ans['error']}")
            return load_tensors(qdir / "observed.pt")
        finally:
            shutil.rmtree(qdir, ignore_errors=True)


def _observed_values(gm: fx.GraphModule, ans: Any, qdir: Path) -> Optional[Dict[str, Any]]:
    """The worker's captured values under ``gm``'s node names (None when there are none or the
    re-traced graph does not list the same ops)."""
    if not isinstance(ans, dict) or not ans.get("observed"):
        return None
    compute = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    if [target_name(n) for n in compute] != ans.get("ops"):
        log.info("worker's re-traced graph lists other ops; its captured buffers are not used")
        return None
    return {compute[i].name: v for i, v in zip(ans["observed"], load_tensors(qdir / "observed.pt"))}


# ---------------------------------------------------------------- worker side

def _check_observed(spec: OracleSpec, gm: fx.GraphModule, inputs: List[Any], qdir: Path) -> Dict[str, Any]:
    """Worker side of :meth:`Worker.check_observed`: values saved by compute-node position."""
    ref, _ = record_values(gm, inputs)
    v, values = oracles.check_observed(spec, gm, inputs, ref)
    compute = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    ans: Dict[str, Any] = {"verdict": _verdict_json(v), "ops": [target_name(n) for n in compute]}
    if values:
        pos = [i for i, n in enumerate(compute) if n.name in values]
        save_tensors([values[compute[i].name] for i in pos], qdir / "observed.pt")
        ans["observed"] = pos
    return ans


def _verdict_json(v: Verdict) -> Dict[str, Any]:
    return {"fails": v.fails, "detail": v.detail, "signature": dataclasses.asdict(v.signature) if v.signature else None}


def _handle(req: Dict[str, Any]) -> Dict[str, Any]:
    spec = OracleSpec.from_json(req["spec"])
    gm, inputs, _ = read_graph_dir(req["dir"])
    if req["op"] == "observe":
        sides = oracles.observe(spec, gm, inputs)
        save_tensors(sides, Path(req["dir"]) / "observed.pt")
        return {"ok": True}
    if req["op"] == "check_observed":
        return _check_observed(spec, gm, inputs, Path(req["dir"]))
    if spec.kind in oracles.ISOLATED_ONLY:  # surviving the candidate means it does not crash / hang
        v = oracles.check(spec.replace(kind="error", expected=None), gm, inputs)
        v = Verdict(False, v.signature, f"{spec.kind} did not happen")
    else:
        v = oracles.check(spec, gm, inputs)
    return {"verdict": _verdict_json(v)}


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(_WATCH_SECONDS)
        if os.getppid() != parent:
            os._exit(1)


def _die_with_parent(parent: int) -> None:
    """End this process when ``parent`` ends: the kernel's parent-death signal on Linux, and a thread
    watching the parent pid (other systems, and the moment before the signal was armed)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
                log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d); watching the parent pid only", ctypes.get_errno())
        except (OSError, AttributeError) as e:
            log.warning("prctl unavailable (%s); watching the parent pid only", e)
    if os.getppid() != parent:  # the parent already ended
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="determ-parent-watch").start()


def serve(parent: Optional[int] = None) -> int:
    """The worker loop: one JSON request per stdin line, one JSON answer per line.  ``parent``: the pid
    whose end ends this worker."""
    if parent is not None:
        _die_with_parent(parent)
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything printed by torch or a compiler goes to the log, not the protocol
    sys.stdout = sys.stderr
    proto.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            ans = _handle(json.loads(line))
        except Exception as e:  # reported to the parent, which raises it there
            ans = {"error": f"{type(e).__name__}: {e}"}
        proto.write(json.dumps(ans) + "\n")
    return 0


def _parent_arg(argv: List[str]) -> Optional[int]:
    if len(argv) == 2 and argv[0] == "--parent" and argv[1].isdigit():
        return int(argv[1])
    return None


if __name__ == "__main__":
    sys.exit(serve(_parent_arg(sys.argv[1:])))
