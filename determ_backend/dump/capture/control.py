"""The ptdbg_ascend functional interface: ``set_dump_path``, ``register_hook``,
``set_dump_switch``, ``set_overflow_check_switch``, ``module_dump``...

The interface is process-global by design (existing scripts call these
functions from anywhere), so its state lives in one :class:`_Controller`
object.  Nothing happens at import: hooks are installed when a dump is switched
on and removed when it is switched off; a dump still open at normal interpreter
exit is closed then (an ``atexit`` handler registered at the first switch-on).
Recording covers the thread that switched the dump on (and its autograd
backward), as torch function modes are per thread.

Output layout, in the two forms of ptdbg's guide:

* ``set_dump_path("./dump_path", dump_tag)`` (a directory):
  ``./dump_path/<dump_tag>/rank<R>/<prefix>dump.pkl`` (JSON Lines index) and
  ``<prefix>dump/tensors.bin`` (payloads), ``<prefix>`` being ``api_stack_``,
  ``list_``... for modes other than ``all``;
* ``set_dump_path("./dump_path/npu_dump.pkl", dump_tag)`` (the index file):
  ``./dump_path/<dump_tag>/rank<R>/npu_dump.pkl`` and ``npu_dump/tensors.bin``,
  ``api_stack_npu_dump.pkl`` and ``api_stack_npu_dump/`` in ``api_stack`` mode.

The overflow check writes ``Overflow_info_<time>.pkl`` and ``Overflow_info_<time>/``
in either form, under ``./ptdbg_dump/rank<R>/`` when no dump path was set.
A dump this process wrote may be started afresh (``set_dump_path`` to the same
place again); one left by an earlier run is never overwritten: switching on
into it raises a :class:`ConfigError` naming the directory.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch

from determ_backend import devices
from determ_backend.errors import ConfigError, DeviceUnavailableError
from determ_backend.seed import seed_all as _seed_all
from determ_backend.trace.stream import dir_problem
from determ_backend.dump.capture.hooks import ApiRecorder, purge_retired_modes
from determ_backend.dump.capture.modules import Installation
from determ_backend.dump.capture.overflow import OverflowCounter
from determ_backend.dump.capture.session import INDEX_SUFFIX, DumpSession, default_header
from determ_backend.dump.capture.switch import DumpSettings
from determ_backend.dump.capture.writer import PAYLOAD_FILE

__all__ = ["acc_cmp_dump", "overflow_check", "current_rank", "dump_open", "seed_all", "set_dump_path", "register_hook", "set_dump_switch",
           "set_overflow_check_switch", "module_dump", "module_dump_end", "remove_hooks", "dump_parameters",
           "get_dump_dir", "dump_off", "select_ranks"]

log = logging.getLogger(__name__)


class _HookKind:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


acc_cmp_dump = _HookKind("acc_cmp_dump")
"""``register_hook(model, acc_cmp_dump)``: dump API data for accuracy comparison."""

overflow_check = _HookKind("overflow_check")
"""``register_hook(model, overflow_check, overflow_nums=N)``: find APIs that overflow."""


def _needs_npu(what: str) -> None:
    msg = f"{what} needs an Ascend NPU: ACL-level dumps are a feature of the Ascend driver and torch_npu"
    if not devices.is_available("npu"):
        raise DeviceUnavailableError(msg + "; no NPU is available on this machine (use mode='all' or 'api_stack')")
    raise ConfigError(msg + "; determ does not drive ACL dumps: use the API-level modes, or msprobe's ACL dump")


def current_rank() -> int:
    """The rank this process dumps as: ``register_hook(..., rank=N)``, else the distributed rank, else 0."""
    return _STATE.dump_rank()


class _Controller:
    """Process-wide dump state behind the functional interface."""

    def __init__(self) -> None:
        self.root: Optional[Path] = None
        self.stem: Optional[str] = None
        """The index file's stem when ``set_dump_path`` named a ``.pkl`` file; None for the directory form."""
        self.overflow_name: Optional[str] = None
        """``Overflow_info_<time>``: the overflow check's file name, fixed when the check is registered."""
        self.rank: Optional[int] = None
        self.models: List[torch.nn.Module] = []
        self.regions: List[Tuple[str, torch.nn.Module]] = []
        self.overflow: Optional[OverflowCounter] = None
        self.sessions: Dict[str, DumpSession] = {}
        self.installation: Optional[Installation] = None
        self.settings: Optional[DumpSettings] = None
        self.started_at = 0  # the dump's record count when it was last switched on
        self.selected_ranks: Optional[List[int]] = None  # PrecisionDebugger's rank selection (None: every rank)
        self.ring_bytes: Optional[int] = None
        self.written: Set[Path] = set()
        """Index files this process created: only these may be started afresh (never another run's dump)."""

    def rank_dir(self) -> Path:
        if self.root is None:
            raise ConfigError("no dump path: call set_dump_path(fpath) before switching a dump on")
        return self.root / f"rank{self.dump_rank()}"

    def dump_rank(self) -> int:
        """``register_hook(..., rank=N)``'s rank, else the distributed rank, else 0."""
        return self.rank if self.rank is not None else devices.rank_and_world()[0]

    def file_name(self, prefix: str) -> str:
        """The index's name without ``.pkl`` for a mode's ``prefix`` (``""``, ``"api_stack_"``...): ``<prefix>dump``
        in the directory form; the named file's stem in the file form, ``api_stack_`` in front in that mode."""
        if self.stem is None:
            return f"{prefix}dump"
        return f"{prefix}{self.stem}" if prefix == "api_stack_" else self.stem

    def session(self, name: str, task: str, mode: str) -> DumpSession:
        s = self.sessions.get(name)
        rank_dir = self.rank_dir()
        if s is not None and s.rank_dir == rank_dir and s.tensors == (task in ("tensor", "overflow_check")):
            s.reopen()
            return s
        if s is not None:
            s.close()
        self._refuse_earlier_dump(rank_dir, name)
        header = default_header(self.dump_rank(), devices.rank_and_world()[1], mode, task)
        header["device"] = _model_device(self.models)
        if self.selected_ranks:  # the ranks the dump was told to cover: the others' folders are not missing
            header["ranks"] = sorted(self.selected_ranks)
        s = DumpSession(rank_dir, name, header, tensors=task in ("tensor", "overflow_check"),
                        ring_bytes=self.ring_bytes)
        self.sessions[name] = s
        self.written.add(s.index_path.resolve())
        return s

    def _refuse_earlier_dump(self, rank_dir: Path, name: str) -> None:
        """A dump left by another process is never truncated: the user removes it or dumps elsewhere."""
        index, payloads = rank_dir / f"{name}{INDEX_SUFFIX}", rank_dir / name / PAYLOAD_FILE
        if index.resolve() in self.written:
            return
        if index.exists() or (payloads.is_file() and payloads.stat().st_size):
            raise ConfigError(f"dump: {rank_dir} already holds an earlier dump ({index.name}); remove "
                              f"{index.name} and {payloads.parent.name}/ there, or choose another "
                              f"set_dump_path(fpath, dump_tag) -- earlier dumps are never overwritten")

    def new_overflow_name(self) -> str:
        """``Overflow_info_<time>`` (ptdbg's name), made unique among the files already in the rank directory."""
        base = f"Overflow_info_{time.strftime('%Y%m%d%H%M%S')}"
        name, n = base, 1
        rank_dir = self.rank_dir()
        while (rank_dir / f"{name}{INDEX_SUFFIX}").exists() or name in self.sessions:
            name, n = f"{base}_{n}", n + 1
        return name

    def switch_on(self, settings: DumpSettings, online: Optional[Any] = None) -> None:
        self.switch_off()
        _register_exit_hook()
        session = self.session(self.file_name(settings.prefix), settings.task, settings.mode)
        rec = ApiRecorder(session, settings, online=online)
        self.installation = Installation(rec, self.models, self.regions)
        self.settings = settings
        self.started_at = session.seq

    def overflow_on(self) -> None:
        self.switch_off()
        _register_exit_hook()
        if self.root is None:  # ptdbg's guide: the overflow check dumps into ./ptdbg_dump without set_dump_path
            self.root = Path.cwd() / "ptdbg_dump"
            log.info("overflow check: no set_dump_path; overflow dumps go to %s", self.root)
        if self.overflow_name is None:
            self.overflow_name = self.new_overflow_name()
        session = self.session(self.overflow_name, "overflow_check", "overflow_check")
        rec = ApiRecorder(session, DumpSettings(), overflow=self.overflow)
        self.installation = Installation(rec, self.models, ())
        self.started_at = session.seq

    def switch_off(self) -> int:
        """Stop the dump that is on; how many records it wrote since it was switched on."""
        inst, self.installation = self.installation, None
        written = inst.rec.session.seq - self.started_at if inst is not None else 0
        if inst is not None:
            inst.remove()
            inst.rec.flusher.flush()
            inst.rec.active = False
        try:
            self.close_sessions()
        finally:
            online = inst.rec.online if inst is not None else None
            if online is not None:  # after the sessions: the writer has judged every entry
                inst.rec.online = None
                online.close(inst.rec.session.rank_dir)
        return written

    def close_sessions(self) -> None:
        errors = []
        for s in self.sessions.values():
            try:
                s.close()
            except Exception as e:  # close every session, then report the first failure
                errors.append(e)
        if errors:
            raise errors[0]


