"""Per-device differences in one place: availability, sync, RNG state and seeding.

Supported device types: ``cpu``, ``cuda`` (also ROCm), ``npu`` (Ascend, through
the ``torch_npu`` extension when it is importable) and ``xpu``.  Everything else
in determ asks this module instead of touching ``torch.cuda``/``torch.npu``
directly.  The NPU path is exercised in tests with a stand-in ``torch_npu``
module; it has not been run on Ascend hardware.
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Dict, List, Optional, Tuple

import torch

from determ_backend.errors import ConfigError, DeviceUnavailableError

__all__ = [
    "DEVICE_TYPES",
    "device_module",
    "is_available",
    "device_count",
    "synchronize",
    "rank_and_world",
    "world_size",
    "available_devices",
    "get_rng_state",
    "set_rng_state",
    "parse_device_spec",
    "manual_seed",
    "require",
]

DEVICE_TYPES = ("cpu", "cuda", "npu", "xpu")


def _load_npu() -> Optional[Any]:
    """``torch.npu`` after importing ``torch_npu``, or None when it is not installed."""
    if hasattr(torch, "npu") and hasattr(torch.npu, "is_available"):
        return torch.npu
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return None
    return getattr(torch, "npu", None)


def device_module(kind: str) -> Optional[Any]:
    """``torch.cuda`` / ``torch.npu`` / ``torch.xpu`` (None for ``cpu`` or when absent)."""
    if kind == "cpu":
        return None
    if kind == "cuda":
        return torch.cuda
    if kind == "xpu":
        return getattr(torch, "xpu", None)
    if kind == "npu":
        return _load_npu()
    raise ConfigError(f"unknown device type {kind!r}; expected one of {', '.join(DEVICE_TYPES)}")


def is_available(kind: str) -> bool:
    if kind == "cpu":
        return True
    mod = device_module(kind)
    try:
        return bool(mod is not None and mod.is_available())
    except Exception:  # a broken driver stack means "not available", not a crash
        return False


def device_count(kind: str) -> int:
    if kind == "cpu":
        return 1
    return int(device_module(kind).device_count()) if is_available(kind) else 0


def available_devices() -> List[str]:
    return [k for k in DEVICE_TYPES if is_available(k)]


def _split(device) -> Tuple[str, Optional[int]]:
    """``(type, index)`` of a ``torch.device`` or a string such as ``"npu:1"``.

    Strings are parsed here rather than by ``torch.device``, which knows ``npu``
    only after ``torch_npu`` has been imported.
    """
    if isinstance(device, torch.device):
        return device.type, device.index
    m = re.match(r"^(\w+)(?::(\d+))?$", str(device).strip())
    if not m or m.group(1) not in DEVICE_TYPES:
        raise ConfigError(f"unknown device {device!r}; expected one of {', '.join(DEVICE_TYPES)} with an optional :INDEX")
    return m.group(1), None if m.group(2) is None else int(m.group(2))


def rank_and_world() -> Tuple[int, int]:
    """``(rank, world size)`` of this process under ``torch.distributed``; ``(0, 1)`` when no process group runs."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def world_size() -> int:
    return rank_and_world()[1]


def synchronize(device) -> None:
    """Wait for all queued work on ``device`` (a no-op on CPU)."""
    kind = _split(device)[0]
    if kind != "cpu" and is_available(kind):
        device_module(kind).synchronize()


def get_rng_state() -> Dict[str, Any]:
    """Snapshot of the CPU RNG and every present accelerator's RNGs."""
    state: Dict[str, Any] = {"cpu": torch.get_rng_state()}
    for kind in DEVICE_TYPES[1:]:
        if is_available(kind):
            state[kind] = device_module(kind).get_rng_state_all()
    return state


def rng_state_moved(before: Dict[str, Any], after: Dict[str, Any]) -> bool:
    """Whether random numbers were drawn between two :func:`get_rng_state` snapshots (a draw from any default
    generator moves its state: CPU, or any device of an accelerator)."""
    def same(a: Any, b: Any) -> bool:
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return torch.equal(a, b)
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    return before.keys() != after.keys() or not all(same(before[k], after[k]) for k in before)


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    for kind in DEVICE_TYPES[1:]:
        if kind in state and is_available(kind):
            device_module(kind).set_rng_state_all(state[kind])


def manual_seed(seed: int) -> List[str]:
    """Seed the CPU and every present accelerator; returns the device types seeded."""
    torch.manual_seed(seed)
    seeded = ["cpu"]
    for kind in DEVICE_TYPES[1:]:
        if is_available(kind):
            device_module(kind).manual_seed_all(seed)
            seeded.append(kind)
    return seeded


_SPEC = re.compile(r"^(cpu|cuda|npu|xpu)(:\d+)?(?::([a-z0-9_]+))?$")


def parse_device_spec(spec: str) -> Tuple[str, Optional[torch.dtype]]:
    """``"cuda:1:float64"`` -> ``("cuda:1", torch.float64)``; ``"cpu:float64"`` -> ``("cpu", torch.float64)``."""
    m = _SPEC.match(spec.strip()) if isinstance(spec, str) else None
    if not m:
        raise ConfigError(f"bad device spec {spec!r}; expected DEVICE[:INDEX][:DTYPE], e.g. cpu, cuda:0, cpu:float64")
    dev = m.group(1) + (m.group(2) or "")
    dtype = None
    if m.group(3):
        dtype = getattr(torch, m.group(3), None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(f"bad dtype {m.group(3)!r} in device spec {spec!r}")
        if not dtype.is_floating_point:  # the dtype floating values are cast to: an integer one computes nothing alike
            raise ConfigError(f"device spec {spec!r}: expected a floating-point dtype (e.g. float32, float64, "
                              f"bfloat16), got {m.group(3)}")
    return dev, dtype


def require(device: str) -> None:
    """Raise :class:`DeviceUnavailableError` unless ``device`` (a type or ``type:index``) is usable here."""
    kind, index = _split(device)
    if kind not in DEVICE_TYPES:
        raise ConfigError(f"unknown device {device!r}; expected one of {', '.join(DEVICE_TYPES)}")
    if not is_available(kind):
        raise DeviceUnavailableError(f"device {device!r} is not available on this machine (available: {', '.join(available_devices())})")
    if kind != "cpu" and index is not None and index >= device_count(kind):
        raise DeviceUnavailableError(f"device {device!r} is not available: this machine has {device_count(kind)} {kind} device(s)")
