"""Settings: one frozen dataclass.

Precedence: field defaults < environment (``DETERM_*`` and ``REPRO_*``) <
``torch.compile(..., options={...})`` (keys are field names, or the env-var names).
Validation lives in ``__post_init__`` so every source is checked the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterator, Mapping, Optional, Tuple

from determ_backend.devices import parse_device_spec
from determ_backend.errors import ConfigError

__all__ = ["DetermConfig", "load_config", "parse_bool", "CHECKS", "STAGES"]

CHECKS = ("determinism", "accuracy", "nan", "batch_invariance")
STAGES = ("eager", "aot_eager", "aot_eager_decomp_partition", "inductor")
"""The compiler stack from the bottom: dynamo only, + AOT autograd, + inductor's decompositions and partitioner, + inductor."""

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def parse_bool(value: Any, source: str) -> bool:
    """``1/0``, ``true/false``, ``yes/no``, ``on/off`` (any case; empty is false); anything else is a
    :class:`ConfigError` naming ``source`` (an env-var or option name) and quoting the value."""
    if isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise ConfigError(f"{source}={str(value)!r}: expected a boolean (1/0, true/false, yes/no, on/off)")


@dataclass(frozen=True)
class DetermConfig:
    dir: str = "./determ_out"
    """Root output directory; each run writes into ``<dir>/<run_id>/`` (``DETERM_DIR``)."""

    run_id: Optional[str] = None
    """Name of this run's sub-directory; default: a timestamp plus the process id (``DETERM_RUN_ID``)."""

    trace: bool = True
    """Record a fingerprint trace of every traced tensor (``DETERM_TRACE``)."""

    stats: bool = True
    """Add min/max/mean/L2/nan/inf statistics to each trace record (``DETERM_STATS``)."""

    save_tensors: bool = False
    """Also store each traced tensor's data, content-addressed by fingerprint (``DETERM_SAVE_TENSORS``)."""

    reuse_saved: bool = True
    """A backward graph's inputs that its forward returned, unchanged by version counter, take the forward's
    fingerprints instead of being read again (``DETERM_REUSE_SAVED``; 0 reads them: a write between forward
    and backward that bypasses the version counter, through ``tensor.data``, is then seen)."""

    check: Tuple[str, ...] = ()
    """Online checks: ``determinism``, ``accuracy``, ``nan``, ``batch_invariance`` (``DETERM_CHECK``,
    comma-separated)."""

    batch_dim: int = 0
    """The batch dimension of the graphs' inputs for ``batch_invariance`` (``DETERM_BATCH_DIM``)."""

    reference: Optional[str] = None
    """A trace file or run directory to compare this run against online (``DETERM_REFERENCE``)."""

    tol: float = 1e-3
    """Tolerance for accuracy verdicts (``DETERM_TOL``)."""

    fp64_multiplier: float = 2.0
    """Accuracy: compiled error vs fp64 may be at most this multiple of eager's own error (``DETERM_FP64_MULTIPLIER``)."""

    report: bool = True
    """Write ``report.html`` (the HTML report) next to ``report.json`` when a check finds a divergence
    (``DETERM_REPORT``)."""

    raise_on_divergence: bool = False
    """Raise :class:`~determ_backend.errors.AccuracyError` when a check finds a divergence (``DETERM_RAISE``)."""

    repro_after: Optional[str] = None
    """``dynamo`` or ``aot``: where repro flows intercept (``REPRO_AFTER``)."""

    repro_level: int = 2
    """Repro level 1-4 (``REPRO_LEVEL``): 1 dump on error, 2 launcher on error, 3 launcher first + isolated minify, 4 accuracy."""

    minify: bool = True
    """Minify automatically after a level-4 accuracy failure (``DETERM_MINIFY``)."""

    strict: bool = False
    """Accuracy checks also compare non-floating outputs, and bitwise when ``tol`` is 0 (``DETERM_STRICT``)."""

    device: Optional[str] = None
    """Run compiled graphs on this device spec instead, e.g. ``cpu:float64`` or ``cuda:0``; outputs come back
    to the original device and dtype (``DETERM_DEVICE``; set by ``repro-tools xdevice``)."""

    bisect_stage: Optional[str] = None
    """Compile through this stage of the stack instead of the backend's own: one of :data:`STAGES`, with torch's
    bisector hooks scoped to it (``DETERM_BISECT_STAGE``; set by ``repro-tools bisect``)."""

    given: FrozenSet[str] = field(default=frozenset(), compare=False, repr=False)
    """Not a setting: the names of the fields :func:`load_config` took from the environment or ``options``
    (e.g. an online reference comparison uses ``tol`` when it was given)."""

    def __post_init__(self) -> None:
        if not isinstance(self.dir, str) or not self.dir:
            raise ConfigError(f"DETERM_DIR={self.dir!r}; expected a directory path")
        if self.run_id is not None and (self.run_id in (".", "..") or not self.run_id.strip() or any(
                c in self.run_id for c in ("/", "\\", os.sep, os.altsep or "/"))):
            raise ConfigError(f"DETERM_RUN_ID={self.run_id!r}; expected a plain directory name "
                              f"(no path separators, not blank, '.' or '..')")
        bad = [c for c in self.check if c not in CHECKS]
        if bad:
            raise ConfigError(f"DETERM_CHECK={','.join(self.check)!r}: unknown check(s) {', '.join(bad)}; expected a comma-separated subset of {', '.join(CHECKS)}")
        if self.repro_after not in (None, "dynamo", "aot"):
            raise ConfigError(f"REPRO_AFTER={self.repro_after!r}; expected 'dynamo' or 'aot'")
        if self.repro_level not in (1, 2, 3, 4):
            raise ConfigError(f"REPRO_LEVEL={str(self.repro_level)!r}; expected 1, 2, 3 or 4")
        if not self.tol >= 0:
            raise ConfigError(f"DETERM_TOL={str(self.tol)!r}; expected a non-negative number")
        if self.bisect_stage not in (None,) + STAGES:
            raise ConfigError(f"DETERM_BISECT_STAGE={self.bisect_stage!r}; expected one of {', '.join(STAGES)}")
        if self.device is not None:
            try:
                parse_device_spec(self.device)
            except ConfigError as e:
                raise ConfigError(f"DETERM_DEVICE={self.device!r}: {e}") from None
        if isinstance(self.batch_dim, bool) or not isinstance(self.batch_dim, int) or self.batch_dim < 0:
            raise ConfigError(f"DETERM_BATCH_DIM={self.batch_dim!r}; expected a dimension index >= 0")
        if not self.fp64_multiplier > 0:
            raise ConfigError(f"DETERM_FP64_MULTIPLIER={str(self.fp64_multiplier)!r}; expected a positive number")

    def replace(self, **changes: Any) -> "DetermConfig":
        return dataclasses.replace(self, **changes)