_STATE = _Controller()


def _model_device(models: Sequence[torch.nn.Module]) -> str:
    for m in models:
        for p in m.parameters():
            return p.device.type
    return "cpu"


def _register_exit_hook() -> None:
    """Close open dumps at normal interpreter exit (registered on first use, not at import)."""
    if not getattr(_register_exit_hook, "done", False):
        atexit.register(_close_at_exit)
        _register_exit_hook.done = True


def _close_at_exit() -> None:
    try:
        _STATE.switch_off()
    except Exception as e:  # at exit there is no caller left to raise to
        log.error("determ dump: could not finish the dump at exit: %s", e)




def seed_all(seed: int = 1234, mode: bool = False) -> Dict[str, Any]:
    """ptdbg's ``seed_all``: seed every RNG; ``mode=True`` also turns on deterministic algorithms."""
    return _seed_all(seed, deterministic=bool(mode))


def set_dump_path(fpath: Optional[Union[str, os.PathLike]] = None, dump_tag: str = "ptdbg_dump") -> Path:
    """Where the dump goes; both forms of ptdbg's guide (returns the ``<dump_tag>`` directory):

    * a directory, ``set_dump_path("./dump_path", dump_tag)``: ``./dump_path/<dump_tag>/rank<R>/dump.pkl``;
    * the index file, ``set_dump_path("./dump_path/npu_dump.pkl", dump_tag)``:
      ``./dump_path/<dump_tag>/rank<R>/npu_dump.pkl`` with the data directory ``npu_dump/`` beside it
      (``api_stack_npu_dump.pkl`` and ``api_stack_npu_dump/`` in ``api_stack`` mode).

    ``fpath`` defaults to ``$ASCEND_WORK_PATH/dump_data``."""
    if fpath is None:
        work = os.environ.get("ASCEND_WORK_PATH")
        if not work:
            raise ConfigError("set_dump_path: give fpath (or set ASCEND_WORK_PATH)")
        fpath = Path(work) / "dump_data"
    if not isinstance(fpath, (str, os.PathLike)):
        raise ConfigError(f"set_dump_path: fpath must be a path (str or os.PathLike) to a directory or a .pkl "
                          f"file, got {type(fpath).__name__} {fpath!r}")
    if not isinstance(dump_tag, str) or not dump_tag or "/" in dump_tag or dump_tag in (".", ".."):
        raise ConfigError(f"set_dump_path: dump_tag must be a plain directory name, got {dump_tag!r}")
    p, stem = Path(fpath), None
    if p.suffix.lower() == INDEX_SUFFIX:  # the file form: the index is named after the file
        stem = p.stem
        if not stem or stem.startswith("."):
            raise ConfigError(f"set_dump_path: {fpath!s}: expected a file name such as npu_dump.pkl")
        p = p.parent
    elif p.exists() and not p.is_dir():
        raise ConfigError(f"set_dump_path: {p} exists and is not a directory (name the index file with a "
                          f".pkl suffix, or give a directory)")
    problem = dir_problem(p / dump_tag)
    if problem:
        raise ConfigError(f"set_dump_path: cannot use {p / dump_tag}: {problem}")
    _STATE.switch_off()
    _STATE.sessions.clear()
    _STATE.root, _STATE.stem = p / dump_tag, stem
    return _STATE.root


