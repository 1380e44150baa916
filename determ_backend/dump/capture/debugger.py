"""msprobe's ``PrecisionDebugger`` on top of the ptdbg functions, so msprobe scripts port too.

``PrecisionDebugger(config_path=None, task=None, dump_path=None, level=None, step=None, model=None)``
with ``start(model=None)``, ``stop()`` and ``step()``: each selected training step is
dumped under ``<dump_path>/step<N>/rank<R>/`` (``dump.pkl`` + ``dump/tensors.bin``).

msprobe's ``config.json``, as far as determ acts on it (explicit arguments win):

* top level: ``task`` (``statistics``, ``tensor``, ``overflow_check``), ``dump_path``,
  ``level`` (``L0`` module boundaries, ``L1`` APIs, ``mix`` both), ``step`` and
  ``rank`` (ints, or ``"a-b"`` ranges; empty: all);
* the task's section: ``scope``, ``list``, ``data_mode``; ``summary_mode``
  (``statistics``; ``md5``/``xor``: the same records, compared by determ's 64-bit
  fingerprint); ``bench_path`` (an online baseline, :mod:`.online`) with
  ``diff_nums`` (how many divergent records keep their tensors); ``overflow_nums``
  for ``overflow_check``.

Every other key is named in one warning line (never silently ignored); a known key with
a bad value is one :class:`ConfigError` line.  ``list`` takes API name fragments
(``"relu"``, or module names at ``L0``) or call names, in msprobe's form
(``Functional.linear.0.forward``, ``Module.fc1.Linear.forward.0``) or ours
(``Functional_linear_0_forward``, ``Module_fc1.Linear_0_forward``).  A selection
that records nothing in a step is reported once as a warning.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch

from determ_backend.errors import ConfigError, DetermError
from determ_backend.dump.capture import control
from determ_backend.dump.capture.overflow import check_overflow_nums
from determ_backend.dump.capture.switch import DUMP_MODES, LEVELS

__all__ = ["PrecisionDebugger", "call_name", "DebuggerConfig"]

log = logging.getLogger(__name__)

_TASKS = ("statistics", "tensor", "overflow_check")
_MSPROBE_TASKS = ("acc_check", "run_ut", "free_benchmark", "grad_probe", "structure", "diff_check", "nan_check",
                  "exception_dump")
_SUMMARY_MODES = ("statistics", "md5", "xor")
_TOP_KEYS = ("task", "dump_path", "level", "step", "rank")
_TASK_KEYS = {"statistics": ("scope", "list", "data_mode", "summary_mode", "bench_path", "diff_nums"),
              "tensor": ("scope", "list", "data_mode", "bench_path", "diff_nums"),
              "overflow_check": ("overflow_nums",)}
_PREFIXES = "Torch|Tensor|Functional|Distributed|Module"
_MSPROBE_NAME = re.compile(rf"^({_PREFIXES})\.(.+)\.(\d+)\.(forward|backward)$")
_MSPROBE_MODULE = re.compile(r"^Module\.(.+)\.(forward|backward)\.(\d+)$")
_OUR_NAME = re.compile(rf"^({_PREFIXES})_.+_\d+_(forward|backward)$")


def call_name(name: str) -> Optional[str]:
    """Our call name for a full call name in msprobe's form (``Functional.linear.0.forward``,
    ``Module.fc1.Linear.forward.0``) or ours; None for a name fragment such as ``relu``."""
    m = _MSPROBE_MODULE.match(name)
    if m:
        path, direction, n = m.groups()
        return f"Module_{path}_{n}_{direction}"
    m = _MSPROBE_NAME.match(name)
    if m:
        prefix, api, n, direction = m.groups()
        return f"{prefix}_{api.replace('.', '_')}_{n}_{direction}"
    return name if _OUR_NAME.match(name) else None


def _str_list(value: Any, what: str) -> List[str]:
    """A config value that is a string or a list of strings, as a list."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"PrecisionDebugger: {what} must be a string or a list of strings, got {value!r}")
    return list(value)


def _numbers(value: Any, what: str) -> List[int]:
    """``step``/``rank``: an int, or a list of ints and ``"a-b"`` ranges (msprobe's form); [] selects all."""
    items = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    bad = ConfigError(f"PrecisionDebugger: {what} must be an int or a list of ints and 'a-b' ranges, got {value!r}")
    if not isinstance(items, (list, tuple)):
        raise bad
    out: List[int] = []
    for it in items:
        if isinstance(it, int) and not isinstance(it, bool) and it >= 0:
            out.append(it)
            continue
        m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", it) if isinstance(it, str) else None
        if m is None or int(m.group(1)) > int(m.group(2)):
            raise bad
        out.extend(range(int(m.group(1)), int(m.group(2)) + 1))
    return sorted(set(out))


