"""``repro-tools bisect -- CMD ...``: which stage of the compiler stack, and which knob in it, is guilty.

The command runs once per question (see :mod:`repro_tools.bisect.runs` for how a
run is steered and judged):

1. **Stages**, from the bottom: ``eager`` (Dynamo only), ``aot_eager``,
   ``aot_eager_decomp_partition`` (+ inductor's decompositions and partitioner),
   ``inductor``.  The first stage under which the command fails is guilty; when
   it passes under every stage the command is healthy.
2. **Knobs** inside the guilty stage, in this order:

   * config changes that alter numerics (``fallback_random``, ``emulate_precision_casts``,
     layout/padding, split reductions, vectorization and the ``cpp``/``triton``
     math options; ``cse`` for the decomposition stage), first all at once (one
     run), then halved until one change alone fixes the failure;
   * torch's counted subsystems (pattern-matcher passes before/after AOT, joint
     graph passes, CUDA graphs, individual lowerings; individual decompositions in
     the decomposition stage): each is first disabled entirely; when that fixes
     the failure, one run counts its applications and a binary search finds the
     first application that brings the failure in (e.g. the lowering of ``relu``).

When the command also fails with ``torch.compile`` disabled (``TORCH_COMPILE_DISABLE=1``,
asked only once it fails under ``eager``), no stage is guilty: the failure is not
the compiler's, and the verdict says so.

Exit 1 when a guilty stage is found, 0 when the command is healthy, 2 on usage errors
and when the command fails without compiling.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from tqdm import tqdm

from determ_backend import _torch_compat as tc
from determ_backend import devices
from determ_backend.config import STAGES
from determ_backend.errors import ConfigError

from repro_tools.bisect.runs import CommandRunner
from repro_tools.cli.args import check_writable_dir

__all__ = ["register", "run", "bisect_command", "Verdict", "config_knobs"]

log = logging.getLogger(__name__)

_GROUP = "determ_config"
"""Subsystem name under which the config changes being tried are handed to the child."""

_OVERLOAD = re.compile(r"<OpOverload\(op='([\w.]+)', overload='(\w+)'\)>")

_EXTRA_CONFIG = {
    "inductor": (("split_reductions", False), ("cpp.vec_isa_ok", False), ("cpp.enable_unsafe_math_opt_flag", False),
                 ("cpp.enable_floating_point_contract_flag", "off"), ("cpp.use_decompose_tanh", False),
                 ("use_fast_math", False), ("triton.persistent_reductions", False),
                 ("triton.codegen_upcast_to_fp32", True)),
}
"""Numerics-changing settings tried besides torch's own config changes (value = the safe setting)."""


@dataclass
class Verdict:
    stage: Optional[str] = None
    knob: Optional[str] = None
    detail: Optional[str] = None
    index: Optional[int] = None
    runs: int = 0
    seconds: float = 0.0
    reason: Optional[str] = None
    history: List[Dict[str, Any]] = field(default_factory=list)
    fails_uncompiled: bool = False
    """The command fails with ``torch.compile`` disabled too: not a compiler failure."""
    compiled: bool = True
    """Some run compiled a graph (a command that compiles nothing passes every stage and is not healthy: there
    was nothing to bisect)."""

    @property
    def healthy(self) -> bool:
        return self.stage is None and not self.fails_uncompiled and self.compiled

    def to_json(self) -> Dict[str, Any]:
        return {"stage": self.stage, "knob": self.knob, "detail": self.detail, "index": self.index,
                "runs": self.runs, "seconds": round(self.seconds, 2), "healthy": self.healthy,
                "fails_uncompiled": self.fails_uncompiled, "compiled": self.compiled, "failure": self.reason,
                "history": self.history}


def config_knobs(stage: str) -> List[Tuple[str, Any]]:
    """``(config entry, safe value)`` pairs tried in ``stage``: torch's config changes, then ours."""
    out = [cfg for _, cfg in tc.bisector_subsystems(stage) if cfg is not None]
    out += [kv for kv in _EXTRA_CONFIG.get(stage, ()) if kv[0] not in {k for k, _ in out}]
    return out


def counted_subsystems(stage: str) -> List[str]:
    """Torch's counted subsystems of ``stage`` that apply on this machine."""
    names = [name for name, cfg in tc.bisector_subsystems(stage) if cfg is None]
    if not devices.is_available("cuda"):
        names = [n for n in names if n != "cudagraphs"]
    return names