def get_dump_dir() -> Path:
    """The directory this process dumps into (``<fpath>/<dump_tag>/rank<R>``)."""
    return _STATE.rank_dir()


def register_hook(model: torch.nn.Module, hook: _HookKind, overflow_nums: int = 1, dump_mode: str = "api",
                  dump_config: Optional[str] = None, rank: Optional[int] = None) -> None:
    """Attach the dump to ``model``: ``hook`` is ``acc_cmp_dump`` or ``overflow_check``.

    The model is used for its parameters/gradients (recorded before each optimizer step) and its
    compiled submodules (recorded as opaque regions); APIs are recorded process-wide.
    ``overflow_check`` starts checking at once (``set_overflow_check_switch`` toggles it).
    """
    if hook not in (acc_cmp_dump, overflow_check):
        raise ConfigError(f"register_hook: hook must be acc_cmp_dump or overflow_check, got {hook!r}")
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"register_hook: model must be a torch.nn.Module, got {type(model).__name__}")
    if dump_mode == "acl":
        _needs_npu("register_hook(dump_mode='acl')")
    if dump_mode != "api":
        raise ConfigError(f"register_hook: dump_mode={dump_mode!r}; expected 'api' (or 'acl' on an Ascend NPU)")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise ConfigError(f"register_hook: rank must be a non-negative int, got {rank!r}")
    _STATE.rank = rank
    if model not in _STATE.models:
        _STATE.models.append(model)
    if hook is overflow_check:
        _STATE.overflow = OverflowCounter(overflow_nums)
        _STATE.overflow_name = None  # a new check: a new Overflow_info_<time> file
        _STATE.overflow_on()


