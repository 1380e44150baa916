"""determ: find where a PyTorch model's numbers go wrong.

This package runs inside the user's process: fingerprints, compile backends,
dispatch modes, traces and dumps.  Offline tools (repro scripts, minifier,
bisect, the ``repro-tools`` CLI) live in :mod:`repro_tools`.
"""

from .errors import (AccuracyError, ConfigError, DetermError, DeviceUnavailableError, OracleError, ReproError,
                     TraceFormatError, UnsupportedDtypeError)
from .fingerprint import fingerprint_tensors, hash_tensor, hash_tensors, tensor_stats
from .seed import seed_all

__all__ = [
    "hash_tensor", "hash_tensors", "tensor_stats", "fingerprint_tensors", "seed_all",
    "DetermError", "ConfigError", "UnsupportedDtypeError", "DeviceUnavailableError", "TraceFormatError",
    "ReproError", "AccuracyError", "OracleError",
]

__version__ = "0.1.0"
