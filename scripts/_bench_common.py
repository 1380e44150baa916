"""Helpers the benchmark scripts share: PyTorch's own tools they measure determ against.

Owns the reference tools only benchmarks use -- PyTorch's ``DebugMode`` with
tensor-hash logging (``bench_eager_tools.py``, ``bench_backend_overhead.py``), its
FX delta-debugging minifier and cold inductor caches (``bench_minifier.py``).
They reach private torch APIs, as :mod:`determ_backend._torch_compat` does for the
project itself; nothing in ``determ_backend`` or ``repro_tools`` imports this module.
Imported by name from the scripts' directory (``python scripts/bench_*.py``).
"""

from __future__ import annotations

import contextlib

__all__ = ["debug_mode_hashing", "fx_minifier", "fresh_inductor_cache"]


def debug_mode_hashing(hash_fn: str = "hash_tensor"):
    """PyTorch's ``DebugMode`` with tensor-hash logging, as a context manager (None if unavailable)."""
    try:
        from torch.utils._debug_mode import DebugMode
    except ImportError:
        return None
    stack = contextlib.ExitStack()
    stack.enter_context(DebugMode())
    stack.enter_context(DebugMode.log_tensor_hashes(hash_fn=hash_fn))
    return stack


def fx_minifier(gm, inputs, module_fails, **kwargs):
    """PyTorch's own delta-debugging minifier (``torch._functorch.fx_minifier.minifier``), the baseline."""
    from torch._functorch.fx_minifier import minifier as _minifier

    return _minifier(gm, inputs, module_fails, **kwargs)


def fresh_inductor_cache():
    """Context manager: a temporary inductor cache directory and cleared in-memory caches (a cold start)."""
    from torch._inductor.utils import fresh_cache

    return fresh_cache()
