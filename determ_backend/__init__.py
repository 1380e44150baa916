"""determ: find where a PyTorch model's numbers go wrong.

This package runs inside the user's process: fingerprints, compile backends,
dispatch modes, traces and dumps.  Offline tools (repro scripts, minifier,
bisect, the ``repro-tools`` CLI) live in :mod:`repro_tools`.  Importing it
changes no torch configuration.
"""

from determ_backend.errors import (AccuracyError, ConfigError, DetermError, DeviceUnavailableError, NondeterminismError, OracleError, ReproError, TraceFormatError, UnsupportedDtypeError)
from determ_backend.fingerprint.core import fingerprint_tensors, hash_tensor, hash_tensors, tensor_stats
from determ_backend.modes.core import BitwiseEquivalenceMode, HashDebugTrace, HashMode, read_hash_log
from determ_backend.observer.core import (Observer, ObserverContext, disable_mode, enable_mode, marking_non_deterministic, observe, observe_grad, observe_non_deterministic)
from determ_backend.seed import seed_all

__all__ = [
    "hash_tensor", "hash_tensors", "tensor_stats", "fingerprint_tensors", "seed_all",
    "HashMode", "HashDebugTrace", "BitwiseEquivalenceMode", "read_hash_log",
    "Observer", "ObserverContext", "observe", "observe_grad", "observe_non_deterministic", "marking_non_deterministic",
    "enable_mode", "disable_mode", "wrap_backend",
    "DetermError", "ConfigError", "UnsupportedDtypeError", "DeviceUnavailableError", "TraceFormatError",
    "ReproError", "AccuracyError", "OracleError", "NondeterminismError",
]

__version__ = "0.1.0"


def __getattr__(name):  # lazy: the after-dynamo flow (and torch._dynamo) load only when asked for
    if name == "wrap_backend":
        from determ_backend.backends.flows import load_flow

        return load_flow("dynamo").wrap_backend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
