"""determ: find where a PyTorch model's numbers go wrong.

This package runs inside the user's process: fingerprints, compile backends,
dispatch modes, traces and dumps.  Offline tools (repro scripts, minifier,
bisect, the ``repro-tools`` CLI) live in :mod:`repro_tools`.
"""

from .errors import (AccuracyError, ConfigError, DetermError, DeviceUnavailableError, OracleError, ReproError,
                     TraceFormatError, UnsupportedDtypeError)
from .fingerprint import fingerprint_tensors, hash_tensor, hash_tensors, tensor_stats
from .seed import seed_all
from .errors import NondeterminismError
from .modes import BitwiseEquivalenceMode, HashDebugTrace, HashMode, read_hash_log
from .observer import (Observer, ObserverContext, disable_mode, enable_mode, marking_non_deterministic, observe,
                       observe_grad, observe_non_deterministic)

__all__ = [
    "hash_tensor", "hash_tensors", "tensor_stats", "fingerprint_tensors", "seed_all",
    "DetermError", "ConfigError", "UnsupportedDtypeError", "DeviceUnavailableError", "TraceFormatError",
    "ReproError", "AccuracyError", "OracleError",
    "NondeterminismError", "HashMode", "HashDebugTrace", "BitwiseEquivalenceMode", "read_hash_log",
    "Observer", "ObserverContext", "observe", "observe_grad", "observe_non_deterministic", "marking_non_deterministic",
    "enable_mode", "disable_mode",
]

__version__ = "0.1.0"

__all__.append("wrap_backend")


def __getattr__(name):  # lazy: repro_tools (and torch._dynamo) load only when asked for
    if name == "wrap_backend":
        from repro_tools.after_dynamo import wrap_backend

        return wrap_backend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
