"""determ: find where a PyTorch model's numbers go wrong.

This package runs inside the user's process: fingerprints, compile backends,
dispatch modes, traces and dumps.  Offline tools (repro scripts, minifier,
bisect, the ``repro-tools`` CLI) live in :mod:`repro_tools`.  Importing it
changes no torch configuration.
"""

from .errors import (AccuracyError, ConfigError, DetermError, DeviceUnavailableError, NondeterminismError,
                     OracleError, ReproError, TraceFormatError, UnsupportedDtypeError)
from .fingerprint import fingerprint_tensors, hash_tensor, hash_tensors, tensor_stats
from .modes import BitwiseEquivalenceMode, HashDebugTrace, HashMode, read_hash_log
from .observer import (Observer, ObserverContext, disable_mode, enable_mode, marking_non_deterministic, observe,
                       observe_grad, observe_non_deterministic)
from .seed import seed_all

__all__ = [
    "hash_tensor", "hash_tensors", "tensor_stats", "fingerprint_tensors", "seed_all",
    "HashMode", "HashDebugTrace", "BitwiseEquivalenceMode", "read_hash_log",
    "Observer", "ObserverContext", "observe", "observe_grad", "observe_non_deterministic", "marking_non_deterministic",
    "enable_mode", "disable_mode", "wrap_backend",
    "DetermError", "ConfigError", "UnsupportedDtypeError", "DeviceUnavailableError", "TraceFormatError",
    "ReproError", "AccuracyError", "OracleError", "NondeterminismError",
]

__version__ = "0.1.0"


def __getattr__(name):  # lazy: repro_tools (and torch._dynamo) load only when asked for
    if name == "wrap_backend":
        from repro_tools.after_dynamo import wrap_backend

        return wrap_backend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