_ENV = {
    "dir": "DETERM_DIR", "run_id": "DETERM_RUN_ID", "trace": "DETERM_TRACE", "stats": "DETERM_STATS",
    "save_tensors": "DETERM_SAVE_TENSORS", "reuse_saved": "DETERM_REUSE_SAVED", "check": "DETERM_CHECK", "reference": "DETERM_REFERENCE",
    "tol": "DETERM_TOL", "fp64_multiplier": "DETERM_FP64_MULTIPLIER", "raise_on_divergence": "DETERM_RAISE",
    "report": "DETERM_REPORT",
    "repro_after": "REPRO_AFTER", "repro_level": "REPRO_LEVEL", "minify": "DETERM_MINIFY", "strict": "DETERM_STRICT",
    "device": "DETERM_DEVICE", "bisect_stage": "DETERM_BISECT_STAGE", "batch_dim": "DETERM_BATCH_DIM",
}
_BY_ENV = {v: k for k, v in _ENV.items()}


def _coerce(name: str, value: Any, source: str) -> Any:
    f = {f.name: f for f in dataclasses.fields(DetermConfig)}[name]
    kind = str(f.type)
    if kind == "bool":
        return parse_bool(value, source)
    try:
        if kind == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if kind == "float":
            return float(value)
        if kind.startswith("Tuple"):
            items = value.split(",") if isinstance(value, str) else list(value)
            return tuple(s.strip() for s in items if str(s).strip())
        if kind.startswith("Optional"):
            return None if value in (None, "") else str(value)
        if value is None:
            raise ValueError
        return str(value)
    except (TypeError, ValueError):
        what = {"int": "an integer", "float": "a number", "str": "a non-empty string"}.get(kind, kind.lower())
        raise ConfigError(f"{source}={value!r}: expected {what}") from None


def option_names() -> frozenset:
    """Every key ``options=`` accepts: field names and their env-var names."""
    return frozenset(_ENV) | frozenset(_ENV.values())


