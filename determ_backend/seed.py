"""``seed_all``: one call that seeds every RNG a PyTorch program may draw from.

Per-device seeding lives in :mod:`determ_backend.devices`.
"""

from __future__ import annotations

import operator
import os
import random
from typing import Any, Dict

import torch

from determ_backend import devices
from determ_backend.args import check_bool
from determ_backend.errors import ConfigError

__all__ = ["seed_all"]


def seed_all(seed: int = 1234, deterministic: bool = False) -> Dict[str, Any]:
    """Seed Python ``random``, ``PYTHONHASHSEED``, numpy, torch CPU and every present
    CUDA / NPU / XPU device.  With ``deterministic=True`` also turn on
    ``torch.use_deterministic_algorithms``, cuDNN determinism (benchmark off),
    ``CUBLAS_WORKSPACE_CONFIG`` and inductor's ``fallback_random``.

    Returns a dict describing what was set.
    """
    if isinstance(seed, bool) or not hasattr(type(seed), "__index__") or not 0 <= operator.index(seed) < 2**32:
        raise ConfigError(f"seed_all: seed must be an int in [0, 2**32), got {seed!r}")
    check_bool(deterministic=deterministic)  # "no" is a truthy string: it would turn determinism on
    seed = operator.index(seed)  # numpy integers are fine too
    done: Dict[str, Any] = {"seed": seed}
    random.seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    done["python"] = True
    try:
        import numpy as np

        np.random.seed(seed)
        done["numpy"] = True
    except ImportError:
        done["numpy"] = False
    done["devices"] = devices.manual_seed(seed)
    if deterministic:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        from determ_backend import _torch_compat

        _torch_compat.set_fallback_random(True)
        done.update(deterministic_algorithms=True, cudnn_deterministic=True, cudnn_benchmark=False,
                    CUBLAS_WORKSPACE_CONFIG=":4096:8", fallback_random=True)
    return done
