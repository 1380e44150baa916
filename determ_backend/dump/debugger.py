"""msprobe's ``PrecisionDebugger`` on top of the ptdbg functions, so msprobe scripts port too.

``PrecisionDebugger(config_path=None, task=None, dump_path=None, level="L1", step=None)``
with ``start(model=None)``, ``stop()`` and ``step()``: each training step is dumped
under ``<dump_path>/step<N>/rank<R>/`` (``dump.pkl`` + ``dump/tensors.bin``).
Tasks: ``statistics`` (default), ``tensor``, ``overflow_check``; level ``L1`` (API
level).  A ``config.json`` in msprobe's format is read for ``task``,
``dump_path``, ``step``, ``level`` and the task's ``scope``/``list``; explicit
arguments win.  Other levels and tasks are refused with a clear error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from ..errors import ConfigError
from . import control

__all__ = ["PrecisionDebugger"]

_TASKS = ("statistics", "tensor", "overflow_check")


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
                 dump_path: Optional[str] = None, level: Optional[str] = None, step: Optional[List[int]] = None):
        cfg = _load_config(config_path)
        self.task = task or cfg.get("task", "statistics")
        self.level = level or cfg.get("level", "L1")
        self.dump_path = dump_path or cfg.get("dump_path")
        self.steps = list(step if step is not None else cfg.get("step", []))
        task_cfg = cfg.get(self.task, {}) if isinstance(cfg.get(self.task), dict) else {}
        self.scope = list(task_cfg.get("scope", []))
        self.api_list = list(task_cfg.get("list", []))
        if self.task not in _TASKS:
            raise ConfigError(f"PrecisionDebugger: task={self.task!r}; supported: {', '.join(_TASKS)}")
        if self.level != "L1":
            raise ConfigError(f"PrecisionDebugger: level={self.level!r}; only 'L1' (API level) is supported -- use "
                              f"module_dump(module, name) for module-level records")
        if not self.dump_path:
            raise ConfigError("PrecisionDebugger: give dump_path (argument or config.json)")
        if not all(isinstance(s, int) for s in self.steps):
            raise ConfigError(f"PrecisionDebugger: step must be a list of ints, got {self.steps!r}")
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
            mode, kw = "all", {}
            if self.scope:
                mode, kw = ("range", {"scope": self.scope}) if len(self.scope) == 2 else ("list", {"scope": self.scope})
            elif self.api_list:
                mode, kw = "api_list", {"api_list": self.api_list}
            control.set_dump_switch("ON", mode=mode, summary_only=self.task == "statistics", **kw)
        self._on = True

    def stop(self) -> None:
        """Stop dumping and finish this step's files."""
        if self._on:
            control.set_dump_switch("OFF")
            control.remove_hooks()
            self._on = False

    def step(self) -> None:
        """End of a training step: the next ``start()`` dumps into ``step<N+1>``."""
        self.stop()
        self.current_step += 1

    @property
    def step_dir(self) -> Path:
        return Path(self.dump_path) / f"step{self.current_step}"