FLOW_VARIABLES = ("REPRO_AFTER", "REPRO_LEVEL")
"""The environment variables that wrap the determ backends in a repro flow."""

_FLOWS_OFF = [0]  # > 0 while determ's own tooling compiles graphs: a repro script, the minifier's candidates
_UNTRACED = [0]  # > 0 while the minifier compiles its candidates: no tracing and no checks either


@contextlib.contextmanager
def flows_suspended(untraced: bool = False) -> Iterator[None]:
    """Inside, configs have no repro flow (``REPRO_AFTER``/``REPRO_LEVEL`` are ignored): a repro script or the
    minifier compiling a candidate with a determ backend checks that backend, and a flow wrapped around it again
    would dump and minify each candidate in turn (the level-4 flow recursed until Python's limit).  ``untraced``
    (the minifier): no tracing, checks or reference either, so a determ backend compiles each candidate as the
    backend it wraps does (bit for bit), and the candidates' graphs do not enter the program's run as graphs and
    findings of its own.  Graphs compiled before are left as they are: leaving their calls out of the trace is
    :func:`determ_backend.backends.checks.unrecorded`'s job (a level-4 check's own run of a graph)."""
    _FLOWS_OFF[0] += 1
    _UNTRACED[0] += int(untraced)
    try:
        yield
    finally:
        _FLOWS_OFF[0] -= 1
        _UNTRACED[0] -= int(untraced)


def load_config(options: Optional[Mapping[str, Any]] = None, env: Optional[Mapping[str, str]] = None,
                base: Optional[DetermConfig] = None) -> DetermConfig:
    """Build a config from defaults (or ``base``), the environment, then ``options``; under
    ``repro-tools bisect`` (``DETERM_BISECT_DIR`` set) the output directory and run id are bisect's."""
    env = os.environ if env is None else env
    values = {}
    given_as: Dict[str, Tuple[str, Any]] = {}  # field -> (the variable or options key it came from, the value as given)
    for name, var in _ENV.items():
        if var in env:
            values[name] = _coerce(name, env[var], var)
            given_as[name] = (var, env[var])
    for key, value in (options or {}).items():
        name = _BY_ENV.get(key, key)
        if name not in _ENV:
            raise ConfigError(f"unknown determ option {key!r}; expected one of {', '.join(sorted(_ENV))}")
        values[name] = _coerce(name, value, f"options[{key!r}]")
        given_as[name] = (f"options[{key!r}]", value)
    if env.get("DETERM_BISECT_DIR"):  # set by repro-tools bisect, which must find each run's report
        values["dir"] = _coerce("dir", env["DETERM_BISECT_DIR"], "DETERM_BISECT_DIR")
        given_as["dir"] = ("DETERM_BISECT_DIR", env["DETERM_BISECT_DIR"])
        if "DETERM_RUN_ID" in env:
            values["run_id"] = _coerce("run_id", env["DETERM_RUN_ID"], "DETERM_RUN_ID")
            given_as["run_id"] = ("DETERM_RUN_ID", env["DETERM_RUN_ID"])
    try:
        return _built(values, base)
    except ConfigError as e:
        raise ConfigError(_as_given(str(e), given_as)) from None


def _as_given(message: str, given_as: Mapping[str, Tuple[str, Any]]) -> str:
    """A value check's one line (``REPRO_LEVEL='7'; expected ...``) naming where the setting came from (the
    environment variable or the ``options`` key) and the value as the user gave it (``DETERM_TOL='-1'``, not the
    number it was converted to)."""
    for name, (label, value) in given_as.items():
        var = _ENV[name]
        if message.startswith(var + "="):
            rest = message[len(var) + 1:]
            cut = min((i for i in (rest.find("; "), rest.find(": ")) if i >= 0), default=-1)
            return f"{label}={value!r}{rest[cut:]}" if cut >= 0 else message
    return message


def _built(values: Dict[str, Any], base: Optional[DetermConfig]) -> DetermConfig:
    base = base or DetermConfig()
    if _FLOWS_OFF[0]:
        values.pop("repro_after", None)
        values.pop("repro_level", None)
        base = base.replace(repro_after=None)
    if _UNTRACED[0]:
        for name in ("trace", "check", "reference"):
            values.pop(name, None)
        base = base.replace(trace=False, check=(), reference=None)
    return base.replace(**values, given=base.given | frozenset(values))
