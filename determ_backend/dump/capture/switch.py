"""What a dump records: ``set_dump_switch`` settings and the selection of calls.

Modes (ptdbg semantics):

* ``all`` -- every API, forward and backward, statistics and (unless
  ``summary_only``) tensors;
* ``api_stack`` -- the same plus the Python call stack of every API;
* ``list`` -- only the calls named in ``scope`` (``Tensor_permute_1_forward``;
  a name without ``_forward``/``_backward`` selects both directions);
* ``range`` -- from ``scope[0]`` to ``scope[1]`` inclusive, in execution order;
* ``stack`` -- only names, shapes and call stacks (``scope`` as in ``range``
  when given, else every call);
* ``api_list`` -- APIs whose short name contains an entry of ``api_list``
  (``relu`` selects ``Torch_relu``, ``Functional_relu``, ``Functional_leaky_relu``...),
  or whose prefix is the entry (``distributed``);
* ``acl`` -- Ascend ACL operator dumps: needs an Ascend NPU and its driver.

``level`` (msprobe's): ``L1`` records APIs (the default), ``L0`` module boundaries only
(every submodule of the registered models, forward and backward:
``Module_<path>.<Class>_<n>_forward``), ``mix`` both.

``filter_switch="ON"`` leaves out integer/bool tensors and Python scalars;
``dump_mode`` keeps only ``forward``/``backward`` records and/or ``input``/``output``
tensors.  The controller using these lives in :mod:`.control`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Tuple, Union

from determ_backend.errors import ConfigError
from determ_backend.dump.capture.apis import ApiInfo

__all__ = ["MODES", "DUMP_MODES", "LEVELS", "DumpSettings", "Selector"]

MODES = ("all", "list", "range", "stack", "acl", "api_list", "api_stack")
DUMP_MODES = ("all", "forward", "backward", "input", "output")
LEVELS = ("L0", "L1", "mix")


def _as_tuple(v: Union[None, str, Iterable[str]], what: str) -> Tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    try:
        out = tuple(v)
    except TypeError:
        raise ConfigError(f"set_dump_switch: {what} must be a list of strings, got {type(v).__name__}") from None
    if not all(isinstance(x, str) for x in out):
        raise ConfigError(f"set_dump_switch: {what} must be a list of strings, got {list(out)!r}")
    return out


@dataclass(frozen=True)
class DumpSettings:
    mode: str = "all"
    """One of :data:`MODES`."""

    scope: Tuple[str, ...] = ()
    """Call names for ``list``; first and last call for ``range`` and ``stack``."""

    api_list: Tuple[str, ...] = ()
    """API name fragments for ``api_list`` mode."""

    filter_switch: str = "ON"
    """``ON``: skip integer/bool tensors and scalar arguments; ``OFF``: record them too."""

    dump_mode: Tuple[str, ...] = ("all",)
    """Subset of ``forward``, ``backward``, ``input``, ``output``; or ``all``."""

    summary_only: bool = False
    """Statistics and fingerprints only, no tensor payloads."""

    level: str = "L1"
    """One of :data:`LEVELS`: what is recorded -- APIs (``L1``), module boundaries (``L0``) or both (``mix``)."""

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ConfigError(f"set_dump_switch: level={self.level!r}; expected one of {', '.join(LEVELS)} "
                              f"(L0: modules, L1: APIs, mix: both)")
        if self.mode not in MODES:
            raise ConfigError(f"set_dump_switch: mode={self.mode!r}; expected one of {', '.join(MODES)}")
        if self.filter_switch not in ("ON", "OFF"):
            raise ConfigError(f"set_dump_switch: filter_switch={self.filter_switch!r}; expected 'ON' or 'OFF'")
        bad = [m for m in self.dump_mode if m not in DUMP_MODES]
        if bad or not self.dump_mode or ("all" in self.dump_mode and len(self.dump_mode) > 1):
            raise ConfigError(f"set_dump_switch: dump_mode={list(self.dump_mode)!r}; expected 'all' alone or a list "
                              f"of {', '.join(DUMP_MODES[1:])}")
        if self.mode == "list" and not self.scope:
            raise ConfigError("set_dump_switch: mode='list' needs scope=[call names], e.g. ['Torch_relu_3_forward']")
        if self.mode == "range" and len(self.scope) != 2:
            raise ConfigError(f"set_dump_switch: mode='range' needs scope=[first, last], got {list(self.scope)!r}")
        if self.mode == "stack" and len(self.scope) not in (0, 2):
            raise ConfigError(f"set_dump_switch: mode='stack' takes scope=[] or [first, last], got {list(self.scope)!r}")
        if self.mode == "api_list" and not self.api_list:
            raise ConfigError("set_dump_switch: mode='api_list' needs api_list=[names], e.g. ['relu', 'conv2d']")

    @classmethod
    def build(cls, mode: str = "all", scope: Optional[Sequence[str]] = None, api_list: Optional[Sequence[str]] = None,
              filter_switch: str = "ON", dump_mode: Union[None, str, Sequence[str]] = None,
              summary_only: bool = False, level: str = "L1") -> "DumpSettings":
        return cls(mode=mode, scope=_as_tuple(scope, "scope"), api_list=_as_tuple(api_list, "api_list"),
                   filter_switch=filter_switch, dump_mode=_as_tuple(dump_mode, "dump_mode") or ("all",),
                   summary_only=bool(summary_only), level=level)

    @property
    def apis(self) -> bool:
        """Whether torch API calls are recorded (levels ``L1`` and ``mix``)."""
        return self.level != "L0"

    @property
    def modules(self) -> bool:
        """Whether module boundaries are recorded (levels ``L0`` and ``mix``)."""
        return self.level != "L1"

    @property
    def prefix(self) -> str:
        """File name prefix: ``api_stack_dump.pkl`` for mode ``api_stack``, ``dump.pkl`` for ``all``."""
        return "" if self.mode == "all" else f"{self.mode}_"

    @property
    def with_stack(self) -> bool:
        return self.mode in ("stack", "api_stack")

    @property
    def task(self) -> str:
        if self.mode == "stack":
            return "stack"
        return "statistics" if self.summary_only else "tensor"

    def keeps(self, what: str) -> bool:
        """Whether ``forward``/``backward`` records or ``input``/``output`` tensors are kept."""
        if "all" in self.dump_mode:
            return True
        group = ("forward", "backward") if what in ("forward", "backward") else ("input", "output")
        chosen = [m for m in self.dump_mode if m in group]
        return not chosen or what in chosen


class Selector:
    """Decides, in execution order, which calls are recorded (stateful for ``range``)."""

    def __init__(self, settings: DumpSettings):
        self.s = settings
        self._in_range = False
        self._range_done = False
        self._names = set(settings.scope)
        self._apis = tuple(a.lower() for a in settings.api_list)
        self._ranged = settings.mode == "range" or (settings.mode == "stack" and len(settings.scope) == 2)

    def _api_match(self, info: ApiInfo) -> bool:
        name, prefix = info.name.lower(), info.prefix.lower()
        return any(a == prefix or a in name for a in self._apis)

    def _named(self, call: str, direction: str) -> bool:
        return f"{call}_{direction}" in self._names or call in self._names

    def _step_range(self, full: str, call: str) -> bool:
        first, last = self.s.scope
        if self._range_done:
            return False
        if not self._in_range and (full == first or call == first):
            self._in_range = True
        hit = self._in_range
        if self._in_range and (full == last or call == last):
            self._in_range, self._range_done = False, True
        return hit

    def select(self, call: str, info: ApiInfo, direction: str) -> bool:
        """Record the ``direction`` record of ``call``?  Call once per record, in execution order."""
        if not self.s.keeps(direction):
            return False
        mode = self.s.mode
        if self._ranged:
            return self._step_range(f"{call}_{direction}", call)
        if mode == "list":
            return self._named(call, direction)
        if mode == "api_list":
            return self._api_match(info)
        return True

    def select_node(self, call: str, region: str, info: ApiInfo, direction: str) -> bool:
        """Record a traced FX node ``call`` of compiled region call ``region``?  In ``list`` mode naming the
        region selects all its nodes; otherwise nodes are selected like calls."""
        if self.s.mode == "list" and self.s.keeps(direction) and self._named(region, direction):
            return True
        return self.select(call, info, direction)

    def may_backward(self, call: str, info: ApiInfo) -> bool:
        """At forward time: could the backward record of ``call`` be selected (so hooks are needed)?"""
        if not self.s.keeps("backward"):
            return False
        if self._ranged:
            return not self._range_done
        if self.s.mode == "list":
            return self._named(call, "backward")
        if self.s.mode == "api_list":
            return self._api_match(info)
        return True