def _load_config(path: Optional[str]) -> Dict[str, Any]:
    if path is None:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"PrecisionDebugger: config_path {path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"PrecisionDebugger: config_path {path}: is a directory; expected a config.json file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"PrecisionDebugger: config_path {path}: not a UTF-8 text file; expected a config.json") from None
    except OSError as e:
        raise ConfigError(f"PrecisionDebugger: config_path {path}: cannot be read ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"PrecisionDebugger: config_path {path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"PrecisionDebugger: config_path {path}: expected a JSON object")
    return cfg


class DebuggerConfig:
    """A validated msprobe configuration: what :class:`PrecisionDebugger` acts on, and the keys it does not."""

    def __init__(self, cfg: Dict[str, Any], task: Optional[str] = None, dump_path: Optional[str] = None,
                 level: Optional[str] = None, step: Union[None, int, List[int]] = None):
        self.task = task or cfg.get("task") or "statistics"
        if self.task in _MSPROBE_TASKS:
            raise ConfigError(f"PrecisionDebugger: task={self.task!r} is an msprobe task determ does not run; "
                              f"supported: {', '.join(_TASKS)}")
        if self.task not in _TASKS:
            raise ConfigError(f"PrecisionDebugger: task={self.task!r}; supported: {', '.join(_TASKS)}")
        self.level = level or cfg.get("level") or "L1"
        if self.level not in LEVELS:
            why = " (L2, kernel level, needs an Ascend NPU)" if self.level == "L2" else ""
            raise ConfigError(f"PrecisionDebugger: level={self.level!r}{why}; supported: {', '.join(LEVELS)} "
                              f"(L0 modules, L1 APIs, mix both)")
        self.dump_path = dump_path or cfg.get("dump_path")
        if not self.dump_path:
            raise ConfigError("PrecisionDebugger: give dump_path (argument or config.json)")
        if not isinstance(self.dump_path, str):
            raise ConfigError(f"PrecisionDebugger: dump_path must be a string, got {self.dump_path!r}")
        self.steps = _numbers(step if step is not None else cfg.get("step", []), "step")
        self.ranks = _numbers(cfg.get("rank", []), "rank")
        section = cfg.get(self.task, {})
        if not isinstance(section, dict):
            raise ConfigError(f"PrecisionDebugger: {self.task} must be a JSON object, got {section!r}")
        t = self.task
        self.scope = [call_name(s) or s for s in _str_list(section.get("scope", []), f"{t}.scope")]
        self.api_list = _str_list(section.get("list", []), f"{t}.list")
        self.data_mode = _str_list(section.get("data_mode", ["all"]), f"{t}.data_mode") or ["all"]
        if any(m not in DUMP_MODES for m in self.data_mode) or ("all" in self.data_mode and len(self.data_mode) > 1):
            raise ConfigError(f"PrecisionDebugger: {t}.data_mode={self.data_mode!r}; expected ['all'] or a list of "
                              f"{', '.join(DUMP_MODES[1:])}")
        self.summary_mode = section.get("summary_mode", "statistics")
        if self.summary_mode not in _SUMMARY_MODES:
            raise ConfigError(f"PrecisionDebugger: {t}.summary_mode={self.summary_mode!r}; expected one of "
                              f"{', '.join(_SUMMARY_MODES)}")
        self.bench_path = section.get("bench_path")
        if self.bench_path is not None:
            if not isinstance(self.bench_path, str) or not Path(self.bench_path).exists():
                raise ConfigError(f"PrecisionDebugger: {t}.bench_path={self.bench_path!r}: expected the path of a "
                                  f"reference dump (its dump_path, a step or rank directory, or an index)")
        self.diff_nums = section.get("diff_nums", 5)
        if isinstance(self.diff_nums, bool) or not isinstance(self.diff_nums, int) or \
                (self.diff_nums < 0 and self.diff_nums != -1):
            raise ConfigError(f"PrecisionDebugger: {t}.diff_nums={self.diff_nums!r}; expected an int >= 0 (records "
                              f"whose tensors are kept) or -1 (all)")
        self.overflow_nums = section.get("overflow_nums", 1)
        if t == "overflow_check":  # another task's section does not act on it
            check_overflow_nums(self.overflow_nums, f"PrecisionDebugger: {t}.overflow_nums")
        self.ignored = self._ignored(cfg, section)

    def _ignored(self, cfg: Dict[str, Any], section: Dict[str, Any]) -> List[str]:
        """Keys present that determ does not act on (other tasks' sections are inert, as in msprobe)."""
        top = [k for k in cfg if k not in _TOP_KEYS and k not in _TASKS and k not in _MSPROBE_TASKS]
        inner = [f"{self.task}.{k}" for k in section if k not in _TASK_KEYS[self.task]]
        return top + inner

    def selection(self) -> tuple:
        """``set_dump_switch``'s mode and keywords for the config's ``scope`` / ``list``."""
        if self.scope:
            return ("range", {"scope": self.scope}) if len(self.scope) == 2 else ("list", {"scope": self.scope})
        if not self.api_list:
            return "all", {}
        names = [call_name(a) for a in self.api_list]
        if all(names):
            return "list", {"scope": names}
        if any(names):
            raise ConfigError(f"PrecisionDebugger: {self.task}.list={self.api_list!r} mixes call names "
                              f"(Functional.linear.0.forward) and API name fragments (relu); use one kind")
        return "api_list", {"api_list": self.api_list}


class PrecisionDebugger:
    """Dump selected training steps, msprobe style (see the module docstring)."""

    def __init__(self, config_path: Optional[str] = None, task: Optional[str] = None,
                 dump_path: Optional[str] = None, level: Optional[str] = None,
                 step: Union[None, int, List[int]] = None, model: Optional[torch.nn.Module] = None):
        self.config = DebuggerConfig(_load_config(config_path), task, dump_path, level, step)
        c = self.config
        self.task, self.level, self.dump_path, self.steps = c.task, c.level, c.dump_path, c.steps
        self.scope, self.api_list, self.data_mode = c.scope, c.api_list, c.data_mode
        if c.ignored:
            log.warning("PrecisionDebugger: determ does not act on these config keys: %s", ", ".join(c.ignored))
        self._switch = c.selection()
        self.model = model
        self._warned = False
        self._compared_online = False  # a step found in the online baseline's reference (later ones may be missing)
        self.current_step = 0
        self._on = False
        self.online = None
        """The online baseline of the step being dumped (:class:`~.online.OnlineBaseline`), when ``bench_path``."""

    def _wanted(self) -> bool:
        if self.steps and self.current_step not in self.steps:
            return False
        return not self.config.ranks or control.current_rank() in self.config.ranks

    def start(self, model: Optional[torch.nn.Module] = None) -> None:
        """Begin dumping this step (a no-op for steps and ranks not selected)."""
        model = model if model is not None else self.model
        if self._on or not self._wanted():
            return
        if self.level != "L1" and model is None and self.task != "overflow_check":
            raise ConfigError(f"PrecisionDebugger: level={self.level!r} records module boundaries: pass the model "
                              f"(PrecisionDebugger(..., model=m) or start(m))")
        control.set_dump_path(self.dump_path, dump_tag=f"step{self.current_step}")
        control.select_ranks(self.config.ranks)
        if self.task == "overflow_check":
            control.register_hook(model if model is not None else torch.nn.Module(), control.overflow_check,
                                  overflow_nums=self.config.overflow_nums)
        else:
            if model is not None:
                control.register_hook(model, control.acc_cmp_dump)
            mode, kw = self._switch
            online = None
            if self.config.bench_path is not None:
                from determ_backend.dump.capture.online import OnlineBaseline

                try:
                    online = OnlineBaseline.for_step(self.config.bench_path, self.current_step,
                                                     control.current_rank(), keep=self.config.diff_nums)
                except DetermError as e:
                    if not self._compared_online:  # no step of it found yet: a wrong path, a reference of no dump
                        raise
                    # a reference of fewer steps: this step is dumped, not compared, and the training goes on
                    log.warning("%s; step %d is dumped without the online comparison", e, self.current_step)
                else:
                    self._compared_online = True
            self.online = online
            control.set_dump_switch("ON", mode=mode, summary_only=self.task == "statistics",
                                    dump_mode=self.data_mode, level=self.level, online=online, **kw)
        self._on = True

    def stop(self) -> None:
        """Stop dumping and finish this step's files."""
        if self._on:
            written = control.dump_off()
            control.remove_hooks()
            self._on = False
            self._warn_if_empty(written)

    def _warn_if_empty(self, written: int) -> None:
        chosen = self.scope or self.api_list
        if written or not chosen or self.task == "overflow_check" or self._warned:
            return
        self._warned = True
        log.warning("PrecisionDebugger: %s.%s=%s selected no %s call in step %d (names look like "
                    "Functional.linear.0.forward or Functional_linear_0_forward%s)",
                    self.task, "scope" if self.scope else "list", chosen, "API" if self.level == "L1" else "module",
                    self.current_step, "; scope takes whole names, list also fragments like 'linear'" if self.scope
                    else "; fragments like 'linear'")

    def step(self) -> None:
        """End of a training step: the next ``start()`` dumps into ``step<N+1>``."""
        self.stop()
        self.current_step += 1

    @property
    def step_dir(self) -> Path:
        return Path(self.dump_path) / f"step{self.current_step}"