def set_dump_switch(switch: str, mode: str = "all", scope: Optional[Sequence[str]] = None,
                    api_list: Optional[Sequence[str]] = None, filter_switch: str = "ON",
                    dump_mode: Union[None, str, Sequence[str]] = None, summary_only: bool = False,
                    level: str = "L1", online: Optional[Any] = None) -> None:
    """Start (``"ON"``) or stop (``"OFF"``) dumping; see :mod:`determ_backend.dump.capture.switch` for the modes
    and msprobe's levels (``L1`` APIs, ``L0`` modules of the registered models, ``mix`` both).  ``online``: an
    :class:`~determ_backend.dump.capture.online.OnlineBaseline` judging each record against a reference dump.
    Switching off flushes every payload and completes the index."""
    if switch not in ("ON", "OFF"):
        raise ConfigError(f"set_dump_switch: switch must be 'ON' or 'OFF', got {switch!r}")
    if mode == "acl":
        _needs_npu("set_dump_switch(mode='acl')")
    if switch == "OFF":
        settings = _STATE.settings if _STATE.installation is not None else None
        if _STATE.switch_off() == 0 and settings is not None and settings.mode in ("list", "range", "api_list"):
            named = settings.api_list if settings.mode == "api_list" else settings.scope
            log.warning("set_dump_switch: mode=%r with %s=%s recorded no call (names look like Functional_linear_0_forward"
                        "%s)", settings.mode, "api_list" if settings.mode == "api_list" else "scope", list(named),
                        "; api_list takes fragments like 'linear'" if settings.mode == "api_list" else "")
        return
    if not isinstance(summary_only, bool):
        raise ConfigError(f"set_dump_switch: summary_only must be True or False, got {summary_only!r}")
    settings = DumpSettings.build(mode, scope, api_list, filter_switch, dump_mode, summary_only, level)
    if settings.modules and not _STATE.models:
        raise ConfigError(f"set_dump_switch: level={level!r} records module boundaries: call register_hook(model, "
                          f"acc_cmp_dump) first")
    _STATE.switch_on(settings, online)