# ---------------------------------------------------------------------- search

def _fixes_config(r: CommandRunner, stage: str, changes: Sequence[Tuple[str, Any]]) -> bool:
    r.prepare(stage, _GROUP, "test_disable", config=dict(changes))
    label = ", ".join(f"{k}={v!r}" for k, v in changes) if len(changes) <= 2 else f"{len(changes)} config changes"
    return not r.run(stage, _GROUP, f"with {label}").failed


def _search_config(r: CommandRunner, stage: str) -> Optional[Tuple[str, str]]:
    """The config change that fixes the failure, as ``(knob, detail)``; None when none does."""
    group = config_knobs(stage)
    if not group or not _fixes_config(r, stage, group):
        return None
    while len(group) > 1:
        half = group[: len(group) // 2]
        if _fixes_config(r, stage, half):
            group = half
        elif _fixes_config(r, stage, group[len(half):]):
            group = group[len(half):]
        else:
            names = ", ".join(f"{k}={v!r}" for k, v in group)
            return "config", f"only together: {names} fixes it"
    key, value = group[0]
    return key, f"setting {key}={value!r} fixes it"


def _search_subsystem(r: CommandRunner, stage: str, name: str) -> Optional[Tuple[str, Optional[int], Optional[str]]]:
    """``(name, first guilty application, what it was)`` when disabling ``name`` fixes the failure."""
    r.prepare(stage, name, "test_disable")
    if r.run(stage, name, f"without {name}").failed:
        return None
    r.prepare(stage, name, "find_max_bounds", bounds=(0, -1))
    counted = r.run(stage, name, f"counting {name}")
    bounds = r.bounds(stage, name)
    if not counted.failed or bounds is None or bounds[1] < 0:
        log.warning("%s: disabling it fixes the failure, but with it enabled the run %s; not bisecting",
                    name, "passes (flaky?)" if not counted.failed else "applied it 0 times")
        return name, None, None
    lo, hi = bounds
    while lo < hi:
        r.prepare(stage, name, "bisect", bounds=(lo, hi))
        mid = (lo + hi) // 2
        if r.run(stage, name, f"{name} 0..{mid} of 0..{bounds[1]}").failed:
            hi = mid
        else:
            lo = mid + 1
    info = r.debug_info(stage, name, lo)
    if info is None:  # the range never got narrow enough for torch to record it: one confirming run
        r.prepare(stage, name, "bisect", bounds=(lo, lo))
        r.run(stage, name, f"{name} 0..{lo} (confirm)")
        info = r.debug_info(stage, name, lo)
    return name, lo, _readable(info)


def _readable(info: Optional[str]) -> Optional[str]:
    """``<OpOverload(op='aten.hardswish', overload='default')>`` -> ``aten.hardswish.default``."""
    return _OVERLOAD.sub(r"\1.\2", info) if info else info


def _search_knobs(r: CommandRunner, stage: str, v: Verdict) -> None:
    found = _search_config(r, stage)
    if found is not None:
        v.knob, v.detail = found
        return
    for name in counted_subsystems(stage):
        hit = _search_subsystem(r, stage, name)
        if hit is not None:
            v.knob, v.index, v.detail = hit
            return


def _fails_uncompiled(r: CommandRunner, v: Verdict, res: Any) -> bool:
    """After a failure under ``eager``: does the command fail with torch.compile disabled too?"""
    plain = r.run(None)
    tail = r.stderr_tail(plain if plain.failed else res)
    if plain.failed:
        v.fails_uncompiled, v.reason = True, plain.reason
        log.warning("the command fails with torch.compile disabled too (%s)%s", plain.reason,
                    f":\n{tail}" if tail else "")
        return True
    log.warning("the command fails with Dynamo alone (no compiler)%s", f":\n{tail}" if tail else "")
    return False


def bisect_command(command: Sequence[str], workdir: Path, timeout: Optional[float] = None,
                   progress: bool = True) -> Verdict:
    """Find the guilty stage and knob for ``command`` (see the module docstring)."""
    bar = tqdm(desc="bisect", unit="run", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    r = CommandRunner(command, workdir, timeout=timeout, progress=bar)
    v = Verdict()
    t0 = time.perf_counter()
    compiled = False
    try:
        for stage in STAGES:
            res = r.run(stage)
            compiled = compiled or res.compiled
            if res.failed:
                if stage == "eager" and _fails_uncompiled(r, v, res):
                    break
                v.stage, v.reason = stage, res.reason
                _search_knobs(r, stage, v)
                break
        else:
            v.compiled = compiled
    finally:
        bar.close()
    v.runs, v.seconds, v.history = r.runs, time.perf_counter() - t0, r.history
    return v


# ---------------------------------------------------------------------- CLI

def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bisect", help="find the compiler stage and knob that bring a failure in",
        description="Run CMD under the stages eager, aot_eager, aot_eager_decomp_partition and inductor, then "
                    "toggle the knobs inside the first failing stage (config changes, passes, lowerings, "
                    "decompositions), binary-searching counted ones.  A run fails when CMD exits non-zero or a "
                    "determ report.json says divergent.  Exit 1: guilty stage found; 0: healthy; 2: usage error, "
                    "the command fails with torch.compile disabled too (not a compiler failure), or it "
                    "compiles nothing (nothing to bisect).",
        epilog="example: repro-tools bisect -- python train.py --steps 1")
    p.add_argument("--json", action="store_true", help="print the verdict (stage, knob, detail, runs, seconds) as JSON")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per run before it counts as failing (default: no limit)")
    p.add_argument("--workdir", help="directory for run logs and the bisect state "
                                     "(default: a temporary directory, removed afterwards)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command to bisect")
    p.set_defaults(func=run)


def _command(args: argparse.Namespace) -> List[str]:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ConfigError("bisect: no command given; expected: repro-tools bisect [options] -- CMD [ARGS...]")
    if shutil.which(cmd[0]) is None:
        hint = (f"; a Python script runs as: repro-tools bisect -- python {' '.join(cmd)}"
                if cmd[0].endswith(".py") and os.path.isfile(cmd[0]) else "")
        raise ConfigError(f"bisect: command {cmd[0]!r} not found (not an executable file or on PATH){hint}")
    if args.timeout is not None and not args.timeout > 0:
        raise ConfigError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    return cmd


def _aot_repro_in(cmd: Sequence[str]) -> Optional[str]:
    """A repro script written after AOT among the command's arguments: it compiles its graph with inductor's inner
    compiler itself, not through ``torch.compile``, so disabling torch.compile (or a stage) changes nothing."""
    from repro_tools.repro.script import read_meta

    for a in cmd:
        if a.endswith(".py") and Path(a).is_file():
            try:
                if (read_meta(a) or {}).get("after") == "aot":
                    return a
            except Exception:  # not a repro script
                continue
    return None


def _print_text(v: Verdict, cmd: Sequence[str] = ()) -> None:
    print(f"bisect: {v.runs} runs, {v.seconds:.1f} s")
    if v.fails_uncompiled:
        repro = _aot_repro_in(cmd)
        if repro is not None:
            print(f"nothing to bisect: {repro} was written after AOT and compiles its graph with inductor itself, not "
                  "through torch.compile, so it fails whatever torch.compile does; bisect the program it came from, "
                  "or a repro written after dynamo (REPRO_AFTER=dynamo)")
            return
        print(f"not a compiler failure: the command fails with torch.compile disabled too ({v.reason}); "
              "nothing to bisect")
        return
    if v.stage is None and not v.compiled:
        print("nothing to bisect: the command compiled no graph under any stage (does it call torch.compile? "
              "TORCH_COMPILE_DISABLE set?)")
        return
    if v.healthy:
        print("healthy: the command passes under every stage (" + ", ".join(STAGES) + ")")
        return
    below = STAGES[STAGES.index(v.stage) - 1] if STAGES.index(v.stage) else None
    print(f"guilty stage: {v.stage} ({v.reason}" + (f"; passes under {below})" if below else "; fails without a compiler)"))
    if v.knob is None:
        print("knob: none found (no single config change or subsystem of this stage fixes it)")
    elif v.index is not None:
        print(f"knob: {v.knob}, application index {v.index} (0-based, as in --json): {v.detail or '(not recorded)'}")
    else:
        print(f"knob: {v.knob}" + (f" ({v.detail})" if v.detail else ""))


def run(args: argparse.Namespace) -> int:
    cmd = _command(args)
    if args.workdir:
        check_writable_dir(args.workdir, "--workdir")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="determ-bisect-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        v = bisect_command(cmd, workdir, timeout=args.timeout, progress=not args.no_progress)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(v.to_json(), indent=1))
    else:
        _print_text(v, cmd)
    return 2 if v.fails_uncompiled or (v.stage is None and not v.compiled) else 0 if v.healthy else 1
