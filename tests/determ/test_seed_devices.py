"""seed_all and the devices module: reproducible draws, deterministic flags, device specs,
and the Ascend NPU path through a stand-in ``torch_npu`` package (no NPU hardware here)."""

from __future__ import annotations

import importlib
import os
import random
import sys
import textwrap

import numpy as np
import pytest
import torch

from determ_backend import _torch_compat, devices
from determ_backend.errors import ConfigError, DetermError, DeviceUnavailableError
from determ_backend.seed import seed_all


@pytest.fixture
def global_state(monkeypatch):
    """Restore every piece of global state seed_all touches, whatever the test does."""
    for var in ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG"):
        monkeypatch.delenv(var, raising=False)  # monkeypatch puts the original value back
    cfg = _torch_compat.inductor_config()
    cudnn = torch.backends.cudnn
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             cudnn.deterministic, cudnn.benchmark, cfg.fallback_random,
             torch.get_rng_state(), random.getstate(), np.random.get_state())
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        cudnn.deterministic, cudnn.benchmark, cfg.fallback_random = saved[2], saved[3], saved[4]
        torch.set_rng_state(saved[5])
        random.setstate(saved[6])
        np.random.set_state(saved[7])


def _draws():
    return torch.randn(4).tolist(), torch.randint(0, 10**6, (3,)).tolist(), random.random(), np.random.rand(3).tolist()


# ---------------------------------------------------------------- seed_all

def test_seed_all_reproduces_torch_random_and_numpy_draws(global_state):
    seed_all(7)
    first = _draws()
    seed_all(7)
    assert _draws() == first
    seed_all(8)
    other = _draws()
    assert all(a != b for a, b in zip(other, first))


def test_seed_all_reports_what_it_set(global_state):
    done = seed_all(123)
    assert done == {"seed": 123, "python": True, "numpy": True, "devices": devices.manual_seed(123)}
    assert "cpu" in done["devices"]
    assert os.environ["PYTHONHASHSEED"] == "123"
    assert not torch.are_deterministic_algorithms_enabled()