def set_overflow_check_switch(switch: str, filter_switch: str = "OFF") -> None:
    """Turn the overflow check registered with ``register_hook(model, overflow_check)`` on or off."""
    if switch not in ("ON", "OFF"):
        raise ConfigError(f"set_overflow_check_switch: switch must be 'ON' or 'OFF', got {switch!r}")
    if _STATE.overflow is None:
        raise ConfigError("set_overflow_check_switch: call register_hook(model, overflow_check) first")
    if switch == "ON":
        _STATE.overflow.enabled = True
        _STATE.overflow_on()
    else:
        _STATE.switch_off()


def module_dump(module: torch.nn.Module, module_name: str) -> None:
    """Record every call of ``module`` as one entry ``<module_name>_<n>_forward`` (its inner APIs are not
    recorded separately); takes effect at the next ``set_dump_switch("ON")`` or at once if a dump is on."""
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"module_dump: module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(module_name, str) or not module_name:
        raise ConfigError(f"module_dump: module_name must be a non-empty string, got {module_name!r}")
    _STATE.regions.append((module_name, module))
    _reinstall()


def module_dump_end() -> None:
    """Stop recording modules given to :func:`module_dump` as whole entries."""
    _STATE.regions.clear()
    _reinstall()


def _reinstall() -> None:
    if _STATE.installation is not None and _STATE.settings is not None:
        inst = _STATE.installation
        inst.remove()
        _STATE.installation = Installation(inst.rec, _STATE.models, _STATE.regions)


def dump_parameters() -> None:
    """Record the registered models' parameters and gradients now (also done before each optimizer step)."""
    if _STATE.installation is None:
        raise ConfigError("dump_parameters: no dump is on (call set_dump_switch('ON') first)")
    _STATE.installation.snapshot_parameters()


def dump_open(index: Union[str, os.PathLike]) -> bool:
    """Whether this process is writing the dump index ``index`` now (switched on and not yet off)."""
    target = Path(index).resolve()
    return any(not s.closed and s.index_path.resolve() == target for s in _STATE.sessions.values())


def select_ranks(ranks: Optional[Sequence[int]]) -> None:
    """The ranks a dump covers (msprobe's ``rank`` key), written into each index's header: a folder of a rank left
    out is then no missing folder to readers that check every rank of the run is there."""
    _STATE.selected_ranks = list(ranks) if ranks else None


def dump_off() -> int:
    """Switch the dump off, as ``set_dump_switch("OFF")`` without its warning; how many records it wrote since it was
    switched on (callers that say themselves what a selection that recorded nothing means)."""
    return _STATE.switch_off()


def remove_hooks() -> None:
    """Switch everything off, close the dumps and forget registered models (a clean slate)."""
    _STATE.switch_off()
    purge_retired_modes()
    _STATE.models.clear()
    _STATE.selected_ranks = None
    _STATE.regions.clear()
    _STATE.overflow = None
    _STATE.overflow_name = None
    _STATE.rank = None
