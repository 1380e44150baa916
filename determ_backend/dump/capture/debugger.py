"""msprobe's ``PrecisionDebugger`` on top of the ptdbg functions, so msprobe scripts port too.

``PrecisionDebugger(config_path=None, task=None, dump_path=None, level="L1", step=None)``
with ``start(model=None)``, ``stop()`` and ``step()``: each training step is dumped
under ``<dump_path>/step<N>/rank<R>/`` (``dump.pkl`` + ``dump/tensors.bin``).
Tasks: ``statistics`` (default), ``tensor``, ``overflow_check``; level ``L1`` (API
level).  A ``config.json`` in msprobe's format is read for ``task``,
``dump_path``, ``step``, ``level`` and the task's ``scope``/``list``/``data_mode``;
explicit arguments win.  Other levels and tasks are refused with a clear error.

``step`` may be one int or a list; ``list`` one string or a list of API name
fragments (``"relu"``) or call names, in msprobe's form
(``Functional.linear.0.forward``) or ours (``Functional_linear_0_forward``).
A selection that records nothing in a step is reported once as a warning.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch

from determ_backend.errors import ConfigError
from determ_backend.dump.capture import control
from determ_backend.dump.capture.switch import DUMP_MODES

__all__ = ["PrecisionDebugger", "call_name"]

log = logging.getLogger(__name__)

_TASKS = ("statistics", "tensor", "overflow_check")
_MSPROBE_NAME = re.compile(r"^(Torch|Tensor|Functional|Distributed)\.(.+)\.(\d+)\.(forward|backward)$")
_OUR_NAME = re.compile(r"^(Torch|Tensor|Functional|Distributed)_.+_\d+_(forward|backward)$")


def call_name(name: str) -> Optional[str]:
    """Our call name for a full call name in msprobe's (``Functional.linear.0.forward``) or our form; None for
    an API name fragment such as ``relu``."""
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


def _steps(value: Any) -> List[int]:
    steps = [value] if isinstance(value, int) else value
    if not isinstance(steps, (list, tuple)) or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
        raise ConfigError(f"PrecisionDebugger: step must be an int or a list of ints, got {value!r}")
    return list(steps)


def _load_config(path: Optional[str]) -> Dict[str, Any]:
    if path is None:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"PrecisionDebugger: config_path {path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"PrecisionDebugger: config_path {path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"PrecisionDebugger: config_path {path}: expected a JSON object")
    return cfg


class PrecisionDebugger:
    """Dump selected training steps, msprobe style (see the module docstring)."""

    def __init__(self, config_path: Optional[str] = None, task: Optional[str] = None,
                 dump_path: Optional[str] = None, level: Optional[str] = None,
                 step: Union[None, int, List[int]] = None):
        cfg = _load_config(config_path)
        self.task = task or cfg.get("task", "statistics")
        self.level = level or cfg.get("level", "L1")
        self.dump_path = dump_path or cfg.get("dump_path")
        self.steps = _steps(step if step is not None else cfg.get("step", []))
        task_cfg = cfg.get(self.task, {}) if isinstance(cfg.get(self.task), dict) else {}
        self.scope = [call_name(s) or s for s in _str_list(task_cfg.get("scope", []), f"{self.task}.scope")]
        self.api_list = _str_list(task_cfg.get("list", []), f"{self.task}.list")
        self.data_mode = _str_list(task_cfg.get("data_mode", ["all"]), f"{self.task}.data_mode") or ["all"]
        if any(m not in DUMP_MODES for m in self.data_mode):
            raise ConfigError(f"PrecisionDebugger: {self.task}.data_mode={self.data_mode!r}; expected a list of "
                              f"{', '.join(DUMP_MODES)}")
        self._warned = False
        if self.task not in _TASKS:
            raise ConfigError(f"PrecisionDebugger: task={self.task!r}; supported: {', '.join(_TASKS)}")
        if self.level != "L1":
            raise ConfigError(f"PrecisionDebugger: level={self.level!r}; only 'L1' (API level) is supported -- use "
                              f"module_dump(module, name) for module-level records")
        if not self.dump_path:
            raise ConfigError("PrecisionDebugger: give dump_path (argument or config.json)")
        self._switch = self._selection()
        self.current_step = 0
        self._on = False

    def _wanted(self) -> bool:
        return not self.steps or self.current_step in self.steps

    def start(self, model: Optional[torch.nn.Module] = None) -> None:
        """Begin dumping this step (a no-op for steps not selected)."""
        if self._on or not self._wanted():
            return
        control.set_dump_path(self.dump_path, dump_tag=f"step{self.current_step}")
        if self.task == "overflow_check":
            control.register_hook(model if model is not None else torch.nn.Module(), control.overflow_check,
                                  overflow_nums=-1)
        else:
            if model is not None:
                control.register_hook(model, control.acc_cmp_dump)
            mode, kw = self._switch
            control.set_dump_switch("ON", mode=mode, summary_only=self.task == "statistics",
                                    dump_mode=self.data_mode, **kw)
        self._on = True

    def _selection(self) -> tuple:
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

    def stop(self) -> None:
        """Stop dumping and finish this step's files."""
        if self._on:
            written = control.records_written()
            control.set_dump_switch("OFF")
            control.remove_hooks()
            self._on = False
            self._warn_if_empty(written)

    def _warn_if_empty(self, written: int) -> None:
        chosen = self.scope or self.api_list
        if written or not chosen or self.task == "overflow_check" or self._warned:
            return
        self._warned = True
        log.warning("PrecisionDebugger: %s.%s=%s selected no API call in step %d (names look like "
                    "Functional.linear.0.forward or Functional_linear_0_forward; fragments like 'linear')",
                    self.task, "scope" if self.scope else "list", chosen, self.current_step)

    def step(self) -> None:
        """End of a training step: the next ``start()`` dumps into ``step<N+1>``."""
        self.stop()
        self.current_step += 1

    @property
    def step_dir(self) -> Path:
        return Path(self.dump_path) / f"step{self.current_step}"