def test_seed_all_deterministic_sets_every_flag(global_state):
    cfg = _torch_compat.inductor_config()
    torch.backends.cudnn.benchmark = True
    cfg.fallback_random = False
    done = seed_all(5, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert cfg.fallback_random is True
    assert done["deterministic_algorithms"] and done["fallback_random"] and done["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


@pytest.mark.parametrize("seed", [-1, 2**32, 1.5, "1", True, None, np.float32(2.0)])
def test_bad_seed_raises_config_error(seed, global_state):
    with pytest.raises(ConfigError, match=r"seed must be an int in \[0, 2\*\*32\)"):
        seed_all(seed)


def test_a_deterministic_flag_that_is_no_bool_is_refused(global_state):
    """``deterministic="no"`` is a truthy string: it turned deterministic algorithms on."""
    with pytest.raises(ConfigError, match="deterministic='no': expected True or False"):
        seed_all(1, deterministic="no")
    assert not torch.are_deterministic_algorithms_enabled()


def test_numpy_integer_seed_is_accepted(global_state):
    assert seed_all(np.int64(9))["seed"] == 9
    first = _draws()
    seed_all(9)
    assert _draws() == first


# ---------------------------------------------------------------- devices

@pytest.mark.parametrize("spec,expected", [
    ("cpu", ("cpu", None)), ("cpu:float64", ("cpu", torch.float64)), ("cuda:1", ("cuda:1", None)),
    ("cuda:1:float64", ("cuda:1", torch.float64)), ("npu:0:bfloat16", ("npu:0", torch.bfloat16)),
    (" xpu ", ("xpu", None)), ("cpu:float8_e4m3fn", ("cpu", torch.float8_e4m3fn)),
])
def test_parse_device_spec(spec, expected):
    assert devices.parse_device_spec(spec) == expected


@pytest.mark.parametrize("spec", [None, "gpu", "", "CPU", "cpu:floaty", "cpu:size", "cuda:-1", "cpu:float64:x", "cuda:"])
def test_parse_device_spec_rejects_bad_specs(spec):
    with pytest.raises(ConfigError, match="device spec|dtype"):
        devices.parse_device_spec(spec)


@pytest.mark.parametrize("spec", ["cpu:int32", "cpu:bool", "cuda:0:int64", "cpu:complex64"])
def test_a_device_spec_casts_to_floating_dtypes_only(spec):
    """DETERM_DEVICE=cpu:int32 ran the graph in int32 and the program's backward died inside torch."""
    with pytest.raises(ConfigError, match="expected a floating-point dtype"):
        devices.parse_device_spec(spec)


def test_cpu_is_always_available_and_rng_state_roundtrips():
    assert devices.is_available("cpu") and "cpu" in devices.available_devices()
    assert devices.device_module("cpu") is None and devices.device_count("cpu") == 1
    state = devices.get_rng_state()
    a = torch.randn(5)
    devices.set_rng_state(state)
    assert torch.equal(torch.randn(5), a)
    devices.synchronize("cpu")
    devices.synchronize(torch.device("cpu"))
    devices.require("cpu")


@pytest.mark.parametrize("device,error", [("tpu", ConfigError), ("bogus:0", ConfigError), ("cuda:x", ConfigError)])
def test_unknown_devices_are_config_errors(device, error):
    with pytest.raises(error, match="unknown device"):
        devices.require(device)
    with pytest.raises(ConfigError):
        devices.synchronize(device)
    with pytest.raises(ConfigError):
        devices.device_module(device)


@pytest.mark.parametrize("kind", ["cuda", "npu", "xpu"])
def test_absent_accelerators_are_unavailable_not_crashes(kind):
    if devices.is_available(kind):
        pytest.skip(f"{kind} is present on this machine")
    assert devices.device_count(kind) == 0
    devices.synchronize(f"{kind}:0")  # no-op when absent
    with pytest.raises(DeviceUnavailableError, match="not available"):
        devices.require(kind)
    assert issubclass(DeviceUnavailableError, DetermError)


# ---------------------------------------------------------------- NPU through a stand-in torch_npu

_FAKE_TORCH_NPU = textwrap.dedent('''
    """Stand-in for Ascend's torch_npu: importing it installs a ``torch.npu`` namespace."""
    import torch


    class _Npu:
        def __init__(self, count=2):
            self.generators = [torch.Generator() for _ in range(count)]
            self.seeds, self.syncs, self.restored = [], 0, None

        def is_available(self):
            return True

        def device_count(self):
            return len(self.generators)

        def manual_seed_all(self, seed):
            self.seeds.append(seed)
            for g in self.generators:
                g.manual_seed(seed)

        def get_rng_state_all(self):
            return [g.get_state() for g in self.generators]

        def set_rng_state_all(self, states):
            self.restored = states
            for g, s in zip(self.generators, states):
                g.set_state(s)

        def synchronize(self, device=None):
            self.syncs += 1


    torch.npu = _Npu()
''')


@pytest.fixture
def fake_npu(tmp_path, monkeypatch):
    if hasattr(torch, "npu") or "torch_npu" in sys.modules:
        pytest.skip("a real torch_npu is loaded in this process")
    (tmp_path / "torch_npu.py").write_text(_FAKE_TORCH_NPU)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        yield
    finally:
        sys.modules.pop("torch_npu", None)
        if hasattr(torch, "npu"):
            delattr(torch, "npu")


def _npu_draw(index: int = 0):
    return torch.randn(3, generator=torch.npu.generators[index]).tolist()


def test_fake_torch_npu_is_imported_on_demand(fake_npu):
    assert not hasattr(torch, "npu")
    assert devices.is_available("npu")  # imports torch_npu, which installs torch.npu
    assert "torch_npu" in sys.modules and devices.device_module("npu") is torch.npu
    assert devices.device_count("npu") == 2 and "npu" in devices.available_devices()
    devices.require("npu:1")
    with pytest.raises(DeviceUnavailableError, match="has 2 npu"):
        devices.require("npu:2")
    devices.synchronize("npu:0")
    assert torch.npu.syncs == 1


def test_seed_all_seeds_the_npu(fake_npu, global_state):
    done = seed_all(31)
    assert done["devices"] == ["cpu", "npu"] and torch.npu.seeds == [31]
    first = [_npu_draw(0), _npu_draw(1)]
    seed_all(31)
    assert [_npu_draw(0), _npu_draw(1)] == first
    seed_all(32)
    assert _npu_draw(0) != first[0]


def test_npu_rng_state_is_saved_and_restored(fake_npu, global_state):
    seed_all(4)
    state = devices.get_rng_state()
    assert set(state) == {"cpu", "npu"} and len(state["npu"]) == 2
    expected = _npu_draw(1)
    devices.set_rng_state(state)
    assert torch.npu.restored is state["npu"]
    assert _npu_draw(1) == expected


def test_fake_npu_is_gone_after_the_fixture():
    assert not hasattr(torch, "npu") and "torch_npu" not in sys.modules
    assert not devices.is_available("npu")
